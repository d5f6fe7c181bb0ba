"""Dispatch benchmark: host time per call of small sharded programs (spmd vs JAX vs PyTorch eager).

Usage (repository root)::

    python3 -m benchmarks.dispatch --tp 2 --out $OUT --budget-s 150

Workloads (``benchmarks.workloads``): a tiny sharded add ([1024] f32 split over all devices), a
2-layer sharded MLP, one transformer block, and MiniLM from ``spmd.models``. Per workload and
variant: **enqueue-only** (host time of a call with no sync, averaged over many calls, one sync
at the end) and **synced** (call + synchronize, median), both µs. Variants, each in its own
time-boxed child process:

* ``torch eager``: plain PyTorch on one GPU (``benchmarks.anchors.torch_eager``);
* ``spmd eager`` / ``spmd graphs``: ``spmd.jit`` over all ``tp`` devices with
  ``CompileOptions(cuda_graphs=False / True)`` (this file's ``--worker`` mode);
* ``jax``: ``jax.jit`` with the same shardings (``benchmarks.anchors.jax_xla --bench dispatch``).

A variant that fails is shown as n/a with its error in the notes; a child that fails or times
out keeps its columns (n/a cells) and gets a note with its exit code or time-out and the last
line of its output. On ``--device cpu`` the JAX child sees ``tp`` virtual host devices
(``benchmarks.harness.jax_child_env``). Output: a printed table, ``dispatch_results.json`` in
``--out`` and, with ``--doc``, a row set in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, harness, reporting

WORKLOAD_NAMES = ("add", "mlp", "block", "minilm")
SOURCES = {"torch-eager": "torch eager (1 GPU)", "torch-compile": "torch.compile (1 GPU)",
           "torch-compile-ro": "torch.compile reduce-overhead (1 GPU)", "spmd-eager": "spmd eager",
           "spmd-graphs": "spmd graphs", "spmd-graphs-1gpu": "spmd graphs (1 GPU)", "jax": "JAX jit"}
#: --matmul-precision -> (torch.set_float32_matmul_precision, jax_default_matmul_precision): same math
#: on both sides (torch's default is full float32; JAX's default on these GPUs is TF32).
PRECISIONS = {"highest": ("highest", "float32"), "high": ("high", "tensorfloat32")}
SHARES = {"torch-eager": 0.25, "spmd": 0.6, "jax": 1.0}
#: Table sources (columns) that each child measures; spmd-graphs-1gpu only when its records exist.
CHILD_SOURCES = {"torch-eager": ("torch-eager", "torch-compile", "torch-compile-ro"),
                 "spmd": ("spmd-eager", "spmd-graphs"), "jax": ("jax",)}
STARTUP_S = 20.0


def measure(source: str, workload: str, fn: Callable[[], Any], sync: Callable[[], None],
            args: argparse.Namespace, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Time ``fn`` with :func:`common.host_call_times`, emit and return a record; never raises."""
    try:
        enq, thru, syn = common.host_call_times(fn, sync, calls=args.calls, rounds=args.rounds)
        rec = {"enqueue_us": enq, "throughput_us": thru, "synced_us": syn, "error": None}
    except Exception as exc:  # one failure costs one cell
        rec = {"enqueue_us": None, "throughput_us": None, "synced_us": None,
               "error": f"{type(exc).__name__}: {exc}"[:400]}
    rec = {"kind": "dispatch", "source": source, "workload": workload, **rec, **(extra or {})}
    common.emit(rec)
    return rec


def fail(source: str, workload: str, exc: BaseException) -> dict[str, Any]:
    """Emit and return the n/a record of a variant that could not be set up."""
    rec = {"kind": "dispatch", "source": source, "workload": workload, "enqueue_us": None, "synced_us": None,
           "error": f"{type(exc).__name__}: {exc}"[:400]}
    common.emit(rec)
    return rec


def spmd_cases(spmd: Any, mesh: Any, device: Any, seed: int) -> dict[str, Callable[[], tuple]]:
    """Per workload, a builder of (fn, args, in_shardings, out_shardings, reference output)."""
    import torch

    from benchmarks.workloads import WORKLOADS, make_inputs, minilm_case

    P = spmd.PartitionSpec

    def simple(wl):
        def build():
            xs = make_inputs(wl, device, seed)
            with torch.no_grad():
                ref = wl.fn(*xs)
            return wl.fn, xs, tuple(P(*s) for s in wl.specs), P(*wl.out_spec), ref
        return build

    def minilm():
        case = minilm_case(device, seed, mesh=mesh)
        with torch.no_grad():
            ref = case.fn(case.params, case.input_ids, case.attention_mask)
        return (case.fn, [case.params, case.input_ids, case.attention_mask], (case.param_specs, P(), P()), P(), ref)

    return {**{name: simple(wl) for name, wl in WORKLOADS.items()}, "minilm": minilm}


