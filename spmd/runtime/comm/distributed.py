"""Collectives over ``torch.distributed``: one process per device, launched with torchrun.

Each process drives the one mesh device whose partition id equals its global rank, and runs
the same program with its own partition id (multi-controller). all-gather, reduce-scatter and
all-reduce use process-group collectives over one sub-group per replica group; all-to-all and
collective-permute use point-to-point ``batch_isend_irecv`` (XLA's collective-permute sends
to ``source_target_pairs`` targets; a device no pair targets gets zeros).

Every process must create the same sub-groups in the same order (``dist.new_group`` is a
collective call): the constructor walks the program's collectives, which are identical on
every rank. Backends: NCCL (one GPU per process) and gloo (CPU; its missing reduce-scatter is
done as all-reduce then slice). One-shot all-reduces (``CollectiveSpec.algorithm``) run PyTorch's
symmetric-memory one-shot kernel where it is available (``spmd.runtime.comm.symmetric``), else
the process group's all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from spmd.runtime.comm.base import chunk_index
from spmd.runtime.comm.nan_reduce import run_nan_safe
from spmd.runtime.comm.symmetric import SymmetricOneShot
from spmd.runtime.thunks import CollectiveSpec

Tensor = torch.Tensor

_OPS = {"add": dist.ReduceOp.SUM, "multiply": dist.ReduceOp.PRODUCT,
        "maximum": dist.ReduceOp.MAX, "minimum": dist.ReduceOp.MIN}


class DistributedCommunicator:
    """Collectives for the calling process's device (partition id ``pid`` == global rank).

    Args:
      pid: this process's partition id (its rank in the default group).
      num_partitions: mesh size (== world size).
      specs: every collective of the program, in program order (to create sub-groups).
      device: this process's torch device.
    Raises:
      ValueError: the world size is not ``num_partitions``.
    """

    def __init__(self, pid: int, num_partitions: int, specs: Sequence[CollectiveSpec], device: torch.device) -> None:
        world = dist.get_world_size()
        if world != num_partitions:
            raise ValueError(f"torch.distributed world size: expected {num_partitions} (mesh devices), got {world}")
        self.pids = (pid,)
        self.device = device
        self._groups: dict[tuple[int, ...], Any] = {}
        for spec in specs:
            if spec.kind in ("collective-permute", "all-to-all"):
                continue
            for g in spec.groups:
                key = tuple(sorted(g))
                if key not in self._groups:
                    self._groups[key] = dist.group.WORLD if len(key) == world else dist.new_group(list(key))
        self.one_shot = SymmetricOneShot(pid, specs, self._groups, device)

    def run(self, spec: CollectiveSpec, inputs: Sequence[Tensor], stream_id: int, envs: Sequence[Any]) -> list[Tensor]:
        """Run ``spec`` with this device's operand ``inputs[0]``; returns ``[result]``."""
        if envs:
            torch.cuda.set_stream(envs[0].streams[stream_id])
        return run_nan_safe(spec, inputs, lambda sp, x: [self._dispatch(sp, x[0].contiguous())])

    def _dispatch(self, spec: CollectiveSpec, x: Tensor) -> Tensor:
        pid = self.pids[0]
        if spec.kind == "collective-permute":
            return self._permute(spec, x, pid)
        group = next(g for g in spec.groups if pid in g)
        if spec.kind == "all-to-all":
            return self._all_to_all(spec, x, pid, group)
        pg = self._groups[tuple(sorted(group))]
        if spec.kind == "all-gather":
            parts = [torch.empty_like(x) for _ in group]
            dist.all_gather(parts, x, group=pg)
            by_rank = dict(zip(sorted(group), parts, strict=True))
            return torch.cat([by_rank[p] for p in group], dim=spec.dim)
        if spec.kind == "all-reduce" and spec.algorithm == "one-shot":
            y = self.one_shot.run(spec, x)
            if y is not None:
                return y
        y = x.clone()
        dist.all_reduce(y, op=_OPS[spec.reduce_op], group=pg)
        if spec.kind == "all-reduce":
            return y
        if spec.kind == "reduce-scatter":
            start, size = chunk_index(tuple(y.shape), spec.dim, len(group), group.index(pid))
            return y.narrow(spec.dim, start, size).clone(memory_format=torch.contiguous_format)
        raise ValueError(f"collective kind: expected one of all-gather, reduce-scatter, all-reduce, all-to-all, "
                         f"collective-permute, got {spec.kind!r}")

    def _permute(self, spec: CollectiveSpec, x: Tensor, pid: int) -> Tensor:
        out = None
        ops = []
        for src, tgt in spec.pairs:
            if src == pid and tgt == pid:
                out = x.clone()
            elif src == pid:
                ops.append(dist.P2POp(dist.isend, x, tgt))
            elif tgt == pid:
                out = torch.empty(spec.out_dims, dtype=spec.dtype, device=x.device)
                ops.append(dist.P2POp(dist.irecv, out, src))
        _wait(ops)
        return out if out is not None else torch.zeros(spec.out_dims, dtype=spec.dtype, device=x.device)

    def _all_to_all(self, spec: CollectiveSpec, x: Tensor, pid: int, group: tuple[int, ...]) -> Tensor:
        n = len(group)
        me = group.index(pid)
        recv: list[Tensor] = []
        ops = []
        for i, peer in enumerate(group):
            s0, size = chunk_index(tuple(x.shape), spec.split_dim, n, i)
            piece = x.narrow(spec.split_dim, s0, size).contiguous()
            if peer == pid:
                recv.append(piece.clone())
                continue
            buf = torch.empty_like(piece)
            recv.append(buf)
            ops.append(dist.P2POp(dist.isend, piece, peer))
            ops.append(dist.P2POp(dist.irecv, buf, peer))
        _wait(ops)
        assert len(recv) == n and me < n
        return torch.cat(recv, dim=spec.concat_dim)


def _wait(ops: list) -> None:
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
