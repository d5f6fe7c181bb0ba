"""The torch.distributed communicator: 2 and 4 gloo processes on the CPU, one device each."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hlo_helpers import FakeMesh
from programs import collective, windowed_all_gather_dot

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.sharding import MeshShape
from spmd.runtime.executor import Executable, RuntimeOptions


def _programs(n: int):
    """(module, per-parameter arg dims) of every collective kind, plus a windowed ring."""
    mesh = f"x={n}"
    out = [
        (collective("all-gather", mesh, n, (2, 3), (2, 3 * n), dim=1), [(2, 3)]),
        (collective("reduce-scatter", mesh, n, (2 * n, 3), (2, 3), dim=0), [(2 * n, 3)]),
        (collective("all-reduce", mesh, n, (4, 3), (4, 3), reduce="max"), [(4, 3)]),
        (collective("all-to-all", mesh, n, (2, 3 * n), (2 * n, 3), split=1, concat=0), [(2, 3 * n)]),
        (collective("collective-permute", mesh, n, (3, 5), (3, 5), pairs=[(p, (p + 1) % n) for p in range(n - 1)]),
         [(3, 5)]),
        (windowed_all_gather_dot(n), [(4, 16), (16, 8)]),
    ]
    if n == 4:
        m2 = MeshShape(("dp", "tp"), (2, 2))
        groups = tuple(reversed(g) for g in m2.groups(("tp",)))  # unsorted groups: {1,0},{3,2}
        out.append((collective("all-gather", "dp=2,tp=2", 4, (2, 3), (4, 3), groups=groups), [(2, 3)]))
        out.append((collective("reduce-scatter", "dp=2,tp=2", 4, (4, 3), (2, 3), groups=m2.groups(("dp",))),
                    [(4, 3)]))
    return out


def _worker(rank: int, world: int, init: str, backend: str = "gloo") -> None:
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    platform = "cuda" if backend == "nccl" else "cpu"
    if platform == "cuda":
        torch.cuda.set_device(rank)
    try:
        for k, (module, dims) in enumerate(_programs(world)):
            g = torch.Generator().manual_seed(1000 + k)
            full = [[torch.randn(d, generator=g) for _ in range(world)] for d in dims]  # same on every rank
            mesh = FakeMesh(module.mesh, platform)
            ex = Executable(module, mesh, options=RuntimeOptions(distributed=True))
            outs, ready = ex.run([[a[rank].to(mesh.devices[rank])] for a in full])
            if ready[0] is not None:
                ready[0].synchronize()
            ref = evaluate_spmd(module, [[a[p] for a in full] for p in range(world)])
            for o, r in zip(outs, ref, strict=True):
                torch.testing.assert_close(o[0].cpu(), r[rank], rtol=1e-4, atol=1e-4,
                                           msg=lambda m, k=k: f"program {k}: {m}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_distributed_gloo_matches_the_reference(world, tmp_path):
    mp.spawn(_worker, args=(world, f"file://{tmp_path}/store"), nprocs=world, join=True)


@pytest.mark.gpu(count=2)
def test_distributed_nccl_on_two_gpus(tmp_path):
    mp.spawn(_worker, args=(2, f"file://{tmp_path}/store", "nccl"), nprocs=2, join=True)
