"""The attention backend choice (``spmd.runtime.kernels_attention``) on the one-GPU workloads' shapes.

Per shape, every SDPA backend (cuDNN, flash, memory-efficient, math) as the runtime's chooser
times it: one call per CUDA-graph replay with a cold L2, interleaved, median µs (``decide``); and
the same candidates warm (``--reps`` calls in one graph, interleaved rounds, median µs per call:
q / k / v just written by the projection GEMM sit in L2 in a real layer). Printed: each
candidate's µs, the skipped ones (no kernel for the inputs, or a result off the float32 math
definition), PyTorch's own pick, the choice, and what the choice saves per layer and per call of
the model against PyTorch's pick (warm µs x layers).

Shapes, with the layouts and masks the compiled programs pass (the importer turns a boolean mask
into an additive one of q's dtype and broadcasts it to ``[B, H, Sq, Sk]``):

- MiniLM (6 layers, 12 heads of 32, 128 tokens, key-padding mask): float32 8 x 128, bf16 8 x 128,
  bf16 128 x 128; q / k / v are head views of one merged QKV projection ``[B, S, 3 * 384]``.
- Llama-2-7B decode (32 layers, 32 heads of 128, one query against 384 cached keys, position
  mask), bf16, batch 1 and 8; q from the rotary kernel, k / v the cache ``[B, 32, 384, 128]``.

Usage (repository root, one GPU)::

    python3 -m benchmarks.probe.attention_choice [--reps 20] [--rounds 15]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks.graph_timing import capture, time_interleaved
from spmd.runtime import kernels_attention as ka


def minilm(batch: int, dtype: torch.dtype, seq: int = 128, heads: int = 12, head_dim: int = 32):
    """q, k, v ``[B, 12, S, 32]`` views of a merged projection; additive padding mask ``[B, 12, S, S]``."""
    g = torch.Generator(device="cuda").manual_seed(batch)
    qkv = torch.randn(batch, seq, 3, heads, head_dim, device="cuda", generator=g).to(dtype)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    lengths = torch.randint(seq // 4, seq + 1, (batch,), device="cuda", generator=g)
    keep = torch.arange(seq, device="cuda")[None, :] < lengths[:, None]
    bias = torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :]
    return q, k, v, bias.expand(batch, heads, seq, seq), 6


def decode(batch: int, keys: int = 384, heads: int = 32, head_dim: int = 128):
    """q ``[B, 32, 1, 128]``, cache k, v ``[B, 32, 384, 128]``, additive position mask ``[B, 32, 1, 384]``."""
    g = torch.Generator(device="cuda").manual_seed(batch)
    q = torch.randn(batch, heads, 1, head_dim, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(batch, heads, keys, head_dim, device="cuda", generator=g).bfloat16() for _ in range(2))
    pos = keys - 1 - torch.randint(0, 64, (batch,), device="cuda", generator=g)
    seen = torch.arange(keys, device="cuda")[None, :] <= pos[:, None]
    bias = torch.where(seen, 0.0, float("-inf")).bfloat16()[:, None, None, :]
    return q, k, v, bias.expand(batch, heads, 1, keys), 32


SHAPES = {
    "minilm f32 8x128": lambda: minilm(8, torch.float32),
    "minilm bf16 8x128": lambda: minilm(8, torch.bfloat16),
    "minilm bf16 128x128": lambda: minilm(128, torch.bfloat16),
    "llama2-7b decode bf16 b1 k384": lambda: decode(1),
    "llama2-7b decode bf16 b8 k384": lambda: decode(8),
}


def warm_us(names, q, k, v, mask, reps: int, rounds: int) -> dict[str, float]:
    """Median µs per call of each backend, ``reps`` calls per graph replay (L2 warm)."""
    graphs = {n: capture(lambda n=n: ka.run_backend(n, q, k, v, mask, False, None), reps) for n in names}
    return time_interleaved(graphs, rounds)


def main(argv=None) -> int:
    """Print the candidates and the choice per shape; exits 1 without a CUDA GPU."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--reps", type=int, default=20, help="calls per graph for the warm timing")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds for the warm timing")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.probe.attention_choice needs a CUDA GPU")
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}")
    for label, make in SHAPES.items():
        q, k, v, mask, layers = make()
        d = ka.decide(q, k, v, mask, False, None)
        print(f"{label}: {d.line()}")
        timed = [n for n, _ in d.times_us]
        if not timed:
            continue
        warm = warm_us(timed, q, k, v, mask, args.reps, args.rounds)
        print("  warm L2: " + ", ".join(f"{n} {t:.1f} us" for n, t in warm.items()))
        if d.default in warm and d.chosen in warm:
            saved = warm[d.default] - warm[d.chosen]
            print(f"  choice {d.chosen} vs default {d.default}: {saved:+.1f} us per layer warm, "
                  f"{saved * layers:+.1f} us per call over {layers} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
