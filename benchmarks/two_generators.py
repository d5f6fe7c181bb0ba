"""Two ``spmd.Generator``s of one model on one device, interleaved: per-token time, staging, memory.

Usage (repository root)::

    python3 -m benchmarks.two_generators                        # GPU: Llama-2-7B, 32 layers, bf16
    python3 -m benchmarks.two_generators --device cpu --small   # seconds on CPU

Builds ``A`` (``max_batch=--batch-a``) and ``B`` (``--batch-b``) on the same ``LlamaForCausalLM``
and one-device mesh, then runs rounds ``A B A B ...`` of ``--new-tokens`` greedy tokens. Per call
it prints the decode milliseconds per token, the bytes staged into CUDA-graph inputs
(``cuda_graphs.staged.bytes``: a weight copied per step shows as GBs), the decode steps run
eagerly for a donated buffer the other Generator holds, the weight-prologue runs, and (GPU) the
peak memory. Both Generators share one device copy of the weights (``spmd.generation.placement``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and print one line per ``generate`` call."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="the small model shape (CPU dry run)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch-a", type=int, default=1)
    ap.add_argument("--batch-b", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    import spmd
    from spmd.generation import Generator
    from spmd.models.llama_lm import llama_lm

    cuda = args.device.startswith("cuda")
    dtype = torch.float32 if args.small else torch.bfloat16
    layers = min(args.layers, 2) if args.small else args.layers
    model = llama_lm("llama2-7b", layers, device=args.device, small=args.small, dtype=dtype, seed=0)
    mesh = spmd.Mesh.create(("tp",), devices=f"{args.device.split(':')[0]}:1")
    max_seq = args.prompt_len + args.new_tokens - 1
    gens = {name: Generator(model, mesh, max_batch=b, max_seq=max_seq, prefill_len=args.prompt_len)
            for name, b in (("A", args.batch_a), ("B", args.batch_b))}
    counters = {k: spmd.metrics.counter(k) for k in ("cuda_graphs.staged.bytes", "hoist.prologue_runs",
                                                    "cuda_graphs.eager_call.donated_buffer_held")}
    gen_ = torch.Generator().manual_seed(1)
    for r in range(args.rounds):
        for name, gen in gens.items():
            prompts = torch.randint(0, model.config.vocab_size, (gen.max_batch, args.prompt_len), generator=gen_)
            before = {k: c.value for k, c in counters.items()}
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            res = gen.generate(prompts.tolist(), args.new_tokens)
            d = {k: c.value - before[k] for k, c in counters.items()}
            peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""
            ms = res.decode_s / max(args.new_tokens - 1, 1) * 1e3
            print(f"round {r} {name} (batch {gen.max_batch}): {ms:.2f} ms/token, "
                  f"staged {d['cuda_graphs.staged.bytes'] / 2**20:.1f} MiB, "
                  f"eager for held buffers {d['cuda_graphs.eager_call.donated_buffer_held']}, "
                  f"prologue runs {d['hoist.prologue_runs']}{peak}", flush=True)


if __name__ == "__main__":
    main()
