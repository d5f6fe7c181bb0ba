"""async-collectives (+ schedule): golden text of start before the independent dot and done after it,
numerics equal to the synchronous program, the prefetch bound of all-gathers."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

from dataclasses import dataclass

import pytest
from expecttest import TestCase

from spmd.ir.text import parse_module
from spmd.passes.async_collectives import AsyncCollectives
from spmd.passes.schedule import Schedule
from tests.passes.pass_checks import run_pass_checked

HEAD = """HloModule m, num_partitions=2, mesh={tp=2}, is_partitioned=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

"""
DOT = "lhs_contracting_dims={1}, rhs_contracting_dims={0}"


def _module(params: list[str], body: list[str], root: str) -> str:
    lines = "\n".join(f"  {b}" for b in body)
    return HEAD + f"ENTRY %main ({', '.join(params)}) -> {root} {{\n{lines}\n}}\n"


@dataclass(frozen=True)
class _AsyncThenSchedule:
    """The two passes as the pipeline runs them."""

    inner: AsyncCollectives = AsyncCollectives()

    def run(self, module):
        return Schedule().run(self.inner.run(module))


def _entry(text: str) -> str:
    return text[text.index("ENTRY"):]


# column-parallel backward: dX (reduce-scattered, sequence parallel) and then the independent dW
DGRAD_WGRAD = _module(
    ["dy: f32[8,4]", "w: f32[16,4]", "x: f32[8,16]"],
    ["%dy = f32[8,4] parameter(0)", "%w = f32[16,4] parameter(1)", "%x = f32[8,16] parameter(2)",
     "%dx = f32[8,16] dot(%dy, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}",
     "%dx.rs = f32[4,16] reduce-scatter(%dx), dimensions={0}, to_apply=%add, replica_groups={{0,1}}",
     "%dw = f32[4,16] dot(%dy, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}",
     "ROOT %out = (f32[4,16], f32[4,16]) tuple(%dx.rs, %dw)"],
    "(f32[4,16], f32[4,16])")

# sequence-parallel row-parallel backward: the saved activation shard %xs is re-gathered for dW
# while dX runs; the gather is issued before the dX dot and waited on right before the dW dot
REGATHER = _module(
    ["dy: f32[8,4]", "w: f32[16,4]", "xs: f32[4,16]"],
    ["%dy = f32[8,4] parameter(0)", "%w = f32[16,4] parameter(1)", "%xs = f32[4,16] parameter(2)",
     "%dx = f32[8,16] dot(%dy, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}",
     "%x = f32[8,16] all-gather(%xs), dimensions={0}, replica_groups={{0,1}}",
     "%dw = f32[4,16] dot(%dy, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}",
     "ROOT %out = (f32[8,16], f32[4,16]) tuple(%dx, %dw)"],
    "(f32[8,16], f32[4,16])")


class TestGolden(TestCase):
    def test_reduce_scatter_of_dx_runs_under_the_wgrad_dot(self):
        text, _ = run_pass_checked(_AsyncThenSchedule(), DGRAD_WGRAD)
        self.assertExpectedInline(text[text.index("%dx.rs.body"):], """\
%dx.rs.body (dx.rs.arg0: f32[8,16]) -> f32[4,16] {
  %dx.rs.arg0 = f32[8,16] parameter(0)
  ROOT %dx.rs.op = f32[4,16] reduce-scatter(%dx.rs.arg0), dimensions={0}, to_apply=%add, replica_groups={{0,1}}
}