def _place(spmd: Any, mesh: Any, value: Any, spec: Any) -> Any:
    if isinstance(value, dict):
        return {k: _place(spmd, mesh, v, spec[k] if isinstance(spec, dict) else spec) for k, v in value.items()}
    return spmd.device_put(value, spmd.NamedSharding(mesh, spec))


def spmd_worker(args: argparse.Namespace) -> None:
    """Measure spmd eager and spmd with CUDA graphs on every workload, and MiniLM with graphs on
    one GPU (records emitted)."""
    from benchmarks.cm_local import make_mesh, resolve_devices

    seed = args.seed if args.seed is not None else common.fresh_seed()
    devices = resolve_devices(args.device, args.tp)
    try:
        import spmd

        mesh = make_mesh(spmd, devices)
        cases = spmd_cases(spmd, mesh, devices[0], seed)
    except Exception as exc:
        for wl in args.workloads:
            for src in ("spmd-eager", "spmd-graphs"):
                fail(src, wl, exc)
        return
    sync = lambda: common.synchronize(devices)  # noqa: E731
    set_torch_precision(args.matmul_precision)
    for wl in args.workloads:
        _measure_spmd(spmd, mesh, cases, wl, sync, args)
    if "minilm" in args.workloads and args.device == "cuda" and len(devices) > 1:
        try:
            mesh1 = make_mesh(spmd, devices[:1])
            cases1 = spmd_cases(spmd, mesh1, devices[0], seed)
        except Exception as exc:
            fail("spmd-graphs-1gpu", "minilm", exc)
            return
        _measure_spmd(spmd, mesh1, cases1, "minilm", lambda: common.synchronize(devices[:1]), args,
                      variants=(("spmd-graphs-1gpu", True),))


def set_torch_precision(name: str) -> None:
    """Apply ``--matmul-precision`` to PyTorch (``torch.set_float32_matmul_precision``)."""
    import torch

    torch.set_float32_matmul_precision(PRECISIONS[name][0])


def _measure_spmd(spmd: Any, mesh: Any, cases: dict, wl: str, sync: Callable[[], None], args: argparse.Namespace,
                  variants: Sequence[tuple[str, bool]] = (("spmd-eager", False), ("spmd-graphs", True))) -> None:
    """Compile ``wl`` on ``mesh`` once per (source, cuda_graphs) variant and measure each."""
    import torch

    try:
        fn, xs, in_sh, out_sh, ref = cases[wl]()
        placed = [_place(spmd, mesh, x, s) for x, s in zip(xs, in_sh, strict=True)]
    except Exception as exc:
        for src, _ in variants:
            fail(src, wl, exc)
        return
    for src, graphs in variants:
        try:
            f = spmd.jit(fn, mesh=mesh, in_shardings=in_sh, out_shardings=out_sh,
                         options=spmd.CompileOptions(cuda_graphs=graphs))
            out = f(*placed)
            sync()
            extra = {"rel_err": common.rel_error(out.to_torch().float(), ref.float())}
        except Exception as exc:
            fail(src, wl, exc)
            continue
        rec = measure(src, wl, lambda f=f, a=placed: f(*a), sync, args, extra)
        if graphs and args.device == "cuda" and rec.get("error") is None:
            emit_kernels(src, wl, lambda f=f, a=placed: f(*a))
    del placed
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def emit_kernels(source: str, workload: str, call: Callable[[], Any]) -> None:
    """Emit a ``kernels`` record: per device, the kernels of one ``call()`` (``benchmarks.gpu_kernels``).

    The profile is process-wide (CUPTI), so it also sees the kernels JAX launches. A failed
    profile is recorded as its error text: it is a note and must not cost the measurement.
    """
    from dataclasses import asdict

    from benchmarks.gpu_kernels import kernel_summary

    try:
        devices: list[dict] | str = [asdict(d) for d in kernel_summary(call)]
    except Exception as exc:
        devices = f"{type(exc).__name__}: {exc}"[:200]
    common.emit({"kind": "kernels", "source": source, "workload": workload, "devices": devices})


