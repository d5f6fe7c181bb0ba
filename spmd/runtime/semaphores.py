"""Zeroed int32 counters for kernels whose last program finishes the work (split-K semaphores).

A kernel that splits a reduction over programs and merges the parts in the same launch (the
"serial split-K" of cuBLAS and CUTLASS, TensorRT-LLM's multi-block decode attention) has each
program store its part and then count itself in with an atomic add on a counter per output
tile; the program that sees the count reach the number of parts merges them and sets the
counter back to 0. Such a kernel needs counters that are 0 when it starts and that no kernel
running at the same time uses. ``counters(device, n)`` gives them:

- outside a CUDA-graph capture: one buffer per (device, stream), zeroed once when allocated.
  Kernels on one stream run one after the other, and each leaves its counters at 0, so every
  launch on that stream may use the same buffer (a kernel launched early by programmatic
  dependent launch touches it only after its ``griddepcontrol.wait``, when the previous kernel
  has finished);
- inside a capture that ``capture_scope`` opened (spmd's CUDA graphs, ``spmd.runtime.graphs_cuda``,
  and the kernel timing of ``spmd.runtime.kernel_timing``): a fresh buffer per call, allocated in
  the capture (so in the graph's private pool, at an address no other graph uses) and zeroed when
  the capture ends, before the first replay. The scope's list holds the buffers; its owner keeps it
  as long as the graph. Two graphs thus never share counters, and two calls in one graph never do
  either (they may run on different streams);
- inside any other capture (a user's ``torch.cuda.graph``): None. The buffer could not be zeroed
  before the first replay without a kernel in the graph; the caller then runs its kernels that
  need no counters.

A launch that never ran to completion (a device fault) leaves its counters undefined, but a
device fault ends the CUDA context anyway.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

Tensor = torch.Tensor
_local = threading.local()  # .scopes: the open capture scopes of this thread, innermost last
_eager: dict[tuple[int, int], Tensor] = {}  # (device index, stream handle) -> zeroed counters
_eager_lock = threading.Lock()


@contextlib.contextmanager
def capture_scope() -> Iterator[list[Tensor]]:
    """Open around a CUDA-graph capture (outside ``torch.cuda.graph`` / ``capture_begin``):
    counters asked for inside the capture are allocated in it; when the block ends without an
    exception they are zeroed (on their device's current stream, which is then synchronized) and stay in the
    yielded list, which the caller must keep alive as long as the graph."""
    scopes = _scopes()
    held: list[Tensor] = []
    scopes.append(held)
    try:
        yield held
    finally:
        scopes.pop()
    for t in held:
        t.zero_()
    for device in {t.device for t in held if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


def counters(device: torch.device, n: int) -> Tensor | None:
    """``n`` int32 counters on CUDA ``device``, all 0, for one launch that leaves them 0; None
    inside a capture no ``capture_scope`` of this thread opened. See the module docstring."""
    if n < 1:
        raise ValueError(f"n: expected at least 1 counter, got {n}")
    if torch.cuda.is_current_stream_capturing():
        scopes = _scopes()
        if not scopes:
            return None
        t = torch.empty(n, dtype=torch.int32, device=device)
        scopes[-1].append(t)
        return t
    stream = torch.cuda.current_stream(device).cuda_stream
    key = (device.index if device.index is not None else torch.cuda.current_device(), stream)
    with _eager_lock:
        t = _eager.get(key)
        if t is None or t.numel() < n:
            t = torch.zeros(max(n, 2 * (0 if t is None else t.numel())), dtype=torch.int32, device=device)
            _eager[key] = t
    return t[:n]


def _scopes() -> list[list[Tensor]]:
    scopes = getattr(_local, "scopes", None)
    if scopes is None:
        scopes = _local.scopes = []
    return scopes
