"""combine-collectives: golden HLO text, numerics equal to the uncombined program, no cycles."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import pytest
from expecttest import TestCase

from spmd.ir.text import parse_module
from spmd.passes.combine_collectives import CombineCollectives
from tests.passes.pass_checks import run_pass_checked

HEAD = """HloModule m, num_partitions={p}, mesh={mesh}, is_partitioned=true

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%max (c: f32[], d: f32[]) -> f32[] {{
  %c = f32[] parameter(0)
  %d = f32[] parameter(1)
  ROOT %m = f32[] maximum(%c, %d)
}}

%add64 (e: f64[], f: f64[]) -> f64[] {{
  %e = f64[] parameter(0)
  %f = f64[] parameter(1)
  ROOT %s64 = f64[] add(%e, %f)
}}

"""


def _module(body: list[str], params: list[str], root: str, p: int = 2, mesh: str | None = None) -> str:
    sig = ", ".join(params)
    lines = "\n".join(f"  {b}" for b in body)
    return (HEAD.format(p=p, mesh=mesh or "{dp=" + str(p) + "}")
            + f"ENTRY %main ({sig}) -> {root} {{\n{lines}\n}}\n")


GRADS = _module(
    ["%g0 = f32[4,3] parameter(0)", "%g1 = f32[5] parameter(1)", "%g2 = f32[] parameter(2)",
     "%ar.0 = f32[4,3] all-reduce(%g0), to_apply=%add, replica_groups={{0,1}}",
     "%ar.1 = f32[5] all-reduce(%g1), to_apply=%add, replica_groups={{0,1}}",
     "%ar.2 = f32[] all-reduce(%g2), to_apply=%add, replica_groups={{0,1}}",
     "ROOT %out = (f32[4,3], f32[5], f32[]) tuple(%ar.0, %ar.1, %ar.2)"],
    ["g0: f32[4,3]", "g1: f32[5]", "g2: f32[]"], "(f32[4,3], f32[5], f32[])")


class TestGolden(TestCase):
    def test_three_all_reduces_become_one(self):
        text, mod = run_pass_checked(CombineCollectives(), GRADS)
        self.assertExpectedInline(text[text.index("ENTRY"):], """\
ENTRY %main (g0: f32[4,3], g1: f32[5], g2: f32[]) -> (f32[4,3], f32[5], f32[]) {
  %g0 = f32[4,3] parameter(0)
  %g1 = f32[5] parameter(1)
  %g2 = f32[] parameter(2)
  %ar.0.flat = f32[12] reshape(%g0)
  %ar.2.flat = f32[1] reshape(%g2)
  %ar.0.bucket.cat = f32[18] concatenate(%ar.0.flat, %g1, %ar.2.flat), dimensions={0}
  %ar.0.bucket = f32[18] all-reduce(%ar.0.bucket.cat), to_apply=%add, replica_groups={{0,1}}
  %ar.0.part = f32[12] slice(%ar.0.bucket), slice={[0:12:1]}
  %ar.0 = f32[4,3] reshape(%ar.0.part)
  %ar.1 = f32[5] slice(%ar.0.bucket), slice={[12:17:1]}
  %ar.2.part = f32[1] slice(%ar.0.bucket), slice={[17:18:1]}
  %ar.2 = f32[] reshape(%ar.2.part)
  ROOT %out = (f32[4,3], f32[5], f32[]) tuple(%ar.0, %ar.1, %ar.2)
}
""")

    def test_reduce_scatters_on_different_dims_become_one(self):
        src = _module(
            ["%x = f32[4,3] parameter(0)", "%y = f32[3,4] parameter(1)",
             "%rs.0 = f32[2,3] reduce-scatter(%x), dimensions={0}, to_apply=%add, replica_groups={{0,1}}",
             "%rs.1 = f32[3,2] reduce-scatter(%y), dimensions={1}, to_apply=%add, replica_groups={{0,1}}",
             "ROOT %out = (f32[2,3], f32[3,2]) tuple(%rs.0, %rs.1)"],
            ["x: f32[4,3]", "y: f32[3,4]"], "(f32[2,3], f32[3,2])")
        text, _ = run_pass_checked(CombineCollectives(), src)
        self.assertExpectedInline(text[text.index("ENTRY"):], """\
