"""Timing candidate kernels as the runtime runs them: one CUDA-graph replay each, with a cold L2.

Used by the per-shape kernel choices (``kernels_gemv`` for skinny products, ``kernels_attention``
for the SDPA backend), as XLA's and Inductor's autotuners time GEMM candidates on the device.
Each candidate is captured alone in a CUDA graph (a candidate that cannot be captured is dropped),
then the graphs are replayed in interleaved rounds, each replay after a read of a buffer larger
than the L2 cache (the read evicts the operands and leaves no dirty lines to write back), and
timed with CUDA events; the first round is a warm-up.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from spmd.compile_lock import CAPTURE_LOCK

L2_FLUSH_BYTES = 256 * 2**20


def capture_each(calls: Sequence[Callable[[], object]], device: torch.device) -> list[torch.cuda.CUDAGraph | None]:
    """One CUDA graph per call, captured on a side stream of ``device``; None for a call whose
    capture raised (the caller's current stream is restored)."""
    graphs: list[torch.cuda.CUDAGraph | None] = []
    side = torch.cuda.Stream(device)  # torch.cuda.graph's shared default stream may be another device's
    caller = torch.cuda.current_stream(device)
    for call in calls:
        torch.cuda.synchronize(device)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, stream=side, capture_error_mode="thread_local"):
                call()
            graphs.append(g)
        except Exception:  # noqa: BLE001 - a candidate that cannot be captured is not a candidate
            torch.cuda.set_stream(caller)  # a failed capture_end skips torch.cuda.graph's stream restore
            graphs.append(None)
    return graphs


def cold_replay_us(graphs: Sequence[torch.cuda.CUDAGraph | None], device: torch.device,
                   timed_rounds: int) -> list[float | None]:
    """Median µs of one replay of each graph over ``timed_rounds`` interleaved rounds (after one
    warm-up round), each replay after an L2 flush; None where the graph is None."""
    flush = torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.float32, device=device)
    total = torch.empty((), dtype=torch.float32, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(timed_rounds + 1):
        for i, g in enumerate(graphs):
            if g is None:
                continue
            torch.sum(flush, dim=0, out=total)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end) * 1e3)
    return [statistics.median(t[1:]) if g is not None else None for g, t in zip(graphs, times, strict=True)]


def median_us_each(calls: Sequence[Callable[[], object]], device: torch.device, timed_rounds: int) -> tuple[float, ...]:
    """``cold_replay_us`` of ``capture_each(calls)``, captured under ``CAPTURE_LOCK`` (no other
    thread captures meanwhile); a call that cannot be captured times as infinity (never chosen)."""
    with CAPTURE_LOCK:
        graphs = capture_each(calls, device)
    return tuple(float("inf") if t is None else t for t in cold_replay_us(graphs, device, timed_rounds))


def within_roundings(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether a candidate's result ``got`` matches the reference ``want`` within a few 16-bit
    roundings (2% of each value and of ``want``'s largest magnitude; NaN where ``want`` is NaN)."""
    scale = want.float().abs().max().item() + 1e-6
    return torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale, equal_nan=True)
