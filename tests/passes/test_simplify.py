"""simplify: golden HLO text, what it must leave alone, numerics against the module and PyTorch."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase

import spmd
from spmd.ir.text import parse_module, print_module
from spmd.passes.simplify import Simplify, remove_unused
from tests.passes.pass_checks import run_pass_checked

P = spmd.PartitionSpec
HEADER = "HloModule m, num_partitions={p}, mesh={{tp={p}}}, is_partitioned=true\n\n"


def _module(params: list[str], body: list[str], result: str, p: int = 1) -> str:
    """A partitioned module text: ``params`` are 'name: shape[, sharding]', ``body`` the lines after them."""
    lines, sig = [], []
    for k, x in enumerate(params):
        name, rest = x.split(": ")
        shape, *sharding = rest.split(", ")
        sig.append(f"{name}: {shape}")
        lines.append(f"%{name} = {shape} parameter({k})" + (f", {sharding[0]}" if sharding else ""))
    text = "\n".join(f"  {ln}" for ln in [*lines, *body])
    return HEADER.format(p=p) + f"ENTRY %main ({', '.join(sig)}) -> {result} {{\n{text}\n}}\n"


def _run(text: str) -> tuple[str, object]:
    """Simplify ``text``; verify it and check it computes what ``text`` did on fresh random inputs."""
    return run_pass_checked(Simplify(), text, exact=True)  # data movement only: bit-exact


def _opcodes(mod) -> list[str]:
    return [i.opcode for i in mod.entry.instructions]


# --------------------------------------------------------------------------- programs
# The attention-mask broadcast as the partitioner leaves it for heads split over 2 devices.
MASK = _module(
    ["x: f32[2,2,4,4], sharding={devices=[1,2,1,1]<=[2]}", "m: f32[2,4], sharding={replicated}"],
    ["%u = f32[2,1,4] reshape(%m), sharding={replicated}",
     "%u1 = f32[2,1,1,4] reshape(%u), sharding={replicated}",
     "%flat = f32[2,4] reshape(%u1), sharding={replicated}",
     '%b = f32[2,4,4,4] broadcast(%flat), dimensions={0,3}, sharding={replicated}, metadata={op_name="aten.sdpa" source_file="model.py" source_line=7}',
     "%zero = s32[] constant(0)",
     "%pid = u32[] partition-id()",
     "%pids = s32[] convert(%pid)",
     "%two = s32[] constant(2)",
     "%off = s32[] multiply(%pids, %two)",
     "%ds = f32[2,2,4,4] dynamic-slice(%b, %zero, %off, %zero, %zero), dynamic_slice_sizes={2,2,4,4}, sharding={devices=[1,2,1,1]<=[2]}",
     "ROOT %out = f32[2,2,4,4] add(%x, %ds), sharding={devices=[1,2,1,1]<=[2]}"],
    "f32[2,2,4,4]", p=2)

CHAINS = _module(
    ["x: f32[2,3,4]", "v: f32[3]"],
    ["%r1 = f32[6,4] reshape(%x)",
     "%r2 = f32[24] reshape(%r1)",
     "%t1 = f32[3,4,2] transpose(%x), dimensions={1,2,0}",
     "%t2 = f32[4,2,3] transpose(%t1), dimensions={1,2,0}",
     "%t3 = f32[2,3,4] transpose(%t2), dimensions={1,2,0}",
     "%e = f32[2,3,4] exponential(%t3)",
     "%b1 = f32[3,5] broadcast(%v), dimensions={0}",
     "%b2 = f32[2,3,5] broadcast(%b1), dimensions={1,2}",
     "%sl = f32[2,3,2] slice(%b2), slice={[0:2:1], [0:3:1], [1:5:2]}",
     "%same = f32[2,3,4] reshape(%x)",
     "%n = f32[2,3,4] negate(%same)",
     "ROOT %out = (f32[24], f32[4,2,3], f32[2,3,4], f32[2,3,2], f32[2,3,4]) tuple(%r2, %t2, %e, %sl, %n)"],
    "(f32[24], f32[4,2,3], f32[2,3,4], f32[2,3,2], f32[2,3,4])")


# --------------------------------------------------------------------------- golden
class GoldenTest(TestCase):
    def test_mask_broadcast_is_not_sliced(self):
        text, mod = _run(MASK)
        ds = next(i for i in mod.entry.instructions if i.name == "ds")
        assert ds.location is not None and ds.location.source_line == 7  # the broadcast's, the slice had none
        self.assertExpectedInline(re.sub(r", metadata=\{[^}]*\}", "", text), """\
HloModule m, num_partitions=2, mesh={tp=2}, is_partitioned=true

