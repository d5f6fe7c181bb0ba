"""The erf GELU of 16-bit activations: ATen, Inductor and spmd's Triton kernel against a copy.

Per shape ``[M, N]`` and dtype (bf16, f16), each variant is captured 20 times in one CUDA graph and
replayed; variants are timed interleaved over rounds (median µs per call):

* ``aten``: ``torch.nn.functional.gelu`` (libdevice ``erff``);
* ``inductor``: the same op compiled by ``torch.compile``;
* ``spmd-triton``: ``spmd.runtime.triton_gelu.gelu`` (a branch-free erfc);
* ``copy``: ``torch.clone`` of the input, the HBM floor (same bytes read and written);
* ``relu``: ATen's ReLU, an elementwise op with no arithmetic to hide.

It prints each variant's largest error against a float64 GELU, in units of the dtype's rounding.

Usage: ``python3 -m benchmarks.probe.gelu_erf [--shapes "16384,1536;1024,1536"] [--rounds 7]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks.graph_timing import capture, time_interleaved


def main(argv=None) -> int:
    """Entry point; see the module docstring."""
    import torch
    import torch.nn.functional as F

    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--shapes", default="16384,1536;1024,1536")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gelu_erf: no CUDA device", flush=True)
        return 0
    from spmd.runtime import triton_gelu

    dev = torch.device("cuda", 0)
    compiled = torch.compile(lambda t: F.gelu(t), dynamic=False)
    for shape in args.shapes.split(";"):
        m, n = (int(v) for v in shape.split(","))
        for dtype in (torch.bfloat16, torch.float16):
            x = (torch.randn(m, n, generator=torch.Generator().manual_seed(0)) * 3).to(dev, dtype)
            want = F.gelu(x.double())
            variants = {"aten": lambda x=x: F.gelu(x), "inductor": lambda x=x: compiled(x),
                        "spmd-triton": lambda x=x: triton_gelu.gelu(x), "copy": lambda x=x: x.clone(),
                        "relu": lambda x=x: F.relu(x)}
            fi = torch.finfo(dtype)  # one rounding: eps·|want|, at least the smallest subnormal
            unit = (want.abs() * fi.eps).clamp_min(fi.smallest_normal * fi.eps)
            errs = {k: ((variants[k]().double() - want).abs() / unit).max().item()
                    for k in ("aten", "inductor", "spmd-triton")}
            med = time_interleaved({k: capture(fn, 20) for k, fn in variants.items()}, args.rounds)
            gbs = 2 * x.numel() * x.element_size() / 1e3
            cells = ", ".join(f"{k} {us:.1f} µs ({gbs / us:.2f} TB/s)" for k, us in med.items())
            err = ", ".join(f"{k} {v:.2f}" for k, v in errs.items())
            print(f"gelu {str(dtype)[6:]} [{m},{n}]: {cells}; max error in roundings of the dtype: {err}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
