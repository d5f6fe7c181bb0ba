"""Collective-matmul benchmark: spmd's windowed einsum vs NCCL, PyTorch symmetric memory and XLA.

Usage (repository root, GPUs visible)::

    python3 -m benchmarks.collective_matmul --tp 2 --out $OUT --budget-s 420

Runs, each in its own time-boxed child process so that one failure costs only its own rows:

1. ``benchmarks.cm_local``: compute-only, comm-only, the serial NCCL baseline and the spmd
   variants, all in one process over the local GPUs (if spmd crashes that process, the
   unfinished shapes are measured again without spmd);
2. ``benchmarks.anchors.torch_symm_mem`` under ``torch.distributed.run`` (PyTorch fused ops);
3. ``benchmarks.anchors.jax_xla`` twice: XLA's default flags, then windowed einsum forced on.

Every source measures its own limit = max(compute-only, comm-only) in the same run, and each
variant is reported as time (ms) and × that limit. Output: one table per side (printed;
appended to ``docs/benchmarks.md`` with ``--doc``), ``cm_results.json`` and
``benchmarks_collective_matmul.png`` in ``--out`` (the plot also beside ``--doc``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, reporting
from benchmarks.cm_local import BF16_TOLERANCE, SPMD_VARIANTS, build_parser, finish_args

PLOT_NAME = "benchmarks_collective_matmul.png"
SIDE_TITLES = {"ag": "all-gather→matmul", "rs": "matmul→reduce-scatter"}
WINDOWED_XLA_FLAGS = "--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true"
#: Table columns: (source, variant) -> label. Limits come from the same source.
COLUMNS: dict[tuple[str, str], str] = {
    ("local", "serial"): "NCCL serial",
    **{("local", v): v.replace("spmd:", "spmd ") for v in SPMD_VARIANTS},
    ("torch", "serial"): "torch serial",
    ("torch", "fused"): "torch fused",
    ("xla", "xla"): "XLA",
    ("xla-windowed", "xla"): "XLA windowed",
}


def shape_key(shape: Iterable[int]) -> tuple[int, ...]:
    """A shape as a hashable tuple."""
    return tuple(int(d) for d in shape)


def index_records(records: Iterable[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Map (source, side, shape, variant) -> record for every ``kind == "cm"`` record (first wins)."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in records:
        if r.get("kind") == "cm":
            out.setdefault((r.get("source"), r.get("side"), shape_key(r.get("shape", ())), r.get("variant")), r)
    return out


def limit_ms(idx: dict[tuple, dict[str, Any]], source: str, side: str, shape: tuple[int, ...]) -> float | None:
    """max(compute-only, comm-only) of ``source`` for this side and shape, or None if either is missing."""
    parts = [idx.get((source, side, shape, v), {}).get("ms") for v in ("compute", "comm")]
    return None if any(p is None for p in parts) else max(parts)


def ratios(idx: dict[tuple, dict[str, Any]], side: str, shapes: Sequence[tuple[int, ...]]
           ) -> dict[str, list[float | None]]:
    """Per column label, the × own-limit value for each shape (None where missing)."""
    out: dict[str, list[float | None]] = {}
    for (source, variant), label in COLUMNS.items():
        out[label] = [common.ratio(idx.get((source, side, s, variant), {}).get("ms"), limit_ms(idx, source, side, s))
                      for s in shapes]
    return out


def side_table(idx: dict[tuple, dict[str, Any]], side: str, shapes: Sequence[tuple[int, ...]]
               ) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of one side's table: shape, local limit, then ``ms ×ratio`` per column."""
    cols = [c for c in COLUMNS if any((c[0], side, s, c[1]) in idx for s in shapes)]
    headers = ["M, K, N", "limit ms", "compute", "comm", *[COLUMNS[c] for c in cols]]
    rows = []
    for s in shapes:
        loc = limit_ms(idx, "local", side, s)
        row = [", ".join(map(str, s)), reporting.fmt_ms(loc),
               reporting.fmt_ms(idx.get(("local", side, s, "compute"), {}).get("ms")),
               reporting.fmt_ms(idx.get(("local", side, s, "comm"), {}).get("ms"))]
        for source, variant in cols:
            rec = idx.get((source, side, s, variant), {})
            ms = rec.get("ms")
            lim = limit_ms(idx, source, side, s)
            cell = "n/a" if ms is None else f"{reporting.fmt_ms(ms)} {reporting.fmt_ratio(common.ratio(ms, lim))}"
            err = rec.get("rel_err")
            if ms is not None and err is not None and not err < BF16_TOLERANCE:
                cell += " WRONG"
            windowed = source == "xla-windowed" or SPMD_VARIANTS.get(variant, {}).get("windowed_einsum") == "on"
            if windowed and rec.get("hlo", {}).get("collective-permute") == 0:
                cell += " (no CP)"
            if rec.get("events_suspect"):
                cell += " (events?)"
            row.append(cell)
        rows.append(row)
    return headers, rows


