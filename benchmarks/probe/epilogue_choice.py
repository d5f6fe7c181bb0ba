"""The epilogue choice of ``spmd.runtime.kernels_epilogue`` for single linear+GELU shapes, without a model.

For each ``MxKxN:dtype`` (default: MiniLM's intermediate dense layer at batch 128 × 128 in bf16 and
8 × 128 in float32) it builds the pair the runtime fuses (``addmm`` of the bias row, then the exact
GELU), makes the timed choice once as a CUDA-graph warm-up would (cuBLAS + GELU against Inductor's
Triton GEMM with the GELU in its epilogue, each a CUDA-graph replay with a cold L2) and prints the
decision (each candidate's µs), the seconds the first call took (compile + autotune + timing) and
the chosen kernel's largest error against float64.

``--inductor`` adds Inductor config entries to the generated candidate's (``KEY=VALUE`` pairs,
comma-separated; values ``true``/``false``, integers or strings), e.g.
``--inductor triton.enable_persistent_tma_matmul=true`` for the persistent TMA GEMM template.

Usage: ``python3 -m benchmarks.probe.epilogue_choice [--shapes 16384x384x1536:bf16,1024x384x1536:f32]
[--inductor KEY=VALUE,...]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


def probe(m: int, k: int, n: int, dtype_name: str) -> str:
    """One decision's report line for ``gelu(x[m, k] @ w[n, k].T + b[n])`` in ``dtype_name``."""
    import torch
    import torch.nn.functional as F

    from spmd.runtime import fusions
    from spmd.runtime import kernels_epilogue as ke
    from spmd.runtime import kernels_fusion as kf

    dtype = getattr(torch, DTYPES[dtype_name])
    addmm = fusions.make_addmm(False, True)

    def pair(ops, out):
        r = F.gelu(addmm(ops, None))
        return r if out is None else out.copy_(r)

    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype)
    ops = [b.expand(m, n), x, w]
    kernel = ke.make_kernel(pair, pair, ("probe",), 2 * m * k * n, dtype, f"gelu(linear) {dtype_name}")
    before = len(ke.DECISIONS)
    start = time.perf_counter()
    with kf.graph_warmup(), torch.no_grad():
        got = kernel(ops, None)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    exact = F.gelu(x.double() @ w.double().T + b.double())
    rel = ((got.double() - exact).abs().max() / exact.abs().max()).item()
    line = ke.DECISIONS[-1].summary() if len(ke.DECISIONS) > before else "no decision (not eligible)"
    return f"{m}x{k}x{n} {dtype_name}: {line}; first call {first_s:.1f} s; max rel. error {rel:.1e}"


def _config_pairs(text: str) -> dict[str, object]:
    """``KEY=VALUE,...`` as a dict; ``true``/``false`` and integers converted."""
    out: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--inductor: expected KEY=VALUE, got {item!r}")
        low = value.lower()
        out[key] = low == "true" if low in ("true", "false") else int(value) if value.isdigit() else value
    return out


def main(argv: list[str] | None = None) -> None:
    """Parse ``--shapes`` and print one line per shape; exits when no CUDA GPU is present."""
    import torch

    from spmd.runtime import kernels_epilogue as ke

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="16384x384x1536:bf16,1024x384x1536:f32",
                   help="comma-separated MxKxN:dtype (dtype one of bf16, f16, f32)")
    p.add_argument("--inductor", default="", help="comma-separated KEY=VALUE Inductor config entries")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.probe.epilogue_choice needs a CUDA GPU")
    os.environ[ke.CHOICE_ENV] = "auto"
    ke._AUTOTUNE_OPTIONS.update(_config_pairs(args.inductor))
    print(f"Inductor options of the candidate: {ke.autotune_options()}", flush=True)
    for item in args.shapes.split(","):
        dims, _, dt = item.partition(":")
        if dt not in DTYPES or dims.count("x") != 2:
            raise SystemExit(f"--shapes: expected MxKxN:dtype with dtype in {sorted(DTYPES)}, got {item!r}")
        m, k, n = (int(v) for v in dims.split("x"))
        print(probe(m, k, n, dt), flush=True)


if __name__ == "__main__":
    main()
