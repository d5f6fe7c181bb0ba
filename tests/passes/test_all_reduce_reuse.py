"""all-reduce-reuse: golden HLO text, numerics equal to the original program, mismatches left alone."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

from expecttest import TestCase

from spmd.ir.text import parse_module
from spmd.passes.all_reduce_reuse import AllReduceReuse
from tests.passes.pass_checks import run_pass_checked

HEAD = """HloModule m, num_partitions=4, mesh={{dp=2, tp=2}}, is_partitioned=true

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

ENTRY %main (dh: f32[6,5], x: f32[5,4]) -> (f32[3,4], f32[6,4]) {{
  %dh = f32[6,5] parameter(0)
  %x = f32[5,4] parameter(1)
  %mm = f32[6,4] dot(%dh, %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %ar = f32[6,4] all-reduce(%mm), to_apply=%add, replica_groups={ar_groups}
  %sq = f32[6,4] multiply(%ar, %ar)
  %rs = f32[3,4] reduce-scatter(%mm), dimensions={{0}}, to_apply=%add, replica_groups={{{{0,1}},{{2,3}}}}
  ROOT %out = (f32[3,4], f32[6,4]) tuple(%rs, %sq)
}}
"""


class TestGolden(TestCase):
    def test_all_reduce_becomes_an_all_gather_of_the_reduce_scatter(self):
        text, _ = run_pass_checked(AllReduceReuse(), HEAD.format(ar_groups="{{0,1},{2,3}}"))
        self.assertExpectedInline(text[text.index("ENTRY"):], """\
ENTRY %main (dh: f32[6,5], x: f32[5,4]) -> (f32[3,4], f32[6,4]) {
  %dh = f32[6,5] parameter(0)
  %x = f32[5,4] parameter(1)
  %mm = f32[6,4] dot(%dh, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %rs = f32[3,4] reduce-scatter(%mm), dimensions={0}, to_apply=%add, replica_groups={{0,1},{2,3}}
  %ar = f32[6,4] all-gather(%rs), dimensions={0}, replica_groups={{0,1},{2,3}}
  %sq = f32[6,4] multiply(%ar, %ar)
  ROOT %out = (f32[3,4], f32[6,4]) tuple(%rs, %sq)
}
""")


def test_other_replica_groups_are_left_alone():
    _, mod = run_pass_checked(AllReduceReuse(), HEAD.format(ar_groups="{{0,2},{1,3}}"))
    assert "all-gather" not in [i.opcode for i in mod.entry.instructions]


def test_disabled():
    mod = parse_module(HEAD.format(ar_groups="{{0,1},{2,3}}"))
    AllReduceReuse(enabled=False).run(mod)
    assert "all-gather" not in [i.opcode for i in mod.entry.instructions]
