"""Probe: can a 2-GPU CUDA graph join the caller's streams through external event nodes, and
what does it save per replay against cross-device event joins outside the graph?

Captures a graph launched on device 0 whose device-1 part (one small kernel per device) waits
for an event the caller's device-1 stream records before each launch, and records one that
stream waits for after it. Tries the wait through ``torch.cuda.Event(external=True)`` and through
the driver (``cuStreamWaitEvent(..., CU_EVENT_WAIT_EXTERNAL)``), then times 2000 replays with each
launch protocol (GPU µs per call from events).

Usage: ``python3 -m benchmarks.probe.external_events``
"""

from __future__ import annotations

import time

import torch

from spmd.runtime import graphs_cuda


def wait_external(stream: torch.cuda.Stream, event: torch.cuda.Event, use_driver: bool) -> None:
    """``stream`` waits for ``event`` as an external event: through PyTorch or the driver."""
    if use_driver:
        graphs_cuda.wait_external(stream, event)
    else:
        stream.wait_event(event)


def record_external(event: torch.cuda.Event, stream: torch.cuda.Stream, use_driver: bool) -> None:
    """``event`` recorded on ``stream`` as an external event: through PyTorch or the driver."""
    if use_driver:
        graphs_cuda.record_external(event, stream)
    else:
        event.record(stream)


def build(use_driver: bool, external: bool):
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    s0 = torch.cuda.Stream(d0)
    s1 = torch.cuda.Stream(d1)
    x0 = torch.randn(1024, device=d0)
    x1 = torch.randn(1024, device=d1)
    with torch.cuda.device(d1):
        start = torch.cuda.Event(external=True)
        finish = torch.cuda.Event(external=True)
        start.record(torch.cuda.current_stream(d1))
        finish.record(torch.cuda.current_stream(d1))
    torch.cuda.synchronize(d0)
    torch.cuda.synchronize(d1)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.device(d0), torch.cuda.stream(s0):
        g.capture_begin()
        fork = torch.cuda.Event()
        fork.record(s0)
        s1.wait_event(fork)
        if external:
            wait_external(s1, start, use_driver)
        with torch.cuda.stream(s1):
            y1 = x1 * 2 + 1
        x0.mul_(1.0)
        if external:
            record_external(finish, s1, use_driver)
        join = torch.cuda.Event()
        join.record(s1)
        s0.wait_event(join)
        g.capture_end()
    return g, start, finish, y1


def time_protocol(g, start, finish, external: bool, calls: int = 2000) -> float:
    """GPU µs per replay on the current streams of both devices."""
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    c0, c1 = torch.cuda.current_stream(d0), torch.cuda.current_stream(d1)
    with torch.cuda.device(d1):
        join = torch.cuda.Event()
    with torch.cuda.device(d0):
        done = torch.cuda.Event()
    best = []
    for _ in range(3):
        torch.cuda.synchronize(d0)
        torch.cuda.synchronize(d1)
        t0 = time.perf_counter()
        for _ in range(calls):
            if external:
                start.record(c1)
                g.replay()
                c1.wait_event(finish)
            else:
                join.record(c1)
                c0.wait_event(join)
                g.replay()
                done.record(c0)
                c1.wait_event(done)
        torch.cuda.synchronize(d0)
        torch.cuda.synchronize(d1)
        best.append((time.perf_counter() - t0) * 1e6 / calls)
    return min(best)


VARIANTS = {"joins": ("joins outside the graph", False, False),
            "torch": ("external events (torch)", False, True),
            "driver": ("external events (driver)", True, True)}


def main() -> int:
    """Entry point; see the module docstring. ``argv[1]``: comma-separated VARIANTS keys."""
    import sys

    results = {}
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
    for label, use_driver, external in (VARIANTS[n] for n in names):
        try:
            g, start, finish, _ = build(use_driver, external)
            results[label] = time_protocol(g, start, finish, external)
            print(f"{label}: {results[label]:.1f} µs per replay", flush=True)
        except Exception as exc:  # noqa: BLE001 - a probe reports every failure
            print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
