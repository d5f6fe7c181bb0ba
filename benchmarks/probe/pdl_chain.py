"""Programmatic dependent launch on a chain of decode-step kernels: where the 32-layer step lost time.

With ``SPMD_PDL=1`` the 32-layer Llama-2-7B decode step at batch 1 took 4.237 ms against 3.937
ms without (docs/benchmarks.md, 2026-12-02). This probe separates the causes on the kernels
alone: per layer, the products of one decode layer through spmd's Triton kernels with their
prologues (RMS norm + Q/K/V, o accumulating into the residual, RMS norm + gate/up, SwiGLU +
down accumulating), and the attention over a 384-key cache (split-KV Triton kernel, or PyTorch's
SDPA pick), each layer with its own weights (no L2 reuse between layers), ``--layers`` layers
captured as one CUDA graph per variant and replayed in interleaved rounds (median):

- ``plain``: stream-ordered launches, split-KV attention;
- ``plain-sdpa``: the same with PyTorch's SDPA (cuDNN on an H200) for the attention;
- ``pdl``: PDL, each program prefetching the first lines of its weight rows into L2
  (``PREFETCH_BYTES`` per launch; spmd's ``triton_pdl.PREFETCH_BUDGET_BYTES`` is 0 since this probe);
- ``pdl-noprefetch``: PDL without the prefetch.

Anchors in the same run: a device-to-device copy of one layer's bytes (the HBM limit for
streaming them; bytes read + written) and the bytes per layer over the time (GB/s). Configurations
are the ones the decode benchmark's chooser picked at batch 1 and 8 (2026-12-02).

Usage (repository root, one Hopper GPU)::

    python3 -m benchmarks.probe.pdl_chain [--batch 1 8] [--layers 8] [--rounds 15] [--doc docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from benchmarks import reporting
from benchmarks.graph_timing import capture, time_interleaved

HIDDEN, INNER, HEADS, HEAD_DIM, KEYS = 4096, 11008, 32, 128, 384
VARIANTS = ("plain", "plain-sdpa", "pdl", "pdl-noprefetch")
PREFETCH_BYTES = 8 * 2**20  # the ``pdl`` variant's prefetch per launch (spmd's default is none)
#: (block_n, block_k, num_warps, num_stages) per product, as chosen in the 2026-12-02 decode runs
ROW = {"qkv": (16, 256, 4, 3), "o": (16, 512, 8, 3), "gate-up": (16, 256, 4, 3), "down": (16, 512, 8, 3)}
TILE = {"qkv": (32, 256, 4, 4), "o": (32, 256, 4, 4), "gate-up": (64, 128, 4, 4), "down": (32, 256, 4, 4)}


def make_layer(batch: int, seed: int) -> dict:
    """One layer's weights (bf16, scaled so activations stay O(1)) and KV cache with a position mask."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()

    pos = KEYS - 1 - torch.randint(0, 64, (batch,), device="cuda", generator=g)
    seen = torch.arange(KEYS, device="cuda")[None, :] <= pos[:, None]
    return {"wqkv": rand(3 * HIDDEN, HIDDEN, scale=HIDDEN ** -0.5), "wo": rand(HIDDEN, HIDDEN, scale=HIDDEN ** -0.5),
            "wgu": rand(2 * INNER, HIDDEN, scale=HIDDEN ** -0.5), "wd": rand(HIDDEN, INNER, scale=INNER ** -0.5),
            "n1": rand(HIDDEN), "n2": rand(HIDDEN), "k": rand(batch, HEADS, KEYS, HEAD_DIM),
            "v": rand(batch, HEADS, KEYS, HEAD_DIM),
            "mask": torch.where(seen, 0.0, float("-inf")).bfloat16()[:, None, None, :].expand(batch, HEADS, 1, KEYS)}


def layer_bytes(layer: dict) -> int:
    return sum(layer[n].nbytes for n in ("wqkv", "wo", "wgu", "wd", "k", "v"))


