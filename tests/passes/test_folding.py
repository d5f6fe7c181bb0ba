"""folding: the one host-folding rule, and the lowering, the view analysis and assign-buffers agreeing on it."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase

import spmd
import spmd.passes.assign_buffers as ab_mod
import spmd.passes.views as views_mod
import spmd.runtime.lower as lower_mod
from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.hlo import ASYNC_DONE_OPCODES, Instruction, Module, Shape
from spmd.ir.text import parse_module
from spmd.mesh import Mesh
from spmd.passes import folding
from spmd.passes.assign_buffers import HEAP_OPCODES, assign_buffers
from spmd.passes.folding import FOLD_MAX_NUMEL, NEVER_FOLDED, folded_instructions, is_foldable
from spmd.passes.views import analyze_views
from spmd.runtime.executor import Executable
from tests.runtime.programs import windowed_all_gather_dot

PREFIX = """%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused (p: f32[8]) -> f32[8] {
  %p = f32[8] parameter(0)
  ROOT %neg = f32[8] negate(%p)
}

%body.iota (bi: s32[8]) -> s32[8] {
  %bi = s32[8] parameter(0)
  ROOT %bi.neg = s32[8] negate(%bi)
}

%body.x (bx: f32[8,8]) -> f32[8,8] {
  %bx = f32[8,8] parameter(0)
  ROOT %bx.neg = f32[8,8] negate(%bx)
}

