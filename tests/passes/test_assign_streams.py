"""assign-streams: partial dots become async pairs on compute streams, permutes go to the comm stream."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import pytest
from expecttest import TestCase

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module
from spmd.passes.assign_streams import AssignStreams
from spmd.passes.windowed_einsum import WindowedEinsum
from tests.passes.test_windowed_einsum import ag_module, random_args, rs_module


def _streams(text: str, bidirectional: bool, **options):
    mod = parse_module(text)
    WindowedEinsum(mode="on", bidirectional=bidirectional).run(mod)
    AssignStreams(**options).run(mod)
    verify_module(mod)
    return mod


@pytest.mark.parametrize("n", [1, 2, 3])
def test_round_robin_and_comm_stream(n):
    mod = _streams(ag_module("lhs", 4, 5), True, num_compute_streams=n)
    starts = [i for i in mod.entry.instructions if i.opcode == "async-start"]
    assert [s.stream_id for s in starts] == [1 + k % n for k in range(len(starts))]
    assert len(starts) == 8
    for i in mod.entry.instructions:
        if i.opcode.startswith("collective-permute"):
            assert i.stream_id == n + 1
        elif i.opcode == "async-done":
            assert i.stream_id == i.operands[0].stream_id
        elif i.opcode not in ("async-start", "parameter"):
            assert i.stream_id == 0
        assert i.opcode not in ("dot", "collective-permute")
    # each called computation holds one partial dot and the dynamic-update-slice it feeds
    for s in starts:
        ops = [b.opcode for b in s.attrs["calls"].instructions if b.opcode != "parameter"]
        assert ops == ["dot", "dynamic-update-slice"]


def test_without_fused_update_only_the_dot_moves():
    mod = _streams(ag_module("lhs", 2, 5), False, fuse_update=False)
    for s in (i for i in mod.entry.instructions if i.opcode == "async-start"):
        assert [b.opcode for b in s.attrs["calls"].instructions if b.opcode != "parameter"] == ["dot"]
    assert sum(i.opcode == "dynamic-update-slice" for i in mod.entry.instructions) == 2


def test_reduce_scatter_slices_move_with_their_dot():
    mod = _streams(rs_module("lhs", 4, 5), False)
    assert not any(i.opcode == "dynamic-slice" for i in mod.entry.instructions)
    adds = [i for i in mod.entry.instructions if i.opcode == "add" and i.shape.rank == 2]
    assert len(adds) == 3 and all(a.stream_id == 0 for a in adds)


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("kind", ["ag", "rs"])
def test_numerics(kind, bidirectional, fuse):
    text = ag_module("batch", 4, 3) if kind == "ag" else rs_module("rhs", 4, 7)
    ref = parse_module(text)
    args = random_args(ref)
    want = evaluate_spmd(ref, args)
    got = evaluate_spmd(_streams(text, bidirectional, fuse_update=fuse), args)
    for w, g in zip(want[0], got[0], strict=True):
        assert ((g - w).abs().max() / w.abs().max()) < 1e-5


def test_errors_and_untouched_modules():
    with pytest.raises(ValueError, match="num_compute_streams"):
        AssignStreams(num_compute_streams=0)
    text = ag_module("lhs", 2, 4)
    mod = AssignStreams().run(parse_module(text))  # no windowed einsum: nothing becomes async
    assert [i.opcode for i in mod.entry.instructions] == [i.opcode for i in parse_module(text).entry.instructions]
    assert all(i.stream_id == 0 for i in mod.entry.instructions if i.opcode != "parameter")


class GoldenTest(TestCase):
    def test_all_gather_p2(self):
        mod = _streams(ag_module("lhs", 2, 4), False)
        self.assertExpectedInline(print_module(mod), """\
HloModule m, num_partitions=2, mesh={tp=2}, is_partitioned=true

