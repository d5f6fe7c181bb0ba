"""Thunks: the units of work of a lowered SPMD program.

A lowered program (``spmd.runtime.lower.Program``) is a flat list of thunks, each with an
explicit execution stream id, in the style of XLA's GPU runtime
(xla/service/gpu/runtime: KernelThunk, NcclCollectiveThunk with async start/done, and the
stream joins of WaitForStreamsThunk). Values live in per-device *slots*: a per-call list
``vals[slot]`` of tensors for each device. Tuples and get-tuple-element never reach the
runtime: the lowering resolves them statically to slots.

Local thunks (``KernelThunk``, ``RecordEventThunk``, ``WaitEventThunk``) run on one device
at a time: ``run(vals, views, env)`` with that device's slot list, its arena views and its
per-device environment (CUDA streams/events, or None on CPU). A ``CollectiveThunk`` runs on
every local device at once through a communicator (``spmd.runtime.comm``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Tensor = torch.Tensor
KernelFn = Callable[[list[Tensor], "Tensor | None"], Tensor]


@dataclass(eq=False)
class KernelThunk:
    """One kernel call on one stream: ``vals[out] = fn([vals[i] for i in ins], buffer)``.

    Fields:
      name: the instruction name (for traces and errors).
      stream_id: execution stream (0 = main compute stream).
      fn: closure from ``kernels.compile_kernel`` (or a fused closure of the lowering).
      ins: operand slots.
      out: result slot.
      buffer: index into the per-device arena views (a preallocated output), or -1.
      release: slots whose last reader this is and that may be dropped after it.
      work: a rough cost (result elements, times the contracted size for dots).
    """

    name: str
    stream_id: int
    fn: KernelFn
    ins: tuple[int, ...]
    out: int
    buffer: int = -1
    release: tuple[int, ...] = ()
    work: int = 0

    def run(self, vals: list, views: list, env: Any) -> None:
        """Run on one device: read the operand slots, write the result slot."""
        buf = views[self.buffer] if self.buffer >= 0 else None
        vals[self.out] = self.fn([vals[i] for i in self.ins], buf)


@dataclass(eq=False)
class MultiOutputKernelThunk(KernelThunk):
    """A multi-output fusion's kernel: ``vals[out] = fn(operands, destinations)``, a tuple of tensors.

    ``buffers``: per output element, the index of the arena view (or donated parameter buffer,
    past the arena views) the kernel stores that element into, or -1 (fresh memory). The
    get-tuple-element thunks that follow read the elements out of ``vals[out]``.
    """

    buffers: tuple[int, ...] = ()

    def run(self, vals: list, views: list, env: Any) -> None:
        dests = [views[b] if b >= 0 else None for b in self.buffers]
        vals[self.out] = self.fn([vals[i] for i in self.ins], dests)


@dataclass(eq=False)
class RecordEventThunk:
    """Record event ``event_id`` on stream ``stream_id`` (the producer side of a stream join)."""

    name: str
    stream_id: int
    event_id: int
    release: tuple[int, ...] = ()

    def run(self, vals: list, views: list, env: Any) -> None:
        env.events[self.event_id].record(env.streams[self.stream_id])


@dataclass(eq=False)
class WaitEventThunk:
    """Make stream ``stream_id`` wait for event ``event_id`` (the consumer side of a join)."""

    name: str
    stream_id: int
    event_id: int
    release: tuple[int, ...] = ()

    def run(self, vals: list, views: list, env: Any) -> None:
        env.streams[self.stream_id].wait_event(env.events[self.event_id])


@dataclass(frozen=True)
class CollectiveSpec:
    """What a collective does, independent of the transport.

    Fields:
      kind: "all-gather" | "reduce-scatter" | "all-reduce" | "all-to-all" | "collective-permute".
      groups: replica groups as partition ids (never empty: "all devices" is spelled out).
      dim: gather / scatter dim (all-gather, reduce-scatter).
      split_dim, concat_dim: all-to-all dims.
      reduce_op: "add" | "maximum" | "minimum" | "multiply" (all-reduce, reduce-scatter).
      pairs: (source, target) partition ids (collective-permute).
      out_dims, dtype: per-device result shape and torch dtype.
      algorithm: "ring" (the transport's default: NCCL, or the process group's) or "one-shot"
        (an all-reduce: every device gathers all operands into fixed staging buffers and reduces
        them locally in group order; chosen by ``spmd.passes.select_all_reduce``).
    """

    kind: str
    groups: tuple[tuple[int, ...], ...] = ()
    dim: int = 0
    split_dim: int = 0
    concat_dim: int = 0
    reduce_op: str = "add"
    pairs: tuple[tuple[int, int], ...] = ()
    out_dims: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    algorithm: str = "ring"


@dataclass(eq=False)
class CollectiveThunk:
    """A collective over all local devices on stream ``stream_id``: ``vals[out] = C(vals[in_])``.

    The synchronous form and the ``*-start`` form lower to the same thunk; ``*-done`` is pure
    aliasing (its consumers join the collective's stream through events).
    """

    name: str
    stream_id: int
    spec: CollectiveSpec
    in_: int
    out: int
    release: tuple[int, ...] = ()


Thunk = KernelThunk | RecordEventThunk | WaitEventThunk | CollectiveThunk


@dataclass(frozen=True)
class Segment:
    """Consecutive local thunks (no collective among them): each device can run them alone.

    ``work`` sums the kernels' rough costs (see ``KernelThunk.work``).
    """

    thunks: tuple[Thunk, ...]
    work: int = 0


def segments(thunks: list[Thunk]) -> list[Segment | CollectiveThunk]:
    """Split a thunk list into maximal local segments separated by collectives.

    Issuing a segment on device 0, then on device 1, ... keeps every device's program order and
    issues every collective on all devices before any later thunk, which is all the
    "thunk i on every device before thunk i+1" rule needs: cross-device waits only happen
    inside collectives.
    """
    out: list[Segment | CollectiveThunk] = []
    cur: list[Thunk] = []
    for th in thunks:
        if isinstance(th, CollectiveThunk):
            if cur:
                out.append(_segment(cur))
                cur = []
            out.append(th)
        else:
            cur.append(th)
    if cur:
        out.append(_segment(cur))
    return out


def _segment(thunks: list[Thunk]) -> Segment:
    return Segment(tuple(thunks), sum(getattr(t, "work", 0) for t in thunks))
