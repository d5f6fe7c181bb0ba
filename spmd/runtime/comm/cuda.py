"""Collectives over local CUDA GPUs driven from one process.

- all-gather / reduce-scatter / all-reduce: NCCL through ``torch.cuda.nccl`` (one NCCL clique
  per replica group, cached by PyTorch per device list), issued on each device's stream of
  the collective's stream id (``streams=``).
- all-to-all and collective-permute (and the three above when NCCL is off): copy-engine peer
  copies, ``dst.copy_(src, non_blocking=True)`` issued while the *source* device's current
  stream is a stream that runs the copy and the destination device's current stream is its
  stream of the collective's id. PyTorch's cross-device copy then orders the copy after the
  destination stream's earlier work (the destination buffer is free: it was allocated on that
  stream) and makes the destination stream wait for the copy's completion — the data-ready
  and copy-done events of a collective-permute thunk. The operand is ready on the source
  stream because the lowering made that stream wait for the operand's producer.
  A collective-permute copies on a per-device *send* stream (forked from the collective's
  stream before any copy is issued, joined back after all of them): were the copy on the
  collective's stream itself, device 1's copy to device 0 would be ordered after device 0's
  copy to device 1 (PyTorch records the destination's readiness on the destination's current
  stream, which then already holds the first copy), and the two directions of a ring step
  would run one after the other instead of at once.

- one-shot all-reduces (``CollectiveSpec.algorithm == "one-shot"``, chosen by
  ``spmd.passes.select_all_reduce``; also every add all-reduce of at most
  ``p2p_all_reduce_max_bytes`` per device, an opt-in override): ``spmd.runtime.comm.one_shot`` --
  every device pulls every peer's operand with a copy-engine peer copy into fixed staging buffers
  (all copies at once, on per-device send streams as for a collective-permute) and reduces them
  in partition-id order on its collective stream, so every device computes bit-identical results.
  Its kernels are cheaper than NCCL's (MiniLM's [8,128,384] float32 all-reduce on 2xH200: a
  6.2 µs peer copy and a 2.0 µs add against a 16.3 µs NCCL ring kernel), but its cross-device
  event joins cost more inside a CUDA graph than NCCL's in-kernel flag synchronization (the
  MiniLM graph replayed in 1033 µs against 980 µs with NCCL, the transformer block in 117
  against 97 µs), and a program with one cannot be captured as one graph per device. The cost
  model (``spmd.passes.all_reduce_cost``) weighs both; the override is off by default
  (``P2P_ALL_REDUCE_MAX_BYTES = 0``).

Peer access is enabled once at construction (a first tiny copy between every pair does it),
so that later copies — and CUDA graph captures — go device to device.

Results are fresh tensors allocated on the destination's collective stream; the executor's
fork/join keeps the caching allocator's reuse of them stream-ordered.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from spmd.runtime.comm.base import chunk_index, reduce_stack
from spmd.runtime.comm.nan_reduce import run_nan_safe
from spmd.runtime.comm.one_shot import StagingBuffers, is_one_shot, one_shot_cuda
from spmd.runtime.thunks import CollectiveSpec

Tensor = torch.Tensor

_NCCL_OPS = {"add": 0, "multiply": 1, "maximum": 2, "minimum": 3}  # ncclRedOp_t
P2P_ALL_REDUCE_ENV = "SPMD_P2P_ALL_REDUCE_MAX_BYTES"
#: Largest all-reduce (bytes per device) run as one-shot peer copies instead of NCCL (0 = none;
#: see the module docstring for why).
P2P_ALL_REDUCE_MAX_BYTES = 0


def p2p_all_reduce_max_bytes() -> int:
    """``SPMD_P2P_ALL_REDUCE_MAX_BYTES`` (0 = always NCCL), else ``P2P_ALL_REDUCE_MAX_BYTES``.

    Raises ValueError naming the variable for a value that is not an integer >= 0.
    """
    raw = os.environ.get(P2P_ALL_REDUCE_ENV, "")
    if not raw:
        return P2P_ALL_REDUCE_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{P2P_ALL_REDUCE_ENV}: expected an integer >= 0 (bytes), got {raw!r}")
    return value


_limit_from_env = p2p_all_reduce_max_bytes  # the constructor's argument of the same name shadows it


def nccl_available() -> bool:
    """Whether this PyTorch build has ``torch.cuda.nccl`` collectives."""
    try:
        import torch.cuda.nccl as nccl

        return torch.cuda.is_available() and hasattr(torch._C, "_nccl_all_gather") and nccl.version() is not None
    except (ImportError, RuntimeError, AttributeError):
        return False


class CudaCommunicator:
    """Collectives over ``devices`` (local index == partition id).

    Args:
      devices: the CUDA devices of the mesh in partition-id order.
      use_nccl: NCCL for all-gather / reduce-scatter / all-reduce; None = when available.
      p2p_all_reduce_max_bytes: all-reduces up to this many bytes per device run as one-shot
        peer copies (see the module docstring); None = ``p2p_all_reduce_max_bytes()``.
    Raises ValueError from ``p2p_all_reduce_max_bytes()``.
    """

    def __init__(self, devices: Sequence[torch.device], use_nccl: bool | None = None,
                 p2p_all_reduce_max_bytes: int | None = None) -> None:
        self.devices = list(devices)
        self.pids = tuple(range(len(self.devices)))
        self.use_nccl = nccl_available() if use_nccl is None else use_nccl
        limit = p2p_all_reduce_max_bytes
        if limit is None:
            limit = _limit_from_env()
        elif not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"p2p_all_reduce_max_bytes: expected an int >= 0 (bytes) or None, got {limit!r}")
        self.p2p_max_bytes = limit
        enable_peer_access(self.devices)
        self._send: dict[tuple[int, int], tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event]] = {}
        self.staging = StagingBuffers(self.devices)

    def nccl_only(self, spec: CollectiveSpec) -> bool:
        """Whether ``spec`` runs as NCCL kernels alone: no peer copy and no cross-device event.

        Such collectives synchronize the devices inside their kernels, so each device's part of
        a program made only of them can be captured into a graph of its own.
        """
        if not self.use_nccl or spec.kind not in ("all-gather", "reduce-scatter", "all-reduce"):
            return False
        return spec.kind != "all-reduce" or not self.one_shot(spec)

    def run(self, spec: CollectiveSpec, inputs: Sequence[Tensor], stream_id: int, envs: Sequence[Any]) -> list[Tensor]:
        """Run ``spec`` with ``inputs[pid]``; every device uses its stream ``stream_id``."""
        streams = [env.streams[stream_id] for env in envs]
        for s in streams:
            torch.cuda.set_stream(s)
        return run_nan_safe(spec, inputs, lambda sp, x: self._dispatch(sp, x, streams, stream_id))

    def _dispatch(self, spec: CollectiveSpec, x: list[Tensor], streams, stream_id: int) -> list[Tensor]:
        if spec.kind == "collective-permute":
            return self._permute(spec, x, streams, stream_id)
        if spec.kind == "all-to-all":
            return self._all_to_all(spec, x)
        if spec.kind == "all-gather":
            return self._nccl_all_gather(spec, x, streams) if self.use_nccl else self._copy_all_gather(spec, x)
        if spec.kind == "reduce-scatter":
            return self._nccl_reduce_scatter(spec, x, streams) if self.use_nccl else self._copy_reduce(spec, x, True)
        if spec.kind == "all-reduce":
            if self.one_shot(spec):
                return self._p2p_all_reduce(spec, x, streams, stream_id)
            return self._nccl_all_reduce(spec, x, streams) if self.use_nccl else self._copy_reduce(spec, x, False)
        raise ValueError(f"collective kind: expected one of all-gather, reduce-scatter, all-reduce, all-to-all, "
                         f"collective-permute, got {spec.kind!r}")

    # ------------------------------------------------------------------ NCCL
    def _nccl_all_gather(self, spec: CollectiveSpec, x: list[Tensor], streams) -> list[Tensor]:
        import torch.cuda.nccl as nccl

        out: list = [None] * len(x)
        for g in spec.groups:
            ins = [x[p].contiguous() for p in g]
            outs = [torch.empty((len(g), *ins[0].shape), dtype=spec.dtype, device=self.devices[p]) for p in g]
            nccl.all_gather(ins, outs, streams=[streams[p] for p in g])
            for p, o in zip(g, outs, strict=True):
                out[p] = _stacked_to_concat(o, spec.dim, spec.out_dims)
        return out

    def _nccl_reduce_scatter(self, spec: CollectiveSpec, x: list[Tensor], streams) -> list[Tensor]:
        import torch.cuda.nccl as nccl

        out: list = [None] * len(x)
        for g in spec.groups:
            ins = [_split_to_stacked(x[p], spec.dim, len(g)) for p in g]
            outs = [torch.empty(spec.out_dims, dtype=spec.dtype, device=self.devices[p]) for p in g]
            nccl.reduce_scatter(ins, outs, op=_NCCL_OPS[spec.reduce_op], streams=[streams[p] for p in g])
            for p, o in zip(g, outs, strict=True):
                out[p] = o
        return out

    def _nccl_all_reduce(self, spec: CollectiveSpec, x: list[Tensor], streams) -> list[Tensor]:
        import torch.cuda.nccl as nccl

        out: list = [None] * len(x)
        for g in spec.groups:
            ins = [x[p].contiguous() for p in g]
            outs = [torch.empty(spec.out_dims, dtype=spec.dtype, device=self.devices[p]) for p in g]
            nccl.all_reduce(ins, outs, op=_NCCL_OPS[spec.reduce_op], streams=[streams[p] for p in g])
            for p, o in zip(g, outs, strict=True):
                out[p] = o
        return out

    # ------------------------------------------------------------------ peer copies
    def _send_stream(self, pid: int, stream_id: int) -> tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event]:
        """(send stream, fork event, join event) of device ``pid`` for collective stream ``stream_id``."""
        key = (pid, stream_id)
        if key not in self._send:
            dev = self.devices[pid]
            with torch.cuda.device(dev):
                self._send[key] = (torch.cuda.Stream(device=dev), torch.cuda.Event(), torch.cuda.Event())
        return self._send[key]

    def _permute(self, spec: CollectiveSpec, x: list[Tensor], streams: Sequence[Any], stream_id: int) -> list[Tensor]:
        out: list = [None] * len(x)
        srcs = sorted({src for src, tgt in spec.pairs if src != tgt})
        for src in srcs:  # fork every send stream before any copy is issued
            send, fork, _ = self._send_stream(src, stream_id)
            fork.record(streams[src])
            send.wait_event(fork)
        for src, tgt in spec.pairs:
            buf = torch.empty(spec.out_dims, dtype=spec.dtype, device=self.devices[tgt])
            if src != tgt:
                torch.cuda.set_stream(self._send_stream(src, stream_id)[0])
            buf.copy_(x[src], non_blocking=True)
            torch.cuda.set_stream(streams[src])
            out[tgt] = buf
        for src in srcs:  # the collective's stream knows the operand is no longer read
            send, _, join = self._send_stream(src, stream_id)
            join.record(send)
            streams[src].wait_event(join)
        for p in range(len(x)):
            if out[p] is None:
                out[p] = torch.zeros(spec.out_dims, dtype=spec.dtype, device=self.devices[p])
        return out

    def one_shot(self, spec: CollectiveSpec) -> bool:
        """Whether all-reduce ``spec`` runs one-shot: chosen by the compiler, or an add of at most
        ``p2p_max_bytes`` per device (the ``SPMD_P2P_ALL_REDUCE_MAX_BYTES`` override)."""
        if is_one_shot(spec):
            return True
        if not self.p2p_max_bytes or spec.reduce_op != "add":
            return False
        return 0 < math.prod(spec.out_dims) * spec.dtype.itemsize <= self.p2p_max_bytes

    def _p2p_all_reduce(self, spec: CollectiveSpec, x: list[Tensor], streams: Sequence[Any],
                        stream_id: int) -> list[Tensor]:
        """One-shot all-reduce: peer copies into staging buffers, then a reduction in partition-id order."""
        return one_shot_cuda(spec, x, self.staging, streams, lambda pid: self._send_stream(pid, stream_id), stream_id)

    def _all_to_all(self, spec: CollectiveSpec, x: list[Tensor]) -> list[Tensor]:
        out: list = [None] * len(x)
        for g in spec.groups:
            n = len(g)
            for j, dst in enumerate(g):
                buf = torch.empty(spec.out_dims, dtype=spec.dtype, device=self.devices[dst])
                for i, src in enumerate(g):
                    s0, size = chunk_index(tuple(x[src].shape), spec.split_dim, n, j)
                    d0, dsize = chunk_index(spec.out_dims, spec.concat_dim, n, i)
                    buf.narrow(spec.concat_dim, d0, dsize).copy_(x[src].narrow(spec.split_dim, s0, size),
                                                                 non_blocking=True)
                out[dst] = buf
        return out

    def _copy_all_gather(self, spec: CollectiveSpec, x: list[Tensor]) -> list[Tensor]:
        out: list = [None] * len(x)
        for g in spec.groups:
            for dst in g:
                buf = torch.empty((len(g), *x[g[0]].shape), dtype=spec.dtype, device=self.devices[dst])
                for i, src in enumerate(g):
                    buf[i].copy_(x[src], non_blocking=True)
                out[dst] = _stacked_to_concat(buf, spec.dim, spec.out_dims)
        return out

    def _copy_reduce(self, spec: CollectiveSpec, x: list[Tensor], scatter: bool) -> list[Tensor]:
        out: list = [None] * len(x)
        for g in spec.groups:
            n = len(g)
            for j, dst in enumerate(g):
                pieces = []
                for src in g:
                    v = x[src]
                    if scatter:
                        s0, size = chunk_index(tuple(v.shape), spec.dim, n, j)
                        v = v.narrow(spec.dim, s0, size)
                    buf = torch.empty(v.shape, dtype=spec.dtype, device=self.devices[dst])
                    buf.copy_(v, non_blocking=True)
                    pieces.append(buf)
                out[dst] = reduce_stack(pieces, spec.reduce_op)
        return out


def _stacked_to_concat(stacked: Tensor, dim: int, out_dims: tuple[int, ...]) -> Tensor:
    """[n, *shard] (shards in group order) -> the shards concatenated along ``dim``."""
    if dim == 0:
        return stacked.view(out_dims)
    return stacked.movedim(0, dim).reshape(out_dims)


def _split_to_stacked(x: Tensor, dim: int, n: int) -> Tensor:
    """x split in ``n`` equal chunks along ``dim`` -> contiguous [n, *chunk]."""
    if dim == 0:
        return x.contiguous()
    return torch.stack(torch.chunk(x, n, dim=dim))


def enable_peer_access(devices: Sequence[torch.device]) -> None:
    """Enable peer access between every pair of ``devices`` with a first tiny copy each way."""
    for a in devices:
        for b in devices:
            if a != b:
                torch.zeros(1, device=b).copy_(torch.ones(1, device=a))
    for d in devices:
        torch.cuda.synchronize(d)