ENTRY %main (x: f32[2,2,4,4], m: f32[2,4]) -> f32[2,2,4,4] {
  %x = f32[2,2,4,4] parameter(0), sharding={devices=[1,2,1,1]<=[2]}
  %m = f32[2,4] parameter(1), sharding={replicated}
  %ds = f32[2,2,4,4] broadcast(%m), dimensions={0,3}, sharding={devices=[1,2,1,1]<=[2]}
  ROOT %out = f32[2,2,4,4] add(%x, %ds), sharding={devices=[1,2,1,1]<=[2]}
}
""")

    def test_chains(self):
        text, _ = _run(CHAINS)
        self.assertExpectedInline(text, """\
HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

ENTRY %main (x: f32[2,3,4], v: f32[3]) -> (f32[24], f32[4,2,3], f32[2,3,4], f32[2,3,2], f32[2,3,4]) {
  %x = f32[2,3,4] parameter(0)
  %v = f32[3] parameter(1)
  %r2 = f32[24] reshape(%x)
  %t2 = f32[4,2,3] transpose(%x), dimensions={2,0,1}
  %e = f32[2,3,4] exponential(%x)
  %sl = f32[2,3,2] broadcast(%v), dimensions={1}
  %n = f32[2,3,4] negate(%x)
  ROOT %out = (f32[24], f32[4,2,3], f32[2,3,4], f32[2,3,2], f32[2,3,4]) tuple(%r2, %t2, %e, %sl, %n)
}
""")

    def test_root_chain_keeps_name_sharding_and_location(self):
        text, mod = _run(_module(
            ["x: f32[4,6], sharding={devices=[2,1]<=[2]}"],
            ["%a = f32[24] reshape(%x), sharding={devices=[2]<=[2]}",
             '%b = f32[2,2,6] reshape(%a), sharding={devices=[2,1,1]<=[2]}, metadata={op_name="aten.view" source_file="f.py" source_line=3}',
             "ROOT %c = f32[6,2,2] transpose(%b), dimensions={2,1,0}, sharding={devices=[1,1,2]<=[2]}"],
            "f32[6,2,2]", p=2))
        assert mod.entry.root.name == "c"
        self.assertExpectedInline(text, """\
HloModule m, num_partitions=2, mesh={tp=2}, is_partitioned=true

