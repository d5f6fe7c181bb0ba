"""Matrix-vector products of decode steps as generated reduction kernels, chosen by timing.

A one-row product ``out[1, N] = x[1, K] @ w[N, K].T`` (one token through a linear layer) reads
the whole weight once and does two flops per weight element: its time is the time to stream
``w`` from HBM. cuBLAS picks a GEMM kernel (often split-K plus a reduction kernel) that on an
H200 reads 2.5-3.7 TB/s for Llama-2-7B's projections, while a plain row reduction that Inductor
generates and tunes (coordinate-descent tuning of its block sizes, as gpt-fast sets it) reads
3.4-4.3 TB/s for the same shapes and is slower for others (``benchmarks/gemv.py`` measures both).
So, as XLA's and Inductor's GEMM autotuners do, the kernel is chosen per shape by timing both
candidates on the device once (L2 flushed before each timed call, median of a few), and the
choice is cached per (shape, dtype, accumulate, device).

The generated kernel accumulates in float32 and rounds once, as cuBLAS does; ``accumulate``
(``addmm``'s ``C + A @ B`` in place) adds the rounded product to ``out`` in a second kernel:
two roundings, as eager PyTorch's ``h + F.linear(x, w)`` makes. Used only where fusions run as
generated kernels (``kernels_fusion.fusion_compiler``:
inside CUDA-graph warm-up and capture by default), for 16-bit weights of at least
``MIN_WEIGHT_BYTES``, and only when a graph warm-up (not a capture) can time the candidates.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spmd import metrics
from spmd.compile_lock import CAPTURE_LOCK
from spmd.runtime import kernels_fusion as kf

Tensor = torch.Tensor
MIN_WEIGHT_BYTES = 4 * 2**20
_L2_FLUSH_BYTES = 256 * 2**20
_TIMED_CALLS = 5
_OPTIONS = {**kf._INDUCTOR_OPTIONS, "coordinate_descent_tuning": True}
_choices: dict[tuple, Callable[[Tensor, Tensor, Tensor], None] | None] = {}


def as_weight(y: Tensor) -> Tensor | None:
    """``y [K, N]`` as the contiguous ``[N, K]`` weight it views (``w.T``), or None if it is not one."""
    if y.dim() != 2 or y.stride() != (1, y.shape[0]):
        return None
    return y.t()


def gemv(x: Tensor, w: Tensor, out: Tensor, accumulate: bool) -> bool:
    """Write ``x[1, K] @ w[N, K].T`` (plus ``out`` when ``accumulate``) into ``out[1, N]`` with the
    faster kernel for this shape; returns False (nothing written) where cuBLAS should run instead:
    the shape is not a one-row 16-bit product of a large contiguous weight, fusions run op by op
    on this device, or cuBLAS was timed faster."""
    if not _eligible(x, w, out):
        return False
    key = (x.device, x.dtype, w.shape, accumulate, x.stride(), out.stride())
    if key not in _choices:
        if torch.cuda.is_current_stream_capturing():
            return False  # no timing inside a capture: cuBLAS, and decide at the next warm-up
        _choices[key] = _choose(x, w, out, accumulate)
    kernel = _choices[key]
    if kernel is None:
        return False
    kernel(x, w, out)
    return True


def _eligible(x: Tensor, w: Tensor, out: Tensor) -> bool:
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype == out.dtype):
        return False
    if x.dim() != 2 or x.shape[0] != 1 or out.shape != (1, w.shape[0]) or not w.is_contiguous():
        return False
    if w.numel() * w.element_size() < MIN_WEIGHT_BYTES:
        return False
    mode = kf.fusion_compiler(x.device)
    return mode == "inductor" or (mode == "graphs" and kf._graph_call())


def _product(x: Tensor, w: Tensor, out: Tensor) -> Tensor:
    return out.copy_((x.float() * w.float()).sum(-1).unsqueeze(0).to(out.dtype))


def _choose(x: Tensor, w: Tensor, out: Tensor, accumulate: bool):
    """The generated kernel (accumulating: into a fresh buffer, then one add into ``out``) if it
    beats cuBLAS on this device, else None (compile failures too). Inductor's fused
    accumulate-into-``out`` form measured twice as slow as this pair on an H200."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        with kf.COMPILE_LOCK, torch.no_grad(), metrics.timer("gemv.compile"):
            gm = make_fx(_product)(x, w, out.clone())
            scratch = out.clone()
            compiled = torch._inductor.compile(gm, [x, w, scratch], options=_OPTIONS)
            compiled(x, w, scratch)
            if not torch.allclose(scratch.float(), _product(x, w, out.clone()).float(), rtol=2e-2, atol=2e-2):
                raise RuntimeError("generated matrix-vector kernel disagrees with its definition")
    except Exception:  # noqa: BLE001 - any compiler failure keeps cuBLAS
        metrics.counter("gemv.fallback").inc()
        return None

    def generated(x: Tensor, w: Tensor, out: Tensor) -> None:
        if accumulate:
            product = torch.empty_like(out)
            compiled(x, w, product)
            out.add_(product)
        else:
            compiled(x, w, out)

    def cublas(x: Tensor, w: Tensor, out: Tensor) -> None:
        if accumulate:
            out.addmm_(x, w.t())
        else:
            torch.mm(x, w.t(), out=out)

    gen_us, blas_us = _median_us((generated, cublas), x, w, out.clone())
    DECISIONS.append(Decision(tuple(w.shape), str(x.dtype), accumulate, gen_us, blas_us))
    metrics.counter("gemv.generated" if gen_us < blas_us else "gemv.cublas").inc()
    return generated if gen_us < blas_us else None


@dataclass(frozen=True)
class Decision:
    """One timed choice: weight ``[N, K]``, dtype, accumulate, and each candidate's median µs."""

    weight_shape: tuple[int, int]
    dtype: str
    accumulate: bool
    generated_us: float
    cublas_us: float


DECISIONS: list[Decision] = []  # every choice made in this process, in order (for reports)


def _median_us(kernels, x: Tensor, w: Tensor, out: Tensor) -> tuple[float, ...]:
    """Median µs of one call of each kernel as the runtime runs it (a CUDA graph replay), interleaved,
    each with a cold L2 (a read of a large buffer before each call evicts ``w`` and leaves no dirty
    lines to write back)."""
    graphs = []
    with CAPTURE_LOCK:
        for kernel in kernels:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                kernel(x, w, out)
            graphs.append(g)
    flush = torch.ones(_L2_FLUSH_BYTES // 4, dtype=torch.float32, device=x.device)
    total = torch.empty((), dtype=torch.float32, device=x.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: list[list[float]] = [[] for _ in kernels]
    for _ in range(_TIMED_CALLS + 1):
        for k, g in enumerate(graphs):
            torch.sum(flush, dim=0, out=total)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) * 1e3)
    return tuple(statistics.median(t[1:]) for t in times)
