"""How fast and how accurate float32 GEMMs are on this GPU, PyTorch against JAX/XLA.

For the GEMM shapes of MiniLM and the dispatch block (``--shapes m,k,n;...``), on fresh random
inputs, it times (CUDA events around ``--calls`` back-to-back calls, median of interleaved
rounds) and checks against a float64 product:

* ``torch-f32``: ``torch.mm`` at matmul precision 'highest' (full float32);
* ``torch-tf32``: ``torch.mm`` at 'high' (one TF32 pass);
* ``torch-3xtf32``: the float32 emulation of Henry, Tang and Heinecke ("Leveraging the bfloat16
  artificial intelligence datatype for higher-precision computations", ARITH 2019) with TF32
  parts: a = a_hi + a_lo, b = b_hi + b_lo, a·b ≈ a_hi·b_hi + a_hi·b_lo + a_lo·b_hi as one TF32
  GEMM over the concatenated contraction dim [a_hi | a_lo | a_hi] @ [b_hi; b_hi; b_lo] (b's
  parts made once, as for weights that do not change; ``+split-b`` makes them every call);
* ``torch-3xtf32-3mm``: the same sum as three TF32 GEMMs accumulated with ``addmm``;
* ``jax-highest`` / ``jax-high``: ``jax.jit(jnp.dot)`` at precision HIGHEST / HIGH, timed the
  same way (its kernels run on the same device; CUDA events on PyTorch's stream bracket a
  ``block_until_ready``-free loop, and a final block waits for JAX's stream).

Per variant it prints the summed kernel time per call (``torch.profiler``, process-wide, so
JAX's kernels too), the host-loop time, the error, and the longest kernels; once, the optimized
HLO of JAX's HIGHEST dot (its custom call's backend config shows which algorithm XLA picked).

Usage: ``python3 -m benchmarks.probe.f32_gemm [--shapes "m,k,n;m,k,n"] [--calls 200] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks import common

DEFAULT_SHAPES = "1024,384,1152;1024,384,384;1024,384,1536;1024,1536,384;1024,384,576;1024,768,384;256,1024,4096"


def parse_gemm_shapes(text: str) -> list[tuple[int, int, int]]:
    """argparse ``type`` of ``--shapes``: ``"m,k,n;m,k,n"`` -> ``[(m, k, n), ...]``.

    Raises ``argparse.ArgumentTypeError`` (a usage error naming the flag, exit status 2) unless
    every ``;``-separated entry is three positive decimal integers separated by commas.
    """
    shapes = []
    for entry in text.split(";"):
        dims = [d.strip() for d in entry.split(",")]
        if len(dims) != 3 or not all(d.isascii() and d.isdigit() and int(d) > 0 for d in dims):
            raise argparse.ArgumentTypeError(
                f"expected 'm,k,n;m,k,n;...' with positive integers, got {text!r} (bad entry {entry!r})")
        shapes.append((int(dims[0]), int(dims[1]), int(dims[2])))
    return shapes


def tf32_split(x):
    """(hi, lo): hi = x with its low 13 mantissa bits cleared (exactly representable in TF32),
    lo = x - hi (exact in float32)."""
    import torch

    hi = (x.view(torch.int32) & -8192).view(torch.float32)
    return hi, x - hi


def with_tf32(fn):
    """``fn`` wrapped to run with TF32 GEMMs allowed (``torch.backends.cuda.matmul.allow_tf32``)."""
    import torch

    def run():
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return fn()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
    return run


def run_shape(shape: tuple[int, int, int], args: argparse.Namespace, jx, show_hlo: bool) -> None:
    """Time and check every variant on one (m, k, n) GEMM; print one line per variant."""
    import numpy as np
    import torch

    from benchmarks.gpu_kernels import kernel_summary

    dev = torch.device("cuda", 0)
    m, k, n = shape
    g = torch.Generator(device=dev).manual_seed(common.fresh_seed())
    a = torch.randn(m, k, device=dev, generator=g)
    b = torch.randn(k, n, device=dev, generator=g) / k ** 0.5
    ref = (a.double() @ b.double())
    b_hi, b_lo = tf32_split(b)
    b3 = torch.cat([b_hi, b_hi, b_lo], 0)

    def three_concat():
        a_hi, a_lo = tf32_split(a)
        return torch.cat([a_hi, a_lo, a_hi], 1) @ b3

    def three_concat_split_b():
        a_hi, a_lo = tf32_split(a)
        w_hi, w_lo = tf32_split(b)
        return torch.cat([a_hi, a_lo, a_hi], 1) @ torch.cat([w_hi, w_hi, w_lo], 0)

    def three_mm():
        a_hi, a_lo = tf32_split(a)
        out = a_lo @ b_hi
        out = torch.addmm(out, a_hi, b_lo)
        return torch.addmm(out, a_hi, b_hi)

    variants = {"torch-f32": lambda: a @ b, "torch-tf32": with_tf32(lambda: a @ b),
                "torch-3xtf32": with_tf32(three_concat),
                "torch-3xtf32+split-b": with_tf32(three_concat_split_b), "torch-3xtf32-3mm": with_tf32(three_mm)}
    if jx is not None:
        jax, jnp = jx
        aj, bj = jnp.asarray(a.cpu().numpy()), jnp.asarray(b.cpu().numpy())
        for label, prec in (("jax-highest", jax.lax.Precision.HIGHEST), ("jax-high", jax.lax.Precision.HIGH)):
            f = jax.jit(lambda x, y, p=prec: jnp.dot(x, y, precision=p))
            variants[label] = lambda f=f, x=aj, y=bj: f(x, y)
            if label == "jax-highest" and show_hlo:
                hlo = f.lower(aj, bj).compile().as_text()
                print("\n".join(line for line in hlo.splitlines() if "custom-call" in line or "fusion(" in line
                                or "dot(" in line)[:3000])
    print(f"== m,k,n = {m},{k},{n}: {2 * m * k * n / 1e9:.2f} GFLOP")
    results = {name: [] for name in variants}
    for name, fn in variants.items():
        out = fn()
        if hasattr(out, "block_until_ready"):
            out.block_until_ready()
            got = torch.from_numpy(np.asarray(out)).to(dev)
        else:
            got = out
        results[name].append(float((got.double() - ref).norm() / ref.norm()))
    for _ in range(args.rounds):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = None
            for _ in range(args.calls):
                out = fn()
            if hasattr(out, "block_until_ready"):
                out.block_until_ready()
            torch.cuda.synchronize()
            results[name].append((time.perf_counter() - t0) * 1e6 / args.calls)
    for name, fn in variants.items():
        def call(fn=fn):
            out = fn()
            if hasattr(out, "block_until_ready"):
                out.block_until_ready()
        d = max(kernel_summary(call, calls=20, top=3), key=lambda d: d.busy_us)
        us = common.median(results[name][1:])
        print(f"   {name:18s} kernels {d.busy_us:7.1f} µs/call ({2 * m * k * n / d.busy_us / 1e6:6.1f} TFLOP/s), "
              f"host loop {us:7.1f} µs/call, rel err vs f64 {results[name][0]:.1e} | "
              + "; ".join(f"{c:.0f}x {t:.1f} µs {nm[:60]}" for nm, c, t in d.top))


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    common.apply_required_env()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=parse_gemm_shapes, default=DEFAULT_SHAPES,
                    help="GEMM shapes 'm,k,n;m,k,n;...' (positive integers)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-jax", action="store_true")
    args = ap.parse_args(argv)
    common.require_cuda("benchmarks.probe.f32_gemm")
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False

    jx = None
    if not args.no_jax:
        try:
            import jax
            import jax.numpy as jnp
            jx = (jax, jnp)
        except Exception as exc:  # the torch variants still run
            print(f"JAX unavailable: {exc}")
    for i, shape in enumerate(args.shapes):
        run_shape(shape, args, jx, show_hlo=i == 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