"""
BIG = "{" + ",".join(str(k % 7) for k in range(40 * 40)) + "}"

# One instruction of every kind the rule distinguishes; the root keeps all of them live.
EVERY_KIND = [
    "%c = f32[] constant(2)",
    f"%big = f32[40,40] constant({BIG})",
    "%pid = u32[] partition-id()",
    "%pid32 = s32[] convert(%pid)",
    "%off = s32[] multiply(%pid32, %pid32)",
    "%iota = s32[8] iota(), iota_dimension=0",
    "%iota.big = s32[40,40] iota(), iota_dimension=1",
    "%sum = f32[] add(%c, %c)",
    "%limit = f32[32,32] broadcast(%sum), dimensions={}",
    "%over = f32[33,32] broadcast(%sum), dimensions={}",
    "%over.neg = f32[33,32] negate(%over)",
    "%b8 = f32[8,8] broadcast(%c), dimensions={}",
    "%xs = f32[8,8] add(%x, %b8)",
    "%v8 = f32[8] broadcast(%c), dimensions={}",
    '%gelu = f32[8] custom-call(%v8), custom_call_target="gelu", backend_config={"approximate":"none"}',
    "%fusion = f32[8] fusion(%v8), kind=kLoop, calls=%fused",
    "%ar = f32[8] all-reduce(%v8), to_apply=%sum, replica_groups={{0,1}}",
    "%cps = (f32[8], f32[8]) collective-permute-start(%v8), source_target_pairs={{0,1},{1,0}}",
    "%cpd = f32[8] collective-permute-done(%cps)",
    "%tup = (f32[8], s32[8]) tuple(%v8, %iota)",
    "%gte = s32[8] get-tuple-element(%tup), index=1",
    "%gte.add = s32[8] add(%gte, %iota)",
    "%as = ((s32[8]), s32[8]) async-start(%iota), calls=%body.iota",
    "%ad = s32[8] async-done(%as)",
    "%asx = ((f32[8,8]), f32[8,8]) async-start(%xs), calls=%body.x",
    "%adx = f32[8,8] async-done(%asx)",
    "%ds = f32[4,8] dynamic-slice(%x, %off, %pid32), dynamic_slice_sizes={4,8}",
    "%big.neg = f32[40,40] negate(%big)",
    "%iota.big.neg = s32[40,40] negate(%iota.big)",
    "%limit.neg = f32[32,32] negate(%limit)",
    "%gte.neg = s32[8] negate(%gte.add)",
    "%ad.f32 = f32[8] convert(%ad)",
    "%ad.ar = f32[8] add(%ad.f32, %ar)",
]
EVERY_KIND_OUTPUTS = ["off", "big.neg", "iota.big.neg", "limit.neg", "over.neg", "gelu", "fusion", "cpd", "gte.neg",
                      "ad.ar", "adx", "ds"]


def _module(body: list[str], outputs: list[str], params: str = "x: f32[8,8]", p: int = 2) -> Module:
    """A partitioned module on ``p`` devices whose root is the tuple of ``outputs``."""
    insts = {ln.split(" = ")[0][1:]: ln.split(" = ")[1].split(" ")[0] for ln in body}
    name, shape = params.split(": ")
    lines = [f"%{name} = {shape} parameter(0)", *body,
             f"ROOT %root = ({', '.join(insts[o] for o in outputs)}) tuple({', '.join('%' + o for o in outputs)})"]
    result = f"({', '.join(insts[o] for o in outputs)})"
    text = "\n".join(f"  {ln}" for ln in lines)
    return parse_module(f"HloModule m, num_partitions={p}, mesh={{tp={p}}}, is_partitioned=true\n\n{PREFIX}"
                        f"ENTRY %main ({params}) -> {result} {{\n{text}\n}}\n")


def _by_id(module: Module) -> dict[int, Instruction]:
    return {id(i): i for c in module.all_computations() for i in c.instructions}


def _rule(module: Module) -> set[str]:
    """Names of the instructions ``folded_instructions`` says the lowering folds."""
    insts = _by_id(module)
    return {insts[k].name for k in folded_instructions(module.entry)}


def _folded(body: list[str], outputs: list[str], params: str = "x: f32[8,8]") -> set[str]:
    return _rule(_module(body, outputs, params))


def _describe(module: Module) -> str:
    """One line per instruction of the entry (and of async bodies): folded or run."""
    ids = folded_instructions(module.entry)
    lines = []
    for c in module.all_computations():
        if c.name in ("sum", "fused"):
            continue
        lines += [f"{c.name}: {i.name} {'folded' if id(i) in ids else 'run'}" for i in c.instructions]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the rule
def test_constants_fold_at_any_size():
    assert _folded(["%c = f32[] constant(2)", f"%big = f32[40,40] constant({BIG})"], ["c", "big"]) == {"c", "big"}


def test_partition_id_and_arithmetic_on_it_fold():
    got = _folded(["%pid = u32[] partition-id()", "%p = s32[] convert(%pid)", "%k = s32[] constant(4)",
                   "%off = s32[] multiply(%p, %k)"], ["off"])
    assert got == {"pid", "p", "k", "off"}


def test_iota_folds_up_to_the_size_limit():
    module = _module([f"%small = s32[{FOLD_MAX_NUMEL}] iota(), iota_dimension=0",
                      f"%large = s32[{FOLD_MAX_NUMEL + 1}] iota(), iota_dimension=0",
                      "%i2 = s32[40,40] iota(), iota_dimension=0"], ["small", "large", "i2"])
    assert _rule(module) == {"small"}
    program = lower_mod.lower(module, [torch.device("cpu")] * 2)
    assert program.folded_names == {"small"}  # computed from the shape only: the same on every device
    small = program.templates[0][program.output_slots[0]]
    assert torch.equal(small, torch.arange(FOLD_MAX_NUMEL, dtype=torch.int32))
    assert all(torch.equal(t[program.output_slots[0]], small) for t in program.templates)


def test_add_of_two_small_constants_folds_and_an_add_over_a_parameter_does_not():
    got = _folded(["%one = f32[] constant(1)", "%c = f32[8,8] broadcast(%one), dimensions={}",
                   "%cc = f32[8,8] add(%c, %c)", "%xc = f32[8,8] add(%x, %c)", "%xcc = f32[8,8] add(%xc, %cc)"],
                  ["cc", "xcc"])
    assert got == {"one", "c", "cc"}


def test_values_above_the_limit_do_not_fold_nor_do_their_users():
    got = _folded(["%one = f32[] constant(1)", "%at = f32[32,32] broadcast(%one), dimensions={}",
                   "%above = f32[33,32] broadcast(%one), dimensions={}",
                   "%s = f32[1,32] slice(%above), slice={[0:1], [0:32]}"], ["at", "s"])
    assert got == {"one", "at"}


def test_custom_calls_fusions_collectives_async_ops_and_tuples_do_not_fold():
    got = _folded(EVERY_KIND, EVERY_KIND_OUTPUTS)
    assert not got & {"gelu", "fusion", "ar", "cps", "cpd", "tup", "as", "asx", "adx", "bx.neg", "root"}


def test_aliases_denote_what_they_alias():
    got = _folded(EVERY_KIND, EVERY_KIND_OUTPUTS)
    assert {"gte", "gte.add"} <= got  # get-tuple-element of a tuple element that is folded
    assert {"bi", "bi.neg", "ad"} <= got  # an async body computed from folded operands, and its done
    assert "bx" not in got


@pytest.mark.parametrize("opcode", sorted(NEVER_FOLDED))
def test_is_foldable_never(opcode):
    inst = Instruction("i", opcode, Shape("f32", (2,)), [], {})
    assert not is_foldable(inst, True)


def test_is_foldable():
    def inst(opcode, dims, dtype="f32"):
        return Instruction("i", opcode, Shape(dtype, dims), [], {})

    assert is_foldable(inst("constant", (64, 64)), False)
    assert is_foldable(inst("partition-id", (), "u32"), False)
    assert is_foldable(inst("iota", (FOLD_MAX_NUMEL,), "s32"), True)
    assert not is_foldable(inst("iota", (FOLD_MAX_NUMEL + 1,), "s32"), True)
    assert is_foldable(inst("add", (4,)), True) and not is_foldable(inst("add", (4,)), False)
    tup = Instruction("t", "constant", Shape.tuple([Shape("f32", (2,))]), [], {})
    assert not is_foldable(tup, True)


class GoldenTest(TestCase):
    def test_every_kind(self):
        self.assertExpectedInline(_describe(_module(EVERY_KIND, EVERY_KIND_OUTPUTS)), """\
