"""Where a one-GPU row's call time goes when no kernel runs: device idle gaps and host API calls.

For each row of ``benchmarks.one_gpu`` (default: the Llama 4 × 2048 row), it builds spmd and
``torch.compile(mode="reduce-overhead")`` from the same module and prints, per variant:

* the time per call (CUDA events, back to back, median of rounds) and the kernels' summed time;
* the idle gaps of one call on the device (``benchmarks.gpu_kernels.idle_gaps``): span, idle
  time, the longest gaps with the kernels on either side;
* the host's CUDA runtime calls during profiled calls (``cudaGraphLaunch``, ``cudaMalloc``,
  ``cudaStreamSynchronize``, ``cudaMemcpyAsync``, ...): count and µs per call, longest first;
* with ``--clocks``, the SM clock, power draw and throttle reasons under 3 s of back-to-back calls
  (a compute-bound row runs into the power limit, and its clocks fall);
* the spmd counters that moved during the timed calls (graph fallbacks, recaptures, staging).

Usage: ``python3 -m benchmarks.probe.row_gaps [--rows llama2-2l-bf16-4x2048] [--calls 20]``
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks import common, gpu_kernels, harness, one_gpu


def _profiled(fn, calls: int):
    """``torch.profiler`` events (host and CUDA) of ``calls`` back-to-back calls of ``fn``, after
    one untimed call; the device is synchronized before the profile ends."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.events()


def host_calls(fn, calls: int, top: int = 12) -> list[tuple[str, float, float]]:
    """The host-side CUDA runtime / driver calls of ``calls`` calls of ``fn`` (after one untimed
    call): (name, calls per call, µs per call), the ``top`` longest by summed time."""
    import torch

    by_name: dict[str, list[float]] = defaultdict(list)
    for ev in _profiled(fn, calls):
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith("cu"):
            by_name[ev.name].append(ev.cpu_time_total)
    rows = [(n, len(v) / calls, sum(v) / calls) for n, v in by_name.items()]
    return sorted(rows, key=lambda r: -r[2])[:top]


def window_gaps(fn, calls: int, min_us: float = 20.0, top: int = 10) -> tuple[float, float, list[str]]:
    """Device idle time across ``calls`` back-to-back calls of ``fn`` (after one untimed call),
    between calls included: (span µs, idle µs, lines for the ``top`` longest gaps over ``min_us``,
    each with the kernels on either side and the host API calls that ended inside the gap)."""
    import torch

    gpu, host = [], []
    for e in _profiled(fn, calls):
        rng = (e.time_range.start, e.time_range.end, e.name[:50])
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu.append(rng)
        elif e.name.startswith("cu"):
            host.append(rng)
    span, gaps = gpu_kernels.gaps_between(gpu)
    first = min((g[0] for g in gpu), default=0.0)
    lines = []
    for us, g0, g1, before, after in sorted((g for g in gaps if g[0] >= min_us), key=lambda g: -g[0])[:top]:
        inside = sorted({h[2] for h in host if g0 <= h[1] <= g1})
        lines.append(f"{us:8.1f} us at +{g0 - first:9.1f} after {before} before {after}; host calls ending "
                     f"inside: {', '.join(inside) or 'none'}")
    return span, sum(g[0] for g in gaps), lines


def clocks_under_load(fn, seconds: float = 3.0) -> str:
    """SM clock (MHz), power (W) and active throttle reasons sampled by ``nvidia-smi`` every 100 ms
    while ``fn`` runs back to back for ``seconds``: medians of the clock and power, and the
    reasons seen; or why they could not be read."""
    import statistics
    import subprocess
    import time

    import torch

    query = "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active"
    try:
        smi = subprocess.Popen(["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms", "100",
                                "-i", str(torch.cuda.current_device())],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError as exc:
        return f"nvidia-smi n/a: {exc}"
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    smi.terminate()
    out, _ = smi.communicate(timeout=10)
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.count(",") == 2]
    try:
        mhz = statistics.median(float(r[0]) for r in rows)
        watts = statistics.median(float(r[1]) for r in rows)
    except (ValueError, statistics.StatisticsError):
        return f"nvidia-smi gave no readable samples: {out[:200]!r}"
    return f"SM clock {mhz:.0f} MHz, power {watts:.0f} W (medians of {len(rows)} samples), " \
           f"throttle reasons {sorted({r[2] for r in rows})}"


