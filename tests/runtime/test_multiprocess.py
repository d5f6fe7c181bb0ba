"""The multi-process communicator: every collective kind on 2 gloo processes x 2 virtual devices.

Each program runs on a ``Mesh`` whose partitions 0-1 belong to rank 0 and 2-3 to rank 1, in both
reduce modes, and must equal the reference interpreter on the partitions this process drives.
Groups that stay inside a process, groups split over processes, unsorted groups, groups with
several members per process and permute targets that no pair names are all covered.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from programs import collective, windowed_all_gather_dot

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.sharding import MeshShape
from spmd.runtime.executor import Executable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from launch import spawn  # noqa: E402


def _programs():
    m2 = MeshShape(("dp", "tp"), (2, 2))
    dp_groups, tp_groups = m2.groups(("dp",)), m2.groups(("tp",))
    return [
        collective("all-gather", "x=4", 4, (2, 3), (2, 12), dim=1),
        collective("all-gather", "dp=2,tp=2", 4, (2, 3), (4, 3), groups=tuple(reversed(g) for g in dp_groups)),
        collective("all-gather", "dp=2,tp=2", 4, (2, 3), (4, 3), groups=tp_groups),  # inside each process
        collective("reduce-scatter", "x=4", 4, (8, 3), (2, 3), dim=0),
        collective("reduce-scatter", "dp=2,tp=2", 4, (4, 3), (2, 3), groups=dp_groups),
        collective("all-reduce", "x=4", 4, (4, 3), (4, 3), reduce="max"),
        collective("reduce-scatter", "x=4", 4, (8, 3), (2, 3), dim=0, reduce="max"),
        collective("all-reduce", "dp=2,tp=2", 4, (4, 3), (4, 3), groups=((0, 3), (1, 2))),
        collective("all-to-all", "x=4", 4, (2, 12), (8, 3), split=1, concat=0),
        collective("all-to-all", "dp=2,tp=2", 4, (4, 3), (4, 3), groups=dp_groups, split=0, concat=0),
        collective("collective-permute", "x=4", 4, (3, 5), (3, 5), pairs=[(0, 2), (2, 1), (1, 0)]),  # 3 gets 0s
        windowed_all_gather_dot(4),
    ]


def _worker(rank: int, world: int, init_method: str) -> None:
    import spmd
    from spmd.mesh import Mesh

    spmd.distributed.initialize(init_method=init_method, rank=rank, world_size=world, timeout_s=60)
    try:
        for mode in ("gather", "reduce"):
            os.environ["SPMD_DISTRIBUTED_REDUCE"] = mode
            for k, module in enumerate(_programs()):
                mesh = Mesh(module.mesh, "cpu", (0, 1, 0, 1), (0, 0, 1, 1))
                g = torch.Generator().manual_seed(100 + k)
                dims = [tuple(p.shape.dims) for p in module.entry.parameters]
                full = [[torch.randn(d, generator=g) for _ in range(4)] for d in dims]  # same on every rank
                if "to_apply=%max" in str(module):  # a NaN on one device only must reach every result (as amax)
                    full[0][3][0, 0] = full[0][3][1, 2] = float("nan")
                ex = Executable(module, mesh)
                assert ex.pids == (2 * rank, 2 * rank + 1)
                outs, _ = ex.run([[a[p] for p in ex.pids] for a in full])
                ref = evaluate_spmd(module, [[a[p] for a in full] for p in range(4)])
                exact = mode == "gather" or "all-to-all" in str(module) or "permute" in str(module)
                tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-5}
                for o, r in zip(outs, ref, strict=True):
                    for got, p in zip(o, ex.pids, strict=True):
                        torch.testing.assert_close(got, r[p], **tol, equal_nan=True,
                                                   msg=lambda m, k=k, mode=mode: f"{mode} {k}: {m}")
    finally:
        spmd.distributed.shutdown()


def test_every_collective_across_two_processes_of_two_devices():
    spawn(_worker, 2)
