"""windowed einsum through a merging reshape: golden HLO text, numerics equal to the original program."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import pytest
from expecttest import TestCase

from spmd.passes.windowed_einsum import MARK, WindowedEinsum
from tests.passes.pass_checks import run_pass_checked

ON = WindowedEinsum(mode="on", bidirectional=False)


def _module(p: int, params: list[str], body: list[str], root: str) -> str:
    lines = "\n".join(f"  {b}" for b in body)
    return (f"HloModule m, num_partitions={p}, mesh={{tp={p}}}, is_partitioned=true\n\n"
            f"ENTRY %main ({', '.join(params)}) -> {root} {{\n{lines}\n}}\n")


def linear(p: int, b: int = 2, c: int = 2, extra_wgrad: bool = False) -> str:
    """[B, S/P, H] gathered on the sequence dim, flattened to [B*S, H], times W."""
    s = p * c
    body = [f"%x = f32[{b},{c},6] parameter(0)", "%w = f32[6,5] parameter(1)",
            f"%ag = f32[{b},{s},6] all-gather(%x), dimensions={{1}}, replica_groups={{{{{','.join(map(str, range(p)))}}}}}",
            f"%v = f32[{b * s},6] reshape(%ag)",
            f"%d = f32[{b * s},5] dot(%v, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}"]
    params = [f"x: f32[{b},{c},6]", "w: f32[6,5]"]
    if not extra_wgrad:
        return _module(p, params, [*body[:-1], "ROOT " + body[-1]], f"f32[{b * s},5]")
    params.append(f"dy: f32[{b * s},5]")
    body += [f"%dy = f32[{b * s},5] parameter(2)",
             "%dw = f32[6,5] dot(%v, %dy), lhs_contracting_dims={0}, rhs_contracting_dims={0}",
             f"ROOT %out = (f32[{b * s},5], f32[6,5]) tuple(%d, %dw)"]
    return _module(p, params, body, f"(f32[{b * s},5], f32[6,5])")


class TestGolden(TestCase):
    def test_sequence_gather_flattened_with_the_batch(self):
        text, _ = run_pass_checked(ON, linear(2))
        self.assertExpectedInline(text[text.index("ENTRY"):], """\
