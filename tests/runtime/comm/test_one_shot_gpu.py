"""One-shot all-reduce on all local GPUs (``spmd.runtime.comm.one_shot``): numerics against NCCL and
float64, bit-identical devices, fixed staging buffers, and inside ``spmd.jit`` with CUDA graphs on and off.
Skipped without 2 GPUs."""

from __future__ import annotations

import sys

import pytest
import torch

import spmd
from spmd.runtime.comm import cuda as comm_cuda
from spmd.runtime.comm.base import reduce_stack
from spmd.runtime.thunks import CollectiveSpec

P = spmd.PartitionSpec


class _Env:
    def __init__(self, stream):
        self.streams = {0: stream}


def _run(comm, spec, xs):
    envs = [_Env(torch.cuda.current_stream(d)) for d in comm.devices]
    out = comm.run(spec, xs, 0, envs)
    for d in comm.devices:
        torch.cuda.synchronize(d)
    return [o.cpu() for o in out]


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=str)
@pytest.mark.parametrize("op", ["add", "maximum"])
@pytest.mark.parametrize("dims", [(1,), (7, 3), (16, 1, 4096), (3, 1000, 129)], ids=str)
def test_one_shot_matches_nccl_and_float64(dtype, tol, op, dims):
    n = torch.cuda.device_count()
    comm = comm_cuda.CudaCommunicator([torch.device("cuda", d) for d in range(n)])
    groups = ((tuple(range(n))),)
    gen = torch.Generator().manual_seed(len(dims))
    xs = [(torch.randn(dims, dtype=torch.float64, generator=gen) + 0.1).to(dtype) for _ in range(n)]
    spec = CollectiveSpec("all-reduce", groups=groups, reduce_op=op, out_dims=dims, dtype=dtype, algorithm="one-shot")
    on_gpu = [x.to(f"cuda:{d}") for d, x in enumerate(xs)]
    one = _run(comm, spec, on_gpu)
    ring = _run(comm, CollectiveSpec("all-reduce", groups=groups, reduce_op=op, out_dims=dims, dtype=dtype), on_gpu)
    ptrs = [b.data_ptr() for bufs in comm.staging._bufs.values() for b in bufs]
    again = _run(comm, spec, on_gpu)
    assert [b.data_ptr() for bufs in comm.staging._bufs.values() for b in bufs] == ptrs  # fixed staging
    want = reduce_stack([x.double() for x in xs], op)
    scale = want.abs().max().item()
    for p in range(n):
        assert torch.equal(one[p], one[0]) and torch.equal(again[p], one[0])
        assert (one[p].double() - want).abs().max().item() <= tol * scale
        assert (ring[p].double() - want).abs().max().item() <= tol * scale


@pytest.fixture
def one_shot_calls(monkeypatch):
    calls: list = []
    original = comm_cuda.one_shot_cuda

    def spy(spec, *args, **kwargs):
        calls.append(spec.out_dims)
        return original(spec, *args, **kwargs)

    monkeypatch.setattr(comm_cuda, "one_shot_cuda", spy)
    monkeypatch.setattr(sys.modules["spmd.jit"], "_GLOBAL_CACHE", {})
    return calls


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_one_shot_inside_jit_and_cuda_graphs(one_shot_calls, cuda_graphs):
    """A decode-shaped row-parallel matmul (16 rows, 4 KB all-reduce per device); fresh inputs every call:
    warm-up, capture and replays under graphs. Every device holds the same bits, close to float64 and NCCL."""
    n = torch.cuda.device_count()
    mesh = spmd.Mesh.create({"tp": n}, "cuda")
    results = {}
    for mode in ("on", "off"):
        def matmul(x, w):
            return torch.tanh(x @ w)

        f = spmd.jit(matmul, mesh=mesh, in_shardings=(P(None, "tp"), P("tp", None)), out_shardings=P(),
                     options=spmd.CompileOptions(cuda_graphs=cuda_graphs, small_all_reduce=mode))
        calls = len(one_shot_calls)
        gen = torch.Generator().manual_seed(3)
        for _ in range(6):
            x, w = torch.randn(16, 64 * n, generator=gen), torch.randn(64 * n, 64, generator=gen)
            shards = [s.data.cpu() for s in f(x, w).shards]
            assert all(torch.equal(s, shards[0]) for s in shards[1:])
            want = torch.tanh(x.double() @ w.double())
            assert (shards[0].double() - want).abs().max().item() < 1e-5
        results[mode] = shards[0]
        # eager calls issue the thunks; a replayed graph issues nothing
        assert (len(one_shot_calls) > calls) is (mode == "on")
    torch.testing.assert_close(results["on"], results["off"], rtol=1e-5, atol=1e-5)
