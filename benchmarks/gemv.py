"""Decode-shaped GEMMs (``[M, K] x [K, N]`` with M of 1-8) on one GPU: which kernel reads the
weights fastest.

A decode step of a Llama-2-7B layer is four such products (merged Q/K/V, the output projection,
merged gate/up, down) whose time is the time to stream the weight matrix from HBM. This measures,
per shape, the weight bytes read per second by

- ``tn``: ``x @ w.T`` with ``w`` stored ``[N, K]`` (``F.linear``'s layout; cuBLAS "TN"),
- ``nn``: ``x @ w`` with ``w`` stored ``[K, N]`` (the transposed copy a compiler may hoist once),
- ``tn-lt`` / ``nn-lt``: the same through cuBLASLt (``torch.backends.cuda.preferred_blas_library``),
- ``inductor``: ``torch.compile`` of the product written as a multiply and a float32 sum (an
  Inductor reduction kernel, coordinate-descent tuned as gpt-fast sets it),
- ``triton``: ``spmd.runtime.triton_skinny`` in each of ``kernels_gemv.SKINNY_CONFIGS`` (the
  fastest configuration is reported; every configuration's time is printed),

against the device's copy bandwidth (``copy``: a ``[N, K]`` clone, read + write bytes / time).
Weights rotate over copies larger than the L2 cache, so every call reads HBM as in a decode step
over many layers. Each variant is captured in a CUDA graph of ``--calls`` calls and timed in
interleaved rounds (median). Appends a row set to docs/benchmarks.md with ``--doc``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks import reporting

SHAPES = {  # name: (K, N) of the Llama-2-7B decode products
    "qkv": (4096, 12288),
    "o": (4096, 4096),
    "gate-up": (4096, 22016),
    "down": (11008, 4096),
    "lm-head": (4096, 32000),
}
VARIANTS = ("tn", "nn", "tn-lt", "nn-lt", "inductor", "triton")
L2_FLUSH_BYTES = 512 * 2**20


def _product(variant: str):
    if variant.startswith("triton-"):
        from spmd.runtime import triton_skinny
        from spmd.runtime.kernels_gemv import SKINNY_CONFIGS

        bn, bk, warps, stages = SKINNY_CONFIGS[int(variant.removeprefix("triton-"))]

        def skinny(x, w):
            out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
            triton_skinny.launch(x, w, out, accumulate=False, block_n=bn, block_k=bk, num_warps=warps,
                                 num_stages=stages)
            return out
        return skinny
    if variant == "inductor":
        import torch._inductor.config as cfg
        cfg.coordinate_descent_tuning = True

        def red(x, w):
            return (x[:, None, :].float() * w[None, :, :].float()).sum(-1).to(x.dtype)
        return torch.compile(red, fullgraph=True)
    if variant.startswith("tn"):
        return lambda x, w: x @ w.T
    return lambda x, w: x @ w


def _graph(fn, xs, ws, calls: int) -> torch.cuda.CUDAGraph:
    for i in range(3):  # warm up (compiles, cuBLAS handles) outside the graph
        fn(xs, ws[i % len(ws)])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(xs, ws[i % len(ws)])
    return g


def _time_us(g: torch.cuda.CUDAGraph, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def measure(m: int, k: int, n: int, variants, rounds: int, calls: int, dtype=torch.bfloat16) -> dict[str, float]:
    """Median µs per call of each variant (and ``copy``) for ``[m, k] x [k, n]`` in ``dtype``."""
    copies = max(2, -(-L2_FLUSH_BYTES // (k * n * dtype.itemsize)))
    g = torch.Generator(device="cuda").manual_seed(0)
    w_nk = [torch.randn(n, k, device="cuda", dtype=dtype, generator=g) for _ in range(copies)]
    w_kn = [w.T.contiguous() for w in w_nk]
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    ref = (x.double() @ w_nk[0].double().T)
    graphs = {}
    if "triton" in variants:
        from spmd.runtime.kernels_gemv import SKINNY_CONFIGS

        variants = [v for v in variants if v != "triton"] + [f"triton-{i}" for i in range(len(SKINNY_CONFIGS))]
    for v in variants:
        torch.backends.cuda.preferred_blas_library("cublaslt" if v.endswith("-lt") else "cublas")
        ws = w_kn if v.startswith("nn-") or v == "nn" else w_nk
        fn = _product(v)
        err = ((fn(x, ws[0]).double() - ref).norm() / ref.norm()).item()
        if err > 1e-2:
            raise RuntimeError(f"{v}: relative error {err:.2e} against float64")
        graphs[v] = _graph(fn, x, ws, calls)
    torch.backends.cuda.preferred_blas_library("cublas")
    graphs["copy"] = _graph(lambda x, w: w.clone(), x, w_nk, calls)
    times: dict[str, list[float]] = {v: [] for v in graphs}
    for _ in range(rounds):
        for v, gr in graphs.items():
            times[v].append(_time_us(gr, calls))
    result = {v: statistics.median(t) for v, t in times.items()}
    skinny = {v: t for v, t in result.items() if v.startswith("triton-")}
    if skinny:
        result["triton"] = min(skinny.values())
        print(f"  M={m} K={k} N={n} triton configs (µs): "
              + ", ".join(f"{SKINNY_CONFIGS[int(v[7:])]} {t:.1f}" for v, t in skinny.items()), flush=True)
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--doc", type=Path, default=None, help="append the row set to this markdown file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gemv needs a CUDA GPU")
    headers = ["M", "shape (K x N)", *[f"{v} µs" for v in args.variants], "copy µs",
               *[f"{v} TB/s" for v in args.variants], "copy TB/s"]
    rows = []
    for m in args.m:
        for name in args.shapes:
            k, n = SHAPES[name]
            t = measure(m, k, n, args.variants, args.rounds, args.calls)
            wbytes = k * n * 2
            rows.append([str(m), f"{name} {k}x{n}", *[f"{t[v]:.1f}" for v in args.variants], f"{t['copy']:.1f}",
                         *[f"{wbytes / t[v] / 1e6:.2f}" for v in args.variants], f"{2 * wbytes / t['copy'] / 1e6:.2f}"])
            print("  ".join(rows[-1]), flush=True)
    title = "Decode-shaped GEMMs (bf16): weight bytes read per second by kernel choice"
    reporting.print_table(title, headers, rows)
    if args.doc:
        info = reporting.hardware_info()
        body = reporting.markdown_table(headers, rows) + (
            f"\n\nMedian of {args.rounds} interleaved rounds of a CUDA graph of {args.calls} calls; weights rotate "
            f"over > {L2_FLUSH_BYTES >> 20} MiB of copies (no L2 reuse); copy TB/s counts read + write bytes.\n")
        reporting.append_row_set(args.doc, title, info, body)


if __name__ == "__main__":
    main()
