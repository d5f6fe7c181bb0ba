"""Collectives for virtual CPU devices: every device's tensor is on the host, one process.

Plain torch ops (concatenate, stacked reductions, clones), following the reference
interpreter ``spmd.ir.evaluate`` so both give bit-identical results. Every result is a fresh
tensor per device (devices never share memory), so the runtime may write into it in place.
An all-reduce with ``algorithm="one-shot"`` runs ``spmd.runtime.comm.one_shot`` (fixed staging
buffers, reduced locally in group order): the algorithm of the CUDA backend, with host copies;
calls of one executable from several threads take turns on its staging buffers (a lock).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from spmd.runtime.comm.base import chunk_index, reduce_stack
from spmd.runtime.comm.one_shot import StagingBuffers, is_one_shot, one_shot_cpu
from spmd.runtime.thunks import CollectiveSpec

Tensor = torch.Tensor


class CpuCommunicator:
    """Collectives over ``n`` virtual CPU devices (local index == partition id)."""

    def __init__(self, num_devices: int) -> None:
        self.pids = tuple(range(num_devices))
        self.staging = StagingBuffers([torch.device("cpu")] * num_devices)
        self._staging_lock = threading.Lock()

    def run(self, spec: CollectiveSpec, inputs: Sequence[Tensor], stream_id: int = 0,
            envs: Sequence[Any] = ()) -> list[Tensor]:
        """Run ``spec`` on ``inputs[pid]``; returns ``out[pid]`` (see ``comm.base``)."""
        if is_one_shot(spec):
            with self._staging_lock:
                return one_shot_cpu(spec, list(inputs), self.staging, stream_id)
        fn = _KINDS.get(spec.kind)
        if fn is None:
            raise ValueError(f"collective kind: expected one of {sorted(_KINDS)}, got {spec.kind!r}")
        return fn(spec, list(inputs))


def _all_gather(spec: CollectiveSpec, x: list[Tensor]) -> list[Tensor]:
    out: list = [None] * len(x)
    for g in spec.groups:
        parts = [x[p] for p in g]
        for p in g:
            out[p] = torch.cat(parts, dim=spec.dim)
    return out


def _all_reduce(spec: CollectiveSpec, x: list[Tensor]) -> list[Tensor]:
    out: list = [None] * len(x)
    for g in spec.groups:
        total = reduce_stack([x[p] for p in g], spec.reduce_op)
        for i, p in enumerate(g):
            out[p] = total if i == 0 else total.clone()
    return out


def _reduce_scatter(spec: CollectiveSpec, x: list[Tensor]) -> list[Tensor]:
    out: list = [None] * len(x)
    for g in spec.groups:
        total = reduce_stack([x[p] for p in g], spec.reduce_op)
        for i, p in enumerate(g):
            start, size = chunk_index(tuple(total.shape), spec.dim, len(g), i)
            out[p] = total.narrow(spec.dim, start, size).clone(memory_format=torch.contiguous_format)
    return out


def _all_to_all(spec: CollectiveSpec, x: list[Tensor]) -> list[Tensor]:
    out: list = [None] * len(x)
    for g in spec.groups:
        n = len(g)
        pieces = {p: torch.chunk(x[p], n, dim=spec.split_dim) for p in g}
        for j, dst in enumerate(g):
            out[dst] = torch.cat([pieces[src][j] for src in g], dim=spec.concat_dim)
    return out


def _collective_permute(spec: CollectiveSpec, x: list[Tensor]) -> list[Tensor]:
    out: list = [None] * len(x)
    for src, tgt in spec.pairs:
        out[tgt] = x[src].clone(memory_format=torch.contiguous_format)
    for p, v in enumerate(x):
        if out[p] is None:
            out[p] = torch.zeros(spec.out_dims, dtype=spec.dtype, device=v.device)
    return out


_KINDS = {
    "all-gather": _all_gather,
    "all-reduce": _all_reduce,
    "reduce-scatter": _reduce_scatter,
    "all-to-all": _all_to_all,
    "collective-permute": _collective_permute,
}