ENTRY %main (x: f32[2,2,6], w: f32[6,5]) -> f32[8,5] {
  %x = f32[2,2,6] parameter(0)
  %w = f32[6,5] parameter(1)
  %pid = u32[] partition-id()
  %pid.s32 = s32[] convert(%pid)
  %f32.0 = f32[] constant(0.0)
  %d.init = f32[2,4,5] broadcast(%f32.0), dimensions={}
  %c2 = s32[] constant(2)
  %ag.off0 = s32[] multiply(%pid.s32, %c2)
  %ag.chunk1 = f32[2,2,6] collective-permute(%x), source_target_pairs={{0,1},{1,0}}
  %ag.in0 = f32[4,6] reshape(%x)
  %d.0 = f32[4,5] dot(%ag.in0, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":0}
  %d.out0 = f32[2,2,5] reshape(%d.0)
  %zero = s32[] constant(0)
  %d.acc0 = f32[2,4,5] dynamic-update-slice(%d.init, %d.out0, %zero, %ag.off0, %zero)
  %c1 = s32[] constant(1)
  %ag.off1.sum = s32[] add(%pid.s32, %c1)
  %ag.off1.idx = s32[] remainder(%ag.off1.sum, %c2)
  %ag.off1 = s32[] multiply(%ag.off1.idx, %c2)
  %ag.in1 = f32[4,6] reshape(%ag.chunk1)
  %d.1 = f32[4,5] dot(%ag.in1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":1}
  %d.out1 = f32[2,2,5] reshape(%d.1)
  %d.acc1 = f32[2,4,5] dynamic-update-slice(%d.acc0, %d.out1, %zero, %ag.off1, %zero)
  ROOT %d = f32[8,5] reshape(%d.acc1)
}
""")


@pytest.mark.parametrize("p, b, c", [(2, 1, 3), (4, 2, 1), (4, 3, 2)])
def test_numerics(p, b, c):
    _, mod = run_pass_checked(ON, linear(p, b, c))
    assert not any(i.opcode == "all-gather" for i in mod.entry.instructions)


def test_weight_gradient_keeps_the_all_gather():
    """The dot contracting the merged dim (a weight gradient) reads the kept all-gather."""
    _, mod = run_pass_checked(ON, linear(2, extra_wgrad=True))
    ops = [i.opcode for i in mod.entry.instructions]
    assert ops.count("all-gather") == 1 and ops.count("collective-permute") == 1
    marked = [i for i in mod.entry.instructions if i.opcode == "dot" and MARK in i.attrs.get("backend_config", {})]
    assert len(marked) == 2


def test_batch_dim_of_a_bmm():
    """[B, heads/P, S, d] gathered on heads and merged into the bmm's batch dim with B."""
    body = ["%q = f32[2,1,3,4] parameter(0)", "%k = f32[4,4,3] parameter(1)",
            "%ag = f32[2,2,3,4] all-gather(%q), dimensions={1}, replica_groups={{0,1}}",
            "%v = f32[4,3,4] reshape(%ag)",
            "ROOT %s = f32[4,3,3] dot(%v, %k), lhs_batch_dims={0}, rhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_contracting_dims={1}"]
    _, mod = run_pass_checked(ON, _module(2, ["q: f32[2,1,3,4]", "k: f32[4,4,3]"], body, "f32[4,3,3]"))
    assert not any(i.opcode == "all-gather" for i in mod.entry.instructions)


def test_contracted_merged_dim_only_is_left_alone():
    body = ["%x = f32[2,2,6] parameter(0)", "%dy = f32[8,5] parameter(1)",
            "%ag = f32[2,4,6] all-gather(%x), dimensions={1}, replica_groups={{0,1}}",
            "%v = f32[8,6] reshape(%ag)",
            "ROOT %dw = f32[6,5] dot(%v, %dy), lhs_contracting_dims={0}, rhs_contracting_dims={0}"]
    _, mod = run_pass_checked(ON, _module(2, ["x: f32[2,2,6]", "dy: f32[8,5]"], body, "f32[6,5]"))
    assert [i.opcode for i in mod.entry.instructions].count("all-gather") == 1


def rs_linear(p: int, b: int = 2, c: int = 2, dim: int = 1) -> str:
    """[B*S, K] @ [K, 5] viewed as [B, S, 5] and reduce-scattered over S (dim 1) or B (dim 0)."""
    s = p * c if dim == 1 else 4
    bb = b if dim == 1 else p * c
    out = (bb, c, 5) if dim == 1 else (c, s, 5)
    groups = "{" + ",".join(map(str, range(p))) + "}"
    body = [f"%h = f32[{bb * s},6] parameter(0)", "%w = f32[6,5] parameter(1)",
            f"%d = f32[{bb * s},5] dot(%h, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}",
            f"%v = f32[{bb},{s},5] reshape(%d)",
            f"ROOT %rs = f32[{out[0]},{out[1]},5] reduce-scatter(%v), dimensions={{{dim}}}, to_apply=%add, replica_groups={{{groups}}}"]
    lines = "\n".join(f"  {x}" for x in body)
    return (f"HloModule m, num_partitions={p}, mesh={{tp={p}}}, is_partitioned=true\n\n"
            "%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
            "  ROOT %s = f32[] add(%a, %b)\n}\n\n"
            f"ENTRY %main (h: f32[{bb * s},6], w: f32[6,5]) -> f32[{out[0]},{out[1]},5] {{\n{lines}\n}}\n")


class TestGoldenReduceScatter(TestCase):
    def test_row_parallel_output_viewed_as_batch_sequence_and_scattered_over_sequence(self):
        text, _ = run_pass_checked(ON, rs_linear(2))
        self.assertExpectedInline(text[text.index("ENTRY"):], """\
ENTRY %main (h: f32[8,6], w: f32[6,5]) -> f32[2,2,5] {
  %h = f32[8,6] parameter(0)
  %w = f32[6,5] parameter(1)
  %pid = u32[] partition-id()
  %pid.s32 = s32[] convert(%pid)
  %d.lhswide = f32[2,4,6] reshape(%h)
  %c1 = s32[] constant(1)
  %rs.off1.sum = s32[] add(%pid.s32, %c1)
  %c2 = s32[] constant(2)
  %rs.off1.idx = s32[] remainder(%rs.off1.sum, %c2)
  %rs.off1 = s32[] multiply(%rs.off1.idx, %c2)
  %zero = s32[] constant(0)
  %d.lhsin0 = f32[2,2,6] dynamic-slice(%d.lhswide, %zero, %rs.off1, %zero), dynamic_slice_sizes={2,2,6}
  %d.lhs0 = f32[4,6] reshape(%d.lhsin0)
  %d.0 = f32[4,5] dot(%d.lhs0, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":0}
  %d.out0 = f32[2,2,5] reshape(%d.0)
  %rs.recv1 = f32[2,2,5] collective-permute(%d.out0), source_target_pairs={{0,1},{1,0}}
  %rs.off0 = s32[] multiply(%pid.s32, %c2)
  %d.lhsin1 = f32[2,2,6] dynamic-slice(%d.lhswide, %zero, %rs.off0, %zero), dynamic_slice_sizes={2,2,6}
  %d.lhs1 = f32[4,6] reshape(%d.lhsin1)
  %d.1 = f32[4,5] dot(%d.lhs1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":1}
  %d.out1 = f32[2,2,5] reshape(%d.1)
  ROOT %rs = f32[2,2,5] add(%d.out1, %rs.recv1)
}
""")


@pytest.mark.parametrize("p, b, c, dim", [(2, 1, 3, 1), (4, 2, 1, 1), (4, 3, 2, 1), (2, 2, 2, 0)])
def test_reduce_scatter_numerics(p, b, c, dim):
    _, mod = run_pass_checked(ON, rs_linear(p, b, c, dim))
    ops = [i.opcode for i in mod.entry.instructions]
    assert "reduce-scatter" not in ops and ops.count("collective-permute") == p - 1


def test_reduce_scatter_of_a_bmm_split_batch():
    """A bmm's [B*heads] batch dim viewed as [B, heads] and reduce-scattered over heads."""
    body = ["%x = f32[4,3,6] parameter(0)", "%y = f32[4,6,5] parameter(1)",
            "%d = f32[4,3,5] dot(%x, %y), lhs_batch_dims={0}, rhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_contracting_dims={1}",
            "%v = f32[2,2,3,5] reshape(%d)",
            "ROOT %rs = f32[2,1,3,5] reduce-scatter(%v), dimensions={1}, to_apply=%add, replica_groups={{0,1}}"]
    text = (_module(2, ["x: f32[4,3,6]", "y: f32[4,6,5]"], body, "f32[2,1,3,5]")
            .replace("ENTRY", "%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
                              "  ROOT %s = f32[] add(%a, %b)\n}\n\nENTRY"))
    _, mod = run_pass_checked(ON, text)
    assert "reduce-scatter" not in [i.opcode for i in mod.entry.instructions]
