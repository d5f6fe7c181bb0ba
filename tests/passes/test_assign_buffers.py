"""assign-buffers: no two values whose lifetimes may overlap (streams included) share bytes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spmd.ir.hlo import Computation, Instruction, Module, Shape
from spmd.ir.sharding import MeshShape
from spmd.ir.text import parse_module
from spmd.ir.verify import verify_module
from spmd.passes.assign_buffers import ALIGN_BYTES, AssignBuffers, BufferAssignment, assign_buffers
from spmd.passes.views import view_instructions

F = Shape("f32", (40, 40))  # 6400 bytes: never folded by the runtime
S32 = Shape("s32")


# --------------------------------------------------------------------------- an independent oracle
class Oracle:
    """Happens-before by explicit graph reachability over the ops of a scheduled entry computation.

    Ops: every entry instruction but parameters, constants, *-done and tuple. Edges: program
    order per stream, and producer -> consumer across streams (the consumer waits). A value is
    written by its op (an async-start writes its called computation's values) and read by the
    ops that use it (an async-start's called computation reads at the start).
    """

    def __init__(self, module: Module) -> None:
        insts = module.entry.instructions
        self.views = view_instructions(module)
        self.pos = {id(i): k for k, i in enumerate(insts)}
        self.writer: dict[str, int] = {}
        self.reads: dict[str, list[int]] = {}
        self.readers: dict[str, list[str]] = {}
        self.dus_base: dict[str, str | None] = {}  # dynamic-update-slice -> the value of its operand 0
        self.add_base: dict[str, set[str]] = {}  # add -> the values of its operands of its shape
        self.src: dict[int, str | None] = {}
        self.node: dict[int, int] = {}  # id(instruction) -> the op whose completion makes it readable
        succ: dict[int, set[int]] = {k: set() for k in range(len(insts))}
        last: dict[int, int] = {}
        for k, inst in enumerate(insts):
            if inst.opcode in ("parameter", "constant", "tuple") or inst.opcode.endswith("-done"):
                done = inst.opcode.endswith("-done")
                self.src[id(inst)] = self.src.get(id(inst.operands[0])) if done else None
                if done:
                    self.node[id(inst)] = self.node[id(inst.operands[0])]
                continue
            s = inst.stream_id or 0
            if s in last:
                succ[last[s]].add(k)
            last[s] = k
            for o in inst.operands:
                p = self.node.get(id(o))
                if p is not None and (insts[p].stream_id or 0) != s:
                    succ[p].add(k)
            self.node[id(inst)] = k
            if inst.name in self.views:  # no value of its own: reads its operand's, and readers read it
                self._read(self.src.get(id(inst.operands[0])), k, inst.name)
                self.src[id(inst)] = self.src.get(id(inst.operands[0]))
                continue
            self._values(inst, k)
        self.reach = self._closure(succ)

    def _values(self, inst: Instruction, k: int) -> None:
        if inst.opcode == "async-start":
            body = inst.attrs["calls"]
            local = {id(p): self.src.get(id(inst.operands[p.attrs["parameter_number"]])) for p in body.parameters}
            for b in body.instructions:
                if b.opcode == "parameter":
                    continue
                for o in b.operands:
                    self._read(local.get(id(o)), k, b.name)
                if b.opcode == "dynamic-update-slice":
                    self.dus_base[b.name] = local.get(id(b.operands[0]))
                local[id(b)] = b.name
                self.writer[b.name] = k
            self.src[id(inst)] = local[id(body.root)]
            return
        for o in inst.operands:
            self._read(self.src.get(id(o)), k, inst.name)
        if inst.opcode == "dynamic-update-slice":
            self.dus_base[inst.name] = self.src.get(id(inst.operands[0]))
        if inst.opcode == "add":  # in place over an operand read at the output's index, not a GEMM input
            gemm = {self.src.get(id(x)) for o in inst.operands if o.opcode == "dot" for x in o.operands}
            self.add_base[inst.name] = {self.src.get(id(o)) for o in inst.operands
                                        if o.shape == inst.shape and o.name not in self.views} - gemm
        self.writer[inst.name] = k
        self.src[id(inst)] = inst.name

    def _read(self, name: str | None, k: int, reader: str) -> None:
        if name is not None:
            self.reads.setdefault(name, []).append(k)
            self.readers.setdefault(name, []).append(reader)

    @staticmethod
    def _closure(succ: dict[int, set[int]]) -> dict[int, set[int]]:
        reach: dict[int, set[int]] = {}
        for k in sorted(succ, reverse=True):
            r = set()
            for j in succ[k]:
                r |= {j} | reach[j]
            reach[k] = r
        return reach

    def before(self, a: str, b: str) -> bool:
        """Every access of value ``a`` completes before value ``b`` is written."""
        w = self.writer[b]
        return all(w in self.reach[x] for x in [self.writer[a], *self.reads.get(a, [])])

    def check(self, ba: BufferAssignment) -> None:
        names = sorted(ba.offsets_bytes)
        assert not self.views & set(names), "a view has bytes of its own"
        for n in names:
            assert ba.offsets_bytes[n] % ALIGN_BYTES == 0
            assert ba.offsets_bytes[n] + ba.sizes_bytes[n] <= ba.arena_size_bytes
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                oa, ob = ba.offsets_bytes[a], ba.offsets_bytes[b]
                if oa >= ob + ba.sizes_bytes[b] or ob >= oa + ba.sizes_bytes[a]:
                    continue
                if self.before(a, b) or self.before(b, a) or self.in_place(a, b) or self.in_place(b, a):
                    continue
                raise AssertionError(f"%{a} and %{b} share bytes but may be live at once")

    def in_place(self, a: str, b: str) -> bool:
        """``b`` is a dynamic-update-slice updating ``a`` in place, ``a``'s only reader; or an add
        of ``a`` (same shape) that every other access of ``a`` completes before."""
        if self.dus_base.get(b) == a and self.readers.get(a) == [b]:
            return True
        if a in self.add_base.get(b, ()):
            w = self.writer[b]
            return all(x == w or w in self.reach[x] for x in [self.writer[a], *self.reads.get(a, [])])
        return False


# --------------------------------------------------------------------------- random programs
def _module(insts: list[Instruction], root: Instruction, bodies: list[Computation]) -> Module:
    return Module("r", Computation("main", insts, root), bodies, MeshShape(("tp",), (4,)), is_partitioned=True)


def _views(kind: str, k: int, a: Instruction, s: int) -> list[Instruction]:
    """View chains of ``a`` ending in an F-shaped value (each a view unless a user forbids it)."""
    if kind == "t":
        return [Instruction(f"t{k}", "transpose", F, [a], {"dimensions": (1, 0)}, stream_id=s)]
    if kind == "sl":
        return [Instruction(f"sl{k}", "slice", F, [a], {"slice": ((0, 40, 1), (0, 40, 1))}, stream_id=s)]
    flat = Instruction(f"r{k}.flat", "reshape", Shape("f32", (1600,)), [a], stream_id=s)
    return [flat, Instruction(f"r{k}", "reshape", F, [flat], stream_id=s)]


@st.composite
def programs(draw):
    """A random scheduled program: ops on streams 0..3, async dots, collective-permutes, DUS chains,
    and view chains (transpose, slice, reshape pairs) feeding any of them."""
    x = Instruction("x", "parameter", F, attrs={"parameter_number": 0})
    w = Instruction("w", "parameter", F, attrs={"parameter_number": 1})
    zero = Instruction("zero", "constant", S32, attrs={"literal": torch.tensor(0, dtype=torch.int32)}, stream_id=0)
    insts, vals, bodies, pending = [x, w, zero], [x, w], [], []
    for k in range(draw(st.integers(2, 12))):
        kind = draw(st.sampled_from(["neg", "add", "upd", "async", "cp", "done", "t", "sl", "rr"]))
        a, b = draw(st.sampled_from(vals)), draw(st.sampled_from(vals))
        s = draw(st.integers(0, 2))
        if kind in ("t", "sl", "rr"):
            new = _views(kind, k, a, s)
        elif kind == "neg":
            new = [Instruction(f"n{k}", "negate", F, [a], stream_id=s)]
        elif kind == "add":
            new = [Instruction(f"a{k}", "add", F, [a, b], stream_id=s)]
        elif kind == "upd":
            new = [Instruction(f"u{k}.upd", "dynamic-update-slice", F, [a, b, zero, zero], stream_id=s)]
        elif kind == "async":
            p0 = Instruction(f"s{k}.p0", "parameter", F, attrs={"parameter_number": 0})
            p1 = Instruction(f"s{k}.p1", "parameter", F, attrs={"parameter_number": 1})
            dot = Instruction(f"s{k}.dot", "dot", F, [p0, p1],
                              {"lhs_contracting_dims": (1,), "rhs_contracting_dims": (0,)})
            body = [p0, p1, dot]
            if draw(st.booleans()):
                zc = Instruction(f"s{k}.zero", "constant", S32, attrs={"literal": torch.tensor(0, dtype=torch.int32)})
                body += [zc, Instruction(f"s{k}.upd.op", "dynamic-update-slice", F, [p0, dot, zc, zc])]
            bodies.append(Computation(f"s{k}.body", body, body[-1]))
            start = Instruction(f"s{k}-start", "async-start", Shape.tuple([Shape.tuple([F, F]), F]), [a, b],
                                {"calls": bodies[-1]}, stream_id=1 + s % 2)
            pending.append(Instruction(f"s{k}", "async-done", F, [start], stream_id=start.stream_id))
            new = [start]
        elif kind == "cp":
            start = Instruction(f"c{k}-start", "collective-permute-start", Shape.tuple([F, F]), [a],
                                {"source_target_pairs": ((0, 1), (1, 2), (2, 3), (3, 0))}, stream_id=3)
            pending.append(Instruction(f"c{k}", "collective-permute-done", F, [start], stream_id=3))
            new = [start]
        else:
            if not pending:
                continue
            new = [pending.pop(draw(st.integers(0, len(pending) - 1)))]
        insts += new
        if new[-1].opcode not in ("async-start", "collective-permute-start"):
            vals.append(new[-1])
    insts += pending
    vals += pending
    outs = draw(st.lists(st.sampled_from(vals[2:] or vals), min_size=1, max_size=2, unique_by=id))
    root = Instruction("out", "tuple", Shape.tuple([o.shape for o in outs]), outs, stream_id=0)
    insts.append(root)
    return _module(_random_topological_order(draw, insts), root, bodies)


def _random_topological_order(draw, insts: list[Instruction]) -> list[Instruction]:
    left, out, placed = list(insts), [], set()
    while left:
        ready = [i for i in left if all(id(o) in placed for o in i.operands)]
        pick = ready[draw(st.integers(0, len(ready) - 1))]
        left.remove(pick)
        out.append(pick)
        placed.add(id(pick))
    return out


@settings(max_examples=300, deadline=None)
@given(programs())
def test_no_two_possibly_concurrent_values_share_bytes(module):
    verify_module(module)
    ba = assign_buffers(module)
    Oracle(module).check(ba)


@settings(max_examples=40, deadline=None)
@given(programs())
def test_random_programs_run_right_and_race_free(module):
    """Lowered with this assignment: no unordered cross-stream access, and the outputs of the
    interpreter on fresh random inputs (the arena reused across two calls)."""
    from spmd.ir.evaluate import evaluate_spmd
    from spmd.mesh import Mesh
    from spmd.runtime.executor import Executable
    from spmd.runtime.hazards import find_hazards
    from spmd.runtime.lower import lower

    ba = assign_buffers(module)
    assert find_hazards(lower(module, [torch.device("cpu")] * 4, buffers=ba, gpu=True)) == []
    ex = Executable(module, Mesh.create(("tp",), devices="cpu:4"), ba)
    for _ in range(2):
        args = [[torch.randn(40, 40) / 8 + 0.1 for _ in range(2)] for _ in range(4)]
        want = evaluate_spmd(module, args)
        outs, _ = ex.run([[args[d][i] for d in range(4)] for i in range(2)])
        for j, per in enumerate(want):
            for d, w in enumerate(per):
                torch.testing.assert_close(outs[j][d], w, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- fixed programs
HEADER = "HloModule m, num_partitions=2, mesh={tp=2}, is_partitioned=true\n\n"
DOT = "lhs_contracting_dims={1}, rhs_contracting_dims={0}"


def _two_gemms(second_waits_for_first: bool) -> Module:
    operand = "%g0" if second_waits_for_first else "%x"
    return parse_module(HEADER + f"""%b0 (p: f32[64,64], q: f32[64,64]) -> f32[64,64] {{
  %p = f32[64,64] parameter(0)
  %q = f32[64,64] parameter(1)
  ROOT %mm0 = f32[64,64] dot(%p, %q), {DOT}
}}

%b1 (p1: f32[64,64], q1: f32[64,64]) -> f32[64,64] {{
  %p1 = f32[64,64] parameter(0)
  %q1 = f32[64,64] parameter(1)
  ROOT %mm1 = f32[64,64] dot(%p1, %q1), {DOT}
}}

ENTRY %main (x: f32[64,64], w: f32[64,64]) -> f32[64,64] {{
  %x = f32[64,64] parameter(0)
  %w = f32[64,64] parameter(1)
  %g0-start = ((f32[64,64], f32[64,64]), f32[64,64]) async-start(%x, %w), calls=%b0, stream_id=1
  %g0 = f32[64,64] async-done(%g0-start), stream_id=1
  %g1-start = ((f32[64,64], f32[64,64]), f32[64,64]) async-start({operand}, %w), calls=%b1, stream_id=2
  %g1 = f32[64,64] async-done(%g1-start), stream_id=2
  %n0 = f32[64,64] negate(%g0), stream_id=0
  %n1 = f32[64,64] negate(%g1), stream_id=0
  ROOT %r = f32[64,64] add(%n0, %n1), stream_id=0
}}
""")


def test_concurrent_gemms_on_two_streams_never_share_memory():
    """The hazard of openxla/xla#8707: two GEMMs that may run at once must not share a buffer."""
    m = _two_gemms(second_waits_for_first=False)
    ba = assign_buffers(m)
    Oracle(m).check(ba)
    assert {"mm0", "mm1", "n0", "n1"} <= set(ba.offsets_bytes)
    assert ba.offsets_bytes["mm0"] != ba.offsets_bytes["mm1"]


def test_stream_joined_values_are_reused():
    """mm0 is consumed (n0 on stream 0) before n1 is written on stream 0: n1 may take its bytes."""
    m = _two_gemms(second_waits_for_first=True)
    ba = assign_buffers(m)
    Oracle(m).check(ba)
    assert ba.arena_size_bytes < sum(-(-s // ALIGN_BYTES) * ALIGN_BYTES for s in ba.sizes_bytes.values())


def test_value_read_on_an_unjoined_stream_stays_live():
    """%a is read on stream 1 by a GEMM nobody waits for before %c: %c must not reuse %a."""
    m = parse_module(HEADER + f"""%b0 (p: f32[64,64], q: f32[64,64]) -> f32[64,64] {{
  %p = f32[64,64] parameter(0)
  %q = f32[64,64] parameter(1)
  ROOT %mm0 = f32[64,64] dot(%p, %q), {DOT}
}}

ENTRY %main (x: f32[64,64], w: f32[64,64]) -> (f32[64,64], f32[64,64]) {{
  %x = f32[64,64] parameter(0)
  %w = f32[64,64] parameter(1)
  %a = f32[64,64] negate(%x), stream_id=0
  %g0-start = ((f32[64,64], f32[64,64]), f32[64,64]) async-start(%a, %w), calls=%b0, stream_id=1
  %b = f32[64,64] negate(%w), stream_id=0
  %c = f32[64,64] negate(%b), stream_id=0
  %e = f32[64,64] exponential(%c), stream_id=0
  %g0 = f32[64,64] async-done(%g0-start), stream_id=1
  ROOT %r = (f32[64,64], f32[64,64]) tuple(%g0, %e), stream_id=0
}}
""")
    ba = assign_buffers(m)
    Oracle(m).check(ba)
    assert ba.offsets_bytes["a"] not in (ba.offsets_bytes["b"], ba.offsets_bytes["c"])
    # the same program on one stream: %a is dead once the dot ran, so %b reuses it
    m1 = parse_module(HEADER + """ENTRY %main (x: f32[64,64], w: f32[64,64]) -> (f32[64,64], f32[64,64]) {
  %x = f32[64,64] parameter(0)
  %w = f32[64,64] parameter(1)
  %a = f32[64,64] negate(%x), stream_id=0
  %g0 = f32[64,64] dot(%a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, stream_id=0
  %b = f32[64,64] negate(%w), stream_id=0
  %c = f32[64,64] negate(%b), stream_id=0
  %e = f32[64,64] exponential(%c), stream_id=0
  ROOT %r = (f32[64,64], f32[64,64]) tuple(%g0, %e), stream_id=0
}
""")
    ba1 = assign_buffers(m1)
    Oracle(m1).check(ba1)
    assert ba1.offsets_bytes["b"] == ba1.offsets_bytes["a"]


def test_dot_operands_live_until_a_fusable_add():
    """The runtime may fuse dot + add into addmm at the add: %a is read there, %z must not take it."""
    m = parse_module(HEADER + """ENTRY %main (x: f32[64,64], w: f32[64,64]) -> f32[64,64] {
  %x = f32[64,64] parameter(0)
  %w = f32[64,64] parameter(1)
  %a = f32[64,64] negate(%x)
  %d = f32[64,64] dot(%a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %z = f32[64,64] negate(%w)
  ROOT %r = f32[64,64] add(%d, %z)
}
""")
    ba = assign_buffers(m)
    assert ba.offsets_bytes["a"] != ba.offsets_bytes["z"]


def test_dynamic_update_slice_chain_is_in_place():
    m = parse_module(HEADER + """ENTRY %main (x: f32[8,64], w: f32[64,64]) -> f32[64,64] {
  %x = f32[8,64] parameter(0)
  %w = f32[64,64] parameter(1)
  %zero = s32[] constant(0)
  %c8 = s32[] constant(8)
  %acc0 = f32[64,64] negate(%w)
  %acc1 = f32[64,64] dynamic-update-slice(%acc0, %x, %zero, %zero)
  %acc2 = f32[64,64] dynamic-update-slice(%acc1, %x, %c8, %zero)
  ROOT %r = f32[64,64] exponential(%acc2)
}
""")
    ba = assign_buffers(m)
    assert ba.offsets_bytes["acc0"] == ba.offsets_bytes["acc1"] == ba.offsets_bytes["acc2"]
    assert "zero" not in ba.offsets_bytes and "r" not in ba.offsets_bytes and "x" not in ba.offsets_bytes


def test_pass_form_and_errors():
    m = _two_gemms(False)
    assert AssignBuffers().run(m) is m
    m.is_partitioned = False
    import pytest

    with pytest.raises(ValueError, match="not partitioned"):
        assign_buffers(m)


def test_runtime_runs_the_pipeline_with_this_assignment():
    """End to end on virtual CPU devices: windowed einsum, streams, schedule, arena placement."""
    from spmd.ir.evaluate import evaluate_spmd
    from spmd.mesh import Mesh
    from spmd.passes.assign_streams import AssignStreams
    from spmd.passes.schedule import Schedule
    from spmd.passes.windowed_einsum import WindowedEinsum
    from spmd.runtime.executor import Executable
    from tests.passes.test_windowed_einsum import ag_module, random_args, rs_module

    for text in (ag_module("qkv", 4, 37, k=16, n=12), rs_module("lhs", 4, 37, k=16, n=12)):
        for bidirectional in (False, True):
            ref, mod = parse_module(text), parse_module(text)
            args = random_args(ref)
            want = evaluate_spmd(ref, args)
            for pss in (WindowedEinsum(mode="on", bidirectional=bidirectional), AssignStreams(), Schedule()):
                pss.run(mod)
            ba = assign_buffers(mod)
            Oracle(mod).check(ba)
            assert ba.offsets_bytes
            ex = Executable(mod, Mesh.create(("tp",), devices="cpu:4"), ba)
            per_param = [[args[d][i] for d in range(4)] for i in range(len(args[0]))]
            for _ in range(2):  # the arena is reused across calls
                outs, _ = ex.run(per_param)
                for j, w_out in enumerate(want):
                    for d, w in enumerate(w_out):
                        assert ((outs[j][d] - w).abs().max() / w.abs().max()) < 1e-5


RESIDUAL = HEADER + f"""ENTRY %main (x: f32[64,64], w: f32[64,64]) -> f32[64,64] {{
  %x = f32[64,64] parameter(0)
  %w = f32[64,64] parameter(1)
  %h0 = f32[64,64] negate(%x)
  %a1 = f32[64,64] tanh(%h0)
  %d1 = f32[64,64] dot(%a1, %w), {DOT}
  %h1 = f32[64,64] add(%d1, %h0)
  %a2 = f32[64,64] tanh(%h1)
  %d2 = f32[64,64] dot(%a2, %w), {DOT}
  %h2 = f32[64,64] add(%h1, %d2)
  ROOT %out = f32[64,64] exponential(%h2)
}}
"""


def test_a_residual_sum_accumulates_in_one_buffer():
    """Each residual add is its operand's last access: h0, h1 and h2 share one buffer, so the runtime's
    addmm of a dot and the residual accumulates in place (no copy of C)."""
    m = parse_module(RESIDUAL)
    ba = assign_buffers(m)
    Oracle(m).check(ba)
    assert ba.offsets_bytes["h0"] == ba.offsets_bytes["h1"] == ba.offsets_bytes["h2"]
    from spmd.mesh import Mesh
    from spmd.runtime.executor import Executable

    ex = Executable(m, Mesh.create(("tp",), devices="cpu:2"), ba)
    args = [[torch.randn(64, 64) / 8 for _ in range(2)] for _ in range(2)]
    outs, _ = ex.run(args)
    for d in range(2):
        x, w = args[0][d], args[1][d]
        h0 = -x
        h1 = torch.tanh(h0) @ w + h0
        torch.testing.assert_close(outs[0][d], torch.exp(h1 + torch.tanh(h1) @ w), rtol=1e-5, atol=1e-5)


def test_the_gemm_inputs_of_a_fused_addmm_keep_their_bytes():
    """``h + h @ w`` runs as addmm(h, h, w): C may be written in place only if it is not also A."""
    m = parse_module(HEADER + f"""ENTRY %main (x: f32[64,64], w: f32[64,64]) -> f32[64,64] {{
  %x = f32[64,64] parameter(0)
  %w = f32[64,64] parameter(1)
  %h = f32[64,64] negate(%x)
  %d = f32[64,64] dot(%h, %w), {DOT}
  %s = f32[64,64] add(%h, %d)
  ROOT %out = f32[64,64] exponential(%s)
}}
""")
    ba = assign_buffers(m)
    assert ba.offsets_bytes["h"] != ba.offsets_bytes["s"]


def test_an_operand_read_through_a_transpose_keeps_its_bytes():
    """``t(h) + d``: the add reads h at transposed indices, so writing over h in place would race."""
    m = parse_module(HEADER + f"""ENTRY %main (x: f32[64,64], w: f32[64,64]) -> f32[64,64] {{
  %x = f32[64,64] parameter(0)
  %w = f32[64,64] parameter(1)
  %h = f32[64,64] negate(%x)
  %t = f32[64,64] transpose(%h), dimensions={{1,0}}
  %a = f32[64,64] tanh(%x)
  %d = f32[64,64] dot(%a, %w), {DOT}
  %s = f32[64,64] add(%t, %d)
  ROOT %out = f32[64,64] exponential(%s)
}}
""")
    ba = assign_buffers(m)
    Oracle(m).check(ba)
    assert "t" in view_instructions(m) and ba.offsets_bytes["h"] != ba.offsets_bytes["s"]


def test_multi_output_fusion_elements_are_separate_values():
    """Each element of a tuple-shaped fusion is its own (runtime-allocated) value, read through its
    get-tuple-element; the arena value computed from element 0 is placed, the elements are not."""
    from spmd.passes.assign_buffers import _Liveness, element_name
    from spmd.passes.multi_output_fusion import MultiOutputFusion
    from tests.passes.multi_output_fusion_programs import ADAMW

    mod = parse_module(ADAMW.replace(
        "ROOT %out = (f32[8,4], f32[8,4], f32[8,4]) tuple(%fp, %fm, %fv)",
        "%e = f32[8,4] exponential(%fm)\n  %n = f32[8,4] negate(%e)\n"
        "  ROOT %out = (f32[8,4], f32[8,4], f32[8,4]) tuple(%fp, %n, %fv)"))
    MultiOutputFusion().run(mod)
    verify_module(mod)
    (fusion,) = [i for i in mod.entry.instructions if i.opcode == "fusion"]
    live = _Liveness(mod)
    names = [element_name(fusion.name, k) for k in range(3)]
    assert live.src[id(fusion)] == names and all(n in live.heap for n in names)
    by_gte = {i.attrs["index"]: live.src[id(i)] for i in mod.entry.instructions if i.opcode == "get-tuple-element"}
    assert by_gte == {k: [n] for k, n in enumerate(names)}
    (reader,) = [i for i in mod.entry.instructions if i.opcode == "exponential"]
    element = live.values[names[_gte_index(mod, reader)]]
    assert element.readers == [reader]
    ba = assign_buffers(mod)
    assert "e" in ba.offsets_bytes and not any(n in ba.offsets_bytes for n in names)


def _gte_index(mod, reader) -> int:
    (gte,) = reader.operands
    return gte.attrs["index"]
