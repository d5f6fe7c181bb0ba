"""Attention over short key sequences in one pass: every key of a (batch, head) in one block.

Imported only where Triton is installed (it imports ``triton`` at the top);
``spmd.runtime.kernels_attention`` offers it as the ``short-seq`` candidate of its timed choice.

SDPA's flash-style kernels stream the keys in blocks with the online softmax of FlashAttention
(Dao et al., 2022) and are tuned for long sequences and head dims of 64-128. An encoder such as
MiniLM (12 heads of 32, 128 tokens) leaves them far from the memory floor: on an H200 cuDNN's
bf16 kernel runs batch 128 at about 20 TFLOP/s and the memory-efficient float32 kernel takes
22 µs for 50 MFLOP at batch 8. When all keys fit one block (``MAX_KEYS``) the softmax needs no
running rescale, so one program per (batch, head, block of ``block_m`` queries):

1. loads its queries ``[block_m, D]`` (``block_m`` and the warps per program are timed per
   shape among ``CONFIGS`` by the attention choice) and all keys ``[Sk, D]`` of its key/value head,
2. computes the scores with one ``tl.dot`` (float32 accumulation; for float32 inputs with
   ``input_precision="tf32x3"``: each operand split into a TF32 high part and a TF32 remainder,
   three tensor-core products, about float32 accuracy, NVIDIA CUTLASS's "3xTF32", which is what
   PyTorch's own memory-efficient float32 attention runs on compute capability 8.0 and later
   through CUTLASS's ``OpMultiplyAddFastF32``; plain TF32 is never used), adds or applies the mask
   (a mask broadcast over the queries is loaded once per program, as one row),
3. takes the softmax over the row in float32 and multiplies by the values with a second
   ``tl.dot`` (the probabilities cast to the values' dtype for 16-bit inputs, as flash kernels
   do; float32 stays float32).

Grouped-query attention reads key/value head ``h // (Hq / Hkv)``. The mask (bool: True = attend;
float: added to the scores) is read through its strides, so a broadcast view costs nothing.
``is_causal`` is PyTorch's top-left alignment (query ``i`` sees keys ``j <= i``). A row with
every key masked is 0, as PyTorch's math SDPA (its "safe" softmax) gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_KEYS = 256  # all keys in one block: the scores tile [block_m, keys] stays in registers
MAX_HEAD_DIM = 128
_TILE_ELEMENTS = 8192  # block_m * keys per 4 warps: 64 float32 registers per thread for the scores
_SMEM_BYTES = 160 * 2**10  # the key, value, query and probability tiles a program stages
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: (queries per program, warps) offered to the timed choice; a configuration a shape cannot use is left out
CONFIGS = ((16, 4), (32, 4), (64, 4), (64, 8), (128, 8))


@triton.jit
def _attention(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, SQ, SK, HQ, GROUP, scale,
               sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
               sm_b, sm_h, sm_q, sm_k, D, DV,
               HAS_MASK: tl.constexpr, BOOL_MASK: tl.constexpr, MASK_ROW: tl.constexpr, CAUSAL: tl.constexpr,
               F32: tl.constexpr, EVEN_N: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    rdv = tl.arange(0, BLOCK_DV)
    row_ok = rm < SQ
    key_ok = rn < SK
    q = tl.load(q_ptr + b * sq_b + h * sq_h + rm[:, None] * sq_s + rd[None, :],
                mask=row_ok[:, None] & (rd[None, :] < D), other=0.0)
    k = tl.load(k_ptr + b * sk_b + hk * sk_h + rn[:, None] * sk_s + rd[None, :],
                mask=key_ok[:, None] & (rd[None, :] < D), other=0.0)
    v = tl.load(v_ptr + b * sv_b + hk * sv_h + rn[:, None] * sv_s + rdv[None, :],
                mask=key_ok[:, None] & (rdv[None, :] < DV), other=0.0)
    if F32:
        scores = tl.dot(q, tl.trans(k), input_precision="tf32x3")
    else:
        scores = tl.dot(q, tl.trans(k))
    allowed = key_ok[None, :] & row_ok[:, None]
    if HAS_MASK:
        if MASK_ROW:  # the same keys masked for every query (a padding mask): one row
            mk = tl.load(mask_ptr + b * sm_b + h * sm_h + rn * sm_k, mask=key_ok, other=0)[None, :]
        else:
            mk = tl.load(mask_ptr + b * sm_b + h * sm_h + rm[:, None] * sm_q + rn[None, :] * sm_k,
                         mask=allowed, other=0)
        if BOOL_MASK:
            allowed = allowed & (mk != 0)
            scores = scores * scale
        else:
            scores = scores * scale + mk.to(tl.float32)  # one FMA per score
    else:
        scores = scores * scale
    if CAUSAL:
        allowed = allowed & (rn[None, :] <= rm[:, None])
    if CAUSAL or BOOL_MASK or not EVEN_N:  # keys to leave out: the block's padding keys, masked keys
        scores = tl.where(allowed, scores, float("-inf"))
    big = tl.max(scores, axis=1)
    shift = tl.where(big == float("-inf"), 0.0, big)  # every key masked: no NaN
    # exp(s - max); the difference first: a mask of finfo.min times log2(e) would overflow to -inf
    p = tl.exp2((scores - shift[:, None]) * 1.4426950408889634)
    total = tl.sum(p, axis=1)
    if F32:
        acc = tl.dot(p, v, input_precision="tf32x3")
    else:
        acc = tl.dot(p.to(v.dtype), v)
    out = acc * (1.0 / tl.where(total > 0, total, 1.0))[:, None]  # one division a row; every key masked: 0
    tl.store(out_ptr + b * so_b + h * so_h + rm[:, None] * so_s + rdv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (rdv[None, :] < DV))


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool) -> bool:
    """Whether ``attention(q, k, v, mask, is_causal)`` computes these inputs: CUDA tensors of one
    dtype (float16, bfloat16 or float32), q ``[B, Hq, Sq, D]``, k ``[B, Hkv, Sk, D]``, v
    ``[B, Hkv, Sk, Dv]`` with Hkv dividing Hq, 1 <= Sk <= ``MAX_KEYS``, D and Dv <= ``MAX_HEAD_DIM``,
    last dims contiguous, and a bool / floating mask broadcastable to ``[B, Hq, Sq, Sk]`` (or
    none; not both a mask and ``is_causal``, which PyTorch rejects)."""
    if not (q.is_cuda and q.dtype in _DTYPES and q.dtype == k.dtype == v.dtype):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    b, hq, sq, d = q.shape
    _, hkv, sk, _ = k.shape
    if k.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3] or hkv < 1 or hq % hkv:
        return False
    if not (1 <= sk <= MAX_KEYS and sq >= 1 and 1 <= d <= MAX_HEAD_DIM and 1 <= v.shape[3] <= MAX_HEAD_DIM):
        return False
    if not configs(q, k, v):
        return False
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        return False
    if mask is None:
        return True
    if is_causal or (mask.dtype != torch.bool and not mask.dtype.is_floating_point):
        return False
    try:
        return torch.broadcast_shapes(mask.shape, (b, hq, sq, sk)) == (b, hq, sq, sk)
    except RuntimeError:
        return False


def _blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    """(keys block, head-dim block of q / k, head-dim block of v): powers of two, at least 16."""
    return tuple(max(16, triton.next_power_of_2(n)) for n in (k.shape[2], q.shape[3], v.shape[3]))


def configs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The ``CONFIGS`` (queries per program, warps) these shapes can use: no more queries per
    program than the next power of two of Sq (16 at least), a scores tile of at most
    ``_TILE_ELEMENTS`` per 4 warps, and the staged tiles within ``_SMEM_BYTES``."""
    block_n, block_d, block_dv = _blocks(q, k, v)
    size = q.element_size()
    most = max(16, triton.next_power_of_2(q.shape[2]))
    return tuple((m, w) for m, w in CONFIGS
                 if m <= most and m * block_n <= _TILE_ELEMENTS * w // 4
                 and size * (block_n * (block_d + block_dv) + m * (block_d + block_n)) <= _SMEM_BYTES)