def run_layer(x: torch.Tensor, layer: dict, attention: str) -> None:
    """One decode layer on the residual ``x [B, 4096]`` (updated in place)."""
    from spmd.runtime import triton_decode_attention
    from spmd.runtime import triton_skinny as ts

    rows = x.shape[0]
    launch, cfg = (ts.launch_row, ROW) if rows == 1 else (ts.launch, TILE)

    def product(name, a, w, out, accumulate, **prologue):
        bn, bk, warps, stages = cfg[name]
        launch(a, w, out, accumulate=accumulate, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
               **prologue)

    qkv = torch.empty(rows, 3 * HIDDEN, dtype=x.dtype, device=x.device)
    product("qkv", x, layer["wqkv"], qkv, False, prologue=ts.PROLOGUE_RMS_NORM, g=layer["n1"], eps=1e-5,
            divisor=float(HIDDEN))
    q = qkv[:, :HIDDEN].view(rows, HEADS, 1, HEAD_DIM)
    if attention == "split-kv":
        attn = triton_decode_attention.attention(q, layer["k"], layer["v"], layer["mask"], None)
    else:
        attn = F.scaled_dot_product_attention(q, layer["k"], layer["v"], attn_mask=layer["mask"])
    product("o", attn.reshape(rows, HIDDEN), layer["wo"], x, True)
    gu = torch.empty(rows, 2 * INNER, dtype=x.dtype, device=x.device)
    product("gate-up", x, layer["wgu"], gu, False, prologue=ts.PROLOGUE_RMS_NORM, g=layer["n2"], eps=1e-5,
            divisor=float(HIDDEN))
    product("down", gu[:, :INNER], layer["wd"], x, True, prologue=ts.PROLOGUE_SWIGLU, g=gu[:, INNER:])


def variant_graph(name: str, x: torch.Tensor, layers: list[dict]):
    """``(graph, reps)`` of all layers under variant ``name`` (PDL and prefetch as it says)."""
    from spmd.runtime import triton_pdl

    attention = "sdpa" if name == "plain-sdpa" else "split-kv"
    saved = triton_pdl.PREFETCH_BUDGET_BYTES
    triton_pdl.PREFETCH_BUDGET_BYTES = 0 if name == "pdl-noprefetch" else PREFETCH_BYTES
    try:
        with _pdl(name.startswith("pdl")):
            return capture(lambda: [run_layer(x, layer, attention) for layer in layers], reps=1)
    finally:
        triton_pdl.PREFETCH_BUDGET_BYTES = saved


@contextlib.contextmanager
def _pdl(on: bool):
    """``SPMD_PDL`` set to ``on`` inside the block (launches read it at capture)."""
    old = os.environ.get("SPMD_PDL")
    os.environ["SPMD_PDL"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SPMD_PDL", None)
        else:
            os.environ["SPMD_PDL"] = old


def measure(batch: int, n_layers: int, rounds: int) -> dict[str, float]:
    """Median µs per layer of each variant, and of the copy anchor; checks the variants agree."""
    layers = [make_layer(batch, seed) for seed in range(n_layers)]
    per_layer = layer_bytes(layers[0])
    src = torch.empty(per_layer // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    start = torch.randn(batch, HIDDEN, device="cuda").bfloat16()
    xs = {name: start.clone() for name in VARIANTS}
    graphs = {name: variant_graph(name, xs[name], layers) for name in VARIANTS}
    copies = [src.clone() for _ in range(n_layers)]
    graphs["copy"] = capture(lambda: [dst.copy_(c) for c in copies], reps=1)
    for name in VARIANTS:  # one replay from the same start: the results agree (PDL changes no bit)
        xs[name].copy_(start)
        graphs[name][0].replay()
    torch.cuda.synchronize()
    for name in VARIANTS[1:]:
        if name.startswith("pdl") and not torch.equal(xs[name], xs["plain"]):
            raise SystemExit(f"{name}: result differs from plain launches")
    times = time_interleaved(graphs, rounds)
    return {name: t / n_layers for name, t in times.items()} | {"bytes": per_layer}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--doc", type=Path, default=None, help="append the row set to this markdown file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("benchmarks.probe.pdl_chain needs a GPU of compute capability 9.0 or later")
    headers = ["batch", *[f"{v} µs/layer" for v in VARIANTS], "copy µs/layer",
               *[f"{v} GB/s" for v in VARIANTS], "copy GB/s (read+write)"]
    rows = []
    for batch in args.batch:
        t = measure(batch, args.layers, args.rounds)
        b = t["bytes"]
        rows.append([str(batch), *[f"{t[v]:.1f}" for v in VARIANTS], f"{t['copy']:.1f}",
                     *[f"{b / t[v] / 1e3:,.0f}" for v in VARIANTS], f"{2 * b / t['copy'] / 1e3:,.0f}"])
    title = "PDL on a chain of decode-layer kernels (Llama-2-7B shapes, bf16)"
    reporting.print_table(title, headers, rows)
    if args.doc:
        body = reporting.markdown_table(headers, rows) + (
            f"\n\n{args.layers} layers (own weights and cache each) in one CUDA graph per variant, median of "
            f"{args.rounds} interleaved rounds; GB/s = weight and KV bytes of a layer / time.\n")
        reporting.append_row_set(args.doc, title, reporting.hardware_info(), body)


if __name__ == "__main__":
    main()
