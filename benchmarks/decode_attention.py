"""Decode-step attention on one GPU: one query token per sequence against a preallocated KV cache
masked by position, by kernel choice.

Llama-2-7B shapes (32 heads of 128, bf16): ``q [B, 32, 1, 128]``, ``k, v [B, 32, S, 128]`` with the
first ``L`` positions valid. Variants: ``F.scaled_dot_product_attention`` with a boolean position
mask under PyTorch's default backend choice and with each backend forced (cuDNN, memory-efficient,
math), and ``flex_attention`` compiled with a position ``score_mod`` (its decoding kernel splits the
keys over thread blocks). Each variant is captured in a CUDA graph of ``--calls`` calls and timed in
interleaved rounds (median µs per call); the KV bytes read per call over the time give TB/s.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import reporting
from benchmarks.graph_timing import capture, time_interleaved

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def _sdpa(backend):
    def run(q, k, v, mask, pos):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return run


def _flex():
    from torch.nn.attention.flex_attention import flex_attention
    compiled = torch.compile(flex_attention, fullgraph=True)

    def run(q, k, v, mask, pos):
        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.where(kv_idx <= pos[b], score, -float("inf"))
        return compiled(q, k, v, score_mod=score_mod)
    return run


def _cudnn_valid(valid):
    """cuDNN over only the first ``valid`` cache slots (a static prefix: what reading only the
    positions in use would cost; not a usable decode kernel by itself)."""
    def run(q, k, v, mask, pos):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k[:, :, :valid], v[:, :, :valid], attn_mask=mask[..., :valid])
    return run


def _packed(k):
    """``[B, H, S, D]`` -> ``[B * S, H, D]`` (a contiguous copy, made once outside the timing)."""
    b, h, s, d = k.shape
    return k.transpose(1, 2).reshape(b * s, h, d).contiguous()


def _flash_seqused(batch, seq):
    """FlashAttention-2 varlen forward reading only ``pos + 1`` keys of each sequence (``seqused_k``)."""
    cache = {}

    def run(q, k, v, mask, pos):
        if "kv" not in cache:
            dev = q.device
            cache["kv"] = _packed(k), _packed(v)
            cache["cq"] = torch.arange(batch + 1, device=dev, dtype=torch.int32)
            cache["ck"] = torch.arange(batch + 1, device=dev, dtype=torch.int32) * seq
            cache["used"] = (pos + 1).to(torch.int32)
        kp, vp = cache["kv"]
        out = torch.ops.aten._flash_attention_forward(
            q.reshape(batch, 32, 128), kp, vp, cache["cq"], cache["ck"], 1, seq, 0.0, False, False,
            seqused_k=cache["used"])[0]
        return out.view(batch, 32, 1, 128)
    return run


def _efficient_seqlen(batch, seq):
    """The memory-efficient (CUTLASS) forward with per-sequence key lengths (``seqlen_k``)."""
    cache = {}

    def run(q, k, v, mask, pos):
        if "kv" not in cache:
            dev = q.device
            cache["kv"] = _packed(k)[None], _packed(v)[None]
            cache["cq"] = torch.arange(batch + 1, device=dev, dtype=torch.int32)
            cache["ck"] = torch.arange(batch + 1, device=dev, dtype=torch.int32) * seq
            cache["used"] = (pos + 1).to(torch.int32)
        kp, vp = cache["kv"]
        out = torch.ops.aten._efficient_attention_forward(
            q.reshape(1, batch, 32, 128), kp, vp, None, cache["cq"], cache["ck"], 1, seq, 0.0, 0, False,
            seqlen_k=cache["used"])[0]
        return out.view(batch, 32, 1, 128)
    return run


def _inductor():
    """Decode attention written as reductions and compiled by Inductor (generated kernels)."""
    def attn(q, k, v, mask):
        s = (q.float() * k.float()).sum(-1, keepdim=True).transpose(-1, -2) * (q.shape[-1] ** -0.5)
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        return (p.transpose(-1, -2) * v.float()).sum(-2, keepdim=True).to(q.dtype)
    compiled = torch.compile(attn, fullgraph=True, dynamic=False)
    return lambda q, k, v, mask, pos: compiled(q, k, v, mask)


def _flex_block(batch, seq):
    """flex_attention with a block mask that skips the key blocks past each sequence's position."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    compiled = torch.compile(flex_attention, fullgraph=True)
    cache = {}

    def run(q, k, v, mask, pos):
        if "bm" not in cache:
            def mask_mod(b, h, q_idx, kv_idx):
                return kv_idx <= pos[b]
            cache["bm"] = create_block_mask(mask_mod, batch, None, 1, seq, device=q.device)
        return compiled(q, k, v, block_mask=cache["bm"])
    return run


def measure(batch: int, seq: int, valid: int, calls: int, rounds: int) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 32, 1, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(batch, 32, seq, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    pos = torch.full((batch,), valid - 1, device="cuda", dtype=torch.int32)
    mask = (torch.arange(seq, device="cuda") <= pos[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    variants = {name: _sdpa(b) for name, b in BACKENDS.items()}
    variants["flex"] = _flex()
    variants.update({"flex-blockmask": _flex_block(batch, seq), "flash-seqused": _flash_seqused(batch, seq),
                     "efficient-seqlen": _efficient_seqlen(batch, seq), "inductor": _inductor(),
                     "cudnn-valid-only": _cudnn_valid(valid)})
    graphs, out = {}, {}
    for name, fn in variants.items():
        try:
            r = fn(q, k, v, mask, pos)
            err = ((r.double() - ref).norm() / ref.norm()).item()
            if err > 2e-2:
                raise RuntimeError(f"relative error {err:.1e}")
            graphs[name] = capture(lambda fn=fn: fn(q, k, v, mask, pos), calls)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape is reported, not fatal
            out[name] = f"n/a ({type(exc).__name__}: {str(exc).splitlines()[0][:60]})"
    return {**out, **time_interleaved(graphs, rounds)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--seq", type=int, default=384, help="cache length (prompt + new tokens)")
    ap.add_argument("--valid", type=int, default=256, help="valid positions in the cache")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    names = [*BACKENDS, "flex", "flex-blockmask", "flash-seqused", "efficient-seqlen", "inductor",
             "cudnn-valid-only"]
    rows = []
    for b in args.batch:
        t = measure(b, args.seq, args.valid, args.calls, args.rounds)
        kv_bytes = 2 * b * 32 * args.valid * 128 * 2
        rows.append([str(b), *[f"{t[n]:.1f} ({kv_bytes / t[n] / 1e6:.2f} TB/s)" if isinstance(t[n], float)
                               else t[n] for n in names]])
    reporting.print_table(f"decode attention µs per call (cache {args.seq}, {args.valid} valid), bf16",
                          ["batch", *names], rows)


if __name__ == "__main__":
    main()
