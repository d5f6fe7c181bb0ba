"""cse: golden HLO text, what it must keep apart, numerics against the module and PyTorch."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import re

import pytest
import torch
from expecttest import TestCase
from torch import nn

import spmd
from spmd.ir.custom_calls import CUSTOM_CALLS
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module
from spmd.passes.cse import CSE, PURE_CUSTOM_CALLS
from tests.passes.pass_checks import run_pass_checked

P = spmd.PartitionSpec
ADD_F32 = """%add.f32 (add.f32.lhs: f32[], add.f32.rhs: f32[]) -> f32[] {
  %add.f32.lhs = f32[] parameter(0)
  %add.f32.rhs = f32[] parameter(1)
  ROOT %add.f32.out = f32[] add(%add.f32.lhs, %add.f32.rhs)
}

"""


def _module(params: list[str], body: list[str], result: str, p: int = 1, computations: str = "") -> str:
    """A partitioned module text: ``params`` are 'name: shape', ``body`` the lines after the parameters."""
    lines = [f"%{n} = {s} parameter({k})" for k, (n, s) in enumerate(x.split(": ") for x in params)]
    text = "\n".join(f"  {ln}" for ln in [*lines, *body])
    return (f"HloModule m, num_partitions={p}, mesh={{tp={p}}}, is_partitioned=true\n\n{computations}"
            f"ENTRY %main ({', '.join(params)}) -> {result} {{\n{text}\n}}\n")


def _run(text: str, **options) -> tuple[str, object]:
    """CSE ``text``; verify it and check it computes what ``text`` did on fresh random inputs."""
    return run_pass_checked(CSE(**options), text, exact=True)


def _count(mod, opcode: str) -> int:
    return sum(i.opcode == opcode for i in mod.entry.instructions)


# --------------------------------------------------------------------------- programs
TWICE = _module(
    ["x: f32[4,4]", "y: f32[4]"],
    ["%c1 = f32[] constant(2.0)",
     "%c2 = f32[] constant(2.0)",
     "%c3 = f64[] constant(2.0)",
     "%e1 = f32[4,4] exponential(%x)",
     "%e2 = f32[4,4] exponential(%x)",
     "%b1 = f32[4,4] broadcast(%y), dimensions={0}",
     "%b2 = f32[4,4] broadcast(%y), dimensions={0}",
     "%b3 = f32[4,4] broadcast(%y), dimensions={1}",
     "%s1 = f32[4,4] add(%e1, %b1)",
     "%s2 = f32[4,4] add(%e2, %b2)",
     "%s3 = f32[4,4] add(%e2, %b3)",
     "%k1 = f32[4,4] broadcast(%c1), dimensions={}",
     "%k2 = f32[4,4] broadcast(%c2), dimensions={}",
     "%m1 = f32[4,4] multiply(%s1, %k1)",
     "%m2 = f32[4,4] multiply(%s2, %k2)",
     "%d = f64[] convert(%c2)",
     "%q = f64[] multiply(%d, %c3)",
     "ROOT %out = (f32[4,4], f32[4,4], f32[4,4], f64[]) tuple(%m1, %m2, %s3, %q)"],
    "(f32[4,4], f32[4,4], f32[4,4], f64[])")


# --------------------------------------------------------------------------- golden
class GoldenTest(TestCase):
    def test_equal_subexpressions(self):
        text, _ = _run(TWICE)
        self.assertExpectedInline(text, """\
HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