def counters_moved(before: dict, after: dict) -> dict[str, int]:
    """spmd counters whose value changed between two ``spmd.metrics.snapshot()`` results."""
    b, a = before.get("counters", {}), after.get("counters", {})
    return {k: v - b.get(k, 0) for k, v in a.items() if v != b.get(k, 0)}


def probe_row(row: one_gpu.Row, args) -> None:
    """Build spmd and compile-ro for ``row`` and print the figures of the module docstring."""
    import torch

    import spmd
    from spmd import metrics

    device = torch.device("cuda")
    module32, inputs32 = one_gpu.build_module(row, False, args.seed)
    dtype = one_gpu._dtype(row.dtype)
    module = module32.to(device=device, dtype=dtype)
    inputs = one_gpu._cast_inputs(inputs32, dtype, device)
    ns = argparse.Namespace(variants=["compile-ro", "spmd"])
    calls, errors = one_gpu.build_variants(row, module, inputs, device, ns)
    calls.pop("eager", None)
    for name, err in errors.items():
        print(f"[{row.name}] {name}: n/a: {err}", flush=True)
    for fn in calls.values():
        for _ in range(3):
            fn()
    before = metrics.snapshot()
    times = common.interleaved(calls, [device], rounds=args.rounds, reps=args.calls, warmup=2)
    moved = counters_moved(before, metrics.snapshot())
    for name, fn in calls.items():
        devs = gpu_kernels.kernel_summary(fn, calls=5, top=0)
        busy = devs[0].busy_us if devs else float("nan")
        print(f"[{row.name}] {name}: {times[name].median_ms:.3f} ms per call, kernels busy {busy / 1e3:.3f} ms",
              flush=True)
        gpu_kernels.print_idle_gaps(f"{row.name}/{name}", fn, top=3)
        span, idle, lines = window_gaps(fn, 5, top=args.top)
        print(f"[window] {row.name}/{name}: 5 calls span {span / 1e3:.3f} ms ({span / 5e3:.3f} per call), "
              f"idle {idle / 5e3:.3f} ms per call", flush=True)
        for line in lines:
            print(f"[window]   {line}", flush=True)
        if args.clocks:
            print(f"[clocks] {row.name}/{name}: {clocks_under_load(fn)}", flush=True)
        enq, thr, synced = common.host_call_times(fn, torch.cuda.synchronize, calls=10, rounds=3, warmup=2)
        print(f"[host] {row.name}/{name}: enqueue {enq / 1e3:.3f} ms, throughput {thr / 1e3:.3f} ms, "
              f"synced {synced / 1e3:.3f} ms per call", flush=True)
        for api, n, us in host_calls(fn, 5, top=args.top):
            print(f"[host] {row.name}/{name}: {api:32s} x{n:<6.1f} {us:9.1f} us per call", flush=True)
    print(f"[{row.name}] spmd counters moved during the timed calls: {moved}", flush=True)
    print(f"[{row.name}] spmd version options: {spmd.CompileOptions()}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=harness.name_list(one_gpu.ROW_NAMES, allow_empty=False),
                    default=["llama2-2l-bf16-4x2048"])
    ap.add_argument("--rounds", type=harness.positive_int, default=3)
    ap.add_argument("--calls", type=harness.positive_int, default=10)
    ap.add_argument("--top", type=harness.positive_int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clocks", action="store_true", help="sample the SM clock and power under 3 s of calls")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("row_gaps: no CUDA device", flush=True)
        return 0
    for name in args.rows:
        row = next(r for r in one_gpu.ROWS if r.name == name)
        torch._dynamo.reset()
        probe_row(row, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
