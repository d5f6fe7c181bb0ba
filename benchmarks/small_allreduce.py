"""Small all-reduce benchmark: NCCL ring against the one-shot fast path, 1 KB - 1 MB, interleaved.

Usage (repository root; needs 2+ GPUs, or ``--device cpu`` for a dry run on virtual devices)::

    python3 -m benchmarks.small_allreduce --tp 2 --out $OUT --doc docs/benchmarks.md

Per message size (bytes per device, bf16 by default) three pairs of variants, each pair timed in
interleaved rounds (``benchmarks.common.interleaved``: A B, A B, ...; median of round medians):

* **comm eager**: one all-reduce through the communicator (``CudaCommunicator.run``: NCCL via
  ``torch.cuda.nccl`` against ``spmd.runtime.comm.one_shot``'s peer copies into fixed staging
  buffers plus one local reduction), device time between events on every device's stream;
* **graph, per layer**: an ``--layers``-layer chain (``h = tanh(sum_0(x * h))``, ``x`` sharded on
  dim 0 over ``tp``: one all-reduce of ``rows x width`` per layer and almost no compute) under
  ``spmd.jit`` with CUDA graphs, ``CompileOptions(small_all_reduce="off" / "on")``; the step time
  divided by the layers, so the difference is the per-all-reduce difference;
* the cost model's prediction for both (``spmd.passes.all_reduce_cost.H200_PEER_COPY``), to
  refit its constants against;
* with ``--symm`` (CUDA): one process per GPU, NCCL ``dist.all_reduce`` against PyTorch's
  symmetric-memory one-shot kernel, eager and from a CUDA graph
  (``benchmarks.small_allreduce_symm``), against ``H200_SYMMETRIC_MEMORY``.

Output: a printed table, ``small_allreduce_results.json`` in ``--out`` and, with ``--doc``, a row
set appended to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, harness, reporting

SIZES_BYTES = (1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
DTYPES = {"bf16": "bfloat16", "f32": "float32"}
SYMM_HEADERS = ["bytes/device", "NCCL eager µs", "symm eager µs", "×", "NCCL graph µs", "symm graph µs", "×",
                "model ring µs", "model one-shot µs"]
HEADERS = ["bytes/device", "comm NCCL µs", "comm one-shot µs", "×", "graph NCCL µs/layer",
           "graph one-shot µs/layer", "×", "model ring µs", "model one-shot µs"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring). Exits with status 2 on bad values."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tp", type=harness.positive_int, default=None, help="devices (default: all visible)")
    p.add_argument("--sizes", type=harness.positive_int, nargs="+", default=list(SIZES_BYTES),
                   help="message sizes, bytes per device")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--layers", type=harness.positive_int, default=16, help="layers of the graph chain")
    p.add_argument("--rounds", type=harness.positive_int, default=5)
    p.add_argument("--reps", type=harness.positive_int, default=50)
    p.add_argument("--warmup", type=harness.positive_int, default=5)
    p.add_argument("--symm", action=argparse.BooleanOptionalAction, default=False,
                   help="also time the one-process-per-GPU symmetric-memory path")
    p.add_argument("--out", type=Path, default=None, help="directory for small_allreduce_results.json")
    p.add_argument("--doc", type=Path, default=None, help="append a row set to this markdown file")
    args = p.parse_args(argv)
    if args.tp is not None and args.tp < 2:
        p.error(f"--tp: expected at least 2 devices, got {args.tp}")
    return args


def _shape(size_bytes: int, itemsize: int) -> tuple[int, int]:
    """(rows, width) of a message of about ``size_bytes``: 1-16 rows (decode batches), width >= 8."""
    elems = max(size_bytes // itemsize, 8)
    rows = 1
    while rows < 16 and elems // (rows * 2) >= 256:
        rows *= 2
    return rows, max(elems // rows, 8)


def comm_variants(torch: Any, devices: list, size_bytes: int, dtype: Any) -> dict[str, Any]:
    """The two communicator calls (NCCL / one-shot) of one all-reduce of ``size_bytes`` per device."""
    from spmd.runtime.thunks import CollectiveSpec

    rows, width = _shape(size_bytes, torch.empty((), dtype=dtype).element_size())
    n = len(devices)
    if devices[0].type == "cuda":
        from spmd.runtime.comm.cuda import CudaCommunicator

        comm: Any = CudaCommunicator(devices)
    else:
        from spmd.runtime.comm.cpu import CpuCommunicator

        comm = CpuCommunicator(n)
    xs = [common.fresh_randn((rows, width), dtype, d, seed=k + 1) for k, d in enumerate(devices)]

    class _Env:
        def __init__(self, dev: Any) -> None:
            self.streams = {0: torch.cuda.current_stream(dev) if dev.type == "cuda" else None}

    envs = [_Env(d) for d in devices]
    specs = {alg: CollectiveSpec("all-reduce", groups=(tuple(range(n)),), out_dims=(rows, width), dtype=dtype,
                                 algorithm=alg) for alg in ("ring", "one-shot")}
    return {f"comm-{alg}": (lambda s=spec: comm.run(s, xs, 0, envs)) for alg, spec in specs.items()}


def chain(h: Any, x: Any, layers: int) -> Any:
    """``layers`` times ``h = tanh(sum_0(x * h))``: with ``x`` sharded on dim 0, one local multiply-sum
    and one all-reduce of ``h``'s size per layer (almost no compute: the all-reduces dominate)."""
    import torch

    for _ in range(layers):
        h = torch.tanh((x * h).sum(0))
    return h


