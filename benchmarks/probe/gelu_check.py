"""MiniLM's feed-forward up-projection epilogue: where the bias and the exact (erf) GELU should run.

Per shape ``M,K,N`` (activations [M, K], weight [N, K]) and dtype, each variant is captured 20
times in one CUDA graph and replayed; variants are timed interleaved over rounds (median µs per
repetition, GEMM included):

* ``addmm+gelu``: ``torch.addmm`` with the 1-d bias (cuBLASLt bias epilogue), then ATen's GELU
  (spmd's bf16 program);
* ``mm+fused``: ``torch.mm``, then bias add and GELU in one Inductor-generated kernel (spmd's
  float32 program; ``torch.compile``'s choice for float32);
* ``addmm+inductor-gelu``: the bias epilogue, then GELU as an Inductor-generated kernel alone;
* ``gelu-only``: ATen's GELU on the [M, N] activations alone (its share of the first variant).

It prints the error of each variant against a float64 reference too (all are the erf GELU:
cuBLASLt's GELU epilogue is the tanh approximation, so it is not a candidate).

Usage: ``python3 -m benchmarks.probe.gelu_check [--shapes "m,k,n;..."] [--dtype bf16|f32]``
(default: MiniLM's FFN-up at 8 x 128 and 128 x 128 tokens).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.graph_timing import capture, time_interleaved

SHAPES = ((1024, 384, 1536), (16384, 384, 1536))


def _parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--shapes", default="", help='"m,k,n;m,k,n" (default: MiniLM FFN-up at 1024 and 16384 tokens)')
    p.add_argument("--dtype", default="bf16", choices=("f32", "bf16"))
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    args.shapes = (tuple(tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s.strip())
                   if args.shapes else SHAPES)
    return args


def _variants(a, w, b) -> dict:
    import torch
    import torch.nn.functional as F

    fused = torch.compile(lambda y, bias: F.gelu(y + bias), dynamic=False)
    gelu = torch.compile(lambda y: F.gelu(y), dynamic=False)
    h = torch.addmm(b, a, w.t())
    return {
        "addmm+gelu": lambda: F.gelu(torch.addmm(b, a, w.t())),
        "mm+fused": lambda: fused(torch.mm(a, w.t()), b),
        "addmm+inductor-gelu": lambda: gelu(torch.addmm(b, a, w.t())),
        "gelu-only": lambda: F.gelu(h),
    }


def main(argv=None) -> int:
    """Entry point; see the module docstring."""
    import torch
    import torch.nn.functional as F

    args = _parse_args(argv)
    torch.set_float32_matmul_precision("highest")
    dev = torch.device("cuda", 0)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    for m, k, n in args.shapes:
        gen = torch.Generator().manual_seed(0)
        a, w, b = (torch.randn(m, k, generator=gen) / 4, torch.randn(n, k, generator=gen) / 4,
                   torch.randn(n, generator=gen))
        want = F.gelu(torch.addmm(b.double(), a.double(), w.double().t()))
        a, w, b = (t.to(dev, dtype) for t in (a, w, b))
        variants = _variants(a, w, b)
        errors = {name: ((fn().double().cpu() - want).abs().max() / want.abs().max()).item()
                  for name, fn in variants.items() if name != "gelu-only"}
        med = time_interleaved({name: capture(fn, 20) for name, fn in variants.items()}, args.rounds)
        cells = ", ".join(f"{name} {us:.2f} µs" for name, us in med.items())
        errs = ", ".join(f"{name} {e:.1e}" for name, e in errors.items())
        print(f"{args.dtype} {m},{k},{n}: {cells}; rel. error vs float64: {errs}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