def notes(idx: dict[tuple, dict[str, Any]], side: str) -> list[str]:
    """Notes for one side: worst relative error per variant, XLA HLO collective counts, n/a reasons."""
    worst: dict[str, float] = {}
    failures: dict[tuple[str, str], list[str]] = {}
    hlo = []
    for (source, s_side, shape, variant), rec in sorted(idx.items(), key=lambda kv: str(kv[0])):
        if s_side != side:
            continue
        name = f"{source}/{variant}"
        if rec.get("rel_err") is not None:
            worst[name] = max(worst.get(name, 0.0), float(rec["rel_err"]))
        if rec.get("hlo") and source.startswith("xla"):
            hlo.append(f"{source} compiled HLO {shape}: " + ", ".join(f"{k} {v}" for k, v in rec["hlo"].items()))
        if rec.get("error"):
            failures.setdefault((source, str(rec["error"])[:200]), []).append(f"{variant} {shape}")
    out = []
    if worst:
        out.append("worst rel. error vs float32 (fused: vs serial): "
                   + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())))
    out += hlo
    out += [f"n/a {src} [{'; '.join(where[:4])}{' …' if len(where) > 4 else ''}]: {err}"
            for (src, err), where in failures.items()]
    return out


def plan_children(args: argparse.Namespace, shapes: Sequence[tuple[int, ...]], no_spmd: bool = False
                  ) -> dict[str, tuple[list[str], dict[str, str], list[str]]]:
    """Command, extra env and env keys to drop for each child, by source name."""
    py = sys.executable
    common_args = ["--tp", str(args.tp), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                   "--reps", str(args.reps), "--shapes", ";".join(",".join(map(str, s)) for s in shapes),
                   "--sides", ",".join(args.sides)]
    local = [py, "-m", "benchmarks.cm_local", *common_args, "--device", args.device,
             "--spmd-variants", ",".join(args.spmd_variants)]
    local += ["--no-spmd"] if (no_spmd or args.no_spmd) else []
    local += ["--no-check"] if args.no_check else []
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.tp}",
                "-m", "benchmarks.anchors.torch_symm_mem", *common_args]
    jax = [py, "-m", "benchmarks.anchors.jax_xla", "--bench", "cm", *common_args]
    return {
        "local": (local, {}, []),
        "torch": (torchrun, {}, []),
        "xla": ([*jax, "--label", "xla"], {}, ["XLA_FLAGS"]),
        "xla-windowed": ([*jax, "--label", "xla-windowed"], {"XLA_FLAGS": WINDOWED_XLA_FLAGS}, []),
    }


#: Share of the time left that each child may use, in run order.
SHARES = {"local": 0.45, "torch": 0.4, "xla": 0.7, "xla-windowed": 1.0}
STARTUP_S = 25.0  # child start-up + margin between its own budget and the hard time box


def run_children(args: argparse.Namespace, deadline: common.Deadline) -> tuple[list[dict], list[dict]]:
    """Run the selected children in order; returns (records, child status dicts)."""
    records: list[dict] = []
    status: list[dict] = []
    shapes = [tuple(s) for s in args.shapes]
    children = plan_children(args, shapes)
    for name in [n for n in SHARES if n not in args.skip]:
        if common.terminated():
            break
        box = max(0.0, (deadline.left() - args.reserve_s) * SHARES[name])
        cmd, extra, drop = children[name]
        cmd = [*cmd, "--budget-s", str(max(1.0, box - STARTUP_S))]
        res = common.run_child(name, cmd, box, common.child_env(extra, drop))
        records += res.records
        status.append(_status(res))
        if not res.ok and not common.terminated():
            records += _rerun(args, name, res, deadline, status, no_spmd=name == "local")
    return records, status


