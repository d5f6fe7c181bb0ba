"""What the GPU runs per call: kernel counts and summed kernel time per device (torch.profiler).

``kernel_summary(fn)`` profiles a few calls of ``fn`` and classifies every CUDA kernel as matrix
math (cuBLAS / CUTLASS GEMMs, split-K reductions, fused attention), collective (NCCL kernels,
peer copies) or other (elementwise, norms, copies, generated fusions). The summed time of the
matrix-math kernels is the floor a program with these GEMMs cannot go below on that device;
the gap between the busy time and the measured time per call is launch latency and idle time.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

_MATMUL = re.compile(r"gemm|sgemm|xmma|nvjet|cutlass|splitKreduce|fmha|flash|attention|cublas", re.IGNORECASE)
#: NCCL kernels, peer copies, and XLA's own collective kernels (``all_reduce_1_0_fusion_1``, ...).
_COLLECTIVE = re.compile(r"nccl|PtoP|all[_-]?reduce|all[_-]?gather|reduce[_-]?scatter|collective[_-]?permute",
                         re.IGNORECASE)


@dataclass(frozen=True)
class DeviceKernels:
    """One device's kernels per call: count, summed µs by class (matmul, collective, other), and
    ``top``: the longest kernels as (name[:80], launches per call, µs per call), longest first."""

    device: int
    kernels: int
    busy_us: float
    matmul_us: float
    collective_us: float
    other_us: float
    top: tuple[tuple[str, float, float], ...] = ()


def kind(name: str) -> str:
    """"matmul", "collective" or "other" for a CUDA kernel (or memcpy) name."""
    if _COLLECTIVE.search(name):
        return "collective"
    return "matmul" if _MATMUL.search(name) else "other"


def kernel_summary(fn: Callable[[], object], calls: int = 10, top: int = 8) -> list[DeviceKernels]:
    """Per CUDA device that ran kernels, a :class:`DeviceKernels` averaged over ``calls`` calls.

    ``fn`` is called once untimed, then ``calls`` times under ``torch.profiler`` (CUDA activity);
    every device is synchronized before the profile ends. ``top`` longest kernel names are kept.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)
    count: dict[int, int] = defaultdict(int)
    by_kind: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_name: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
        count[ev.device_index] += 1
        by_kind[ev.device_index][kind(ev.name)] += us
        by_name[ev.device_index][ev.name[:80]].append(us)
    out = []
    for dev in sorted(count):
        k = by_kind[dev]
        longest = sorted(by_name[dev].items(), key=lambda kv: -sum(kv[1]))[:top]
        out.append(DeviceKernels(dev, round(count[dev] / calls), sum(k.values()) / calls, k["matmul"] / calls,
                                 k["collective"] / calls, k["other"] / calls,
                                 tuple((n, len(v) / calls, sum(v) / calls) for n, v in longest)))
    return out


def print_kernels(label: str, fn: Callable[[], object], calls: int = 3, top: int = 25) -> None:
    """Print the kernel summary of ``fn`` (per call) and its ``top`` longest kernels, one per line."""
    try:
        devs = kernel_summary(fn, calls=calls, top=top)
    except Exception as exc:  # a profile must not stop a benchmark
        print(f"[kernels] {label}: profile failed: {type(exc).__name__}: {exc}", flush=True)
        return
    for d in devs:
        print(f"[kernels] {label} dev{d.device}: {d.kernels} kernels, busy {d.busy_us:.1f} us "
              f"(matmul {d.matmul_us:.1f}, collective {d.collective_us:.1f}, other {d.other_us:.1f})", flush=True)
        for name, n, us in d.top:
            print(f"[kernels]   {us:9.1f} us  x{n:<6.1f} {name}", flush=True)


def idle_gaps(fn: Callable[[], object], top: int = 10) -> tuple[float, float, list[tuple[float, str, str]]]:
    """Device 0's idle time during one call of ``fn`` (after one untimed call).

    Returns ``(span_us, idle_us, gaps)``: the span from the first kernel's start to the last
    kernel's end, the time inside it when no kernel ran on any stream, and the ``top`` longest idle
    gaps as (µs, kernel before, kernel after), longest first.
    """
    span, gaps = gaps_between(kernel_events(fn))
    gaps.sort(key=lambda g: -g[0])
    return span, sum(g[0] for g in gaps), [(us, before, after) for us, _, _, before, after in gaps[:top]]


def kernel_events(fn: Callable[[], object], name_chars: int = 60) -> list[tuple[float, float, str]]:
    """``(start µs, end µs, name)`` of device 0's kernels during one call of ``fn`` (after one
    untimed call), in start order, names cut to ``name_chars``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted((e.time_range.start, e.time_range.end, e.name[:name_chars]) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.device_index == 0)


def gaps_between(kernels: list[tuple[float, float, str]]) -> tuple[float, list[tuple[float, float, float, str, str]]]:
    """``(span, gaps)`` of ``(start, end, name)`` kernel intervals (µs) on one device, any stream: the
    span from the first start to the last end, and each stretch inside it when no kernel ran as
    ``(µs, start, end, kernel before, kernel after)``, in time order."""
    evs = sorted(kernels)
    if not evs:
        return 0.0, []
    gaps, end, last = [], evs[0][1], evs[0][2]
    for s, e, name in evs[1:]:
        if s > end:
            gaps.append((s - end, end, s, last, name))
        if e >= end:
            end, last = e, name
    return end - evs[0][0], gaps


def print_idle_gaps(label: str, fn: Callable[[], object], top: int = 10) -> None:
    """Print ``idle_gaps`` of ``fn`` (never raises: a profile must not stop a benchmark)."""
    try:
        span, idle, gaps = idle_gaps(fn, top)
    except Exception as exc:  # noqa: BLE001
        print(f"[gaps] {label}: profile failed: {type(exc).__name__}: {exc}", flush=True)
        return
    print(f"[gaps] {label}: span {span:.1f} us, idle {idle:.1f} us", flush=True)
    for us, before, after in gaps:
        print(f"[gaps]   {us:8.1f} us  after {before}  before {after}", flush=True)
