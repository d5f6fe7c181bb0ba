"""One-shot all-reduce over fixed staging buffers, for the devices one process drives.

The algorithm of a ``CollectiveSpec`` with ``algorithm="one-shot"``
(``spmd.passes.select_all_reduce``), the same on virtual CPU devices and on local CUDA GPUs:

1. every device ``dst`` of a replica group ``g`` (``k`` devices) owns one staging buffer
   ``[k, *out_dims]``, allocated at the all-reduce's first run and reused by every later run
   (fixed addresses: a CUDA graph captures the copies into it);
2. every member ``src`` copies its operand into row ``g.index(src)`` of every member's staging
   buffer -- on CUDA a copy-engine peer copy (P2P over NVLink), all at once, each issued on
   ``src``'s *send* stream of the collective's stream id; the row of ``dst`` itself is a local
   copy on ``dst``'s collective stream;
3. every device reduces its staging buffer over dim 0 with one kernel (``sum`` / ``amax`` /
   ``amin`` / ``prod`` over the stacked rows: the reduction of ``spmd.runtime.comm.base.reduce_stack``,
   which the reference interpreter and the CPU ring use too), on its collective stream, into a
   fresh result. The rows are in group order on every device and the kernel is the same, so every
   device holds bit-identical results, and a bf16 / f16 sum accumulates in float32 and rounds once.

Ordering on CUDA (no host synchronization, so it can be captured into a CUDA graph): before any
copy, every send stream waits for an event recorded on its device's collective stream (the
operand is ready there); PyTorch's cross-device ``copy_`` makes the copy wait for the destination
device's current stream -- its collective stream, where the previous run's reduction read the
staging buffer -- and makes that stream wait for the copy's end; after the copies, every
collective stream waits for its send stream (the operand is no longer read).

This is the copy-engine variant of the one-shot all-reduce of TensorRT-LLM's and vLLM's custom
all-reduce kernels (which read the peers' buffers from one kernel and synchronize through flags in
device memory instead of stream events).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd.runtime.thunks import CollectiveSpec

Tensor = torch.Tensor
ONE_SHOT = "one-shot"
_REDUCE = {"add": torch.sum, "maximum": torch.amax, "minimum": torch.amin, "multiply": torch.prod}


def is_one_shot(spec: CollectiveSpec) -> bool:
    """Whether ``spec`` is an all-reduce to run one-shot."""
    return spec.kind == "all-reduce" and spec.algorithm == ONE_SHOT


def reduce_staged(staged: Tensor, op: str) -> Tensor:
    """``staged`` ``[k, *dims]`` reduced over dim 0 with ``op`` into a fresh ``dims`` tensor of its dtype.

    Raises ValueError for an ``op`` that is not add / maximum / minimum / multiply.
    """
    fn = _REDUCE.get(op)
    if fn is None:
        raise ValueError(f"reduce op: expected one of {sorted(_REDUCE)}, got {op!r}")
    return fn(staged, 0).to(staged.dtype)


class StagingBuffers:
    """The fixed staging buffers of one communicator, allocated on first use and held.

    ``devices[p]`` is the torch device of local device ``p`` (local index == position).
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self._bufs: dict[tuple, list[Tensor]] = {}

    def get(self, spec: CollectiveSpec, group: tuple[int, ...], stream_id: int) -> list[Tensor]:
        """One ``[len(group), *spec.out_dims]`` buffer per member of ``group`` (on its device), in group order."""
        key = (group, stream_id, tuple(spec.out_dims), spec.dtype)
        bufs = self._bufs.get(key)
        if bufs is None:
            bufs = [torch.empty((len(group), *spec.out_dims), dtype=spec.dtype, device=self.devices[p]) for p in group]
            self._bufs[key] = bufs
        return bufs

    @property
    def size_bytes(self) -> int:
        """Bytes held by all staging buffers, summed over devices."""
        return sum(b.numel() * b.element_size() for bufs in self._bufs.values() for b in bufs)

    def __len__(self) -> int:
        return len(self._bufs)


def one_shot_cpu(spec: CollectiveSpec, x: Sequence[Tensor], staging: StagingBuffers,
                 stream_id: int = 0) -> list[Tensor]:
    """The one-shot all-reduce on virtual CPU devices: ``out[p]`` for every local device ``p``.

    Same staging rows, copies and reduction as ``one_shot_cuda`` (host copies instead of peer copies).
    """
    out: list = [None] * len(x)
    for g in spec.groups:
        bufs = staging.get(spec, tuple(g), stream_id)
        for i, src in enumerate(g):
            for buf in bufs:
                buf[i].copy_(x[src])
        for j, dst in enumerate(g):
            out[dst] = reduce_staged(bufs[j], spec.reduce_op)
    return out


def one_shot_cuda(spec: CollectiveSpec, x: Sequence[Tensor], staging: StagingBuffers, streams: Sequence[Any],
                  send_stream: Callable[[int], tuple[Any, Any, Any]], stream_id: int) -> list[Tensor]:
    """The one-shot all-reduce on local CUDA GPUs (see the module docstring).

    Args:
      spec: a one-shot all-reduce.
      x: operand of local device ``p`` (on its device).
      staging: the communicator's staging buffers.
      streams: collective stream of each local device (already each device's current stream).
      send_stream: ``pid -> (send stream, fork event, join event)`` of that device for ``stream_id``.
      stream_id: the collective's stream id.
    Returns the fresh result of every local device.
    """
    srcs = sorted({p for g in spec.groups if len(g) > 1 for p in g})
    for src in srcs:  # every send stream forks from its collective stream before any copy is issued
        send, fork, _ = send_stream(src)
        fork.record(streams[src])
        send.wait_event(fork)
    staged = {}
    for g in spec.groups:
        bufs = staging.get(spec, tuple(g), stream_id)
        staged[tuple(g)] = bufs
        for i, src in enumerate(g):
            if len(g) > 1:
                torch.cuda.set_stream(send_stream(src)[0])
            for j, dst in enumerate(g):
                if dst != src:
                    bufs[j][i].copy_(x[src], non_blocking=True)
            torch.cuda.set_stream(streams[src])
            bufs[i][i].copy_(x[src], non_blocking=True)  # the local row, on the collective stream
    for src in srcs:  # the collective stream knows the operand is no longer read
        send, _, join = send_stream(src)
        join.record(send)
        streams[src].wait_event(join)
    out: list = [None] * len(x)
    for g, bufs in staged.items():
        for j, dst in enumerate(g):
            out[dst] = reduce_staged(bufs[j], spec.reduce_op)
    return out