ENTRY %main (x: f32[4,4], y: f32[4]) -> (f32[4,4], f32[4,4], f32[4,4], f64[]) {
  %x = f32[4,4] parameter(0)
  %y = f32[4] parameter(1)
  %c1 = f32[] constant(2.0)
  %c3 = f64[] constant(2.0)
  %e1 = f32[4,4] exponential(%x)
  %b1 = f32[4,4] broadcast(%y), dimensions={0}
  %b3 = f32[4,4] broadcast(%y), dimensions={1}
  %s1 = f32[4,4] add(%e1, %b1)
  %s3 = f32[4,4] add(%e1, %b3)
  %k1 = f32[4,4] broadcast(%c1), dimensions={}
  %k2 = f32[4,4] broadcast(%c1), dimensions={}
  %m1 = f32[4,4] multiply(%s1, %k1)
  %m2 = f32[4,4] multiply(%s1, %k2)
  %d = f64[] convert(%c1)
  %q = f64[] multiply(%d, %c3)
  ROOT %out = (f32[4,4], f32[4,4], f32[4,4], f64[]) tuple(%m1, %m2, %s3, %q)
}
""")

    def test_scalar_broadcasts_when_asked(self):
        text, _ = _run(TWICE, merge_scalar_broadcasts=True)
        self.assertExpectedInline(text.split("%s3", 1)[1], """\
 = f32[4,4] add(%e1, %b3)
  %k1 = f32[4,4] broadcast(%c1), dimensions={}
  %m1 = f32[4,4] multiply(%s1, %k1)
  %d = f64[] convert(%c1)
  %q = f64[] multiply(%d, %c3)
  ROOT %out = (f32[4,4], f32[4,4], f32[4,4], f64[]) tuple(%m1, %m1, %s3, %q)
}
""")

    def test_per_layer_mask_broadcasts(self):
        text, mod = _run(_module(
            ["m: f32[2,4]", "x0: f32[2,2,4,4]", "x1: f32[2,2,4,4]"],
            ['%b0 = f32[2,2,4,4] broadcast(%m), dimensions={0,3}, sharding={devices=[1,2,1,1]<=[2]}, metadata={op_name="layer0"}',
             "%a0 = f32[2,2,4,4] add(%x0, %b0)",
             '%b1 = f32[2,2,4,4] broadcast(%m), dimensions={0,3}, sharding={devices=[1,2,1,1]<=[2]}, metadata={op_name="layer1"}',
             "%a1 = f32[2,2,4,4] add(%a0, %b1)",
             "ROOT %a2 = f32[2,2,4,4] add(%a1, %x1)"], "f32[2,2,4,4]", p=2))
        assert mod.entry.instructions[3].location.op_name == "layer0"  # the kept one keeps its metadata
        self.assertExpectedInline(re.sub(r", metadata=\{[^}]*\}", "", text), """\
HloModule m, num_partitions=2, mesh={tp=2}, is_partitioned=true

