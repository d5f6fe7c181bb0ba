"""Executor on virtual CPU devices: collectives, async forms, parallel vs serial, threads."""

from __future__ import annotations

import threading

import pytest
import torch
from hlo_helpers import FakeMesh
from programs import collective, windowed_all_gather_dot

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.sharding import MeshShape
from spmd.runtime.executor import Executable, RuntimeOptions


def _per_device(args, n):
    return [[a[d] for a in args] for d in range(n)]


def _run_and_check(module, args, options=None):
    options = options or RuntimeOptions()
    n = module.num_partitions
    ex = Executable(module, FakeMesh(module.mesh), options=options)
    outs, ready = ex.run(args)
    assert ready == [None] * n
    ref = evaluate_spmd(module, _per_device(args, n))
    assert len(outs) == len(ref)
    for out, r in zip(outs, ref, strict=False):
        for a, b in zip(out, r, strict=False):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    return outs


def _rand(n, dims):
    return [[torch.randn(dims) for _ in range(n)]]


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("parallel", [False, True])
def test_all_gather_reduce_scatter_all_reduce(n, parallel):
    opts = RuntimeOptions(cpu_parallel=parallel)
    x = _rand(n, (2, 3))
    ag = _run_and_check(collective("all-gather", f"x={n}", n, (2, 3), (2, 3 * n), dim=1), x, opts)
    expect = torch.cat([torch.exp(t) for t in x[0]], dim=1) ** 2
    torch.testing.assert_close(ag[0][n - 1], expect)
    _run_and_check(collective("reduce-scatter", f"x={n}", n, (2 * n, 3), (2, 3), dim=0), _rand(n, (2 * n, 3)), opts)
    out = _run_and_check(collective("all-reduce", f"x={n}", n, (4, 3), (4, 3), reduce="max"), _rand(n, (4, 3)), opts)
    assert all(torch.equal(out[0][0], o) for o in out[0])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_to_all_and_collective_permute(n):
    _run_and_check(collective("all-to-all", f"x={n}", n, (2 * n, 3), (2 * n, 3), split=0, concat=0),
                   _rand(n, (2 * n, 3)))
    _run_and_check(collective("all-to-all", f"x={n}", n, (2, 3 * n), (2 * n, 3), split=1, concat=0),
                   _rand(n, (2, 3 * n)))
    pairs = [(p, (p + 1) % n) for p in range(n - 1)]  # device 0 receives nothing: zeros
    out = _run_and_check(collective("collective-permute", f"x={n}", n, (3, 5), (3, 5), pairs=pairs), _rand(n, (3, 5)))
    assert torch.count_nonzero(out[0][0]) == 0 and torch.count_nonzero(out[0][1]) == 15


@pytest.mark.parametrize("axes", [(0,), (1,), (0, 1)])
def test_two_d_mesh_replica_groups(axes):
    mesh = MeshShape(("dp", "tp"), (2, 4))
    groups = mesh.groups(tuple(mesh.axis_names[a] for a in axes))
    g = len(groups[0])
    spec = "dp=2,tp=4"
    _run_and_check(collective("all-gather", spec, 8, (2, 3), (2 * g, 3), groups=groups), _rand(8, (2, 3)))
    _run_and_check(collective("reduce-scatter", spec, 8, (2 * g, 3), (2, 3), groups=groups), _rand(8, (2 * g, 3)))
    _run_and_check(collective("all-reduce", spec, 8, (2, 3), (2, 3), groups=groups), _rand(8, (2, 3)))
    _run_and_check(collective("all-to-all", spec, 8, (2, 3 * g), (2 * g, 3), groups=groups, split=1, concat=0),
                   _rand(8, (2, 3 * g)))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("async_dot", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
def test_windowed_all_gather_dot(n, async_dot, fuse):
    m = windowed_all_gather_dot(n, async_dot=async_dot)
    args = [[torch.randn(4, 16) for _ in range(n)], [torch.randn(16, 8)] * n]
    outs = _run_and_check(m, args, RuntimeOptions(fuse=fuse))
    full = torch.cat(args[0]) @ args[1][0]
    for d in range(n):
        torch.testing.assert_close(outs[0][d], full, rtol=1e-5, atol=1e-5)


def test_parallel_equals_serial_and_repeated_calls():
    m = windowed_all_gather_dot(4, m=32, k=64, f=48)
    serial = Executable(m, FakeMesh(m.mesh), options=RuntimeOptions(cpu_parallel=False))
    parallel = Executable(m, FakeMesh(m.mesh), options=RuntimeOptions(cpu_parallel=True, cpu_parallel_min_work=0))
    for _ in range(3):
        args = [[torch.randn(32, 64) for _ in range(4)], [torch.randn(64, 48)] * 4]
        a, _ = serial.run(args)
        b, _ = parallel.run(args)
        for x, y in zip(a[0], b[0], strict=False):
            assert torch.equal(x, y)


def test_four_threads_share_one_executable():
    m = windowed_all_gather_dot(4, m=16, k=32, f=24)
    ex = Executable(m, FakeMesh(m.mesh), options=RuntimeOptions(cpu_parallel_min_work=0))
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            g = torch.Generator().manual_seed(seed)
            for _ in range(10):
                xs = [torch.randn(16, 32, generator=g) for _ in range(4)]
                w = torch.randn(32, 24, generator=g)
                outs, _ = ex.run([xs, [w] * 4])
                expect = torch.cat(xs) @ w
                for o in outs[0]:
                    torch.testing.assert_close(o, expect, rtol=1e-5, atol=1e-5)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_bad_arguments_are_rejected():
    m = collective("all-reduce", "x=2", 2, (4, 3), (4, 3))
    ex = Executable(m, FakeMesh(m.mesh))
    with pytest.raises(ValueError, match="expected 1 parameters"):
        ex.run([])
    with pytest.raises(ValueError, match="one tensor per local device"):
        ex.run([[torch.randn(4, 3)]])
    with pytest.raises(ValueError, match=r"args\[0\]\[1\]: expected torch.float32\[4, 3\]"):
        ex.run([[torch.randn(4, 3), torch.randn(4, 4)]])
    with pytest.raises(ValueError, match="expected 2 devices"):
        Executable(m, FakeMesh(MeshShape(("x",), (4,))))
