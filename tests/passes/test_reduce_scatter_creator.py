"""reduce-scatter-creator: golden HLO text, numerics equal to the original program, offsets checked."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

from expecttest import TestCase

from spmd.ir.text import parse_module
from spmd.passes.reduce_scatter_creator import ReduceScatterCreator
from tests.passes.pass_checks import run_pass_checked


def _module(p: int, mesh: str, groups: str, offset: list[str], extra_user: bool = False) -> str:
    g = p // 2 if groups.count("{") > 2 else p  # devices per group: 2 on the 2-d meshes below
    rows = 8 // g
    root = "ROOT %ds" if not extra_user else "%ds"
    tail = [] if not extra_user else [f"ROOT %out = (f32[{rows},4], f32[8,4]) tuple(%ds, %y)"]
    body = ["%dh = f32[8,5] parameter(0)", "%w = f32[5,4] parameter(1)", "%b = f32[4] parameter(2)",
            "%mm = f32[8,4] dot(%dh, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
            f"%ar = f32[8,4] all-reduce(%mm), to_apply=%add, replica_groups={groups}",
            "%bb = f32[8,4] broadcast(%b), dimensions={1}",
            "%y = f32[8,4] add(%ar, %bb)",
            "%pid = u32[] partition-id()", "%pid.s32 = s32[] convert(%pid)", *offset, "%zero = s32[] constant(0)",
            f"{root} = f32[{rows},4] dynamic-slice(%y, %off, %zero), dynamic_slice_sizes={{{rows},4}}", *tail]
    out = f"f32[{rows},4]" if not extra_user else f"(f32[{rows},4], f32[8,4])"
    lines = "\n".join(f"  {b}" for b in body)
    return (f"HloModule m, num_partitions={p}, mesh={mesh}, is_partitioned=true\n\n"
            "%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n  %b.0 = f32[] parameter(1)\n"
            "  ROOT %s = f32[] add(%a, %b.0)\n}\n\n"
            f"ENTRY %main (dh: f32[8,5], w: f32[5,4], b: f32[4]) -> {out} {{\n{lines}\n}}\n")


PID_TIMES_4 = ["%c4 = s32[] constant(4)", "%off = s32[] multiply(%pid.s32, %c4)"]


class TestGolden(TestCase):
    def test_all_reduce_add_bias_slice_becomes_reduce_scatter(self):
        text, _ = run_pass_checked(ReduceScatterCreator(), _module(2, "{tp=2}", "{{0,1}}", PID_TIMES_4))
        self.assertExpectedInline(text[text.index("ENTRY"):], """\
