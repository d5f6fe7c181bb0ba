"""Skinny products of decode steps (``out[M, N] = x[M, K] @ w[N, K].T``, M ≤ 16) with the fastest
kernel for the shape, chosen by timing.

A product of a few rows (one token per sequence through a linear layer) reads the whole weight
once and does ``2·M`` flops per weight element: its time is the time to stream ``w`` from HBM.
cuBLAS picks a GEMM kernel (often split-K plus a reduction kernel) that on an H200 reads 2.5-3.7
TB/s for Llama-2-7B's projections (``benchmarks/gemv.py``), against ~4.1 TB/s for a plain copy.
The candidates are

- ``cublas``: ``torch.mm`` / ``addmm_`` (the default, and the reference the others are checked against);
- ``inductor`` (one row only): the product written as a multiply and a float32 sum, a reduction
  kernel Inductor generates and tunes (coordinate-descent tuning of its block sizes, as gpt-fast
  sets it); 3.4-4.3 TB/s for some shapes, slower for others;
- ``triton-*``: ``spmd.runtime.triton_skinny``, one Triton kernel in a few block configurations
  (``SKINNY_CONFIGS``), the accumulate form fused (``out += x @ w.T`` with one rounding, as
  ``addmm_``);
- ``row-*`` (one row only): the same module's CUDA-core row kernel (``ROW_CONFIGS``), accumulate
  form fused too.

As XLA's and Inductor's GEMM autotuners do, each candidate is checked once against the cuBLAS
result and all are timed on the device once (CUDA-graph replays, L2 flushed before each timed
call, interleaved, median); the fastest is cached per (device, dtype, shape, strides, accumulate).
Used only where fusions run as generated kernels (``kernels_fusion.fusion_compiler``: inside
CUDA-graph warm-up and capture by default), for 16-bit weights of at least ``MIN_WEIGHT_BYTES``,
and only when a graph warm-up (not a capture) can time the candidates. The Inductor candidate's
accumulate form adds its rounded product to ``out`` in a second kernel (two roundings, as eager
PyTorch's ``h + F.linear(x, w)``); cuBLAS and Triton round once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from spmd import metrics
from spmd.runtime import kernels_fusion as kf
from spmd.runtime.kernel_timing import median_us_each, within_roundings

Tensor = torch.Tensor
MIN_WEIGHT_BYTES = 4 * 2**20
MAX_ROWS = 16  # rows of x up to which a product counts as skinny (decode batch sizes)
#: (block_n, block_k, num_warps, num_stages) of the Triton candidates: 16-64 output columns per
#: program (256-2000 programs for Llama-2-7B's shapes), 32-64 KiB of weight in flight per program
SKINNY_CONFIGS = ((16, 256, 4, 4), (32, 256, 4, 4), (32, 128, 4, 5), (64, 128, 4, 4), (16, 512, 4, 3),
                  (64, 256, 8, 3), (32, 256, 4, 6), (32, 512, 8, 3))
#: (block_n, block_k, num_warps, num_stages) of the one-row CUDA-core candidates (``triton_skinny._row_mm``):
#: 4-16 weight rows per program, a [block_n, block_k] float32 partial sum of 16-32 registers a thread
ROW_CONFIGS = ((8, 512, 4, 3), (16, 256, 4, 3), (4, 1024, 4, 3), (8, 1024, 8, 2), (16, 512, 8, 3))
_TIMED_CALLS = 9
_OPTIONS = {**kf._INDUCTOR_OPTIONS, "coordinate_descent_tuning": True}
Kernel = Callable[[Tensor, Tensor, Tensor], None]
_choices: dict[tuple, Kernel | None] = {}


def as_weight(y: Tensor) -> Tensor | None:
    """``y [K, N]`` as the contiguous ``[N, K]`` weight it views (``w.T``), or None if it is not one."""
    if y.dim() != 2 or y.stride() != (1, y.shape[0]):
        return None
    return y.t()


def gemv(x: Tensor, w: Tensor, out: Tensor, accumulate: bool) -> bool:
    """Write ``x[M, K] @ w[N, K].T`` (plus ``out`` when ``accumulate``) into ``out[M, N]`` with the
    fastest kernel for this shape; returns False (nothing written) where cuBLAS should run instead:
    the shape is not a skinny (M ≤ ``MAX_ROWS``) 16-bit product of a large contiguous weight,
    fusions run op by op on this device, or cuBLAS was timed fastest."""
    if not eligible(x, w, out):
        return False
    key = (x.device, x.dtype, x.shape[0], w.shape, accumulate, x.stride(), out.stride())
    if key not in _choices:
        if torch.cuda.is_current_stream_capturing():
            return False  # no timing inside a capture: cuBLAS, and decide at the next warm-up
        _choices[key] = _choose(x, w, out, accumulate)
    kernel = _choices[key]
    if kernel is None:
        return False
    kernel(x, w, out)
    return True


def eligible(x: Tensor, w: Tensor, out: Tensor) -> bool:
    """Whether ``x [M, K] @ w[N, K].T -> out [M, N]`` may run a generated kernel here: CUDA, one
    16-bit dtype, M ≤ ``MAX_ROWS``, contiguous ``w`` of at least ``MIN_WEIGHT_BYTES``, last dims
    contiguous, and generated kernels in use (``kernels_fusion.fusion_compiler``)."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype == out.dtype):
        return False
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or out.shape != (x.shape[0], w.shape[0]):
        return False
    if not w.is_contiguous() or x.stride(1) != 1 or out.stride(1) != 1:
        return False
    if w.numel() * w.element_size() < MIN_WEIGHT_BYTES:
        return False
    mode = kf.fusion_compiler(x.device)
    return mode == "inductor" or (mode == "graphs" and kf._graph_call())


