"""Executor on local CUDA GPUs: NCCL collectives, peer-copy collective-permute on streams,
asynchronous return, tracing. Skipped without 2 GPUs."""

from __future__ import annotations

import time

import pytest
import torch
from hlo_helpers import FakeMesh
from programs import collective, windowed_all_gather_dot

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.sharding import MeshShape
from spmd.ir.text import parse_module
from spmd.runtime.executor import Executable, RuntimeOptions
from spmd.runtime.trace_events import TraceRecorder

N = 2


def _gpu_mesh(module):
    return FakeMesh(module.mesh, platform="cuda")


def _check(module, host_args, options=None, tol=1e-5):
    n = module.num_partitions
    ex = Executable(module, _gpu_mesh(module), options=options or RuntimeOptions())
    dev_args = [[t.to(f"cuda:{d}") for d, t in enumerate(per)] for per in host_args]
    outs, ready = ex.run(dev_args)
    for d, ev in enumerate(ready):
        torch.cuda.current_stream(d).wait_event(ev)
    ref = evaluate_spmd(module, [[a[d] for a in host_args] for d in range(n)])
    for out, r in zip(outs, ref, strict=True):
        for d, (a, b) in enumerate(zip(out, r, strict=True)):
            assert a.device == torch.device("cuda", d)
            torch.testing.assert_close(a.cpu(), b, rtol=tol, atol=tol)
    return ex, outs


