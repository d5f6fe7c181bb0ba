"""Split-KV attention for one query per sequence (a decode step): the "flash-decoding" scheme.

Imported only where Triton is installed (it imports ``triton`` at the top);
``spmd.runtime.kernels_attention`` offers it as the ``split-kv`` candidate of its timed choice.

A decode step's attention has one query row per (sequence, head): SDPA's kernels parallelise over
(batch, head, query block), so Llama-2-7B at batch 1 (32 heads) runs 32 programs that each read a
whole head's key / value cache, a fraction of the GPU's SMs. Here the keys of each (batch, head)
are split into ``num_splits`` ranges (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
inference", 2023; the split-K scheme of FlashInfer's and vLLM's paged-attention v2 decode kernels):

1. ``_partial``, grid (B·Hq, splits): one program per (batch, head, range) streams its keys and
   values ``BLOCK_S`` at a time with the online softmax of FlashAttention (running maximum ``m``,
   sum ``l`` of ``exp(s - m)`` and ``acc = Σ exp(s - m)·v``, float32) and writes ``(m, l, acc)``;
2. ``_combine``, grid (B·Hq): rescales the ranges to their common maximum and writes
   ``Σ acc_j e^{m_j - M} / Σ l_j e^{m_j - M}`` in the query's dtype.

Grouped-query attention reads key / value head ``h // (Hq / Hkv)``. The mask (bool: True =
attend; float: added to the scores) is read through its strides, so a broadcast view costs
nothing. A range whose keys are all masked contributes nothing (its maximum stays -inf and its
sum 0); a row with every key masked is 0, as PyTorch's math SDPA (its "safe" softmax) gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd.runtime import triton_pdl

BLOCK_S = 64


@triton.jit
def _partial(q_ptr, k_ptr, v_ptr, mask_ptr, part_ptr, S, HQ, GROUP, scale, keys_per_split,
             sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_h, sm_s,
             HAS_MASK: tl.constexpr, BOOL_MASK: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
             PDL: tl.constexpr, KV_LINES: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    rd = tl.arange(0, D)
    rs = tl.arange(0, BLOCK_S)
    start = split * keys_per_split
    if PDL:  # the cache's first keys and values into L2 while the previous kernel finishes
        triton_pdl.gdc_launch_dependents()
        first = tl.minimum(start + rs, S - 1)
        eb: tl.constexpr = k_ptr.dtype.element_ty.primitive_bitwidth // 8
        triton_pdl.prefetch_rows(k_ptr + b * sk_b + hk * sk_h + first * sk_s, eb, KV_LINES)
        triton_pdl.prefetch_rows(v_ptr + b * sv_b + hk * sv_h + first * sv_s, eb, KV_LINES)
        triton_pdl.gdc_wait()
    q = tl.load(q_ptr + b * sq_b + h * sq_h + rd).to(tl.float32) * scale
    end = tl.minimum(start + keys_per_split, S)
    m = tl.full((), float("-inf"), tl.float32)
    l_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for s0 in range(start, end, BLOCK_S):
        s = s0 + rs
        ok = s < end
        kb = tl.load(k_ptr + b * sk_b + hk * sk_h + s[:, None] * sk_s + rd[None, :], mask=ok[:, None], other=0.0)
        vb = tl.load(v_ptr + b * sv_b + hk * sv_h + s[:, None] * sv_s + rd[None, :], mask=ok[:, None], other=0.0)
        if HAS_MASK:
            mk = tl.load(mask_ptr + b * sm_b + h * sm_h + s * sm_s, mask=ok, other=0)
        scores = tl.sum(kb.to(tl.float32) * q[None, :], axis=1)
        if HAS_MASK:
            if BOOL_MASK:
                scores = tl.where(mk != 0, scores, float("-inf"))
            else:
                scores = scores + mk.to(tl.float32)
        scores = tl.where(ok, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # every key so far masked: no NaN
        p = tl.exp(scores - shift)
        alpha = tl.exp(m - shift)
        acc = acc * alpha + tl.sum(p[:, None] * vb.to(tl.float32), axis=0)
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        m = m_new
    base = part_ptr + (bh * num_splits + split) * (D + 2)
    tl.store(base + rd, acc)
    tl.store(base + D, m)
    tl.store(base + D + 1, l_sum)


@triton.jit
def _combine(part_ptr, out_ptr, HQ, so_b, so_h, NUM_SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr,
             D: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        triton_pdl.gdc_launch_dependents()
        triton_pdl.gdc_wait()
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    rj = tl.arange(0, SPLITS_POW2)
    rd = tl.arange(0, D)
    ok = rj < NUM_SPLITS
    base = part_ptr + bh * NUM_SPLITS * (D + 2)
    m = tl.load(base + rj * (D + 2) + D, mask=ok, other=float("-inf"))
    l_sum = tl.load(base + rj * (D + 2) + D + 1, mask=ok, other=0.0)
    acc = tl.load(base + rj[:, None] * (D + 2) + rd[None, :], mask=ok[:, None], other=0.0)
    big = tl.max(m, axis=0)
    shift = tl.where(big == float("-inf"), 0.0, big)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - shift))
    total = tl.sum(l_sum * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # every key masked: 0
    tl.store(out_ptr + b * so_b + h * so_h + rd, out.to(out_ptr.dtype.element_ty))


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool) -> bool:
    """Whether ``attention(q, k, v, mask)`` is a decode step this kernel computes: CUDA, 16-bit,
    q ``[B, Hq, 1, D]``, k / v ``[B, Hkv, S, D]`` with Hkv dividing Hq, D a power of two in
    16..256, last dims contiguous, not causal, and a bool / floating mask broadcastable to
    ``[B, Hq, 1, S]`` (or none)."""
    if is_causal or not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[2] != 1:
        return False
    b, hq, _, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or k.shape[1] < 1 or hq % k.shape[1]:
        return False
    if d < 16 or d > 256 or d & (d - 1) or k.shape[2] < 1:
        return False
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        return False
    if mask is None:
        return True
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return False
    try:
        return torch.broadcast_shapes(mask.shape, (b, hq, 1, k.shape[2])) == (b, hq, 1, k.shape[2])
    except RuntimeError:
        return False


def num_splits(bh: int, keys: int, num_sms: int) -> int:
    """Key ranges per (batch, head): about four programs per SM in all (each loads its keys and
    values together, so more programs in flight hide more of HBM's latency), each with at least
    one ``BLOCK_S`` block of keys."""
    return max(1, min(triton.cdiv(4 * num_sms, bh), triton.cdiv(keys, BLOCK_S)))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float | None, num_sms: int | None = None) -> torch.Tensor:
    """``softmax(q @ k.T * scale + mask) @ v`` for ``eligible`` inputs: ``[B, Hq, 1, D]`` in q's dtype.

    ``scale``: None = ``1 / sqrt(D)``; ``num_sms``: the device's SM count (None: asked of CUDA).
    The caller checks ``eligible``.
    """
    b, hq, _, d = q.shape
    hkv, keys = k.shape[1], k.shape[2]
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits = num_splits(b * hq, keys, num_sms)
    per_split = triton.cdiv(triton.cdiv(keys, splits), BLOCK_S) * BLOCK_S
    splits = triton.cdiv(keys, per_split)
    part = torch.empty(b * hq, splits, d + 2, dtype=torch.float32, device=q.device)
    out = torch.empty(b, hq, 1, d, dtype=q.dtype, device=q.device)
    if mask is not None:
        mask = mask.expand(b, hq, 1, keys)
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)
    m_strides = (mask.stride(0), mask.stride(1), mask.stride(3)) if mask is not None else (0, 0, 0)
    pdl = triton_pdl.enabled(q.device, b)
    launch = {"launch_pdl": True} if pdl else {}
    kv_lines = triton_pdl.prefetch_lines(1, 1, d * k.element_size()) if pdl else 0
    _partial[(b * hq, splits)](
        q, k, v, q if mask is None else mask, part, keys, hq, hq // hkv,
        float(d ** -0.5 if scale is None else scale), per_split,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        *m_strides, HAS_MASK=mask is not None, BOOL_MASK=mask is not None and mask.dtype == torch.uint8,
        D=d, BLOCK_S=BLOCK_S, PDL=pdl, KV_LINES=kv_lines, num_warps=4, **launch)
    _combine[(b * hq,)](part, out, hq, out.stride(0), out.stride(1), NUM_SPLITS=splits,
                        SPLITS_POW2=triton.next_power_of_2(splits), D=d, PDL=pdl, num_warps=4, **launch)
    return out