ENTRY %main (x: f32[4,6]) -> f32[6,2,2] {
  %x = f32[4,6] parameter(0), sharding={devices=[2,1]<=[2]}
  %b = f32[2,2,6] reshape(%x), sharding={devices=[2,1,1]<=[2]}, metadata={op_name="aten.view" source_file="f.py" source_line=3}
  ROOT %c = f32[6,2,2] transpose(%b), dimensions={2,1,0}, sharding={devices=[1,1,2]<=[2]}
}
""")

    def test_update_into_a_broadcast_scalar_becomes_a_pad(self):
        """``slice_scatter`` into zeros (rotate_half's backward): two updates at constant starts, the
        second's start past the end (clamped as HLO does); both become pads of the update."""
        text, _ = _run(_module(
            ["a: f32[2,3,2]", "b: f32[2,3,2]"],
            ["%z = f32[] constant(0)",
             "%zeros = f32[2,3,4] broadcast(%z), dimensions={}",
             "%c0 = s64[] constant(0)",
             "%c2 = s64[] constant(2)",
             "%c9 = s64[] constant(9)",
             "%lo = f32[2,3,4] dynamic-update-slice(%zeros, %a, %c0, %c2, %c0)",
             "%hi = f32[2,3,4] dynamic-update-slice(%zeros, %b, %c0, %c0, %c9)",
             "ROOT %sum = f32[2,3,4] add(%lo, %hi)"], "f32[2,3,4]"))
        self.assertExpectedInline(text, """\
HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

ENTRY %main (a: f32[2,3,2], b: f32[2,3,2]) -> f32[2,3,4] {
  %a = f32[2,3,2] parameter(0)
  %b = f32[2,3,2] parameter(1)
  %z = f32[] constant(0.0)
  %lo = f32[2,3,4] pad(%a, %z), padding=0_0_0x0_0_0x0_2_0
  %hi = f32[2,3,4] pad(%b, %z), padding=0_0_0x0_0_0x2_0_0
  ROOT %sum = f32[2,3,4] add(%lo, %hi)
}
""")


# --------------------------------------------------------------------------- what stays
NOT_REWRITTEN = {
    "dynamic_slice_of_an_operand_dim": (
        ["v: f32[4]", "i: s32[]"],
        ["%b = f32[3,4] broadcast(%v), dimensions={1}", "%zero = s32[] constant(0)",
         "ROOT %ds = f32[3,2] dynamic-slice(%b, %zero, %i), dynamic_slice_sizes={3,2}"], "f32[3,2]"),
    "slice_of_an_operand_dim": (
        ["v: f32[4]"],
        ["%b = f32[3,4] broadcast(%v), dimensions={1}", "ROOT %s = f32[2,3] slice(%b), slice={[0:2:1], [1:4:1]}"],
        "f32[2,3]"),
    "slice_of_an_operand_dim_by_stride": (
        ["v: f32[4]"],
        ["%b = f32[3,4] broadcast(%v), dimensions={1}", "ROOT %s = f32[3,2] slice(%b), slice={[0:3:1], [0:4:2]}"],
        "f32[3,2]"),
    "dynamic_slice_of_a_parameter": (
        ["x: f32[3,4]", "i: s32[]"],
        ["ROOT %ds = f32[3,2] dynamic-slice(%x, %i, %i), dynamic_slice_sizes={3,2}"], "f32[3,2]"),
    "reshape_of_a_negate": (
        ["x: f32[3,4]"], ["%n = f32[3,4] negate(%x)", "ROOT %r = f32[12] reshape(%n)"], "f32[12]"),
    "transpose_of_a_reshape": (
        ["x: f32[12]"], ["%r = f32[3,4] reshape(%x)", "ROOT %t = f32[4,3] transpose(%r), dimensions={1,0}"],
        "f32[4,3]"),
    "broadcast_that_transposes": (
        ["x: f32[3,3]"], ["ROOT %b = f32[3,3] broadcast(%x), dimensions={1,0}"], "f32[3,3]"),
    "update_into_a_broadcast_vector": (
        ["v: f32[3]", "u: f32[3,2]"],
        ["%b = f32[3,4] broadcast(%v), dimensions={0}", "%c0 = s32[] constant(0)",
         "ROOT %d = f32[3,4] dynamic-update-slice(%b, %u, %c0, %c0)"], "f32[3,4]"),
    "update_at_a_computed_start": (
        ["u: f32[3,2]", "i: s32[]"],
        ["%z = f32[] constant(1)", "%b = f32[3,4] broadcast(%z), dimensions={}", "%c0 = s32[] constant(0)",
         "ROOT %d = f32[3,4] dynamic-update-slice(%b, %u, %c0, %i)"], "f32[3,4]"),
    "root_no_op_reshape": (["x: f32[3,4]"], ["ROOT %r = f32[3,4] reshape(%x)"], "f32[3,4]"),
    "tuple_output_no_op_transpose": (
        ["x: f32[3,4]"], ["%t = f32[3,4] transpose(%x), dimensions={0,1}", "%n = f32[3,4] negate(%x)",
                          "ROOT %out = (f32[3,4], f32[3,4]) tuple(%t, %n)"], "(f32[3,4], f32[3,4])"),
}


@pytest.mark.parametrize("case", sorted(NOT_REWRITTEN))
def test_not_rewritten(case):
    params, body, result = NOT_REWRITTEN[case]
    text = _module(params, body, result)
    got, _ = _run(text)
    assert got == print_module(parse_module(text))


def test_no_op_slices_and_broadcast():
    text = _module(["x: f32[3,4]", "i: s32[]"],
                   ["%s = f32[3,4] slice(%x), slice={[0:3:1], [0:4:1]}",
                    "%d = f32[3,4] dynamic-slice(%s, %i, %i), dynamic_slice_sizes={3,4}",
                    "%b = f32[3,4] broadcast(%d), dimensions={0,1}",
                    "ROOT %n = f32[3,4] negate(%b)"], "f32[3,4]")
    got, mod = _run(text)
    assert _opcodes(mod) == ["parameter", "parameter", "negate"] and "negate(%x)" in got


def test_composed_broadcasts_that_restore_the_operand():
    text = _module(["x: f32[3,4]"],
                   ["%b = f32[4,3] broadcast(%x), dimensions={1,0}",
                    "%c = f32[3,4] broadcast(%b), dimensions={1,0}",
                    "ROOT %n = f32[3,4] negate(%c)"], "f32[3,4]")
    _, mod = _run(text)
    assert _opcodes(mod) == ["parameter", "negate"]


def test_used_inner_values_stay():
    text = _module(["x: f32[2,3,4]"],
                   ["%t1 = f32[3,4,2] transpose(%x), dimensions={1,2,0}",
                    "%t2 = f32[4,2,3] transpose(%t1), dimensions={1,2,0}",
                    "ROOT %out = (f32[3,4,2], f32[4,2,3]) tuple(%t1, %t2)"], "(f32[3,4,2], f32[4,2,3])")
    got, _ = _run(text)
    assert "%t1 = f32[3,4,2] transpose(%x)" in got and "%t2 = f32[4,2,3] transpose(%x), dimensions={2,0,1}" in got


def test_remove_unused_keeps_parameters_root_and_used_values():
    mod = parse_module(_module(["x: f32[3]"], ["%a = f32[3] negate(%x)", "%b = f32[3] exponential(%a)",
                                               "ROOT %c = f32[3] negate(%x)"], "f32[3]"))
    comp = mod.entry
    assert remove_unused(comp, [comp.root, *comp.parameters]) == 0
    assert remove_unused(comp, [comp.instructions[2]]) == 2  # %b, then %a that only %b read
    assert [i.name for i in comp.instructions] == ["x", "c"]


def test_unpartitioned_module_is_rejected():
    with pytest.raises(ValueError, match="not partitioned"):
        Simplify().run(parse_module(CHAINS.replace(", is_partitioned=true", "")))


# --------------------------------------------------------------------------- numerics through spmd.jit
def masked_heads(q, k, v, keep):
    """Attention over heads with a padding mask, then a transposed / reshaped output.

    q, k, v [B, H, S, D]; keep [B, S] (1 = attend). The mask bias [B, 1, 1, S] is broadcast to
    the scores [B, H, S, S]; the output goes through two transposes and two reshapes.
    """
    b, h, s, d = q.shape
    bias = ((1.0 - keep) * -1e4)[:, None, None, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # [B, H, S, D]
    t = o.transpose(1, 2).transpose(1, 3)  # [B, D, H, S]
    return torch.tanh(t.reshape(b, d, h * s).reshape(b * d, h * s))


@pytest.mark.parametrize("n, heads", [(2, 4), (4, 4), (4, 8), (4, 6)])
def test_masked_heads_numerics(n, heads):
    """Heads split evenly (the mask broadcast loses its dynamic-slice) and unevenly (6 heads on 4
    devices: the partitioner pads the broadcast before slicing it, and the pad stays)."""
    mesh = spmd.Mesh.create({"tp": n}, f"cpu:{n}")
    head_split = P(None, "tp")
    f = spmd.jit(masked_heads, mesh=mesh, in_shardings=(head_split, head_split, head_split, P()), out_shardings=P(),
                 options=spmd.CompileOptions(verify=True))
    g = torch.Generator().manual_seed(100 * n + heads)
    q, k, v = (torch.randn(2, heads, 6, 5, generator=g) for _ in range(3))
    keep = (torch.rand(2, 6, generator=g) > 0.3).float()
    keep[:, 0] = 1.0
    lowered = f.lower(q, k, v, keep)
    partitioned, simplified = lowered.as_text("spmd-partition"), lowered.as_text("simplify")
    assert " dynamic-slice(" in partitioned
    if heads % n == 0:
        assert " dynamic-slice(" not in simplified
        assert re.search(rf"f32\[2,{heads // n},6,6\] broadcast\(", simplified)
    want = masked_heads(q.double(), k.double(), v.double(), keep.double())
    got = f(q, k, v, keep).to_torch()
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5


# --------------------------------------------------------------------------- collectives over one device
SINGLETON_AXIS = """HloModule m, num_partitions=2, mesh={dp=2,tp=1}, is_partitioned=true

%add.f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %r = f32[] add(%a, %b)
}

ENTRY %main (x: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8] parameter(0), sharding={devices=[2,1]<=[2]}
  %n = f32[4,8] negate(%x), sharding={devices=[2,1]<=[2]}
  %ar = f32[4,8] all-reduce(%n), replica_groups={{0},{1}}, to_apply=%add.f32, sharding={devices=[2,1]<=[2]}
  %ag = f32[4,8] all-gather(%ar), replica_groups={{0},{1}}, dimensions={1}, sharding={devices=[2,1]<=[2]}
  %keep = f32[4,8] all-reduce(%ag), replica_groups={{0,1}}, to_apply=%add.f32, sharding={devices=[2,1]<=[2]}
  ROOT %e = f32[4,8] exponential(%keep), sharding={devices=[2,1]<=[2]}
}
"""


def test_collectives_over_single_device_groups_are_dropped():
    got, mod = _run(SINGLETON_AXIS)
    assert _opcodes(mod) == ["parameter", "negate", "all-reduce", "exponential"]
    assert re.search(r"all-reduce\(%n\), .*replica_groups=\{\{0,1\}\}", got)


def test_decode_on_a_one_device_mesh_has_no_collectives():
    from spmd.models.llama_lm import llama_lm

    model = llama_lm("llama2-7b", 1, small=True, dtype=torch.float32, seed=0)
    mesh = spmd.Mesh.create(("tp",), devices="cpu:1")
    gen = spmd.Generator(model, mesh, max_batch=1, max_seq=12, prefill_len=4)
    gen.generate([[1, 2, 3]], 2)
    for program in gen.programs(spmd.generation.Sampling()):
        (compiled,) = program._cache.values()
        assert compiled.collectives() == []