def plan_children(args: argparse.Namespace) -> dict[str, tuple[list[str], dict[str, str], list[str]]]:
    """Per child name: (command, extra env, env keys to drop), for :func:`common.child_env`.

    Every child gets the same workloads, device, tp, timing options, precision and ``--seed``
    (when given). The JAX child's environment comes from :func:`harness.jax_child_env` (``tp``
    virtual host devices on CPU); the others run without the caller's ``XLA_FLAGS``.
    """
    py = sys.executable
    base = ["--tp", str(args.tp), "--calls", str(args.calls), "--rounds", str(args.rounds),
            "--device", args.device, "--workloads", ",".join(args.workloads),
            "--matmul-precision", args.matmul_precision]
    base += [] if args.seed is None else ["--seed", str(args.seed)]
    jax_extra, jax_drop = harness.jax_child_env(args.device, args.tp)
    return {
        "torch-eager": ([py, "-m", "benchmarks.anchors.torch_eager", *base], {}, ["XLA_FLAGS"]),
        "spmd": ([py, "-m", "benchmarks.dispatch", "--worker", *base], {}, ["XLA_FLAGS"]),
        "jax": ([py, "-m", "benchmarks.anchors.jax_xla", "--bench", "dispatch", "--label", "jax", *base],
                jax_extra, jax_drop),
    }


def run_children(args: argparse.Namespace, deadline: common.Deadline) -> tuple[list[dict], list[dict]]:
    """Run torch eager, spmd and JAX children in turn, each time-boxed; returns (records, status).

    ``status`` holds one :func:`harness.child_status` dict per child not in ``--skip``, also for
    those left unstarted after SIGTERM.
    """
    cmds = plan_children(args)
    records, status = [], []
    for name in [n for n in SHARES if n not in args.skip]:
        if common.terminated():
            status.append(harness.child_status(harness.not_run(name, "SIGTERM received")))
            continue
        box = max(0.0, (deadline.left() - args.reserve_s) * SHARES[name])
        cmd, extra, drop = cmds[name]
        res = common.run_child(name, cmd, box, common.child_env(extra, drop))
        records += res.records
        status.append(harness.child_status(res))
    return records, status


