"""Lowering: folding, fusions, stream joins, buffer assignment, tracing."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hlo_helpers import FakeMesh
from programs import windowed_all_gather_dot

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.text import parse_module
from spmd.runtime import fusions
from spmd.runtime.executor import Executable, RuntimeOptions
from spmd.runtime.lower import lower
from spmd.runtime.thunks import CollectiveThunk, KernelThunk, RecordEventThunk, WaitEventThunk
from spmd.runtime.trace_events import TraceRecorder

CPU4 = [torch.device("cpu")] * 4


@dataclass(frozen=True)
class Buffers:
    offsets_bytes: dict
    sizes_bytes: dict
    arena_size_bytes: int


def _kernel_names(program) -> list[str]:
    return [t.name for t in program.thunks if isinstance(t, KernelThunk)]


def test_offsets_from_partition_id_are_folded():
    p = lower(windowed_all_gather_dot(4), CPU4)
    names = _kernel_names(p)
    assert not any(n.startswith(("pid", "s.", "r.", "off.", "i.")) for n in names), names
    off_slot = [t for t in p.thunks if t.name == "buf.1"][0].ins[-2]
    assert [int(t[off_slot]) for t in p.templates] == [0, 4, 8, 12]


def test_dot_into_dynamic_update_slice_is_fused():
    fused = lower(windowed_all_gather_dot(4), CPU4)
    plain = lower(windowed_all_gather_dot(4), CPU4, fuse=False)
    assert not any(n.startswith("dot") for n in _kernel_names(fused))
    assert sum(n.startswith("dot") for n in _kernel_names(plain)) == 4


@pytest.mark.parametrize("buf, upd, ok", [
    ((8, 4), (2, 4), True), ((8, 4), (8, 2), False), ((1, 8, 4), (1, 2, 4), True),
    ((2, 8, 4), (1, 2, 4), True), ((2, 8, 4), (2, 2, 4), False), ((8, 4), (8, 4), True),
])
def test_contiguous_update(buf, upd, ok):
    assert fusions.contiguous_update(buf, upd) is ok


ADDMM = """HloModule a, num_partitions=2, mesh={{x=2}}, is_partitioned=true

ENTRY %main (x: f32[{b}6,8], w: f32[{b}{wd}], c: f32[5]) -> f32[{b}6,5] {{
  %x = f32[{b}6,8] parameter(0)
  %w = f32[{b}{wd}] parameter(1)
  %c = f32[5] parameter(2)
  %d = f32[{b}6,5] dot(%x, %w), {batch}lhs_contracting_dims={{{lc}}}, rhs_contracting_dims={{{rc}}}
  %cb = f32[{b}6,5] broadcast(%c), dimensions={{{cdim}}}
  ROOT %r = f32[{b}6,5] add(%cb, %d)
}}
"""


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_dot_add_is_fused_into_addmm(batched, transposed):
    b = "3," if batched else ""
    text = ADDMM.format(b=b, wd="5,8" if transposed else "8,5",
                        batch="lhs_batch_dims={0}, rhs_batch_dims={0}, " if batched else "",
                        lc=2 if batched else 1, rc=(2 if batched else 1) if transposed else (1 if batched else 0),
                        cdim=2 if batched else 1)
    m = parse_module(text)
    p = lower(m, CPU4[:2])
    assert _kernel_names(p) == ["cb", "r"]
    lead = (3,) if batched else ()
    args = [[torch.randn(*lead, 6, 8) for _ in range(2)],
            [torch.randn(*lead, *((5, 8) if transposed else (8, 5))) for _ in range(2)],
            [torch.randn(5) for _ in range(2)]]
    outs, _ = Executable(m, FakeMesh(m.mesh)).run(args)
    plain, _ = Executable(m, FakeMesh(m.mesh), options=RuntimeOptions(fuse=False)).run(args)
    for d in range(2):
        w = args[1][d].transpose(-1, -2) if transposed else args[1][d]
        torch.testing.assert_close(outs[0][d], args[0][d] @ w + args[2][d], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[0][d], plain[0][d], rtol=1e-5, atol=1e-5)


def test_stream_joins_record_before_wait_and_skip_implied_waits():
    p = lower(windowed_all_gather_dot(4, async_dot=True), CPU4, gpu=True)
    recorded: set[int] = set()
    for t in p.thunks:
        if isinstance(t, RecordEventThunk):
            recorded.add(t.event_id)
        if isinstance(t, WaitEventThunk):
            assert t.event_id in recorded
    assert p.stream_ids == (0, 1, 2)
    # the dot on stream 1 reads the chunk (stream 2) and w (a parameter): one wait per step
    waits = [t for t in p.thunks if isinstance(t, WaitEventThunk) and t.stream_id == 1]
    assert len(waits) == 4
    # on CPU no event thunks are emitted at all
    cpu = lower(windowed_all_gather_dot(4, async_dot=True), CPU4)
    assert not any(isinstance(t, (RecordEventThunk, WaitEventThunk)) for t in cpu.thunks)
    assert sum(isinstance(t, CollectiveThunk) for t in cpu.thunks) == 3


TRANSITIVE = """HloModule t, num_partitions=2, mesh={x=2}, is_partitioned=true