%d.acc0.body (d.acc0.arg0: f32[4,6], d.acc0.arg1: f32[6,5], d.acc0.arg2: f32[8,5], d.acc0.arg3: s32[], d.acc0.arg4: s32[]) -> f32[8,5] {
  %d.acc0.arg0 = f32[4,6] parameter(0)
  %d.acc0.arg1 = f32[6,5] parameter(1)
  %d.acc0.arg2 = f32[8,5] parameter(2)
  %d.acc0.arg3 = s32[] parameter(3)
  %d.acc0.arg4 = s32[] parameter(4)
  %d.0.op = f32[4,5] dot(%d.acc0.arg0, %d.acc0.arg1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":0}
  ROOT %d.acc0.op = f32[8,5] dynamic-update-slice(%d.acc0.arg2, %d.0.op, %d.acc0.arg3, %d.acc0.arg4)
}

%d.body (d.arg0: f32[4,6], d.arg1: f32[6,5], d.arg2: f32[8,5], d.arg3: s32[], d.arg4: s32[]) -> f32[8,5] {
  %d.arg0 = f32[4,6] parameter(0)
  %d.arg1 = f32[6,5] parameter(1)
  %d.arg2 = f32[8,5] parameter(2)
  %d.arg3 = s32[] parameter(3)
  %d.arg4 = s32[] parameter(4)
  %d.1.op = f32[4,5] dot(%d.arg0, %d.arg1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":1}
  ROOT %d.op = f32[8,5] dynamic-update-slice(%d.arg2, %d.1.op, %d.arg3, %d.arg4)
}

ENTRY %main (x: f32[4,6], w: f32[6,5]) -> f32[8,5] {
  %x = f32[4,6] parameter(0)
  %w = f32[6,5] parameter(1)
  %pid = u32[] partition-id(), stream_id=0
  %pid.s32 = s32[] convert(%pid), stream_id=0
  %f32.0 = f32[] constant(0.0), stream_id=0
  %d.init = f32[8,5] broadcast(%f32.0), dimensions={}, stream_id=0
  %c4 = s32[] constant(4), stream_id=0
  %ag.off0 = s32[] multiply(%pid.s32, %c4), stream_id=0
  %ag.chunk1-start = (f32[4,6], f32[4,6]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}, stream_id=3
  %ag.chunk1 = f32[4,6] collective-permute-done(%ag.chunk1-start), stream_id=3
  %zero = s32[] constant(0), stream_id=0
  %d.acc0-start = ((f32[4,6], f32[6,5], f32[8,5], s32[], s32[]), f32[8,5]) async-start(%x, %w, %d.init, %ag.off0, %zero), calls=%d.acc0.body, stream_id=1
  %d.acc0 = f32[8,5] async-done(%d.acc0-start), stream_id=1
  %c1 = s32[] constant(1), stream_id=0
  %ag.off1.sum = s32[] add(%pid.s32, %c1), stream_id=0
  %c2 = s32[] constant(2), stream_id=0
  %ag.off1.idx = s32[] remainder(%ag.off1.sum, %c2), stream_id=0
  %ag.off1 = s32[] multiply(%ag.off1.idx, %c4), stream_id=0
  %d-start = ((f32[4,6], f32[6,5], f32[8,5], s32[], s32[]), f32[8,5]) async-start(%ag.chunk1, %w, %d.acc0, %ag.off1, %zero), calls=%d.body, stream_id=2
  ROOT %d = f32[8,5] async-done(%d-start), stream_id=2
}
""")

    def test_reduce_scatter_p2_bidirectional_one_stream(self):
        mod = _streams(rs_module("lhs", 2, 4), True, num_compute_streams=1)
        self.assertExpectedInline(print_module(mod).split("ENTRY", 1)[1], """\
 %main (x: f32[8,6], w: f32[6,5]) -> f32[4,5] {
  %x = f32[8,6] parameter(0)
  %w = f32[6,5] parameter(1)
  %pid = u32[] partition-id(), stream_id=0
  %pid.s32 = s32[] convert(%pid), stream_id=0
  %c1 = s32[] constant(1), stream_id=0
  %rs.off1.sum = s32[] add(%pid.s32, %c1), stream_id=0
  %c2 = s32[] constant(2), stream_id=0
  %rs.off1.idx = s32[] remainder(%rs.off1.sum, %c2), stream_id=0
  %c4 = s32[] constant(4), stream_id=0
  %rs.off1 = s32[] multiply(%rs.off1.idx, %c4), stream_id=0
  %zero = s32[] constant(0), stream_id=0
  %d.cw0-start = ((f32[8,6], s32[], s32[], f32[6,5]), f32[2,5]) async-start(%x, %rs.off1, %zero, %w), calls=%d.cw0.body, stream_id=1
  %d.cw0 = f32[2,5] async-done(%d.cw0-start), stream_id=1
  %rs.off1h = s32[] add(%rs.off1, %c2), stream_id=0
  %d.ccw0-start = ((f32[8,6], s32[], s32[], f32[6,5]), f32[2,5]) async-start(%x, %rs.off1h, %zero, %w), calls=%d.ccw0.body, stream_id=1
  %d.ccw0 = f32[2,5] async-done(%d.ccw0-start), stream_id=1
  %rs.cwrecv1-start = (f32[2,5], f32[2,5]) collective-permute-start(%d.cw0), source_target_pairs={{0,1},{1,0}}, stream_id=2
  %rs.cwrecv1 = f32[2,5] collective-permute-done(%rs.cwrecv1-start), stream_id=2
  %rs.off0 = s32[] multiply(%pid.s32, %c4), stream_id=0
  %rs.ccwrecv1-start = (f32[2,5], f32[2,5]) collective-permute-start(%d.ccw0), source_target_pairs={{0,1},{1,0}}, stream_id=2
  %rs.ccwrecv1 = f32[2,5] collective-permute-done(%rs.ccwrecv1-start), stream_id=2
  %rs.off0h = s32[] add(%rs.off0, %c2), stream_id=0
  %f32.0 = f32[] constant(0.0), stream_id=0
  %rs.init = f32[4,5] broadcast(%f32.0), dimensions={}, stream_id=0
  %rs.cwout-start = ((f32[8,6], s32[], s32[], f32[6,5], f32[2,5], f32[4,5]), f32[4,5]) async-start(%x, %rs.off0, %zero, %w, %rs.cwrecv1, %rs.init), calls=%rs.cwout.body, stream_id=1
  %rs.cwout = f32[4,5] async-done(%rs.cwout-start), stream_id=1
  %rs-start = ((f32[8,6], s32[], s32[], f32[6,5], f32[2,5], f32[4,5], s32[]), f32[4,5]) async-start(%x, %rs.off0h, %zero, %w, %rs.ccwrecv1, %rs.cwout, %c2), calls=%rs.body, stream_id=1
  ROOT %rs = f32[4,5] async-done(%rs-start), stream_id=1
}
""")


@pytest.mark.parametrize("advised", [1, 2])
def test_per_site_streams_from_the_cost_model(advised):
    mod = parse_module(rs_module("lhs", 4, 5))
    WindowedEinsum(mode="on").run(mod)  # bidirectional=None: the cost model chooses and records its advice
    dots = [i for i in mod.entry.instructions if i.opcode == "dot"]
    assert dots and all("compute_streams" in d.attrs["backend_config"] for d in dots)
    for d in dots:
        d.attrs["backend_config"]["compute_streams"] = advised
    AssignStreams(num_compute_streams=None).run(mod)
    verify_module(mod)
    starts = [i for i in mod.entry.instructions if i.opcode == "async-start"]
    assert {s.stream_id for s in starts} == set(range(1, advised + 1))
    # stream ids stay dense: the communication stream follows the compute streams in use
    assert all(i.stream_id == advised + 1 for i in mod.entry.instructions if i.opcode.startswith("collective-permute"))