def table(records: Sequence[dict], workloads: Sequence[str], sources: Sequence[str] = ()
          ) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: one row per workload, per source a cell ``enqueue / throughput / synced`` µs.

    Columns: the sources with a record, plus ``sources`` (those of children that ran, so that a
    child that failed before its first record still shows as n/a cells), in :data:`SOURCES` order.
    """
    idx = {(r.get("source"), r.get("workload")): r for r in records if r.get("kind") == "dispatch"}
    sources = [s for s in SOURCES if s in sources or any((s, w) in idx for w in workloads)]
    headers = ["workload", *[f"{SOURCES[s]} enq / thru / sync µs" for s in sources]]
    rows = []
    for w in workloads:
        row = [w]
        for s in sources:
            r = idx.get((s, w), {})
            enq, thru, syn = r.get("enqueue_us"), r.get("throughput_us"), r.get("synced_us")
            row.append("n/a" if enq is None or syn is None else
                       f"{enq:.1f} / {'?' if thru is None else f'{thru:.1f}'} / {syn:.1f}")
        rows.append(row)
    return headers, rows


def report(records: list[dict], status: list[dict], args: argparse.Namespace, info: dict[str, Any]) -> None:
    """Print the table and notes, write dispatch_results.json, append the docs row set.

    The notes (printed, under ``notes`` in the JSON, and in the row set) name every child that
    did not finish ok, with its exit code or time-out and the last line of its output.
    """
    ran = [src for s in status for src in CHILD_SOURCES.get(s["name"], ())]
    headers, rows = table(records, args.workloads, ran)
    title = f"dispatch, tp={args.tp}: µs per call, enqueue-only / throughput / synced"
    reporting.print_table(title, headers, rows)
    lines = [f"float32 GEMMs at matmul precision {args.matmul_precision!r} in every column "
             f"(torch {PRECISIONS[args.matmul_precision][0]!r}, JAX {PRECISIONS[args.matmul_precision][1]!r})"]
    lines += harness.child_failure_notes(status)
    errs = ("rel_err", "rel_err_vs_f32", "rel_err_vs_eager")
    lines += [_note(r) for r in records if r.get("kind") == "dispatch"
              and (r.get("error") or any(r.get(k) is not None for k in errs))]
    lines += [_kernel_note(r) for r in records if r.get("kind") == "kernels"]
    for line in lines:
        print("  " + line)
    reporting.write_json(Path(args.out) / "dispatch_results.json",
                         {"info": info, "args": vars(args), "children": status, "notes": lines, "records": records})
    if args.doc:
        body = (f"### {title}\n\n{reporting.markdown_table(headers, rows)}\n\n"
                + "\n".join(f"- {line}" for line in lines))
        reporting.append_row_set(Path(args.doc), f"dispatch, tp={args.tp}", info, body)


def _kernel_note(r: dict[str, Any]) -> str:
    """One line per profiled variant: kernels per call on the busiest device, by class, and
    whether its longest kernels include TF32 GEMMs (the check that each column ran the stated
    precision)."""
    devs = r.get("devices")
    if not isinstance(devs, list) or not devs:
        return f"{r['source']}/{r['workload']}: kernel profile n/a: {devs}"
    d = max(devs, key=lambda x: x["busy_us"])
    tf32 = any("tf32" in name.lower() or "tensorop_s1688" in name.lower() for name, *_ in d.get("top", ()))
    return (f"{r['source']}/{r['workload']}: GPU kernels per call on cuda:{d['device']}: {d['kernels']} kernels, "
            f"busy {d['busy_us']:.1f} µs = GEMM/attention {d['matmul_us']:.1f} + collectives "
            f"{d['collective_us']:.1f} + other {d['other_us']:.1f}" + ("; TF32 GEMMs among them" if tf32 else ""))


def _note(r: dict[str, Any]) -> str:
    if r.get("error"):
        return f"{r['source']}/{r['workload']}: n/a: {r['error'][:200]}"
    if r.get("rel_err_vs_eager") is not None:
        return f"{r['source']}/{r['workload']}: rel. distance to torch eager's result {r['rel_err_vs_eager']:.1e}"
    if r.get("rel_err") is None:
        line = f"{r['source']}/{r['workload']}: rel. distance to its own full-float32 result {r['rel_err_vs_f32']:.1e}"
        if r.get("rel_err_vs_torch") is not None:
            line += f", rel. error vs torch float32 {r['rel_err_vs_torch']:.1e}"
        return line
    return f"{r['source']}/{r['workload']}: rel. error vs torch float32 {r['rel_err']:.1e}"


def build_parser() -> argparse.ArgumentParser:
    """Options of the parent and of the ``--worker`` child."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help="run the spmd measurements in this process")
    ap.add_argument("--tp", type=int, default=None, help="devices (default: all GPUs, or 2 on CPU)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--workloads", type=harness.name_list(WORKLOAD_NAMES, allow_empty=False),
                    default=list(WORKLOAD_NAMES), help=f"comma-separated subset of {', '.join(WORKLOAD_NAMES)}")
    ap.add_argument("--calls", type=harness.positive_int, default=200)
    ap.add_argument("--rounds", type=harness.positive_int, default=5)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--budget-s", type=harness.non_negative_float, default=150.0)
    ap.add_argument("--reserve-s", type=harness.non_negative_float, default=10.0)
    ap.add_argument("--skip", type=harness.name_list(tuple(SHARES)), default=[],
                    help=f"comma-separated children to skip, of: {', '.join(SHARES)}")
    ap.add_argument("--out", default="/tmp/spmd_bench_out")
    ap.add_argument("--doc", default=None)
    ap.add_argument("--matmul-precision", choices=tuple(PRECISIONS), default="highest",
                    help="float32 GEMM math on every side: highest = full float32 (PyTorch's default), "
                         "high = TF32 (JAX's default on these GPUs)")
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and check options; unknown workloads or children, or ``--tp`` below 1, are usage
    errors (SystemExit 2, message naming the flag)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.tp is None:
        args.tp = common.default_tp(args.device)
    if args.tp < 1:
        ap.error(f"argument --tp: expected a positive number of devices, got {args.tp}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parent (default) or spmd worker (``--worker``). The parent exits 1 when no
    variant was measured (every child failed or was skipped), else 0."""
    common.apply_required_env()
    args = parse_args(argv)
    if args.worker:
        spmd_worker(args)
        return 0
    deadline = common.Deadline(args.budget_s)
    common.install_sigterm_handler()
    info = reporting.hardware_info()
    print(f"dispatch: tp={args.tp} workloads={args.workloads} budget={args.budget_s}s", flush=True)
    records, status = run_children(args, deadline)
    report(records, status, args, info)
    measured = any(r.get("kind") == "dispatch" and r.get("error") is None for r in records)
    if not measured:
        print("dispatch: no variant was measured (see the notes above)", file=sys.stderr)
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