ENTRY %main (m: f32[2,4], x0: f32[2,2,4,4], x1: f32[2,2,4,4]) -> f32[2,2,4,4] {
  %m = f32[2,4] parameter(0)
  %x0 = f32[2,2,4,4] parameter(1)
  %x1 = f32[2,2,4,4] parameter(2)
  %b0 = f32[2,2,4,4] broadcast(%m), dimensions={0,3}, sharding={devices=[1,2,1,1]<=[2]}
  %a0 = f32[2,2,4,4] add(%x0, %b0)
  %a1 = f32[2,2,4,4] add(%a0, %b0)
  ROOT %a2 = f32[2,2,4,4] add(%a1, %x1)
}
""")


def test_root_duplicate_is_replaced_and_dead_code_goes():
    text, mod = _run(_module(["x: f32[3]", "y: f32[3]"],
                             ["%a = f32[3] tanh(%x)", "%n = f32[3] negate(%y)", "%unused = f32[3] exponential(%n)",
                              "%b = f32[3] tanh(%x)", "%u = f32[3] add(%a, %a)", "ROOT %r = f32[3] tanh(%x)"],
                             "f32[3]"))
    assert mod.entry.root.name == "a"
    # %b and %r go; %unused and %u were dead before and are not the pass's to remove
    assert [i.name for i in mod.entry.instructions] == ["x", "y", "a", "n", "unused", "u"]


# --------------------------------------------------------------------------- what stays apart / what merges
X = ["x: f32[4]"]
PAIRS = {
    "sharding": (X, ["%a = f32[4] negate(%x), sharding={replicated}", "%b = f32[4] negate(%x), sharding={devices=[2]<=[2]}"], 2),
    "stream_id": (X, ["%a = f32[4] negate(%x), stream_id=0", "%b = f32[4] negate(%x), stream_id=1"]),
    "dtype": (X, ["%a = f32[4] convert(%x)", "%b = f64[4] convert(%x)"]),
    "attrs": (X, ["%a = f32[2] slice(%x), slice={[0:2:1]}", "%b = f32[2] slice(%x), slice={[2:4:1]}"]),
    "config": (X, ['%a = f32[4] custom-call(%x), custom_call_target="gelu", backend_config={"approximate":"none"}',
                   '%b = f32[4] custom-call(%x), custom_call_target="gelu", backend_config={"approximate":"tanh"}']),
    "literal_value": ([], ["%a = f32[2] constant({1.0, 2.0})", "%b = f32[2] constant({1.0, 3.0})"]),
    "literal_sign_of_zero": ([], ["%a = f32[] constant(0.0)", "%b = f32[] constant(-0.0)"]),
    "literal_dtype": ([], ["%a = s32[] constant(1)", "%b = s64[] constant(1)"]),
    "all_reduce": (X, ["%a = f32[4] all-reduce(%x), to_apply=%add.f32, replica_groups={{0,1}}",
                       "%b = f32[4] all-reduce(%x), to_apply=%add.f32, replica_groups={{0,1}}"], 2),
    "all_gather": (X, ["%a = f32[8] all-gather(%x), dimensions={0}, replica_groups={{0,1}}",
                       "%b = f32[8] all-gather(%x), dimensions={0}, replica_groups={{0,1}}"], 2),
    "collective_permute": (X, ["%a = f32[4] collective-permute(%x), source_target_pairs={{0,1},{1,0}}",
                               "%b = f32[4] collective-permute(%x), source_target_pairs={{0,1},{1,0}}"], 2),
    "sharding_constraint": (X, ['%a = f32[4] custom-call(%x), custom_call_target="Sharding", sharding={replicated}',
                                '%b = f32[4] custom-call(%x), custom_call_target="Sharding", sharding={replicated}']),
    "scalar_broadcast": ([], ["%c = f32[] constant(1.0)", "%a = f32[4] broadcast(%c), dimensions={}",
                              "%b = f32[4] broadcast(%c), dimensions={}"]),
}
MERGING = {
    "partition_id": ([], ["%a = u32[] partition-id()", "%b = u32[] partition-id()"], 2),
    "iota": ([], ["%a = s32[4] iota(), iota_dimension=0", "%b = s32[4] iota(), iota_dimension=0"]),
    "literal": ([], ["%a = f32[2] constant({1.0, 2.0})", "%b = f32[2] constant({1.0, 2.0})"]),
    "softmax": (X, ['%a = f32[4] custom-call(%x), custom_call_target="softmax", backend_config={"dim":0}',
                    '%b = f32[4] custom-call(%x), custom_call_target="softmax", backend_config={"dim":0}']),
    "reduce": (["x: f32[4,4]"], ["%z = f32[] constant(0.0)",
                                 "%a = f32[4] reduce(%x, %z), dimensions={1}, to_apply=%add.f32",
                                 "%b = f32[4] reduce(%x, %z), dimensions={1}, to_apply=%add.f32"]),
    "get_tuple_element": (X, ["%t = (f32[4], f32[4]) tuple(%x, %x)", "%a = f32[4] get-tuple-element(%t), index=1",
                              "%b = f32[4] get-tuple-element(%t), index=1"]),
}


def _pair_module(params: list[str], body: list[str], p: int = 1) -> str:
    shapes = {ln.split(" = ")[0]: ln.split(" = ")[1].split(" ")[0] for ln in body}
    result = f"({shapes['%a']}, {shapes['%b']})"
    return _module(params, [*body, f"ROOT %out = {result} tuple(%a, %b)"], result, p, ADD_F32)


@pytest.mark.parametrize("case", sorted(PAIRS))
def test_kept_apart(case):
    text = _pair_module(*PAIRS[case])
    got, _ = _run(text)
    assert got == print_module(parse_module(text))


@pytest.mark.parametrize("case", sorted(MERGING))
def test_merged(case):
    _, mod = _run(_pair_module(*MERGING[case]))
    assert [o.name for o in mod.entry.root.operands] == ["a", "a"]


def test_called_computations_compare_by_identity():
    other = ADD_F32.replace("add.f32", "add2.f32")
    text = _module(["x: f32[4,4]"], ["%z = f32[] constant(0.0)",
                                     "%a = f32[4] reduce(%x, %z), dimensions={1}, to_apply=%add.f32",
                                     "%b = f32[4] reduce(%x, %z), dimensions={1}, to_apply=%add2.f32",
                                     "ROOT %out = (f32[4], f32[4]) tuple(%a, %b)"], "(f32[4], f32[4])",
                   computations=ADD_F32 + other)
    got, _ = _run(text)
    assert got == print_module(parse_module(text))


def test_async_pairs_are_kept_apart():
    body = """%body (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8] parameter(0)
  ROOT %neg = f32[4,8] negate(%p)
}