def default_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_sms: int) -> tuple[int, int]:
    """The configuration used when none is named: of ``configs``, the most queries per program at
    4 warps that still leaves two programs per SM (else the fewest queries per program)."""
    usable = configs(q, k, v)
    four = [c for c in usable if c[1] == 4] or list(usable)
    bh = q.shape[0] * q.shape[1]
    enough = [c for c in four if bh * triton.cdiv(q.shape[2], c[0]) >= 2 * num_sms]
    return max(enough) if enough else min(four)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
              scale: float | None, config: tuple[int, int] | None = None, num_sms: int | None = None) -> torch.Tensor:
    """``softmax(q @ k.T * scale + mask) @ v`` for ``eligible`` inputs: ``[B, Hq, Sq, Dv]`` in q's
    dtype, laid out as ``[B, Sq, Hq, Dv]`` (SDPA's flash and cuDNN outputs are too), so that the
    usual ``transpose(1, 2).reshape(B, Sq, Hq * Dv)`` after attention is a view, not a copy.

    ``scale``: None = ``1 / sqrt(D)``; ``config``: (queries per program, warps), one of
    ``configs(q, k, v)`` (None: ``default_config``); ``num_sms``: the device's SM count (None:
    asked of CUDA). The caller checks ``eligible``.
    """
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    if config is None:
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        config = default_config(q, k, v, num_sms)
    bm, warps = config
    block_n, block_d, block_dv = _blocks(q, k, v)
    out = torch.empty(b, sq, hq, dv, dtype=q.dtype, device=q.device).transpose(1, 2)
    if mask is not None:
        mask = mask.expand(b, hq, sq, sk)
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)
    m_strides = mask.stride() if mask is not None else (0, 0, 0, 0)
    _attention[(triton.cdiv(sq, bm), b * hq)](
        q, k, v, q if mask is None else mask, out, sq, sk, hq, hq // hkv,
        float(d ** -0.5 if scale is None else scale),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        *m_strides, d, dv, HAS_MASK=mask is not None, BOOL_MASK=mask is not None and mask.dtype == torch.uint8,
        MASK_ROW=mask is not None and (sq == 1 or mask.stride(2) == 0), CAUSAL=bool(is_causal),
        F32=q.dtype == torch.float32, EVEN_N=sk == block_n, BLOCK_M=bm, BLOCK_N=block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, num_warps=warps)
    return out