ENTRY %main (x: f32[4,3], y: f32[3,4]) -> (f32[2,3], f32[3,2]) {
  %x = f32[4,3] parameter(0)
  %y = f32[3,4] parameter(1)
  %rs.0.rows = f32[2,6] reshape(%x)
  %rs.1.front = f32[4,3] transpose(%y), dimensions={1,0}
  %rs.1.rows = f32[2,6] reshape(%rs.1.front)
  %rs.0.bucket.cat = f32[2,12] concatenate(%rs.0.rows, %rs.1.rows), dimensions={1}
  %rs.0.bucket = f32[1,12] reduce-scatter(%rs.0.bucket.cat), dimensions={0}, to_apply=%add, replica_groups={{0,1}}
  %rs.0.part = f32[1,6] slice(%rs.0.bucket), slice={[0:1:1], [0:6:1]}
  %rs.0 = f32[2,3] reshape(%rs.0.part)
  %rs.1.part = f32[1,6] slice(%rs.0.bucket), slice={[0:1:1], [6:12:1]}
  %rs.1.front.out = f32[2,3] reshape(%rs.1.part)
  %rs.1 = f32[3,2] transpose(%rs.1.front.out), dimensions={1,0}
  ROOT %out = (f32[2,3], f32[3,2]) tuple(%rs.0, %rs.1)
}
""")


def _opcodes(mod) -> list[str]:
    return [i.opcode for i in mod.entry.instructions]


def test_bucket_size_limits_each_bucket():
    # 48 + 20 + 4 bytes: a 64-byte bucket holds ar.0 alone, then ar.1 + ar.2
    _, mod = run_pass_checked(CombineCollectives(bucket_size_bytes=64), GRADS)
    assert _opcodes(mod).count("all-reduce") == 2
    _, mod = run_pass_checked(CombineCollectives(bucket_size_bytes=0), GRADS)
    assert _opcodes(mod).count("all-reduce") == 3


def test_dependent_all_reduce_starts_a_new_bucket():
    """ar.1 reads ar.0's result: combining them would be a cycle."""
    src = _module(
        ["%g0 = f32[4] parameter(0)", "%g1 = f32[4] parameter(1)",
         "%ar.0 = f32[4] all-reduce(%g0), to_apply=%add, replica_groups={{0,1}}",
         "%t = f32[4] multiply(%ar.0, %g1)",
         "%ar.1 = f32[4] all-reduce(%t), to_apply=%add, replica_groups={{0,1}}",
         "%ar.2 = f32[4] all-reduce(%g1), to_apply=%add, replica_groups={{0,1}}",
         "ROOT %out = (f32[4], f32[4]) tuple(%ar.1, %ar.2)"],
        ["g0: f32[4]", "g1: f32[4]"], "(f32[4], f32[4])")
    _, mod = run_pass_checked(CombineCollectives(), src)
    assert _opcodes(mod).count("all-reduce") == 2  # ar.0 alone; ar.1 with ar.2


def test_different_reduction_groups_and_dtypes_stay_apart():
    src = _module(
        ["%g0 = f32[4] parameter(0)", "%g1 = f32[4] parameter(1)", "%g2 = f32[4] parameter(2)", "%g3 = f64[4] parameter(3)",
         "%r.a = f32[4] all-reduce(%g0), to_apply=%add, replica_groups={{0,1},{2,3}}",
         "%r.b = f32[4] all-reduce(%g1), to_apply=%max, replica_groups={{0,1},{2,3}}",
         "%r.c = f32[4] all-reduce(%g2), to_apply=%add, replica_groups={{0,2},{1,3}}",
         "%r.d = f64[4] all-reduce(%g3), to_apply=%add64, replica_groups={{0,1},{2,3}}",
         "%r.e = f32[4] all-reduce(%g1), to_apply=%add, replica_groups={{0,1},{2,3}}",
         "ROOT %out = (f32[4], f32[4], f32[4], f64[4], f32[4]) tuple(%r.a, %r.b, %r.c, %r.d, %r.e)"],
        ["g0: f32[4]", "g1: f32[4]", "g2: f32[4]", "g3: f64[4]"], "(f32[4], f32[4], f32[4], f64[4], f32[4])",
        p=4, mesh="{dp=2, tp=2}")
    _, mod = run_pass_checked(CombineCollectives(), src)
    ars = [i for i in mod.entry.instructions if i.opcode == "all-reduce"]
    assert len(ars) == 4  # only r.a + r.e combine
    assert sorted(i.shape.dims[0] for i in ars) == [4, 4, 4, 8]


def test_split_batch_all_reduces_are_left_alone():
    src = GRADS.replace("replica_groups={{0,1}}", 'backend_config={"split_batch":0}, replica_groups={{0,1}}')
    mod = parse_module(src)
    CombineCollectives().run(mod)
    assert _opcodes(mod).count("all-reduce") == 3


@pytest.mark.parametrize("value, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_bucket_size(value, error):
    with pytest.raises(error, match="bucket_size_bytes"):
        CombineCollectives(bucket_size_bytes=value)
