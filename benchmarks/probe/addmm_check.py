"""GEMM + bias variants for linear layers on [M, K] activations with [N, K] weights (float32 or bf16).

Per shape, each variant is captured 50 times in one CUDA graph and replayed; variants are
timed interleaved over rounds (median µs per GEMM): ``mm`` alone, ``mm`` then a bias add,
``addmm`` with the 1-d bias (cuBLASLt bias epilogue), ``addmm`` with the bias expanded to
[M, N] (a stride-0 broadcast: cuBLAS beta=1 on a copy).

Usage: ``python3 -m benchmarks.probe.addmm_check [--shapes "m,k,n;..."] [--dtype f32|bf16]``
(default: the tp=2 dispatch shapes in float32; ``--shapes one-gpu`` takes MiniLM's one-GPU
linear layers at 8 x 128 and 128 x 128 tokens: q/k/v merged, attention output, FFN up, FFN down).
"""

from __future__ import annotations

import sys

from benchmarks.graph_timing import capture, time_interleaved

SHAPES = ((1024, 384, 576), (1024, 384, 768), (1024, 192, 384), (1024, 768, 384), (128, 512, 768),
          (128, 512, 1024))
ONE_GPU_SHAPES = tuple((m, k, n) for m in (1024, 16384)
                       for k, n in ((384, 1152), (384, 384), (384, 1536), (1536, 384)))


def _parse_args(argv):
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--shapes", default="", help='"m,k,n;m,k,n", or "one-gpu" (default: the tp=2 shapes)')
    p.add_argument("--dtype", default="f32", choices=("f32", "bf16"))
    args = p.parse_args(argv)
    if args.shapes == "one-gpu":
        args.shapes = ONE_GPU_SHAPES
    elif args.shapes:
        args.shapes = tuple(tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s.strip())
    else:
        args.shapes = SHAPES
    return args


def _variants(a, w, b) -> dict:
    import torch

    return {
        "mm": lambda: torch.mm(a, w.t()),
        "mm+add": lambda: torch.mm(a, w.t()) + b,
        "addmm1d": lambda: torch.addmm(b, a, w.t()),
        "addmm2d": lambda: torch.addmm(b.expand(a.shape[0], b.shape[0]), a, w.t()),
    }


def main(argv=None) -> int:
    """Entry point; see the module docstring."""
    import torch

    args = _parse_args(argv)
    torch.set_float32_matmul_precision("highest")
    dev = torch.device("cuda", 0)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    print(f"{args.dtype}: {'M,K,N':>16} {'mm':>7} {'mm+add':>7} {'addmm1d':>8} {'addmm2d':>8}  µs per GEMM (median)")
    for m, k, n in args.shapes:
        a, w, b = (torch.randn(m, k, device=dev, dtype=dtype), torch.randn(n, k, device=dev, dtype=dtype),
                   torch.randn(n, device=dev, dtype=dtype))
        variants = _variants(a, w, b)
        med = time_interleaved({name: capture(fn, 50) for name, fn in variants.items()}, 7)
        print(f"{f'{m},{k},{n}':>16} {med['mm']:7.2f} {med['mm+add']:7.2f} {med['addmm1d']:8.2f} {med['addmm2d']:8.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
