"""Donated parameters: outputs written into the caller's buffers only when that is safe."""

from __future__ import annotations

import pytest
import torch
from hlo_helpers import FakeMesh

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.text import parse_module
from spmd.runtime.executor import Executable

KV = """HloModule kv, num_partitions=2, mesh={x=2}, is_partitioned=true

ENTRY %main (cache: f32[16,8], new: f32[2,8]) -> f32[16,8] {
  %cache = f32[16,8] parameter(0)
  %new = f32[2,8] parameter(1)
  %pid = u32[] partition-id()
  %p = s32[] convert(%pid)
  %three = s32[] constant(3)
  %off = s32[] multiply(%p, %three)
  %zero = s32[] constant(0)
  %t = f32[2,8] tanh(%new)
  ROOT %upd = f32[16,8] dynamic-update-slice(%cache, %t, %off, %zero)
}
"""

LATE_READ = """HloModule late, num_partitions=2, mesh={x=2}, is_partitioned=true

ENTRY %main (x: f32[4,4]) -> (f32[4,4], f32[4,4]) {
  %x = f32[4,4] parameter(0)
  %a = f32[4,4] add(%x, %x)
  %b = f32[4,4] negate(%x)
  ROOT %t = (f32[4,4], f32[4,4]) tuple(%a, %b)
}
"""


def _args(dims_list):
    return [[torch.randn(d) for _ in range(2)] for d in dims_list]


def test_kv_cache_update_is_written_in_place_into_the_donated_cache():
    m = parse_module(KV)
    ex = Executable(m, FakeMesh(m.mesh))
    args = _args([(16, 8), (2, 8)])
    ref = evaluate_spmd(m, [[a[d].clone() for a in args] for d in range(2)])
    plain, _ = ex.run(args)
    assert all(plain[0][d].data_ptr() != args[0][d].data_ptr() for d in range(2))
    outs, _ = ex.run(args, donated=frozenset({0}))
    for d in range(2):
        assert outs[0][d].data_ptr() == args[0][d].data_ptr()
        torch.testing.assert_close(outs[0][d], ref[0][d])
        torch.testing.assert_close(plain[0][d], ref[0][d])


def test_a_parameter_read_after_the_writer_is_not_overwritten_early():
    m = parse_module(LATE_READ)
    ex = Executable(m, FakeMesh(m.mesh))
    args = _args([(4, 4)])
    x = [t.clone() for t in args[0]]
    outs, _ = ex.run(args, donated=frozenset({0}))
    for d in range(2):
        torch.testing.assert_close(outs[0][d], 2 * x[d])
        torch.testing.assert_close(outs[1][d], -x[d])
        assert outs[1][d].data_ptr() == args[0][d].data_ptr()  # the last reader may write in place
        assert outs[0][d].data_ptr() != args[0][d].data_ptr()


def test_bad_donation_index_is_rejected():
    m = parse_module(LATE_READ)
    ex = Executable(m, FakeMesh(m.mesh))
    with pytest.raises(ValueError, match="donated"):
        ex.run(_args([(4, 4)]), donated=frozenset({3}))


UNREAD = """HloModule unread, num_partitions=2, mesh={x=2}, is_partitioned=true

ENTRY %main (x: f32[4,6], d64: f64[4,6], d: f32[1,6,4], e: f32[4,6]) -> f32[4,6] {
  %x = f32[4,6] parameter(0)
  %d64 = f64[4,6] parameter(1)
  %d = f32[1,6,4] parameter(2)
  %e = f32[4,6] parameter(3)
  ROOT %y = f32[4,6] add(%x, %x)
}
"""

# a replicated parameter sliced per device (the partitioner's replicated -> sharded change)
SLICED = """HloModule sliced, num_partitions=2, mesh={x=2}, is_partitioned=true

ENTRY %main (x: f32[4,4]) -> f32[2,4] {
  %x = f32[4,4] parameter(0)
  %zero = s32[] constant(0)
  %pid = u32[] partition-id()
  %p = s32[] convert(%pid)
  %two = s32[] constant(2)
  %off = s32[] multiply(%p, %two)
  %ds = f32[4,2] dynamic-slice(%x, %zero, %off), dynamic_slice_sizes={4,2}
  ROOT %t = f32[2,4] transpose(%ds), dimensions={1,0}
}
"""


def test_an_unread_donated_parameter_receives_only_an_output_of_its_shape_and_dtype():
    m = parse_module(UNREAD)
    ex = Executable(m, FakeMesh(m.mesh))
    args = [[torch.randn(4, 6) for _ in range(2)], [torch.randn(4, 6, dtype=torch.float64) for _ in range(2)],
            [torch.randn(1, 6, 4) for _ in range(2)], [torch.randn(4, 6) for _ in range(2)]]
    outs, _ = ex.run(args, donated=frozenset({1, 2}))
    for d in range(2):
        assert outs[0][d].dtype == torch.float32 and outs[0][d].shape == (4, 6)
        assert outs[0][d].data_ptr() not in (args[1][d].data_ptr(), args[2][d].data_ptr())
        torch.testing.assert_close(outs[0][d], 2 * args[0][d])
    outs, _ = ex.run(args, donated=frozenset({1, 2, 3}))
    for d in range(2):
        assert outs[0][d].data_ptr() == args[3][d].data_ptr()  # unread, same shape and dtype: reused
        torch.testing.assert_close(outs[0][d], 2 * args[0][d])


def test_a_donated_parameter_that_is_sliced_runs_with_the_variants_arena():
    """Donated, the slice is no parameter view: the variant places it in the arena (more views)."""
    from spmd.passes.assign_buffers import assign_buffers

    m = parse_module(SLICED)
    ex = Executable(m, FakeMesh(m.mesh), buffers=assign_buffers(m))
    args = _args([(4, 4)])
    x = [t.clone() for t in args[0]]
    outs, _ = ex.run(args, donated=frozenset({0}))
    for d in range(2):
        torch.testing.assert_close(outs[0][d], x[d][:, 2 * d:2 * d + 2].T)


def test_a_non_contiguous_donated_buffer_is_not_written():
    m = parse_module(LATE_READ)
    ex = Executable(m, FakeMesh(m.mesh))
    args = [[torch.randn(4, 4).T for _ in range(2)]]
    x = [t.clone() for t in args[0]]
    outs, _ = ex.run(args, donated=frozenset({0}))
    for d in range(2):
        assert outs[1][d].data_ptr() != args[0][d].data_ptr()
        torch.testing.assert_close(outs[1][d], -x[d])
        torch.testing.assert_close(args[0][d], x[d])
