"""sink-scale: golden HLO text, numerics equal to the unrewritten program, non-uniform scales left alone."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

from expecttest import TestCase

from spmd.ir.text import parse_module
from spmd.passes.sink_scale import SinkScale
from tests.passes.pass_checks import run_pass_checked

HEAD = """HloModule m, num_partitions=2, mesh={tp=2}, is_partitioned=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

"""


def _module(scalar: list[str], rs_dim: int = 0, extra_user: bool = False) -> str:
    out = "f32[4,6]" if rs_dim == 0 else "f32[8,3]"
    body = ["%dh = f32[8,5] parameter(0)", "%x = f32[5,6] parameter(1)", *scalar,
            "%mm = f32[8,6] dot(%dh, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
            "%lr = f32[8,6] broadcast(%c), dimensions={}",
            "%g = f32[8,6] multiply(%mm, %lr)"]
    rs = f"{out} reduce-scatter(%g), dimensions={{{rs_dim}}}, to_apply=%add, replica_groups={{{{0,1}}}}"
    if extra_user:
        body += [f"%rs = {rs}", f"ROOT %out = ({out}, f32[8,6]) tuple(%rs, %g)"]
        ret = f"({out}, f32[8,6])"
    else:
        body.append(f"ROOT %rs = {rs}")
        ret = out
    lines = "\n".join(f"  {b}" for b in body)
    return HEAD + f"ENTRY %main (dh: f32[8,5], x: f32[5,6]) -> {ret} {{\n{lines}\n}}\n"


CONST = ["%c = f32[] constant(0.5)"]


class TestGolden(TestCase):
    def test_lr_scale_moves_after_the_reduce_scatter(self):
        text, _ = run_pass_checked(SinkScale(), _module(CONST))
        self.assertExpectedInline(text[text.index("ENTRY"):], """\
ENTRY %main (dh: f32[8,5], x: f32[5,6]) -> f32[4,6] {
  %dh = f32[8,5] parameter(0)
  %x = f32[5,6] parameter(1)
  %c = f32[] constant(0.5)
  %mm = f32[8,6] dot(%dh, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %rs.unscaled = f32[4,6] reduce-scatter(%mm), dimensions={0}, to_apply=%add, replica_groups={{0,1}}
  %rs.scale = f32[4,6] broadcast(%c), dimensions={}
  ROOT %rs = f32[4,6] multiply(%rs.unscaled, %rs.scale)
}
""")


def test_scatter_over_dim_1():
    _, mod = run_pass_checked(SinkScale(), _module(CONST, rs_dim=1))
    assert [i.opcode for i in mod.entry.instructions][-3:] == ["reduce-scatter", "broadcast", "multiply"]


def test_a_scale_that_depends_on_partition_id_is_left_alone():
    """Each device scaling by its own factor does not commute with the sum."""
    scalar = ["%pid = u32[] partition-id()", "%c = f32[] convert(%pid)"]
    _, mod = run_pass_checked(SinkScale(), _module(scalar))
    assert mod.entry.root.opcode == "reduce-scatter"


def test_multiply_with_another_user_is_left_alone():
    mod = parse_module(_module(CONST, extra_user=True))
    SinkScale().run(mod)
    assert "rs.unscaled" not in [i.name for i in mod.entry.instructions]


def test_disabled():
    mod = parse_module(_module(CONST))
    SinkScale(enabled=False).run(mod)
    assert mod.entry.root.operands[0].opcode == "multiply"