def _product(x: Tensor, w: Tensor, out: Tensor) -> Tensor:
    return out.copy_((x.float() * w.float()).sum(-1).unsqueeze(0).to(out.dtype))


def _cublas(accumulate: bool) -> Kernel:
    def cublas(x: Tensor, w: Tensor, out: Tensor) -> None:
        if accumulate:
            out.addmm_(x, w.t())
        else:
            torch.mm(x, w.t(), out=out)
    return cublas


def _inductor(x: Tensor, w: Tensor, out: Tensor, accumulate: bool) -> Kernel:
    """The generated reduction (accumulating: into a fresh buffer, then one add into ``out``;
    Inductor's fused accumulate-into-``out`` form measured twice as slow as this pair on an H200)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(_product)(x, w, out.clone())
    compiled = torch._inductor.compile(gm, [x, w, out.clone()], options=_OPTIONS)

    def generated(x: Tensor, w: Tensor, out: Tensor) -> None:
        if accumulate:
            product = torch.empty_like(out)
            compiled(x, w, product)
            out.add_(product)
        else:
            compiled(x, w, out)
    return generated


def _candidates(x: Tensor, w: Tensor, out: Tensor, accumulate: bool) -> list[tuple[str, Callable[[], Kernel]]]:
    """(name, builder) of every non-cuBLAS candidate for this shape; a builder may raise."""
    found: list[tuple[str, Callable[[], Kernel]]] = []
    if x.shape[0] == 1:
        found.append(("inductor", lambda: _inductor(x, w, out, accumulate)))
    try:
        from spmd.runtime import triton_skinny
    except ImportError:  # no Triton on this machine: cuBLAS and Inductor only
        return found
    for bn, bk, warps, stages in SKINNY_CONFIGS:
        def build(bn=bn, bk=bk, warps=warps, stages=stages) -> Kernel:
            return lambda x, w, out: triton_skinny.launch(x, w, out, accumulate=accumulate, block_n=bn, block_k=bk,
                                                          num_warps=warps, num_stages=stages)
        found.append((f"triton-{bn}x{bk}-w{warps}-s{stages}", build))
    for bn, bk, warps, stages in ROW_CONFIGS if x.shape[0] == 1 else ():
        def build_row(bn=bn, bk=bk, warps=warps, stages=stages) -> Kernel:
            return lambda x, w, out: triton_skinny.launch_row(x, w, out, accumulate=accumulate, block_n=bn,
                                                              block_k=bk, num_warps=warps, num_stages=stages)
        found.append((f"row-{bn}x{bk}-w{warps}-s{stages}", build_row))
    return found


def checked(build: Callable[[], Callable], run: Callable[[Callable, Tensor], object], out: Tensor,
            want: Tensor) -> Callable | None:
    """The built kernel if it compiles, runs (``run(kernel, result)`` writes or accumulates into
    ``result``, a copy of ``out``) and matches ``want`` (the reference kernel's result) within a few
    16-bit roundings; else None."""
    try:
        kernel = build()
        got = out.clone()
        run(kernel, got)
        torch.cuda.synchronize(out.device)
    except Exception:  # noqa: BLE001 - any compiler or launch failure drops the candidate
        return None
    if not within_roundings(got, want):
        return None
    return kernel


def _choose(x: Tensor, w: Tensor, out: Tensor, accumulate: bool) -> Kernel | None:
    """The fastest correct candidate on this device, or None where cuBLAS is fastest."""
    with kf.COMPILE_LOCK, torch.no_grad(), metrics.timer("gemv.compile"):
        cublas = _cublas(accumulate)
        want = out.clone()
        cublas(x, w, want)
        names, kernels = ["cublas"], [cublas]
        for name, build in _candidates(x, w, out, accumulate):
            kernel = checked(build, lambda k, o: k(x, w, o), out, want)
            if kernel is None:
                metrics.counter("gemv.fallback").inc()
                continue
            names.append(name)
            kernels.append(kernel)
    times = _median_us(tuple(kernels), lambda k, o: k(x, w, o), out.clone())
    best = min(range(len(times)), key=times.__getitem__)
    DECISIONS.append(Decision(tuple(w.shape), x.shape[0], str(x.dtype), accumulate,
                              tuple(zip(names, times, strict=True)), names[best]))
    metrics.counter("gemv.cublas" if best == 0 else "gemv.generated").inc()
    return None if best == 0 else kernels[best]


@dataclass(frozen=True)
class Decision:
    """One timed choice: weight ``[N, K]``, rows M, dtype, accumulate, each candidate's median µs
    (name, µs), the chosen candidate's name, and the prologue the kernels compute on the input
    ("none", or "rms-norm" / "swiglu" for ``spmd.runtime.kernels_prologue``'s choices)."""

    weight_shape: tuple[int, int]
    rows: int
    dtype: str
    accumulate: bool
    times_us: tuple[tuple[str, float], ...]
    chosen: str
    prologue: str = "none"

    def time_us(self, name: str) -> float:
        """The median µs of candidate ``name`` (``nan`` if it was not timed)."""
        return dict(self.times_us).get(name, float("nan"))

    def summary(self) -> str:
        """One report line: shape, the chosen kernel and every candidate's µs."""
        times = ", ".join(f"{n} {t:.1f}" for n, t in self.times_us)
        pro = "" if self.prologue == "none" else f" prologue={self.prologue}"
        return (f"gemv M={self.rows} {self.weight_shape} {self.dtype} accumulate={self.accumulate}{pro}: "
                f"{self.chosen} ({times} us)")


DECISIONS: list[Decision] = []  # every choice made in this process, in order (for reports)


def _median_us(kernels, run: Callable[[Callable, Tensor], object], out: Tensor) -> tuple[float, ...]:
    """Median µs of one call ``run(kernel, out)`` of each kernel as the runtime runs it (a CUDA
    graph replay), interleaved, each with a cold L2 (``spmd.runtime.kernel_timing``); a kernel that
    cannot be captured times as infinity (never chosen)."""
    return median_us_each([lambda k=k: run(k, out) for k in kernels], out.device, _TIMED_CALLS)