def graph_variants(torch: Any, mesh: Any, size_bytes: int, dtype: Any, layers: int) -> dict[str, Any]:
    """``chain`` under spmd.jit with CUDA graphs (on GPU meshes), one-shot off / on."""
    import functools

    import spmd

    P = spmd.PartitionSpec
    tp = mesh.num_devices
    rows, width = _shape(size_bytes, torch.empty((), dtype=dtype).element_size())
    dev = mesh.devices[0]
    h0 = common.fresh_randn((rows, width), dtype, dev, seed=7).cpu()
    x = common.fresh_randn((tp, rows, width), dtype, dev, seed=8, scale=1.0).cpu()
    fn = functools.partial(chain, layers=layers)
    fn.__name__ = "chain"  # type: ignore[attr-defined]
    out = {}
    for mode in ("off", "on"):
        opts = spmd.CompileOptions(small_all_reduce=mode, small_all_reduce_max_bytes=1 << 30,
                                   cuda_graphs=mesh.platform == "cuda")
        f = spmd.jit(fn, mesh=mesh, in_shardings=(P(), P("tp")), out_shardings=P(), options=opts)
        shardings = f.lower(h0, x).compile().input_shardings
        args = (spmd.device_put(h0, shardings[0]), spmd.device_put(x, shardings[1]))
        out[f"graph-{'one-shot' if mode == 'on' else 'ring'}"] = lambda f=f, args=args: f(*args)
    return out


