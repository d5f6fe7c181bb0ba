"""MiniLM's head and tail at batch 128 × 128 (bf16): where the embedding gather and the mean
pooling should run.

Head (``BertEmbeddings``: word-embedding gather, + position rows, + token-type row, LayerNorm),
each variant captured 20 times in one CUDA graph and timed interleaved (median µs per call):

* ``clamp+index_select+fused``: what spmd's gather kernel runs (indices clamped as XLA clamps
  them, ``index_select``), then the adds and the LayerNorm as one Inductor-generated kernel;
* ``inductor``: the whole block compiled by Inductor (default config: with its device-side
  bounds assert on the indirect load);
* ``inductor-clamp``: the same with the indices clamped in the graph (Inductor can then prove
  the bounds and drop the assert);
* ``inductor-noassert``: the whole block, ``assert_indirect_indexing=False``;
* ``copy``: a copy of the output's bytes (a floor: the rows read once and the result written);
* ``gather:index_select`` (spmd's gather kernel, into its buffer), ``gather:embedding`` and
  ``gather:indexing`` (``table[ids]``): the row gather alone, through three ATen kernels.

Tail (mean pooling over the attention mask, then L2 normalisation, ``BertSentenceEncoder``):
``eager`` (ATen op by op), ``inductor`` (the tail compiled) and ``sum`` (a plain reduction over
the sequence of the same [B, S, H] tensor: a floor).

Usage: ``python3 -m benchmarks.probe.embed_pool [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.graph_timing import capture, time_interleaved

B, S, H, V, P = 128, 128, 384, 30522, 512


def _head_variants(ids, table, pos, typ, w, b):
    import torch
    import torch.nn.functional as F

    def rest(x):
        return F.layer_norm(x + pos[:S] + typ[0], (H,), w, b, 1e-12)

    def whole(i):
        return rest(F.embedding(i, table))

    def whole_clamped(i):
        return rest(F.embedding(i.clamp(0, V - 1), table))

    fused_rest = torch.compile(rest, dynamic=False)
    f_all, f_clamp = torch.compile(whole, dynamic=False), torch.compile(whole_clamped, dynamic=False)
    f_noassert = torch.compile(whole, dynamic=False, options={"assert_indirect_indexing": False})
    out = torch.empty(B, S, H, dtype=table.dtype, device=table.device)
    src, flat = torch.randn_like(out), ids.reshape(-1)
    return {
        "clamp+index_select+fused": lambda: fused_rest(table.index_select(0, ids.reshape(-1).clamp(0, V - 1))
                                                       .reshape(B, S, H)),
        "inductor": lambda: f_all(ids),
        "inductor-clamp": lambda: f_clamp(ids),
        "inductor-noassert": lambda: f_noassert(ids),
        "copy": lambda: out.copy_(src),
        "gather:index_select": lambda: torch.index_select(table, 0, flat, out=out.view(B * S, H)),
        "gather:embedding": lambda: F.embedding(ids, table),
        "gather:indexing": lambda: table[ids],
    }, whole


def _tail_variants(x, keep):
    import torch

    def tail(x, keep):
        summed = (x * keep[:, :, None]).sum(dim=1)
        count = keep.sum(dim=1, keepdim=True).clamp(min=1e-9)
        mean = summed / count
        norm = (mean * mean).sum(dim=1, keepdim=True).sqrt().clamp(min=1e-12)
        return mean / norm

    f_tail = torch.compile(tail, dynamic=False)
    return {
        "eager": lambda: tail(x, keep),
        "inductor": lambda: f_tail(x, keep),
        "sum": lambda: x.sum(dim=1),
    }, tail


def main(argv=None) -> int:
    """Entry point; see the module docstring."""
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    dev, dt = torch.device("cuda", 0), torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (B, S), generator=gen)
    table, pos, typ = (torch.randn(n, H, generator=gen) for n in (V, P, 2))
    w, b = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    heads, _ = _head_variants(ids.to(dev), *(t.to(dev, dt) for t in (table, pos, typ, w, b)))
    ref = heads["clamp+index_select+fused"]().float()
    errs = {k: (f().float() - ref).abs().max().item() for k, f in heads.items()
            if k != "copy" and not k.startswith("gather")}
    med = time_interleaved({k: capture(f, 20) for k, f in heads.items()}, args.rounds)
    print("head: " + ", ".join(f"{k} {v:.2f} µs" for k, v in med.items()), flush=True)
    print("head max |diff| vs clamp+index_select+fused: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    x = torch.randn(B, S, H, generator=gen).to(dev, dt)
    keep = torch.ones(B, S)
    keep[B // 2:, S * 3 // 4:] = 0
    keep = keep.to(dev, dt)
    tails, _ = _tail_variants(x, keep)
    med = time_interleaved({k: capture(f, 20) for k, f in tails.items()}, args.rounds)
    print("tail: " + ", ".join(f"{k} {v:.2f} µs" for k, v in med.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
