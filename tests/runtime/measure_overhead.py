"""Print the executor's per-call host overhead (not a test; run it directly).

    python tests/runtime/measure_overhead.py

On CPU: a tiny elementwise program and the windowed all-gather-dot program on 4 virtual
devices, serial and thread-pool execution. With 2+ CUDA GPUs: the same programs on 2 GPUs,
host time to enqueue one call, and time per call with a device synchronisation.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from hlo_helpers import FakeMesh  # noqa: E402
from programs import windowed_all_gather_dot  # noqa: E402

from spmd.ir.text import parse_module  # noqa: E402
from spmd.runtime.executor import Executable, RuntimeOptions  # noqa: E402

TINY = """HloModule tiny, num_partitions={n}, mesh={{x={n}}}, is_partitioned=true

ENTRY %main (x: f32[8]) -> f32[8] {{
  %x = f32[8] parameter(0)
  ROOT %y = f32[8] add(%x, %x)
}}
"""


def _time(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def _report(name: str, ex: Executable, args, sync=None, iters: int = 200) -> None:
    kernels = sum(1 for t in ex.program.thunks if type(t).__name__ == "KernelThunk")
    issue = _time(lambda: ex.run(args), iters)
    line = f"{name:<42} thunks/device={len(ex.program.thunks):3d} kernels={kernels:3d}  issue {issue:8.1f} us/call"
    if sync is not None:
        def call():
            _, ready = ex.run(args)
            for ev in ready:
                ev.synchronize()
        line += f"  synced {_time(call, iters):8.1f} us/call"
    print(line)


def main() -> None:
    n = 4
    for parallel in (False, True):
        opts = RuntimeOptions(cpu_parallel=parallel)
        tiny = parse_module(TINY.format(n=n))
        _report(f"cpu tiny add, parallel={parallel}", Executable(tiny, FakeMesh(tiny.mesh), options=opts),
                [[torch.randn(8) for _ in range(n)]])
        wag = windowed_all_gather_dot(n, m=8, k=16, f=8)
        _report(f"cpu windowed ag-dot n=4 (small), parallel={parallel}",
                Executable(wag, FakeMesh(wag.mesh), options=opts),
                [[torch.randn(8, 16) for _ in range(n)], [torch.randn(16, 8)] * n])
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        g = 2
        tiny = parse_module(TINY.format(n=g))
        ex = Executable(tiny, FakeMesh(tiny.mesh, "cuda"))
        _report("cuda tiny add (2 GPUs)", ex, [[torch.randn(8, device=f"cuda:{d}") for d in range(g)]], sync=True)
        for async_dot in (False, True):
            wag = windowed_all_gather_dot(g, m=8, k=16, f=8, async_dot=async_dot)
            ex = Executable(wag, FakeMesh(wag.mesh, "cuda"))
            args = [[torch.randn(8, 16, device=f"cuda:{d}") for d in range(g)],
                    [torch.randn(16, 8, device=f"cuda:{d}") for d in range(g)]]
            _report(f"cuda windowed ag-dot (2 GPUs) async_dot={async_dot}", ex, args, sync=True)


if __name__ == "__main__":
    main()