ENTRY %main (dh: f32[8,5], w: f32[5,4], b: f32[4]) -> f32[4,4] {
  %dh = f32[8,5] parameter(0)
  %w = f32[5,4] parameter(1)
  %b = f32[4] parameter(2)
  %mm = f32[8,4] dot(%dh, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %bb = f32[8,4] broadcast(%b), dimensions={1}
  %pid = u32[] partition-id()
  %pid.s32 = s32[] convert(%pid)
  %c4 = s32[] constant(4)
  %off = s32[] multiply(%pid.s32, %c4)
  %zero = s32[] constant(0)
  %ds.rs = f32[4,4] reduce-scatter(%mm), dimensions={0}, to_apply=%add, replica_groups={{0,1}}
  %ds.in0 = f32[4,4] dynamic-slice(%bb, %off, %zero), dynamic_slice_sizes={4,4}
  ROOT %ds = f32[4,4] add(%ds.rs, %ds.in0)
}
""")


def test_two_d_mesh_groups_with_a_table_offset():
    """tp groups {{0,1},{2,3}} of a dp=2 x tp=2 mesh: device k of its group starts at k * 4."""
    offset = ["%c2 = s32[] constant(2)", "%k = s32[] remainder(%pid.s32, %c2)", "%c4 = s32[] constant(4)",
              "%off = s32[] multiply(%k, %c4)"]
    _, mod = run_pass_checked(ReduceScatterCreator(), _module(4, "{dp=2, tp=2}", "{{0,1},{2,3}}", offset))
    assert "reduce-scatter" in [i.opcode for i in mod.entry.instructions]


def test_offsets_of_another_grouping_are_left_alone():
    """pid % 2 is each device's index in {{0,1},{2,3}}, not in {{0,2},{1,3}}."""
    offset = ["%c2 = s32[] constant(2)", "%k = s32[] remainder(%pid.s32, %c2)", "%c4 = s32[] constant(4)",
              "%off = s32[] multiply(%k, %c4)"]
    _, mod = run_pass_checked(ReduceScatterCreator(), _module(4, "{dp=2, tp=2}", "{{0,2},{1,3}}", offset))
    assert "reduce-scatter" not in [i.opcode for i in mod.entry.instructions]


def test_all_reduce_read_elsewhere_is_left_alone():
    mod = parse_module(_module(2, "{tp=2}", "{{0,1}}", PID_TIMES_4, extra_user=True))
    ReduceScatterCreator().run(mod)
    assert "reduce-scatter" not in [i.opcode for i in mod.entry.instructions]


def test_disabled():
    mod = parse_module(_module(2, "{tp=2}", "{{0,1}}", PID_TIMES_4))
    ReduceScatterCreator(enabled=False).run(mod)
    assert "all-reduce" in [i.opcode for i in mod.entry.instructions]


RESHAPED = """HloModule m, num_partitions=2, mesh={tp=2}, is_partitioned=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b.0 = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b.0)
}

ENTRY %main (h: f32[8,5], w: f32[5,4], b: f32[4]) -> f32[2,2,4] {
  %h = f32[8,5] parameter(0)
  %w = f32[5,4] parameter(1)
  %b = f32[4] parameter(2)
  %mm = f32[8,4] dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar = f32[8,4] all-reduce(%mm), to_apply=%add, replica_groups={{0,1}}
  %bb = f32[8,4] broadcast(%b), dimensions={1}
  %y = f32[8,4] add(%ar, %bb)
  %v = f32[2,4,4] reshape(%y)
  %pid = u32[] partition-id()
  %pid.s32 = s32[] convert(%pid)
  %c2 = s32[] constant(2)
  %off = s32[] multiply(%pid.s32, %c2)
  %zero = s32[] constant(0)
  ROOT %ds = f32[2,2,4] dynamic-slice(%v, %zero, %off, %zero), dynamic_slice_sizes={2,2,4}
}
"""


class TestGoldenReshape(TestCase):
    def test_sequence_parallel_output_through_the_batch_sequence_reshape(self):
        """[B*S, H] row-parallel output + bias, viewed as [B, S, H], sliced to the sequence shard."""
        text, _ = run_pass_checked(ReduceScatterCreator(), RESHAPED)
        self.assertExpectedInline(text[text.index("ENTRY"):], """\
ENTRY %main (h: f32[8,5], w: f32[5,4], b: f32[4]) -> f32[2,2,4] {
  %h = f32[8,5] parameter(0)
  %w = f32[5,4] parameter(1)
  %b = f32[4] parameter(2)
  %mm = f32[8,4] dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %bb = f32[8,4] broadcast(%b), dimensions={1}
  %pid = u32[] partition-id()
  %pid.s32 = s32[] convert(%pid)
  %c2 = s32[] constant(2)
  %off = s32[] multiply(%pid.s32, %c2)
  %zero = s32[] constant(0)
  %ds.operand = f32[2,4,4] reshape(%mm)
  %ds.rs = f32[2,2,4] reduce-scatter(%ds.operand), dimensions={1}, to_apply=%add, replica_groups={{0,1}}
  %ds.in0.full = f32[2,4,4] reshape(%bb)
  %ds.in0 = f32[2,2,4] dynamic-slice(%ds.in0.full, %zero, %off, %zero), dynamic_slice_sizes={2,2,4}
  ROOT %ds = f32[2,2,4] add(%ds.rs, %ds.in0)
}
""")
