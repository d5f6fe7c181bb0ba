"""A Triton kernel for skinny products ``out[M, N] = x[M, K] @ w[N, K].T`` (M ≤ 16), optionally ``+ out``.

Imported only on CUDA machines (it imports ``triton`` at the top); ``spmd.runtime.kernels_skinny``
wraps it and ``spmd.runtime.kernels_gemv`` times it against cuBLAS per shape.

One program owns ``BLOCK_N`` output columns for all M ≤ 16 rows and streams its ``[BLOCK_N, K]``
slab of the weight once, ``BLOCK_K`` columns per step, through a ``num_stages``-deep software
pipeline (Triton's asynchronous copies into shared memory): the weight is read exactly once and
nothing else is large, so the time is the time to stream ``w`` from HBM. The rows of ``x`` are
padded to 16 (the smallest tensor-core tile; padded rows are masked loads of zero and are never
stored). Products accumulate in float32 and are rounded once to the output dtype; with
``ACCUMULATE`` the old ``out`` is added in float32 before that one rounding, as cuBLAS's
``addmm_`` (beta = 1) does. The structure is the split-free "GEMV as a skinny GEMM" of decode
kernels in gpt-fast / TensorRT-LLM, without split-K: every Llama-2-7B decode shape has at least
256 column blocks of 16, enough to keep all SMs streaming.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _skinny_mm(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
               ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            if EVEN_N:
                b = tl.load(w_ptrs)
            else:
                b = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + rk) < K
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    o_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    o_mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, accumulate: bool, block_n: int, block_k: int,
           num_warps: int, num_stages: int) -> None:
    """Write ``x[M, K] @ w[N, K].T`` (plus ``out`` when ``accumulate``) into ``out[M, N]``.

    x, w, out: CUDA tensors of one 16-bit dtype, last dims contiguous, M ≤ 16 (the caller checks).
    """
    m, k = x.shape
    n = w.shape[0]
    _skinny_mm[(triton.cdiv(n, block_n),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        ACCUMULATE=accumulate, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, EVEN_N=n % block_n == 0, num_warps=num_warps, num_stages=num_stages)