def _rand(dims):
    return [[torch.randn(dims) for _ in range(N)]]


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("use_nccl", [True, False])
@pytest.mark.parametrize("stream_id", [None, 3])
def test_collectives_on_two_gpus(use_nccl, stream_id):
    opts = RuntimeOptions(use_nccl=use_nccl)
    mesh = f"x={N}"
    for dim, ind, outd in ((0, (4, 6), (8, 6)), (1, (4, 6), (4, 12))):
        _check(collective("all-gather", mesh, N, ind, outd, dim=dim, stream_id=stream_id), _rand(ind), opts)
        _check(collective("reduce-scatter", mesh, N, outd, ind, dim=dim, stream_id=stream_id), _rand(outd), opts)
    _check(collective("all-reduce", mesh, N, (5, 7), (5, 7), stream_id=stream_id), _rand((5, 7)), opts)
    _check(collective("all-reduce", mesh, N, (5, 7), (5, 7), reduce="max", stream_id=stream_id), _rand((5, 7)), opts)
    _check(collective("all-to-all", mesh, N, (4, 6), (8, 3), split=1, concat=0, stream_id=stream_id),
           _rand((4, 6)), opts)
    _check(collective("collective-permute", mesh, N, (64, 32), (64, 32), pairs=[(0, 1), (1, 0)],
                      stream_id=stream_id), _rand((64, 32)), opts)
    _, outs = _check(collective("collective-permute", mesh, N, (8, 4), (8, 4), pairs=[(0, 1)], stream_id=stream_id),
                     _rand((8, 4)), opts)
    assert torch.count_nonzero(outs[0][0]) == 0


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("async_dot", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_windowed_all_gather_dot_with_streams(async_dot, fuse, dtype):
    m, k, f = 512, 1024, 768
    module = windowed_all_gather_dot(N, m=m, k=k, f=f, dtype=dtype, async_dot=async_dot)
    ex = Executable(module, _gpu_mesh(module), options=RuntimeOptions(fuse=fuse))
    assert ex.program.stream_ids == ((0, 1, 2) if async_dot else (0, 2))
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    tol = 1e-3 if dtype == "f32" else 3e-2
    for _ in range(3):
        xs = [torch.randn(m, k, dtype=tdt) for _ in range(N)]
        w = torch.randn(k, f, dtype=tdt) / k ** 0.5
        outs, ready = ex.run([[x.to(f"cuda:{d}") for d, x in enumerate(xs)], [w.to(f"cuda:{d}") for d in range(N)]])
        for ev in ready:
            ev.synchronize()
        expect = (torch.cat(xs).float() @ w.float())
        for d in range(N):
            torch.testing.assert_close(outs[0][d].float().cpu(), expect, rtol=tol, atol=tol)


BIG = """HloModule big, num_partitions=2, mesh={x=2}, is_partitioned=true

ENTRY %main (a: f32[4096,4096]) -> f32[4096,4096] {
  %a = f32[4096,4096] parameter(0)
  %b = f32[4096,4096] dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %c = f32[4096,4096] dot(%b, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %d = f32[4096,4096] dot(%c, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %e = f32[4096,4096] dot(%d, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


@pytest.mark.gpu(count=2)
def test_run_returns_before_the_gpus_finish():
    module = parse_module(BIG)
    ex = Executable(module, _gpu_mesh(module))
    a = [torch.randn(4096, 4096, device=f"cuda:{d}") / 64 for d in range(N)]
    ex.run([a])  # warm up cuBLAS
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    t0 = time.perf_counter()
    outs, ready = ex.run([a])
    t_issue = time.perf_counter() - t0
    for ev in ready:
        ev.synchronize()
    t_done = time.perf_counter() - t0
    assert t_issue < 0.5 * t_done, (t_issue, t_done)
    expect = a[0] @ a[0] @ a[0] @ a[0] @ a[0]
    torch.testing.assert_close(outs[0][0], expect, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu(count=2)
def test_arg_ready_events_and_trace():
    module = windowed_all_gather_dot(N, m=256, k=256, f=128, async_dot=True)
    ex = Executable(module, _gpu_mesh(module))
    xs, ready_in = [], []
    for d in range(N):
        s = torch.cuda.Stream(device=d)
        with torch.cuda.stream(s):
            x = torch.randn(256, 256, device=f"cuda:{d}")
            torch.cuda._sleep(10_000_000)  # the argument becomes ready late
            x.mul_(2.0)
            ev = torch.cuda.Event()
            ev.record(s)
        xs.append(x)
        ready_in.append(ev)
    w = torch.randn(256, 128)
    rec = TraceRecorder()
    outs, ready = ex.run([xs, [w.to(f"cuda:{d}") for d in range(N)]], arg_ready=[ready_in, [None, None]], trace=rec)
    for ev in ready:
        ev.synchronize()
    expect = torch.cat([x.cpu() for x in xs]) @ w
    torch.testing.assert_close(outs[0][1].cpu(), expect, rtol=1e-3, atol=1e-3)
    events = rec.events()
    assert {e.device for e in events} == {0, 1}
    assert {e.stream_id for e in events} == {0, 1, 2}
    assert sum(e.name.startswith("cp.") for e in events) == 2 * (N - 1)


@pytest.mark.gpu(count=2)
def test_two_d_groups_need_four_gpus_else_skip():
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    mesh = MeshShape(("dp", "tp"), (2, 2))
    groups = mesh.groups(("tp",))
    module = collective("all-reduce", "dp=2,tp=2", 4, (4, 4), (4, 4), groups=groups)
    ex = Executable(module, _gpu_mesh(module))
    xs = [torch.randn(4, 4) for _ in range(4)]
    outs, ready = ex.run([[x.to(f"cuda:{d}") for d, x in enumerate(xs)]])
    for ev in ready:
        ev.synchronize()
    torch.testing.assert_close(outs[0][1].cpu(), ((xs[0].exp() + xs[1].exp()) ** 2), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu(count=2)
def test_donated_kv_cache_on_gpus():
    from test_donation import KV

    module = parse_module(KV)
    ex = Executable(module, _gpu_mesh(module))
    host = [[torch.randn(16, 8) for _ in range(N)], [torch.randn(2, 8) for _ in range(N)]]
    ref = evaluate_spmd(module, [[a[d] for a in host] for d in range(N)])
    args = [[t.to(f"cuda:{d}") for d, t in enumerate(per)] for per in host]
    outs, ready = ex.run(args, donated=frozenset({0}))
    for d, ev in enumerate(ready):
        ev.synchronize()
        assert outs[0][d].data_ptr() == args[0][d].data_ptr()
        torch.testing.assert_close(outs[0][d].cpu(), ref[0][d])


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("async_dot", [False, True])
def test_windowed_program_with_the_assign_buffers_pass(async_dot):
    from spmd.passes.assign_buffers import assign_buffers

    m, k, f = 256, 512, 384
    module = windowed_all_gather_dot(N, m=m, k=k, f=f, async_dot=async_dot)
    ex = Executable(module, _gpu_mesh(module), assign_buffers(module))
    assert ex.program.arena_views
    for _ in range(3):
        xs = [torch.randn(m, k) for _ in range(N)]
        w = torch.randn(k, f) / k ** 0.5
        outs, ready = ex.run([[x.to(f"cuda:{d}") for d, x in enumerate(xs)], [w.to(f"cuda:{d}") for d in range(N)]])
        for ev in ready:
            ev.synchronize()
        for d in range(N):
            torch.testing.assert_close(outs[0][d].cpu(), torch.cat(xs) @ w, rtol=1e-3, atol=1e-3)