def measure_size(torch: Any, mesh: Any, size_bytes: int, dtype: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One table row: measured µs of the four variants and the model's two predictions."""
    from spmd.passes.all_reduce_cost import H200_PEER_COPY, one_shot_us, ring_us

    devices = list(mesh.devices)
    timing_devices = devices if mesh.platform == "cuda" else []
    rec: dict[str, Any] = {"size_bytes": size_bytes, "tp": mesh.num_devices, "layers": args.layers, "errors": {}}
    for group in ("comm", "graph"):
        try:
            variants = (comm_variants(torch, devices, size_bytes, dtype) if group == "comm"
                        else graph_variants(torch, mesh, size_bytes, dtype, args.layers))
            res = common.interleaved(variants, timing_devices, rounds=args.rounds, warmup=args.warmup, reps=args.reps)
        except Exception as exc:  # one failing group costs its cells only
            rec["errors"][group] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        for name, m in res.items():
            per = args.layers if group == "graph" else 1
            rec[name.replace("-", "_") + "_us"] = None if m.median_ms is None else m.median_ms * 1e3 / per
            if m.error:
                rec["errors"][name] = m.error
    rec["model_ring_us"] = ring_us(size_bytes, mesh.num_devices, H200_PEER_COPY)
    rec["model_one_shot_us"] = one_shot_us(size_bytes, mesh.num_devices, H200_PEER_COPY)
    common.emit({"kind": "small_allreduce", **rec})
    return rec


def _us(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def table_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    """Table cells per record (see ``HEADERS``); × is one-shot time over NCCL time (< 1: one-shot faster)."""
    rows = []
    for r in records:
        cr, co = r.get("comm_ring_us"), r.get("comm_one_shot_us")
        gr, go = r.get("graph_ring_us"), r.get("graph_one_shot_us")
        rows.append([str(r["size_bytes"]), _us(cr), _us(co), reporting.fmt_ratio(common.ratio(co, cr)), _us(gr),
                     _us(go), reporting.fmt_ratio(common.ratio(go, gr)), _us(r.get("model_ring_us")),
                     _us(r.get("model_one_shot_us"))])
    return rows


def symm_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    """Table cells of the one-process-per-GPU records (see ``SYMM_HEADERS``)."""
    from spmd.passes.all_reduce_cost import H200_SYMMETRIC_MEMORY, one_shot_us, ring_us

    rows = []
    for r in records:
        ne, se, ng, sg = (r.get(k) for k in ("nccl_eager_us", "symm_eager_us", "nccl_graph_us", "symm_graph_us"))
        b, k = r["size_bytes"], r["tp"]
        rows.append([str(b), _us(ne), _us(se), reporting.fmt_ratio(common.ratio(se, ne)), _us(ng), _us(sg),
                     reporting.fmt_ratio(common.ratio(sg, ng)), _us(ring_us(b, k, H200_SYMMETRIC_MEMORY)),
                     _us(one_shot_us(b, k, H200_SYMMETRIC_MEMORY))])
    return rows


def _symm_section(args: argparse.Namespace, tp: int) -> str:
    """Run the symmetric-memory variant; its markdown table (or the reason it could not run)."""
    from benchmarks import small_allreduce_symm

    try:
        recs = small_allreduce_symm.run(tp, list(args.sizes), DTYPES[args.dtype], args.layers, args.rounds,
                                        max(args.reps // 5, 4))
    except Exception as exc:  # the single-process table stands on its own
        return f"\n\nOne process per GPU (symmetric memory): not run: {type(exc).__name__}: {exc}"[:400]
    rows = symm_rows(recs)
    reporting.print_table("one process per GPU: NCCL vs symmetric-memory one-shot", SYMM_HEADERS, rows)
    notes = [f"- {r['size_bytes']} B: {r['error']}" for r in recs if r.get("error")]
    return ("\n\nOne process per GPU, µs per all-reduce (model: H200_SYMMETRIC_MEMORY):\n\n"
            + reporting.markdown_table(SYMM_HEADERS, rows) + ("\n\n" + "\n".join(notes) if notes else ""))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (0, or 1 when no cell was measured)."""
    args = parse_args(argv)
    common.apply_required_env()
    import torch

    import spmd

    if args.device == "cuda":
        common.require_cuda("small_allreduce")
        if torch.cuda.device_count() < 2:
            print("small_allreduce: needs at least 2 GPUs, found", torch.cuda.device_count())
            return 1
    tp = args.tp or (torch.cuda.device_count() if args.device == "cuda" else 2)
    mesh = spmd.Mesh.create(("tp",), devices=f"{args.device}:{tp}")
    dtype = getattr(torch, DTYPES[args.dtype])
    records = []
    for size in args.sizes:  # the JSON is rewritten after every size: a run cut short keeps what it measured
        records.append(measure_size(torch, mesh, size, dtype, args))
        print(f"size {size} B: {records[-1]}", flush=True)
        if args.out is not None:
            reporting.write_json(Path(args.out) / "small_allreduce_results.json", records)
    title = f"Small all-reduce: NCCL vs one-shot, tp={tp}, {args.dtype}, {args.layers}-layer graph chain"
    body = reporting.markdown_table(HEADERS, table_rows(records))
    notes = [f"- {r['size_bytes']} B {k}: {v}" for r in records for k, v in r["errors"].items()]
    body += ("\n\n" + "\n".join(notes) if notes else "") + (
        "\n\ncomm: one all-reduce through the communicator, eager, device time; graph: spmd.jit CUDA-graph replay "
        "of the row-parallel chain, per layer (one all-reduce each); model: spmd.passes.all_reduce_cost.H200_PEER_COPY."
        " × = one-shot / NCCL.\n")
    reporting.print_table(title, HEADERS, table_rows(records))
    if args.symm and args.device == "cuda":
        body += _symm_section(args, tp)
    if args.doc is not None:
        reporting.append_row_set(args.doc, title, reporting.hardware_info(), body)
    measured = any(r.get(k) is not None for r in records for k in ("comm_ring_us", "graph_ring_us"))
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