"""
    text = _module(["x: f32[4,8]"], [
        "%s1 = ((f32[4,8]), f32[4,8]) async-start(%x), calls=%body, stream_id=1",
        "%d1 = f32[4,8] async-done(%s1), stream_id=1",
        "%s2 = ((f32[4,8]), f32[4,8]) async-start(%x), calls=%body, stream_id=1",
        "%d2 = f32[4,8] async-done(%s2), stream_id=1",
        "%g1 = (f32[4,8], f32[8,8]) all-gather-start(%x), dimensions={0}, replica_groups={{0,1}}, stream_id=2",
        "%h1 = f32[8,8] all-gather-done(%g1), stream_id=2",
        "%g2 = (f32[4,8], f32[8,8]) all-gather-start(%x), dimensions={0}, replica_groups={{0,1}}, stream_id=2",
        "%h2 = f32[8,8] all-gather-done(%g2), stream_id=2",
        "ROOT %out = (f32[4,8], f32[4,8], f32[8,8], f32[8,8]) tuple(%d1, %d2, %h1, %h2)"],
        "(f32[4,8], f32[4,8], f32[8,8], f32[8,8])", p=2, computations=body)
    mod = parse_module(text)
    CSE().run(mod)
    verify_module(mod)
    assert print_module(mod) == print_module(parse_module(text))


def test_pure_targets_are_registered():
    assert frozenset(CUSTOM_CALLS) - {"Sharding"} == PURE_CUSTOM_CALLS


def test_errors():
    with pytest.raises(TypeError, match="merge_scalar_broadcasts"):
        CSE(merge_scalar_broadcasts=1)


# --------------------------------------------------------------------------- numerics through spmd.jit
def twice(x, w, b):
    """The same projection, bias and activation written twice: x [B, S, D], w [D, F], b [F]."""
    h1 = torch.tanh(x @ w + b)
    h2 = torch.tanh(x @ w + b)
    return h1 * h2 + torch.tanh(x @ w + b)


@pytest.mark.parametrize("n", [2, 4])
def test_twice_numerics(n):
    mesh = spmd.Mesh.create({"tp": n}, f"cpu:{n}")
    f = spmd.jit(twice, mesh=mesh, in_shardings=(P(), P(None, "tp"), P("tp")), out_shardings=P(),
                 options=spmd.CompileOptions(verify=True))
    g = torch.Generator().manual_seed(30 + n)
    x, w, b = torch.randn(2, 6, 16, generator=g), torch.randn(16, 12, generator=g) / 4, torch.randn(12, generator=g)
    lowered = f.lower(x, w, b)
    assert lowered.as_text("simplify").count(" dot(") == 3 and lowered.as_text("cse").count(" dot(") == 1
    want = twice(x.double(), w.double(), b.double())
    for _ in range(2):
        got = f(x, w, b).to_torch()
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
        x = torch.randn(2, 6, 16, generator=g)
        want = twice(x.double(), w.double(), b.double())


class _Bert(nn.Module):
    """BertSentenceEncoder with 2 small layers and random weights."""

    def __init__(self) -> None:
        super().__init__()
        from spmd.models.bert import BertConfig, BertSentenceEncoder

        cfg = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=32)
        self.model = BertSentenceEncoder(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, attention_mask)


def test_bert_has_one_mask_broadcast():
    """Two BERT layers on tp=2: one broadcast of the mask bias to the per-device scores, no slicing."""
    from spmd.models import plans
    from spmd.parallelize import parallelize

    torch.manual_seed(5)
    model = _Bert().eval()
    plan = plans.Plan(tuple((f"model.{pat}", rule) for pat, rule in plans.bert_plan().rules), "tp")
    pm = parallelize(model, spmd.Mesh.create({"tp": 2}, "cpu:2"), plan, options=spmd.CompileOptions(verify=True))
    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, 5:] = 0
    out = pm(ids, mask).to_torch()
    partitioned, final = pm.lowered.as_text("spmd-partition"), pm.lowered.as_text("schedule")
    assert len(re.findall(r"f32\[2,4,8,8\] broadcast\(", partitioned)) == 2  # one full broadcast per layer
    assert len(re.findall(r"f32\[2,[24],8,8\] broadcast\(", final)) == 1 and " dynamic-slice(" not in final
    with torch.no_grad():
        ref = model.double()(ids, mask)
    assert (out.double() - ref).abs().max().item() < 1e-5
