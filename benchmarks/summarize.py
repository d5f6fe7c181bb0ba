"""Short summary of a benchmark run, printed last by run_gpu.sh: ``python3 -m benchmarks.summarize OUT``.

Reads ``cm_results.json`` and ``dispatch_results.json`` from OUT (either may be missing) and
prints one compact table per benchmark: per side and shape the limit and × limit of the NCCL
serial baseline, the best spmd variant, PyTorch fused and XLA (default / windowed); per
workload the synced µs per call of each dispatch variant; and which child processes failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, reporting
from benchmarks.collective_matmul import SIDE_TITLES, index_records, limit_ms


def cm_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the collective-matmul summary."""
    idx = index_records(results.get("records", []))
    headers = ["side", "M, K, N", "limit ms", "NCCL serial", "best spmd", "torch fused", "XLA", "XLA windowed"]
    rows = []
    sides = results.get("args", {}).get("sides", list(SIDE_TITLES))
    for side in sides:
        for shape in [tuple(s) for s in results.get("shapes", [])]:
            def r(source: str, variant: str, side=side, shape=shape) -> float | None:
                ms = idx.get((source, side, shape, variant), {}).get("ms")
                return common.ratio(ms, limit_ms(idx, source, side, shape))

            spmd = [(r("local", v), v) for (src, _, shp, v) in idx
                    if src == "local" and shp == shape and v.startswith("spmd") and r("local", v) is not None]
            best = min(spmd) if spmd else None
            rows.append([side, ", ".join(map(str, shape)), reporting.fmt_ms(limit_ms(idx, "local", side, shape)),
                         reporting.fmt_ratio(r("local", "serial")),
                         "n/a" if best is None else f"{reporting.fmt_ratio(best[0])} {best[1].removeprefix('spmd:')}",
                         reporting.fmt_ratio(r("torch", "fused")), reporting.fmt_ratio(r("xla", "xla")),
                         reporting.fmt_ratio(r("xla-windowed", "xla"))])
    return headers, rows


def failed_children(results: dict[str, Any]) -> list[str]:
    """One line per child process that did not exit 0 inside its box."""
    return [f"{c['name']}: rc={c.get('returncode')} timed_out={c.get('timed_out')} after {c.get('elapsed_s')} s"
            for c in results.get("children", []) if not c.get("ok")]


def main(argv: list[str] | None = None) -> int:
    """Print the summary of the run in directory ``argv[0]``."""
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "/tmp/spmd_bench_out")
    for name, builder in (("cm_results.json", cm_rows), ("dispatch_results.json", None)):
        path = out / name
        if not path.exists():
            print(f"{name}: missing")
            continue
        results = json.loads(path.read_text())
        if builder is not None:
            headers, rows = builder(results)
            reporting.print_table("collective matmul: × own limit", headers, rows)
        else:
            from benchmarks.dispatch import table

            headers, rows = table(results.get("records", []), results.get("args", {}).get("workloads", []))
            reporting.print_table("dispatch: µs per call, enqueue / throughput / synced", headers, rows)
        for line in failed_children(results):
            print(f"  child failed: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