def _rerun(args: argparse.Namespace, name: str, res: common.ChildResult, deadline: common.Deadline,
           status: list[dict], no_spmd: bool = False) -> list[dict]:
    """Run child ``name`` once more on the shapes it did not finish; returns the new records.

    The shape it was working on when it failed goes last, so that a shape that hangs again costs
    only itself. ``no_spmd``: the local child without spmd variants (after an spmd crash).
    """
    done = {(r["side"], shape_key(r["shape"])) for r in res.records if r.get("kind") == "cm-done"}
    missing = [tuple(s) for s in args.shapes if any((side, tuple(s)) not in done for side in args.sides)]
    if len(missing) > 1:
        missing = missing[1:] + missing[:1]
    box = (deadline.left() - args.reserve_s) * 0.5
    if not missing or box < 60 or (no_spmd and args.no_spmd):
        return []
    cmd, extra, drop = plan_children(args, missing, no_spmd=no_spmd)[name]
    again = common.run_child(f"{name}-again", [*cmd, "--budget-s", str(box - STARTUP_S)], box,
                             common.child_env(extra, drop))
    status.append(_status(again))
    return [r for r in again.records if (r.get("side"), shape_key(r.get("shape", ()))) not in done]


def _status(res: common.ChildResult) -> dict[str, Any]:
    return {"name": res.name, "ok": res.ok, "returncode": res.returncode, "timed_out": res.timed_out,
            "elapsed_s": round(res.elapsed_s, 1), "records": len(res.records),
            "tail": "" if res.ok else res.tail[-1500:]}


def report(records: list[dict], status: list[dict], args: argparse.Namespace, info: dict[str, Any]) -> dict:
    """Print the tables, write JSON and plot, append to the docs; returns the results dict."""
    idx = index_records(records)
    shapes = [tuple(s) for s in args.shapes]
    body, panels = [], []
    for side in args.sides:
        headers, rows = side_table(idx, side, shapes)
        title = f"{SIDE_TITLES[side]}, tp={args.tp}, bf16: time ms ×own limit"
        reporting.print_table(title, headers, rows)
        side_notes = notes(idx, side)
        for line in side_notes:
            print("  " + line)
        body.append(f"### {title}\n\n{reporting.markdown_table(headers, rows)}\n")
        body.append("\n".join(f"- {n}" for n in side_notes) + "\n")
        labels = [",".join(map(str, s)) for s in shapes]
        panels.append((f"{SIDE_TITLES[side]} (tp={args.tp})", labels,
                       {k: v for k, v in ratios(idx, side, shapes).items() if any(x is not None for x in v)}))
    results = {"info": info, "args": {k: v for k, v in vars(args).items() if k != "shapes"},
               "shapes": shapes, "children": status, "records": records}
    out = Path(args.out)
    reporting.write_json(out / "cm_results.json", results)
    pngs = [out / PLOT_NAME] + ([Path(args.doc).parent / PLOT_NAME] if args.doc else [])
    written = reporting.plot_grouped_bars(pngs, panels)
    if args.doc:
        run_line = "Children: " + ", ".join(f"{s['name']} ({'ok' if s['ok'] else 'failed'}, "
                                            f"{s['elapsed_s']} s)" for s in status)
        plot = f"\n![collective matmul]({PLOT_NAME})\n" if written else ""
        reporting.append_row_set(Path(args.doc), f"collective matmul, tp={args.tp}", info,
                              run_line + "\n\n" + "\n".join(body) + plot)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    common.apply_required_env()
    ap = build_parser()
    ap.add_argument("--out", default="/tmp/spmd_bench_out", help="directory for cm_results.json and the plot")
    ap.add_argument("--doc", default=None, help="append a row set to this markdown file (docs/benchmarks.md)")
    ap.add_argument("--skip", type=lambda s: [x for x in s.split(",") if x], default=[],
                    help=f"children to skip, of {list(SHARES)}")
    ap.add_argument("--reserve-s", type=float, default=15.0, help="seconds kept for the report")
    args = finish_args(ap.parse_args(argv))
    bad = [s for s in args.skip if s not in SHARES]
    if bad:
        raise ValueError(f"--skip: expected names from {list(SHARES)}, got {bad}")
    deadline = common.Deadline(args.budget_s)
    common.install_sigterm_handler()
    info = reporting.hardware_info()
    print(f"collective matmul: tp={args.tp} shapes={args.shapes} sides={args.sides} budget={args.budget_s}s",
          flush=True)
    records, status = run_children(args, deadline)
    report(records, status, args, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
