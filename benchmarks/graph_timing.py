"""Timing of GPU work captured in CUDA graphs, for the benchmark and probe scripts.

``capture(fn, reps)`` warms ``fn`` up on a side stream and captures ``reps`` calls of it in one
CUDA graph; ``time_interleaved(graphs, rounds)`` replays every graph once per round, in turn (A B C,
A B C, ...: clocks that sink under load hit every variant alike), and returns each one's median µs
per call, timed with CUDA events around the replay.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Any


def capture(fn: Callable[[], Any], reps: int, warmup: int = 3) -> tuple[Any, int]:
    """``(graph, reps)``: ``reps`` calls of ``fn`` in one CUDA graph, after ``warmup`` eager calls."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                fn()
    torch.cuda.synchronize()
    return g, reps


def time_interleaved(graphs: Mapping[str, tuple[Any, int]], rounds: int) -> dict[str, float]:
    """Median µs per call of each ``(graph, reps)`` over ``rounds`` interleaved replays."""
    import torch

    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, (g, reps) in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / reps)
    return {name: statistics.median(t) for name, t in times.items()}
