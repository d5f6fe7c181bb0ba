"""One multi-device CUDA graph vs one graph per device, for a program with NCCL all-reduces.

The program per device: three [128,512]x[512,512] GEMMs, each followed by an NCCL all-reduce
(``torch.cuda.nccl``, one group call over both devices' streams). (a) is one graph whose
capture starts on device 0 and forks device 1's stream into it with an event (spmd's current
multi-GPU capture); (b) captures each device's stream into its own graph at the same time and
replays them with one launch per device. Prints GPU µs per replay of back-to-back replays and
host µs per launch.

Usage: ``python3 -m benchmarks.probe.split_graphs``
"""

from __future__ import annotations

import sys
import time


def _program(xs, ws, streams):
    import torch
    import torch.cuda.nccl as nccl

    outs = []
    for x, w, s in zip(xs, ws, streams, strict=True):
        with torch.cuda.stream(s):
            outs.append(x @ w)
    for _ in range(3):
        red = []
        for o, s in zip(outs, streams, strict=True):
            with torch.cuda.stream(s):
                red.append(torch.empty_like(o))
        nccl.all_reduce(outs, red, streams=streams)
        outs = []
        for r, w, s in zip(red, ws, streams, strict=True):
            with torch.cuda.stream(s):
                outs.append(r @ w)
    return outs


def _time(launch, streams, n: int = 200) -> tuple[float, float]:
    import torch

    for _ in range(10):
        launch()
    for i in range(len(streams)):
        torch.cuda.synchronize(i)
    e0 = [torch.cuda.Event(enable_timing=True) for _ in streams]
    e1 = [torch.cuda.Event(enable_timing=True) for _ in streams]
    for e, s in zip(e0, streams, strict=True):
        e.record(s)
    t0 = time.perf_counter()
    for _ in range(n):
        launch()
    host = (time.perf_counter() - t0) * 1e6 / n
    for e, s in zip(e1, streams, strict=True):
        e.record(s)
    for i in range(len(streams)):
        torch.cuda.synchronize(i)
    return max(a.elapsed_time(b) for a, b in zip(e0, e1, strict=True)) * 1e3 / n, host


def main() -> int:
    """Entry point; see the module docstring."""
    import torch

    torch.set_float32_matmul_precision("highest")
    n = torch.cuda.device_count()
    devs = [torch.device("cuda", i) for i in range(n)]
    streams = [torch.cuda.Stream(device=d) for d in devs]
    xs = [torch.randn(128, 512, device=d) for d in devs]
    ws = [torch.randn(512, 512, device=d) / 30 for d in devs]
    _program(xs, ws, streams)  # warm up NCCL and cuBLAS
    for i in range(n):
        torch.cuda.synchronize(i)

    # (a) one multi-device graph
    g = torch.cuda.CUDAGraph()
    fork = torch.cuda.Event()
    with torch.cuda.device(0), torch.cuda.stream(streams[0]):
        g.capture_begin()
        fork.record(streams[0])
        for s in streams[1:]:
            s.wait_event(fork)
        _program(xs, ws, streams)
        for s in streams[1:]:
            ev = torch.cuda.Event()
            ev.record(s)
            streams[0].wait_event(ev)
        g.capture_end()

    def launch_a():
        with torch.cuda.device(0):
            g.replay()

    # (b) one graph per device, captured at the same time
    gs = [torch.cuda.CUDAGraph() for _ in devs]
    for i, (gi, s) in enumerate(zip(gs, streams, strict=True)):
        with torch.cuda.device(i):
            torch.cuda.set_stream(s)
            gi.capture_begin(capture_error_mode="relaxed")
    try:
        _program(xs, ws, streams)
    finally:
        for i, gi in enumerate(gs):
            with torch.cuda.device(i):
                torch.cuda.set_stream(streams[i])
                gi.capture_end()

    def launch_b():
        for i, gi in enumerate(gs):
            with torch.cuda.device(i):
                torch.cuda.set_stream(streams[i])
                gi.replay()

    ra = _time(launch_a, streams)
    rb = _time(launch_b, streams)
    ra2 = _time(launch_a, streams)
    rb2 = _time(launch_b, streams)
    print(f"(a) one multi-device graph: GPU {ra[0]:.1f} / {ra2[0]:.1f} µs per replay, host {ra[1]:.1f} / {ra2[1]:.1f}")
    print(f"(b) one graph per device:   GPU {rb[0]:.1f} / {rb2[0]:.1f} µs per replay, host {rb[1]:.1f} / {rb2[1]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