ENTRY %main (dy: f32[8,4], w: f32[16,4], x: f32[8,16]) -> (f32[4,16], f32[4,16]) {
  %dy = f32[8,4] parameter(0)
  %w = f32[16,4] parameter(1)
  %x = f32[8,16] parameter(2)
  %dx = f32[8,16] dot(%dy, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %dx.rs-start = ((f32[8,16]), f32[4,16]) async-start(%dx), calls=%dx.rs.body, stream_id=1
  %dw = f32[4,16] dot(%dy, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %dx.rs = f32[4,16] async-done(%dx.rs-start), stream_id=1
  ROOT %out = (f32[4,16], f32[4,16]) tuple(%dx.rs, %dw)
}
""")

    def test_regather_of_a_saved_activation_runs_under_the_dgrad_dot(self):
        text, _ = run_pass_checked(_AsyncThenSchedule(), REGATHER)
        self.assertExpectedInline(_entry(text), """\
ENTRY %main (dy: f32[8,4], w: f32[16,4], xs: f32[4,16]) -> (f32[8,16], f32[4,16]) {
  %dy = f32[8,4] parameter(0)
  %w = f32[16,4] parameter(1)
  %xs = f32[4,16] parameter(2)
  %x-start = (f32[4,16], f32[8,16]) all-gather-start(%xs), dimensions={0}, backend_config={"prefetch_dots":2}, replica_groups={{0,1}}, stream_id=1
  %dx = f32[8,16] dot(%dy, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %x = f32[8,16] all-gather-done(%x-start), stream_id=1
  %dw = f32[4,16] dot(%dy, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ROOT %out = (f32[8,16], f32[4,16]) tuple(%dx, %dw)
}
""")

    def test_gradient_all_reduce_of_layer_l_runs_under_the_backward_of_layer_l_minus_1(self):
        src = _module(
            ["dy: f32[8,4]", "w1: f32[4,4]", "x1: f32[8,4]", "x0: f32[8,4]"],
            ["%dy = f32[8,4] parameter(0)", "%w1 = f32[4,4] parameter(1)", "%x1 = f32[8,4] parameter(2)",
             "%x0 = f32[8,4] parameter(3)",
             "%dw1 = f32[4,4] dot(%x1, %dy), lhs_contracting_dims={0}, rhs_contracting_dims={0}",
             "%dw1.ar = f32[4,4] all-reduce(%dw1), to_apply=%add, replica_groups={{0,1}}",
             "%dx1 = f32[8,4] dot(%dy, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={1}",
             "%dw0 = f32[4,4] dot(%x0, %dx1), lhs_contracting_dims={0}, rhs_contracting_dims={0}",
             "%dw0.ar = f32[4,4] all-reduce(%dw0), to_apply=%add, replica_groups={{0,1}}",
             "ROOT %out = (f32[4,4], f32[4,4]) tuple(%dw1.ar, %dw0.ar)"],
            "(f32[4,4], f32[4,4])")
        text, _ = run_pass_checked(_AsyncThenSchedule(), src)
        self.assertExpectedInline(_entry(text), """\
ENTRY %main (dy: f32[8,4], w1: f32[4,4], x1: f32[8,4], x0: f32[8,4]) -> (f32[4,4], f32[4,4]) {
  %dy = f32[8,4] parameter(0)
  %w1 = f32[4,4] parameter(1)
  %x1 = f32[8,4] parameter(2)
  %x0 = f32[8,4] parameter(3)
  %dw1 = f32[4,4] dot(%x1, %dy), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %dw1.ar-start = f32[4,4] all-reduce-start(%dw1), to_apply=%add, replica_groups={{0,1}}, stream_id=1
  %dx1 = f32[8,4] dot(%dy, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %dw0 = f32[4,4] dot(%x0, %dx1), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %dw0.ar = f32[4,4] all-reduce(%dw0), to_apply=%add, replica_groups={{0,1}}
  %dw1.ar = f32[4,4] all-reduce-done(%dw1.ar-start), stream_id=1
  ROOT %out = (f32[4,4], f32[4,4]) tuple(%dw1.ar, %dw0.ar)
}
""")


def test_fsdp_parameter_gather_is_prefetched_two_dots_ahead():
    """The all-gather of a weight (ready at the start) starts two GEMMs before its use, not at the top."""
    dots = [f"%h{k + 1} = f32[4,4] dot(%h{k}, %w), {DOT}" for k in range(4)]
    src = _module(
        ["h0: f32[4,4]", "w: f32[4,4]", "v: f32[2,4]"],
        ["%h0 = f32[4,4] parameter(0)", "%w = f32[4,4] parameter(1)", "%v = f32[2,4] parameter(2)",
         "%vg = f32[4,4] all-gather(%v), dimensions={0}, replica_groups={{0,1}}", *dots,
         f"ROOT %y = f32[4,4] dot(%h4, %vg), {DOT}"],
        "f32[4,4]")
    _, mod = run_pass_checked(_AsyncThenSchedule(), src)
    order = [i.name for i in mod.entry.instructions]
    assert order.index("vg-start") == order.index("h3") - 1
    assert order.index("vg") == order.index("y") - 1
    _, mod = run_pass_checked(_AsyncThenSchedule(AsyncCollectives(prefetch_dots=4)), src)
    order = [i.name for i in mod.entry.instructions]
    assert order.index("vg-start") == order.index("h1") - 1


def test_collective_without_an_independent_gemm_stays_synchronous():
    src = _module(
        ["x: f32[4,4]", "w: f32[4,4]"],
        ["%x = f32[4,4] parameter(0)", "%w = f32[4,4] parameter(1)",
         f"%d = f32[4,4] dot(%x, %w), {DOT}",
         "%ar = f32[4,4] all-reduce(%d), to_apply=%add, replica_groups={{0,1}}",
         f"ROOT %e = f32[4,4] dot(%ar, %w), {DOT}"],
        "f32[4,4]")
    mod = parse_module(src)
    AsyncCollectives().run(mod)
    assert [i.opcode for i in mod.entry.instructions].count("all-reduce") == 1
    mod = parse_module(DGRAD_WGRAD)
    AsyncCollectives(enabled=False).run(mod)
    assert "async-start" not in [i.opcode for i in mod.entry.instructions]


def test_comm_stream_follows_the_existing_streams():
    mod = parse_module(DGRAD_WGRAD.replace("dimensions={0}, to_apply", "dimensions={0}, to_apply").replace(
        "%dw = f32[4,16] dot(%dy, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}",
        "%dw = f32[4,16] dot(%dy, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}, stream_id=2"))
    AsyncCollectives().run(mod)
    assert {i.stream_id for i in mod.entry.instructions if i.opcode.startswith("async")} == {3}


@pytest.mark.parametrize("what", ["min_overlap_dots", "prefetch_dots"])
def test_bad_options(what):
    with pytest.raises(ValueError, match=what):
        AsyncCollectives(**{what: 0})


def test_the_transposed_weight_shard_moves_with_its_prefetched_gather():
    """An FSDP gather reads a transpose of the weight shard placed right before its use: the
    transpose goes with the start (two GEMMs ahead), so the gather still overlaps."""
    dots = [f"%h{k + 1} = f32[4,4] dot(%h{k}, %w), {DOT}" for k in range(4)]
    src = _module(
        ["h0: f32[4,4]", "w: f32[4,4]", "v: f32[4,2]"],
        ["%h0 = f32[4,4] parameter(0)", "%w = f32[4,4] parameter(1)", "%v = f32[4,2] parameter(2)", *dots,
         "%vt = f32[2,4] transpose(%v), dimensions={1,0}",
         "%vg = f32[4,4] all-gather(%vt), dimensions={0}, replica_groups={{0,1}}",
         f"ROOT %y = f32[4,4] dot(%h4, %vg), {DOT}"],
        "f32[4,4]")
    _, mod = run_pass_checked(_AsyncThenSchedule(), src)
    order = [i.name for i in mod.entry.instructions]
    assert order.index("vt") + 1 == order.index("vg-start") == order.index("h3") - 1, order
    assert order.index("vg") == order.index("y") - 1


def test_a_saved_activation_gather_and_its_reshape_wait_for_the_backward():
    """The gather of a saved shard is flattened right away but read only by the weight gradient at
    the end: the reshape moves down to that dot, so the gather is issued two GEMMs before it."""
    dots = [f"%h{k + 1} = f32[4,4] dot(%h{k}, %w), {DOT}" for k in range(4)]
    src = _module(
        ["h0: f32[4,4]", "w: f32[4,4]", "xs: f32[1,2,4]"],
        ["%h0 = f32[4,4] parameter(0)", "%w = f32[4,4] parameter(1)", "%xs = f32[1,2,4] parameter(2)",
         "%x = f32[1,4,4] all-gather(%xs), dimensions={1}, replica_groups={{0,1}}",
         "%xv = f32[4,4] reshape(%x)", *dots,
         "ROOT %dw = f32[4,4] dot(%xv, %h4), lhs_contracting_dims={0}, rhs_contracting_dims={0}"],
        "f32[4,4]")
    _, mod = run_pass_checked(_AsyncThenSchedule(), src)
    order = [i.name for i in mod.entry.instructions]
    assert order.index("x-start") == order.index("h3") - 1, order
    assert order.index("x") + 2 == order.index("xv") + 1 == order.index("dw"), order
