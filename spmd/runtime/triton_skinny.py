"""A Triton kernel for skinny products ``out[M, N] = p(x)[M, K] @ w[N, K].T`` (M ≤ 16), optionally ``+ out``.

Imported only on CUDA machines (it imports ``triton`` at the top); ``spmd.runtime.kernels_gemv``
and ``spmd.runtime.kernels_prologue`` time it against cuBLAS per shape.

``_skinny_mm``: one program owns ``BLOCK_N`` output columns for all M ≤ 16 rows and streams its ``[BLOCK_N, K]``
slab of the weight once, ``BLOCK_K`` columns per step, through a ``num_stages``-deep software
pipeline (Triton's asynchronous copies into shared memory): the weight is read exactly once and
nothing else is large, so the time is the time to stream ``w`` from HBM. The rows of ``x`` are
padded to 16 (the smallest tensor-core tile; padded rows are masked loads of zero and are never
stored). Products accumulate in float32 and are rounded once to the output dtype; with
``ACCUMULATE`` the old ``out`` is added in float32 before that one rounding, as cuBLAS's
``addmm_`` (beta = 1) does. The structure is the split-free "GEMV as a skinny GEMM" of decode
kernels in gpt-fast / TensorRT-LLM, without split-K: every Llama-2-7B decode shape has at least
256 column blocks of 16, enough to keep all SMs streaming.

``_row_mm`` (``launch_row``): one row only, on the CUDA cores, the structure of Inductor's
generated row reductions (which measured faster than the tensor-core kernel at one row: Q/K/V
26.8 against 28.0 µs on an H200), with the prologue computed on the row's [BLOCK_K] slice instead
of a 16-row padded tile.

``p`` is the prologue that produced the product's input (each program reads all of ``x`` anyway,
a few KiB from L2, so computing it there costs no HBM traffic and saves one kernel):

- ``PROLOGUE_NONE``: ``p(x) = x``;
- ``PROLOGUE_RMS_NORM``: ``p(x) = x * rsqrt(mean(x², -1) + eps) * g`` (RMSNorm, Zhang & Sennrich
  2019): ``x * g`` rounded to 16 bits feeds the product, the squares of ``x`` accumulate beside
  it (summed once after the loop), and the per-row ``rsqrt`` scales the float32 accumulator at
  the end (a row scale commutes with the product; FlashNorm, arXiv:2407.09577, defers it so);
- ``PROLOGUE_SWIGLU``: ``p(x) = silu(x) * g`` (the gated unit of Llama's MLP, Shazeer 2020), with
  the roundings of the op-by-op program: ``silu(x)`` rounded to 16 bits, then the product with ``g``.

A prologue's inputs are loaded one K step ahead into registers (Triton pipelines only the loads
that feed ``tl.dot`` directly through shared memory): a first version that loaded them in the
step that used them measured 2-7x slower than the plain kernel on an H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd.runtime import triton_pdl

BLOCK_M = 16
PROLOGUE_NONE, PROLOGUE_RMS_NORM, PROLOGUE_SWIGLU = 0, 1, 2


@triton.jit
def _rows(ptrs, m_ok, k_ok):
    return tl.load(ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _skinny_mm(x_ptr, w_ptr, out_ptr, g_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_gm, eps, divisor,
               ACCUMULATE: tl.constexpr, PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr,
               PREFETCH_LINES: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    triton_pdl.start(w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_wn,
                     w_ptr.dtype.element_ty.primitive_bitwidth // 8, PREFETCH_LINES, PDL)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    g_ptrs = g_ptr + rm[:, None] * stride_gm + rk[None, :]  # SwiGLU: the up projection, as x
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PROLOGUE != 0:
        # The prologue's inputs go through registers, not through the pipeline Triton builds for
        # the operands of tl.dot: load them one step ahead so their latency hides under a step.
        a_next = _rows(x_ptrs, m_ok, rk < K)
        if PROLOGUE == 1:
            ssq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)  # summed over K after the loop
            g_next = tl.load(g_ptr + rk, mask=rk < K, other=0.0)
        else:
            u_next = _rows(g_ptrs, m_ok, rk < K)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K and EVEN_N:
            b = tl.load(w_ptrs)
        elif EVEN_K:
            b = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            b = tl.load(w_ptrs, mask=n_ok[:, None] & ((k0 + rk) < K)[None, :], other=0.0)
        if PROLOGUE == 0:
            if EVEN_K:
                a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            else:
                a = _rows(x_ptrs, m_ok, (k0 + rk) < K)
        else:
            k_next = (k0 + BLOCK_K + rk) < K
            a32 = a_next.to(tl.float32)
            a_next = _rows(x_ptrs + BLOCK_K, m_ok, k_next)
            if PROLOGUE == 1:
                ssq += a32 * a32
                gamma = g_next.to(tl.float32)
                g_next = tl.load(g_ptr + k0 + BLOCK_K + rk, mask=k_next, other=0.0)
                a = (a32 * gamma[None, :]).to(x_ptr.dtype.element_ty)
            else:
                up = u_next.to(tl.float32)
                u_next = _rows(g_ptrs + BLOCK_K, m_ok, k_next)
                gate = (a32 * tl.sigmoid(a32)).to(x_ptr.dtype.element_ty).to(tl.float32)
                a = (gate * up).to(x_ptr.dtype.element_ty)
                g_ptrs += BLOCK_K
        acc = tl.dot(a, tl.trans(b), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PROLOGUE == 1:
        acc = acc * (1.0 / tl.sqrt_rn(tl.sum(ssq, axis=1) / divisor + eps))[:, None]
    o_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    o_mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _row_mm(x_ptr, w_ptr, out_ptr, g_ptr, N, K, stride_wn, eps, divisor, ACCUMULATE: tl.constexpr,
            PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
            EVEN_N: tl.constexpr, PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr):
    """One row: ``BLOCK_N`` weight rows per program, products on the CUDA cores (a [BLOCK_N,
    BLOCK_K] float32 partial sum reduced once at the end), the prologue on the [BLOCK_K] slice of
    the row only (no padded rows)."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    triton_pdl.start(w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_wn,
                     w_ptr.dtype.element_ty.primitive_bitwidth // 8, PREFETCH_LINES, PDL)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        if EVEN_K and EVEN_N:
            b = tl.load(w_ptrs)
        elif EVEN_K:
            b = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            b = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(x_ptr + k0 + rk, mask=k_ok, other=0.0)
        if PROLOGUE == 1:
            a32 = a.to(tl.float32)
            ssq += a32 * a32
            gamma = tl.load(g_ptr + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
            a = (a32 * gamma).to(x_ptr.dtype.element_ty)
        elif PROLOGUE == 2:
            a32 = a.to(tl.float32)
            up = tl.load(g_ptr + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
            gate = (a32 * tl.sigmoid(a32)).to(x_ptr.dtype.element_ty).to(tl.float32)
            a = (gate * up).to(x_ptr.dtype.element_ty)
        acc += b.to(tl.float32) * a.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    total = tl.sum(acc, axis=1)
    if PROLOGUE == 1:
        total = total * (1.0 / tl.sqrt_rn(tl.sum(ssq, axis=0) / divisor + eps))
    if ACCUMULATE:
        total += tl.load(out_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def _pdl_options(w: torch.Tensor, programs: int, block_n: int, rows: int) -> dict:
    """The PDL launch options (``triton_pdl``) of a launch over ``rows`` rows of the input, of
    ``programs`` programs that stream ``block_n`` rows of ``w`` each."""
    if not triton_pdl.enabled(w.device, rows):
        return {"PDL": False, "PREFETCH_LINES": 0}
    lines = triton_pdl.prefetch_lines(programs, block_n, w.shape[1] * w.element_size())
    return {"PDL": True, "PREFETCH_LINES": lines, "launch_pdl": True}


def launch_row(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, accumulate: bool, block_n: int, block_k: int,
               num_warps: int, num_stages: int, prologue: int = PROLOGUE_NONE, g: torch.Tensor | None = None,
               eps: float = 0.0, divisor: float = 1.0) -> None:
    """``launch`` for one row (``x [1, K]``, ``out [1, N]``) on the CUDA cores (``_row_mm``); ``g``
    as for ``launch`` (the up projection of SwiGLU as ``[1, K]``, last dim contiguous)."""
    k = x.shape[1]
    n = w.shape[0]
    g = x if g is None else g
    grid = triton.cdiv(n, block_n)
    _row_mm[(grid,)](
        x, w, out, g, n, k, w.stride(0), float(eps), float(divisor), ACCUMULATE=accumulate, PROLOGUE=prologue,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, EVEN_N=n % block_n == 0, num_warps=num_warps,
        num_stages=num_stages, **_pdl_options(w, grid, block_n, 1))


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, accumulate: bool, block_n: int, block_k: int,
           num_warps: int, num_stages: int, prologue: int = PROLOGUE_NONE, g: torch.Tensor | None = None,
           eps: float = 0.0, divisor: float = 1.0) -> None:
    """Write ``p(x)[M, K] @ w[N, K].T`` (plus ``out`` when ``accumulate``) into ``out[M, N]``.

    x, w, out: CUDA tensors of one 16-bit dtype, last dims contiguous, M ≤ 16 (the caller checks).
    ``prologue``: ``PROLOGUE_NONE`` / ``PROLOGUE_RMS_NORM`` (``g``: the norm weight [K], contiguous;
    ``eps`` and ``divisor``, the mean's divisor, floats) / ``PROLOGUE_SWIGLU`` (``g``: the up
    projection [M, K], last dim contiguous).
    """
    m, k = x.shape
    n = w.shape[0]
    g = x if g is None else g
    grid = triton.cdiv(n, block_n)
    _skinny_mm[(grid,)](
        x, w, out, g, m, n, k, x.stride(0), w.stride(0), out.stride(0), g.stride(0) if g.dim() == 2 else 0,
        float(eps), float(divisor), ACCUMULATE=accumulate, PROLOGUE=prologue, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, EVEN_N=n % block_n == 0, num_warps=num_warps,
        num_stages=num_stages, **_pdl_options(w, grid, block_n, m))