ENTRY %main (x: f32[4,4]) -> f32[4,4] {
  %x = f32[4,4] parameter(0)
  %a = f32[4,4] exponential(%x), stream_id=1
  %b = f32[4,4] negate(%a), stream_id=2
  %c = f32[4,4] add(%a, %b)
  ROOT %d = f32[4,4] multiply(%c, %a)
}
"""


def test_transitive_join_needs_no_second_wait():
    p = lower(parse_module(TRANSITIVE), CPU4[:2], gpu=True)
    waits = [(t.stream_id, t.name) for t in p.thunks if isinstance(t, WaitEventThunk)]
    # b (stream 2) waits for a; c (stream 0) waits for b, which already implies a
    assert waits == [(2, "wait.b"), (0, "wait.c")]


def _assign_all(module, share_dus: bool) -> Buffers:
    """Every non-parameter, non-root array value of the entry gets its own 256-byte aligned slice."""
    offsets, sizes, off = {}, {}, 0
    for inst in module.entry.instructions:
        if inst.opcode == "parameter" or inst is module.entry.root or inst.shape.is_tuple:
            continue
        if share_dus and inst.opcode == "dynamic-update-slice" and inst.operands[0].name in offsets:
            offsets[inst.name] = offsets[inst.operands[0].name]
            sizes[inst.name] = inst.shape.size_bytes
            continue
        offsets[inst.name], sizes[inst.name] = off, inst.shape.size_bytes
        off += (inst.shape.size_bytes + 255) // 256 * 256
    return Buffers(offsets, sizes, off)


@pytest.mark.parametrize("share_dus", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
def test_buffer_assignment_arena(share_dus, fuse):
    m = windowed_all_gather_dot(4, m=8, k=16, f=8)
    buffers = _assign_all(m, share_dus)
    ex = Executable(m, FakeMesh(m.mesh), buffers, RuntimeOptions(fuse=fuse))
    assert ex.program.arena_views and ex.program.arena_size_bytes == buffers.arena_size_bytes
    for _ in range(2):  # the arena is reused by the second call
        args = [[torch.randn(8, 16) for _ in range(4)], [torch.randn(16, 8)] * 4]
        outs, _ = ex.run(args)
        expect = torch.cat(args[0]) @ args[1][0]
        ref = evaluate_spmd(m, [[a[d] for a in args] for d in range(4)])
        for d in range(4):
            torch.testing.assert_close(outs[0][d], expect, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(outs[0][d], ref[0][d], rtol=1e-5, atol=1e-5)


def test_cpu_trace_records_every_thunk_on_every_device():
    m = windowed_all_gather_dot(2)
    ex = Executable(m, FakeMesh(m.mesh))
    rec = TraceRecorder()
    ex.run([[torch.randn(4, 16) for _ in range(2)], [torch.randn(16, 8)] * 2], trace=rec)
    events = rec.events()
    assert len(events) == 2 * len(ex.program.thunks)
    assert {e.device for e in events} == {0, 1}
    assert all(e.end_us >= e.start_us for e in events)
    assert len(rec.chrome_trace()["traceEvents"]) == len(events)


@pytest.mark.parametrize("async_dot", [False, True])
def test_with_the_assign_buffers_pass(async_dot):
    from spmd.passes.assign_buffers import assign_buffers

    m = windowed_all_gather_dot(4, m=8, k=16, f=8, async_dot=async_dot)
    buffers = assign_buffers(m)
    ex = Executable(m, FakeMesh(m.mesh), buffers)
    for _ in range(2):
        args = [[torch.randn(8, 16) for _ in range(4)], [torch.randn(16, 8)] * 4]
        outs, _ = ex.run(args)
        expect = torch.cat(args[0]) @ args[1][0]
        for d in range(4):
            torch.testing.assert_close(outs[0][d], expect, rtol=1e-5, atol=1e-5)
