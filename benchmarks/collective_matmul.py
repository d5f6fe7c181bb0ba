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
variant is reported as time (ms) and × that limit. A child that fails or times out keeps its
columns (n/a cells) and gets a note with its exit code or time-out and the last line of its
output. On ``--device cpu`` the XLA children see ``tp`` virtual host devices
(``benchmarks.harness.jax_child_env``). Output: one table per side (printed; appended to
``docs/benchmarks.md`` with ``--doc``), ``cm_results.json`` and
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

from benchmarks import common, harness, reporting
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


def source_columns(source: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    """The :data:`COLUMNS` keys that child ``source`` (or its ``-again`` rerun) measures with ``args``."""
    source = source.removesuffix("-again")
    if source == "local" and not args.no_spmd:
        return [("local", "serial"), *[("local", v) for v in args.spmd_variants]]
    return [c for c in COLUMNS if c[0] == source and not c[1].startswith("spmd:")]


def side_table(idx: dict[tuple, dict[str, Any]], side: str, shapes: Sequence[tuple[int, ...]],
               expected: Iterable[tuple[str, str]] = ()) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of one side's table: shape, local limit, then ``ms ×ratio`` per column.

    Columns: those with a record on this side, plus ``expected`` (the columns of children that
    ran, so that a child that failed before its first record still shows as n/a cells).
    """
    expected = set(expected)
    cols = [c for c in COLUMNS if c in expected or any((c[0], side, s, c[1]) in idx for s in shapes)]
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
    """Command, extra env and env keys to drop for each child, by source name.

    The XLA children's environment comes from :func:`harness.jax_child_env`: on CPU ``tp``
    virtual host devices (windowed: plus :data:`WINDOWED_XLA_FLAGS`), on GPU no caller
    ``XLA_FLAGS`` (windowed: exactly :data:`WINDOWED_XLA_FLAGS`). ``--seed`` goes to every child
    when given.
    """
    py = sys.executable
    common_args = ["--tp", str(args.tp), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                   "--reps", str(args.reps), "--shapes", ";".join(",".join(map(str, s)) for s in shapes),
                   "--sides", ",".join(args.sides)]
    common_args += [] if args.seed is None else ["--seed", str(args.seed)]
    local = [py, "-m", "benchmarks.cm_local", *common_args, "--device", args.device,
             "--spmd-variants", ",".join(args.spmd_variants)]
    local += ["--no-spmd"] if (no_spmd or args.no_spmd) else []
    local += ["--no-check"] if args.no_check else []
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.tp}",
                "-m", "benchmarks.anchors.torch_symm_mem", *common_args]
    jax = [py, "-m", "benchmarks.anchors.jax_xla", "--bench", "cm", "--device", args.device, *common_args]
    return {
        "local": (local, {}, []),
        "torch": (torchrun, {}, []),
        "xla": ([*jax, "--label", "xla"], *harness.jax_child_env(args.device, args.tp)),
        "xla-windowed": ([*jax, "--label", "xla-windowed"],
                         *harness.jax_child_env(args.device, args.tp, WINDOWED_XLA_FLAGS)),
    }


#: Share of the time left that each child may use, in run order.
SHARES = {"local": 0.45, "torch": 0.4, "xla": 0.7, "xla-windowed": 1.0}
STARTUP_S = 25.0  # child start-up + margin between its own budget and the hard time box


def run_children(args: argparse.Namespace, deadline: common.Deadline) -> tuple[list[dict], list[dict]]:
    """Run the selected children in order; returns (records, child status dicts).

    Status holds one :func:`harness.child_status` dict per child run (and per rerun), and one per
    child left unstarted after SIGTERM.
    """
    records: list[dict] = []
    status: list[dict] = []
    shapes = [tuple(s) for s in args.shapes]
    children = plan_children(args, shapes)
    for name in [n for n in SHARES if n not in args.skip]:
        if common.terminated():
            status.append(harness.child_status(harness.not_run(name, "SIGTERM received")))
            continue
        box = max(0.0, (deadline.left() - args.reserve_s) * SHARES[name])
        cmd, extra, drop = children[name]
        cmd = [*cmd, "--budget-s", str(max(1.0, box - STARTUP_S))]
        res = common.run_child(name, cmd, box, common.child_env(extra, drop))
        records += res.records
        status.append(harness.child_status(res))
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
    status.append(harness.child_status(again))
    return [r for r in again.records if (r.get("side"), shape_key(r.get("shape", ()))) not in done]


def report(records: list[dict], status: list[dict], args: argparse.Namespace, info: dict[str, Any]) -> dict:
    """Print the tables, write JSON and plot, append to the docs; returns the results dict.

    Every child that did not finish ok gets a note (:func:`harness.child_failure_notes`): printed
    after the tables, under ``notes["children"]`` in the JSON and under the row set's children line.
    """
    idx = index_records(records)
    shapes = [tuple(s) for s in args.shapes]
    expected = [c for s in status for c in source_columns(s["name"], args)]
    body, panels = [], []
    all_notes: dict[str, list[str]] = {"children": harness.child_failure_notes(status)}
    for side in args.sides:
        headers, rows = side_table(idx, side, shapes, expected)
        title = f"{SIDE_TITLES[side]}, tp={args.tp}, bf16: time ms ×own limit"
        reporting.print_table(title, headers, rows)
        side_notes = all_notes[side] = notes(idx, side)
        for line in side_notes:
            print("  " + line)
        body.append(f"### {title}\n\n{reporting.markdown_table(headers, rows)}\n")
        body.append("\n".join(f"- {n}" for n in side_notes) + "\n")
        labels = [",".join(map(str, s)) for s in shapes]
        panels.append((f"{SIDE_TITLES[side]} (tp={args.tp})", labels,
                       {k: v for k, v in ratios(idx, side, shapes).items() if any(x is not None for x in v)}))
    for line in all_notes["children"]:
        print("  " + line)
    results = {"info": info, "args": {k: v for k, v in vars(args).items() if k != "shapes"},
               "shapes": shapes, "children": status, "notes": all_notes, "records": records}
    out = Path(args.out)
    reporting.write_json(out / "cm_results.json", results)
    pngs = [out / PLOT_NAME] + ([Path(args.doc).parent / PLOT_NAME] if args.doc else [])
    written = reporting.plot_grouped_bars(pngs, panels)
    if args.doc:
        run_line = "Children: " + ", ".join(f"{s['name']} ({'ok' if s['ok'] else 'failed'}, "
                                            f"{s['elapsed_s']} s)" for s in status)
        run_line += "".join(f"\n- {line}" for line in all_notes["children"])
        plot = f"\n![collective matmul]({PLOT_NAME})\n" if written else ""
        reporting.append_row_set(Path(args.doc), f"collective matmul, tp={args.tp}", info,
                              run_line + "\n\n" + "\n".join(body) + plot)
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Options of the parent (the worker's plus ``--out``, ``--doc``, ``--skip``, ``--reserve-s``).

    Unknown children, sides or spmd variants are usage errors (SystemExit 2, the message names
    the flag, the allowed values and what was given); so are bad ``--shapes`` (argparse's message).
    """
    ap = build_parser()
    ap.add_argument("--out", default="/tmp/spmd_bench_out", help="directory for cm_results.json and the plot")
    ap.add_argument("--doc", default=None, help="append a row set to this markdown file (docs/benchmarks.md)")
    ap.add_argument("--skip", type=harness.name_list(tuple(SHARES)), default=[],
                    help=f"comma-separated children to skip, of: {', '.join(SHARES)}")
    ap.add_argument("--reserve-s", type=float, default=15.0, help="seconds kept for the report")
    args = ap.parse_args(argv)
    if args.dtype != "bfloat16":  # the anchors (NCCL, PyTorch fused, XLA) all run bf16
        ap.error(f"argument --dtype: collective_matmul compares every source in bfloat16, got {args.dtype!r}")
    try:
        return finish_args(args)
    except ValueError as exc:
        ap.error(str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    common.apply_required_env()
    args = parse_args(argv)
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
