"""Long random-program sweep: ``python3 -m tests.fuzz.sweep --n 10000 --seed 0 --out report.json``.

Runs ``n`` generated cases (case ``i`` drawn from ``random.Random(f"{seed}:{i}")``, so any one is
rebuilt by ``--only i``), classifies each (``tests.fuzz.oracle``), and writes a JSON report with the
counts per class (with and without donation), the distinct failure signatures with a reproducer of
the first (optionally shrunk, ``--shrink``) case of each, and the spread of error/tolerance ratios
of the matches. Needs only torch (hypothesis is not used). ``--device cuda`` runs on a mesh of
``--cuda-devices`` GPUs (default 1). ``SPMD_FUSION_COMPILER=inductor`` in the environment runs the
fusions as Inductor-generated kernels on CPU too (the code path CUDA graphs use on GPUs).
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import sys
import time
import warnings

from tests.fuzz.case import reproducer
from tests.fuzz.draw import RandomDraw
from tests.fuzz.generate import ALL_FEATURES, default_features, generate_case, op_kinds
from tests.fuzz.oracle import Outcome, run_case

FAILING = ("crash", "wrong", "timeout", "invalid")


def make_case(args, i: int, draw=None):
    draw = draw or RandomDraw(f"{args.seed}:{i}")
    return draw, generate_case(draw, args.seed * 1_000_000 + i, device=args.device, features=args.features,
                               max_ops=args.max_ops, cuda_devices=args.cuda_devices, exclude_ops=args.exclude_ops)


class _Timeout(Exception):
    pass


def run_with_timeout(case, timeout_s: int) -> Outcome:
    """``run_case`` with a SIGALRM time limit (main thread, POSIX); a hang is the class ``timeout``."""
    if timeout_s <= 0 or not hasattr(signal, "SIGALRM"):
        return run_case(case)

    def on_alarm(signum, frame):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(timeout_s)
    try:
        return run_case(case)
    except _Timeout:
        return Outcome("timeout", f"[{'donation' if case.donate else 'no donation'}] timeout after {timeout_s} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def sweep(args) -> dict:
    """Run the sweep; returns (and writes to ``args.out``) the report."""
    spmd_jit = sys.modules["spmd.jit"]  # the module (``spmd.jit`` is also the function)
    counts: collections.Counter = collections.Counter()
    by_donation: collections.Counter = collections.Counter()
    sigs: dict[str, dict] = {}
    ops: collections.Counter = collections.Counter()
    ratios: list[float] = []
    start = time.monotonic()
    report: dict = {}
    for n, i in enumerate(range(args.start, args.start + args.n), start=1):
        draw, case = make_case(args, i)
        out = run_with_timeout(case, args.timeout_s)
        counts[out.cls] += 1
        by_donation[(out.cls, bool(case.donate))] += 1
        ops.update(case.ops)
        ratios += out.ratios
        if out.cls != "match":
            entry = sigs.setdefault(out.signature, {"class": out.cls, "count": 0, "first": i, "ops": len(case.ops)})
            entry["count"] += 1
            if out.cls in FAILING and "repro" not in entry:
                if args.shrink:
                    case, out = shrink_case(args, draw, case, out)
                entry["repro"] = reproducer(case, out.signature)
                entry["detail"] = out.detail[-2000:]
                if args.verbose:
                    print(f"--- case {i}: {out.signature}\n{entry['repro']}", flush=True)
        if n % 200 == 0:
            spmd_jit._GLOBAL_CACHE.clear()  # bound memory over long sweeps
        over = args.budget_s and time.monotonic() - start > args.budget_s
        if n % 5 == 0 or n == args.n or over:
            report = _report(args, counts, by_donation, sigs, ops, ratios, n, time.monotonic() - start)
            if args.out:
                with open(args.out, "w") as fh:
                    json.dump(report, fh, indent=1)
            if args.progress:
                print(f"{n}/{args.n} {dict(counts)} {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        if over:
            break
    return report


def shrink_case(args, draw, case, out):
    from tests.fuzz.shrink import shrink

    seed = case.inputs[0].seed // 100  # the generator's seed for this case (Builder.new_input)

    def make(d):
        return generate_case(d, seed, device=args.device, features=args.features, max_ops=args.max_ops,
                             cuda_devices=args.cuda_devices, exclude_ops=args.exclude_ops)

    return shrink(draw.choices, make, lambda c: run_with_timeout(c, args.timeout_s), out.signature,
                  budget_s=args.shrink_s)


#: Upper bounds of the error/tolerance histogram bins (a match is <= 1).
RATIO_BINS = (0.001, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)


def ratio_histogram(ratios: list[float]) -> dict[str, int]:
    hist = {f"<={b}": 0 for b in RATIO_BINS}
    for r in ratios:
        for b in RATIO_BINS:
            if r <= b:
                hist[f"<={b}"] += 1
                break
    return hist


def _report(args, counts, by_donation, sigs, ops, ratios, n, elapsed_s) -> dict:
    return {
        "programs": n, "seed": args.seed, "start": args.start, "device": args.device,
        "features": sorted(args.features), "elapsed_s": round(elapsed_s, 1),
        "counts": dict(counts),
        "counts_by_donation": {f"{c} ({'donation' if d else 'no donation'})": k for (c, d), k in by_donation.items()},
        "signatures": dict(sorted(sigs.items(), key=lambda kv: (kv[1]["class"] == "unsupported", -kv[1]["count"]))),
        "ops": dict(ops.most_common()),
        "error_over_tolerance": {"max": round(max(ratios, default=0.0), 4), "histogram": ratio_histogram(ratios)},
    }


def merge(reports: list[dict]) -> dict:
    """One report of several sweeps over disjoint ranges (counts summed, first reproducer kept)."""
    out = {"programs": 0, "seed": reports[0]["seed"], "start": min(r["start"] for r in reports),
           "device": reports[0]["device"], "features": reports[0]["features"],
           "elapsed_s": max(r["elapsed_s"] for r in reports), "counts": collections.Counter(),
           "counts_by_donation": collections.Counter(), "signatures": {}, "ops": collections.Counter(),
           "error_over_tolerance": {"max": 0.0, "histogram": collections.Counter()}}
    for r in reports:
        out["programs"] += r["programs"]
        out["counts"].update(r["counts"])
        out["counts_by_donation"].update(r["counts_by_donation"])
        out["ops"].update(r["ops"])
        eot = out["error_over_tolerance"]
        eot["max"] = max(eot["max"], r["error_over_tolerance"]["max"])
        eot["histogram"].update(r["error_over_tolerance"]["histogram"])
        for sig, e in r["signatures"].items():
            mine = out["signatures"].setdefault(sig, dict(e, count=0))
            mine["count"] += e["count"]
            if e["first"] < mine["first"] or "repro" not in mine:
                mine.update({k: v for k, v in e.items() if k != "count"})
    for key in ("counts", "counts_by_donation", "ops"):
        out[key] = dict(out[key])
    out["error_over_tolerance"]["histogram"] = dict(out["error_over_tolerance"]["histogram"])
    out["signatures"] = dict(sorted(out["signatures"].items(),
                                    key=lambda kv: (kv[1]["class"] == "unsupported", -kv[1]["count"])))
    return out


def run_jobs(args, argv: list[str]) -> dict:
    """Split the range over ``args.jobs`` child processes (``--start``/``--n`` each) and merge their reports."""
    import os
    import subprocess
    import tempfile

    per = -(-args.n // args.jobs)
    tmp = tempfile.mkdtemp(prefix="fuzz-sweep-")
    children = []
    rest = _strip(argv, ("--jobs", "--n", "--start", "--out"))
    for k in range(args.jobs):
        start, n = args.start + k * per, min(per, args.n - k * per)
        if n <= 0:
            break
        path = os.path.join(tmp, f"part{k}.json")
        cmd = [sys.executable, "-m", "tests.fuzz.sweep", *rest, "--start", str(start), "--n", str(n), "--out", path]
        children.append((path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL)))
    reports = []
    for path, child in children:
        child.wait()
        if os.path.exists(path):
            with open(path) as fh:
                reports.append(json.load(fh))
    report = merge(reports)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return report


def _strip(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the options ``names`` (each with its value)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if any(a.startswith(n + "=") for n in names):
            continue
        out.append(a)
    return out


def summary(report: dict) -> str:
    """The report as a plain-text table: counts per class, then one line per signature."""
    lines = [f"{report['programs']} programs, seed {report['seed']}, device {report['device']}, "
             f"{report['elapsed_s']} s"]
    total = max(1, report["programs"])
    for cls in ("match", "unsupported", "crash", "wrong", "timeout", "invalid"):
        k = report["counts"].get(cls, 0)
        lines.append(f"  {cls:<12} {k:>7}  {100 * k / total:5.1f}%")
    for key, k in sorted(report["counts_by_donation"].items()):
        lines.append(f"    {key:<30} {k:>7}")
    eot = report["error_over_tolerance"]
    lines.append(f"  error/tolerance of float outputs that matched: max {eot['max']}, histogram {eot['histogram']}")
    lines.append("  signatures (count, class, first case):")
    for sig, e in report["signatures"].items():
        lines.append(f"  {e['count']:>6}  {e['class']:<11} #{e['first']:<6} {sig}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1000, help="number of programs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="index of the first program")
    p.add_argument("--only", type=int, default=None, help="run program INDEX alone and print its reproducer")
    p.add_argument("--out", default=None, help="JSON report path (rewritten every 5 programs)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--cuda-devices", type=int, default=1)
    p.add_argument("--max-ops", type=int, default=12)
    p.add_argument("--timeout-s", type=int, default=120, help="per-program time limit (0 = none)")
    p.add_argument("--without", default="", help="comma-separated features to leave out "
                   f"(of {', '.join(sorted(ALL_FEATURES))})")
    p.add_argument("--exclude-ops", default="", help="comma-separated op kinds never to draw (of "
                   f"{', '.join(op_kinds())})")
    p.add_argument("--shrink", action="store_true", help="shrink the first case of every failure signature")
    p.add_argument("--shrink-s", type=float, default=120.0, help="time budget per shrink")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--budget-s", type=float, default=0, help="stop after this many seconds (0 = run all n)")
    p.add_argument("--jobs", type=int, default=1, help="child processes to split the range over")
    p.add_argument("--merge", nargs="+", default=None, help="merge these JSON reports (to --out) and print them")
    p.add_argument("--verbose", action="store_true", help="print each new failure's reproducer")
    args = p.parse_args(argv)
    unknown = set(filter(None, args.without.split(","))) - ALL_FEATURES
    if unknown:
        p.error(f"--without: unknown features {sorted(unknown)}")
    args.features = default_features() - set(args.without.split(","))
    args.exclude_ops = frozenset(filter(None, args.exclude_ops.split(",")))
    if args.exclude_ops - set(op_kinds()):
        p.error(f"--exclude-ops: unknown op kinds {sorted(args.exclude_ops - set(op_kinds()))}")
    return args


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        present = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if present < args.cuda_devices:
            print(f"tests.fuzz.sweep: --device cuda needs {args.cuda_devices} CUDA GPU(s), found {present}",
                  file=sys.stderr)
            return 2
    if args.only is not None:
        draw, case = make_case(args, args.only)
        out = run_with_timeout(case, args.timeout_s)
        if args.shrink and out.cls in FAILING:
            case, out = shrink_case(args, draw, case, out)
        print(f"{out.cls}: {out.signature}\n{out.detail}\n\n{reproducer(case, out.signature)}")
        return 0 if out.cls not in FAILING else 1
    if args.merge:
        reports = []
        for path in args.merge:
            with open(path) as fh:
                reports.append(json.load(fh))
        report = merge(reports)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(report, fh, indent=1)
    elif args.jobs > 1:
        report = run_jobs(args, list(sys.argv[1:] if argv is None else argv))
    else:
        report = sweep(args)
    print(summary(report))
    return 0 if not any(report["counts"].get(c) for c in FAILING) else 1


if __name__ == "__main__":
    sys.exit(main())
