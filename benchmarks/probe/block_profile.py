"""Where the GPU time of the dispatch benchmark's programs goes: kernels per call, per device.

For each workload of ``benchmarks.workloads`` (default: block) on all local GPUs, for spmd
eager and spmd with CUDA graphs, it prints:

* the GPU time per call of back-to-back calls (CUDA events on every device's current stream,
  median of rounds) -- the floor of the enqueue-only figure of ``benchmarks/dispatch.py``;
* the kernels of one call from ``torch.profiler`` (name, count per call, mean µs), per device,
  and their summed time (eager issue: kernel durations without launch gaps).

Usage: ``python3 -m benchmarks.probe.block_profile [--workloads block,mlp] [--calls 200]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks import common


def gpu_us_per_call(fn, devices, calls: int, rounds: int = 5) -> tuple[float, float]:
    """(GPU µs per call from events, host µs per call) of ``calls`` back-to-back calls; medians."""
    import torch

    gpu, host = [], []
    for _ in range(rounds):
        common.synchronize(devices)
        starts = [torch.cuda.Event(enable_timing=True) for _ in devices]
        ends = [torch.cuda.Event(enable_timing=True) for _ in devices]
        for d, e in zip(devices, starts):
            e.record(torch.cuda.current_stream(d))
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) * 1e6 / calls)
        for d, e in zip(devices, ends):
            e.record(torch.cuda.current_stream(d))
        common.synchronize(devices)
        gpu.append(max(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3 / calls)
    return common.median(gpu), common.median(host)


def kernel_table(fn, calls: int = 20) -> dict[int, list[tuple[str, int, float]]]:
    """Per CUDA device index: (kernel name, launches per call, mean µs), longest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)
    acc: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    spans: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            acc[ev.device_index][ev.name[:90]].append(ev.device_time if hasattr(ev, "device_time") else ev.cuda_time)
            spans[ev.device_index].append((ev.time_range.start, ev.time_range.end, ev.name[:60]))
    for dev, sp in sorted(spans.items()):
        sp.sort()
        period = (sp[-1][1] - sp[0][0]) / calls
        busy = sum(e - s for s, e, _ in sp) / calls
        pair_gaps: dict[tuple[str, str], list[float]] = defaultdict(list)
        for a, b in zip(sp, sp[1:]):
            pair_gaps[(a[2], b[2])].append(b[0] - a[1])
        top = sorted(pair_gaps.items(), key=lambda kv: -sum(kv[1]))[:8]
        print(f"   cuda:{dev}: period {period:.1f} µs/call, kernels busy {busy:.1f}, idle {period - busy:.1f}; "
              f"idle by kernel pair (µs per call, mean gap):")
        for (before, after), gaps in top:
            print(f"      {sum(gaps) / calls:6.1f} {sum(gaps) / len(gaps):6.1f}  {before} -> {after}")
    return {dev: sorted(((n, round(len(v) / calls), sum(v) / len(v)) for n, v in names.items()),
                        key=lambda r: -r[1] * r[2])
            for dev, names in sorted(acc.items())}


def placed_cases(tp: int, workloads):
    """Yield, per workload name, ((fn, in_shardings, out_shardings, reference, placed inputs), mesh,
    devices) on ``tp`` local GPUs (0 = all), with fresh random inputs placed by their shardings
    (``benchmarks.dispatch.spmd_cases``); the inputs are freed after each workload."""
    import torch

    import spmd
    from benchmarks.cm_local import make_mesh, resolve_devices
    from benchmarks.dispatch import _place, spmd_cases

    devices = resolve_devices("cuda", tp or torch.cuda.device_count())
    mesh = make_mesh(spmd, devices)
    cases = spmd_cases(spmd, mesh, devices[0], common.fresh_seed())
    for wl in workloads:
        fn, xs, in_sh, out_sh, ref = cases[wl]()
        placed = [_place(spmd, mesh, x, s) for x, s in zip(xs, in_sh, strict=True)]
        yield wl, (fn, in_sh, out_sh, ref, placed), mesh, devices
        del placed
        torch.cuda.empty_cache()


def host_profile(fn, calls: int, top: int = 25) -> None:
    """Print the ``top`` functions by own time of ``calls`` calls of ``fn`` (cProfile)."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    print("\n".join(buf.getvalue().splitlines()[:top + 12]))


def main(argv=None) -> int:
    """Entry point; see the module docstring."""
    common.apply_required_env()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="block")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--tp", type=int, default=0, help="GPUs to use (default: all)")
    ap.add_argument("--graphs-only", action="store_true", help="skip spmd eager")
    ap.add_argument("--host-profile", type=int, default=0, help="cProfile this many calls; print the top rows")
    args = ap.parse_args(argv)
    common.require_cuda("benchmarks.probe.block_profile")
    import spmd

    for wl, (fn, in_sh, out_sh, ref, placed), mesh, devices in placed_cases(args.tp, args.workloads.split(",")):
        for graphs in (True,) if args.graphs_only else (False, True):
            f = spmd.jit(fn, mesh=mesh, in_shardings=in_sh, out_shardings=out_sh,
                         options=spmd.CompileOptions(cuda_graphs=graphs))
            call = lambda f=f, a=placed: f(*a)  # noqa: E731
            t0 = time.perf_counter()
            call()
            common.synchronize(devices)
            print(f"   first call (compile, fusion codegen, capture) {time.perf_counter() - t0:.1f} s", flush=True)
            for _ in range(20):
                call()
            gpu, host = gpu_us_per_call(call, devices, args.calls)
            label = f"{wl} {'graphs' if graphs else 'eager'}"
            print(f"== {label}: GPU {gpu:.1f} µs/call, host enqueue {host:.1f} µs/call "
                  f"(rel err {common.rel_error(call().to_torch().float(), ref.float()):.1e})", flush=True)
            if args.host_profile:
                host_profile(call, args.host_profile)
            for dev, rows in kernel_table(call).items():
                total = sum(c * us for _, c, us in rows)
                print(f"   cuda:{dev}: {sum(c for _, c, _ in rows)} kernels/call, {total:.1f} µs summed")
                for name, count, us in rows:
                    print(f"      {count:3d} x {us:7.2f} µs  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