body.iota: bi folded
body.iota: bi.neg folded
body.x: bx run
body.x: bx.neg run
main: x run
main: c folded
main: big folded
main: pid folded
main: pid32 folded
main: off folded
main: iota folded
main: iota.big run
main: sum folded
main: limit folded
main: over run
main: over.neg run
main: b8 folded
main: xs run
main: v8 folded
main: gelu run
main: fusion run
main: ar run
main: cps run
main: cpd run
main: tup run
main: gte folded
main: gte.add folded
main: as run
main: ad folded
main: asx run
main: adx run
main: ds run
main: big.neg run
main: iota.big.neg run
main: limit.neg folded
main: gte.neg folded
main: ad.f32 folded
main: ad.ar run
main: root run""")


# --------------------------------------------------------------------------- the sites agree
def _outputs(module: Module) -> set[str]:
    out, stack = set(), [module.entry.root]
    while stack:
        inst = stack.pop()
        out.add(inst.name)
        if inst.opcode == "tuple":
            stack.extend(inst.operands)
    return out


def _lowered(module: Module) -> set[str]:
    """Names of the instructions whose values the lowering folded (persistent per-device values)."""
    return set(lower_mod.lower(module, [torch.device("cpu")] * module.num_partitions).folded_names)


def _values(module: Module) -> list[Instruction]:
    """Entry instructions with an array value of their own that is no output (no parameter or alias)."""
    outs = _outputs(module)
    skip = {"parameter", "tuple", "get-tuple-element", *ASYNC_DONE_OPCODES}
    return [i for i in module.entry.instructions
            if i.opcode not in skip and not i.shape.is_tuple and i.name not in outs]


def _views_see(module: Module) -> tuple[set[str], set[str]]:
    """(checked names, those the view analysis treats as folded).

    A value of rank > 0 that is no view, no output and no slice of a parameter has static
    strides unless the analysis takes it for folded (a folded value is also never a view).
    """
    a = analyze_views(module)
    checked = {i.name for i in _values(module) if i.shape.rank > 0 and i.name not in a.views
               and not (i.opcode in ("slice", "dynamic-slice") and i.operands[0].opcode == "parameter")}
    return checked, {n for n in checked if a.strides[n] is None}


def _buffers_see(module: Module) -> tuple[set[str], set[str]]:
    """(checked names, those assign-buffers gives no bytes as folded values).

    Every value that is no view, no output, not in place over another value and not allocated by
    the runtime's kernels (``HEAP_OPCODES``) gets bytes unless assign-buffers takes it for folded.
    """
    ba, views = assign_buffers(module), views_mod.view_instructions(module)
    dus = {n for i in module.entry.instructions if i.opcode == "dynamic-update-slice"
           for n in (i.name, i.operands[0].name)}
    checked = {i.name for i in _values(module) if i.name not in views and i.name not in dus
               and i.opcode not in HEAP_OPCODES}
    return checked, {n for n in checked if n not in ba.offsets_bytes}


def _check_agreement(module: Module) -> None:
    rule = _rule(module)
    insts = _by_id(module).values()
    aliases = {"parameter", "tuple", "get-tuple-element", *ASYNC_DONE_OPCODES}
    assert _lowered(module) == {i.name for i in insts if i.name in rule and i.opcode not in aliases}, "lower"
    checked, seen = _views_see(module)
    assert seen == rule & checked, "views"
    checked, seen = _buffers_see(module)
    assert seen == rule & checked, "assign-buffers"


def _masked_sum(width: int, cols: int = 300):
    """A softmax, then a sum over the rows, split unevenly (7 rows on 2 devices): the row mask
    is an iota compared with a bound computed from partition-id (folded when small)."""
    def f(x, w):
        return torch.softmax(x @ w, dim=-1).sum(0)

    mesh = spmd.Mesh.create({"tp": 2}, "cpu:2")
    P = spmd.PartitionSpec
    options = spmd.CompileOptions(fuse_elementwise=False)
    jitted = spmd.jit(f, mesh=mesh, in_shardings=(P("tp", None), P()), out_shardings=P(), options=options)
    args = (torch.randn(7, cols), torch.randn(cols, width))
    return f, jitted, args


def _program(kind: str) -> Module:
    if kind == "every-kind":
        return _module(EVERY_KIND, EVERY_KIND_OUTPUTS)
    if kind.startswith("masked-sum"):
        _, jitted, args = _masked_sum(int(kind.split("-")[-1]))
        return jitted.lower(*args).result.module
    return windowed_all_gather_dot(4, m=8, k=16, f=8, async_dot=kind == "windowed-async")


PROGRAMS = ["every-kind", "masked-sum-5", "masked-sum-400", "windowed", "windowed-async"]


@pytest.mark.parametrize("kind", PROGRAMS)
def test_lowering_views_and_buffer_assignment_agree(kind):
    module = _program(kind)
    rule = _rule(module)
    assert rule and any(i.name not in rule for i in module.entry.instructions)
    _check_agreement(module)


def test_masked_sum_folds_the_small_mask_only():
    small, large = _rule(_program("masked-sum-5")), _rule(_program("masked-sum-400"))
    assert {"partition-id", "subtract", "iota", "compare"} <= small
    assert {"partition-id", "subtract"} <= large and not {"iota", "compare"} & large


def _every_iota(comp):
    """The rule with every iota folded, whatever its size (assign-buffers' former rule)."""
    return folded_instructions(comp) | {id(i) for i in comp.instructions if i.opcode == "iota"}


def _not_through_aliases(comp):
    """The rule without folding through get-tuple-element / async-done (the view analysis' former rule)."""
    aliases = {id(i) for i in comp.instructions if i.opcode in ("get-tuple-element", "async-done")}
    return {id(i) for i in comp.instructions if id(i) in folded_instructions(comp) - aliases
            and not any(id(o) in aliases for o in i.operands)}


@pytest.mark.parametrize("site", ["lower", "views", "assign-buffers"])
def test_the_agreement_check_catches_a_site_folding_large_iotas(monkeypatch, site):
    module = _program("masked-sum-400")
    _check_agreement(module)
    if site == "lower":
        monkeypatch.setattr(lower_mod, "is_foldable",
                            lambda inst, ok: inst.opcode == "iota" or folding.is_foldable(inst, ok))
    else:
        monkeypatch.setattr(views_mod if site == "views" else ab_mod, "folded_instructions", _every_iota)
    with pytest.raises(AssertionError, match=site):
        _check_agreement(module)


@pytest.mark.parametrize("site", ["views", "assign-buffers"])
def test_the_agreement_check_catches_a_site_not_folding_through_aliases(monkeypatch, site):
    module = _program("every-kind")
    monkeypatch.setattr(views_mod if site == "views" else ab_mod, "folded_instructions", _not_through_aliases)
    with pytest.raises(AssertionError, match=site):
        _check_agreement(module)


# --------------------------------------------------------------------------- numerics
def test_every_kind_runs_right_with_its_buffer_assignment():
    module = _module(EVERY_KIND, EVERY_KIND_OUTPUTS)
    ex = Executable(module, Mesh.create(("tp",), devices="cpu:2"), assign_buffers(module))
    for _ in range(2):  # the arena and the folded values are reused by the second call
        xs = [torch.randn(8, 8) for _ in range(2)]
        got, _ = ex.run([xs])
        want = evaluate_spmd(module, [[x] for x in xs])
        for g, w in zip(got, want, strict=True):
            for d in range(2):
                torch.testing.assert_close(g[d], w[d])


@pytest.mark.parametrize("width", [5, 400])
def test_masked_sum_matches_pytorch(width):
    f, jitted, args = _masked_sum(width)
    for _ in range(2):
        args = tuple(torch.randn_like(a) for a in args)
        want = f(*[a.double() for a in args])
        torch.testing.assert_close(jitted(*args).to_torch().double(), want, rtol=1e-4, atol=1e-4)
