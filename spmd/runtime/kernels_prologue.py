"""The kernel of a skinny product that computes its input's fusion itself (``spmd.runtime.fusions_prologue``).

A decode step's RMS norm and SwiGLU are small kernels (1-2 µs each on an H200, plus the gap to
the next kernel) whose only reader is a product of a few rows that streams a large weight. The
product's Triton kernel (``spmd.runtime.triton_skinny``, prologues ``PROLOGUE_RMS_NORM`` /
``PROLOGUE_SWIGLU``) reads the fusion's inputs instead and computes the norm or the gated unit
as it loads them: one kernel instead of two, no HBM round trip of the product's input.

Candidates, checked and timed once per (device, dtype, shapes, strides, prologue, accumulate) as
``spmd.runtime.kernels_gemv`` does (CUDA-graph replays with a cold L2, the fastest kept): the
op-by-op pair (the fusion's kernel, then the product with its own timed kernel choice), the
Triton kernel with the prologue in each of ``kernels_gemv.SKINNY_CONFIGS`` and, for one row, the
CUDA-core row kernel in each of ``kernels_gemv.ROW_CONFIGS`` and Inductor's reduction over the
fusion and the product traced as one graph. The pair is the
reference each fused candidate must match within a few 16-bit roundings, and the only path on
CPU, for shapes and layouts the Triton kernel does not take, and inside a capture before a
warm-up decided. Every choice is appended to ``kernels_gemv.DECISIONS`` (``Decision.prologue``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spmd import metrics
from spmd.runtime import kernels_fusion as kf
from spmd.runtime import kernels_gemv as kg
from spmd.runtime.prologue_match import Prologue

Tensor = torch.Tensor
Kernel = Callable[[list[Tensor], Tensor, Tensor], None]  # (fusion operands, weight [N, K], out) -> None
_choices: dict[tuple, Kernel | None] = {}


def make_prologue_product(pro: Prologue, fusion_fn: Callable, product_fn: Callable, num_fusion_ins: int,
                          accumulate: bool, rhs_transposed: bool, fusion_body=None) -> Callable:
    """Closure ``(operands, out) -> Tensor`` of the fused op.

    Operands: ``[*fusion operands, rhs]`` for a product (``product_fn([x, rhs], out)``, a ``dot``
    kernel) or ``[c, *fusion operands, rhs]`` for an accumulating one (``product_fn([c, x, rhs],
    out)``, ``fusions.make_addmm``'s kernel, in place when ``out`` is ``c``'s memory); ``x`` is
    ``fusion_fn(fusion operands, None)``. ``rhs_transposed``: the rhs is the ``[N, K]`` weight
    (contracting its last dim), the only layout the Triton kernel reads. ``fusion_body``: the
    fusion's computation, for the generated one-row candidate (none without it).
    """
    first = 1 if accumulate else 0

    def unfused(f_ops: list[Tensor], rhs: Tensor, out: Tensor | None, c: Tensor | None = None) -> Tensor:
        x = fusion_fn(f_ops, None)
        return product_fn([c, x, rhs] if accumulate else [x, rhs], out)

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        f_ops, rhs = ops[first:first + num_fusion_ins], ops[-1]
        c = ops[0] if accumulate else None
        if out is not None and rhs_transposed and _fused(pro, f_ops, rhs, out, c, unfused, fusion_body):
            return out
        return unfused(f_ops, rhs, out, c)
    return kernel


def _fused(pro: Prologue, f_ops: list[Tensor], w: Tensor, out: Tensor, c: Tensor | None, unfused,
           fusion_body) -> bool:
    """Run the chosen kernel on ``out`` when the fused path applies (CUDA, 16-bit, skinny, the
    layouts the Triton kernel reads, ``out`` being ``c``'s memory when accumulating and sharing
    no bytes with the fusion's inputs); False (nothing written) otherwise."""
    if not w.is_cuda:
        return False
    accumulate = c is not None
    if accumulate and not (c.data_ptr() == out.data_ptr() and c.stride() == out.stride() and c.shape == out.shape):
        return False
    args = _kernel_args(pro, f_ops, out)
    if args is None or not out.is_contiguous() or not w.is_contiguous():
        return False
    x, g = args
    if kf._overlaps(out, [x, g]):
        return False  # the buffer assignment gave the result the bytes of an input the kernel still reads
    o = out.view(x.shape[0], w.shape[0])
    if w.dim() != 2 or w.shape[1] != x.shape[1] or not kg.eligible(x, w, o):
        return False
    key = (x.device, x.dtype, x.shape[0], w.shape, pro, accumulate, x.stride(), g.stride())
    if key not in _choices:
        if torch.cuda.is_current_stream_capturing():
            return False  # no timing inside a capture: the pair, and decide at the next warm-up
        _choices[key] = _choose(pro, f_ops, w, out, accumulate, unfused, fusion_body)
    kernel = _choices[key]
    if kernel is None:
        return False
    kernel(f_ops, w, out)
    return True


def _kernel_args(pro: Prologue, f_ops: list[Tensor], out: Tensor) -> tuple[Tensor, Tensor] | None:
    """(x [M, K], g) as the Triton kernel reads them (last dims contiguous), or None."""
    k = pro.width
    if pro.kind == "rms-norm":
        x, g = f_ops[pro.x], f_ops[pro.g]
        if x.numel() != out.numel() // out.shape[-1] * k or g.shape != (k,) or not g.is_contiguous():
            return None
        x = x.reshape(-1, k)
    else:
        x = f_ops[pro.x].narrow(-1, pro.x_start, k).reshape(-1, k)
        g = f_ops[pro.g].narrow(-1, pro.g_start, k).reshape(-1, k)
        if g.shape != x.shape or g.stride(1) != 1:
            return None
    return (x, g) if x.stride(1) == 1 and x.dtype == g.dtype == out.dtype else None


def _triton(pro: Prologue, accumulate: bool, config: tuple[int, int, int, int], row: bool = False) -> Kernel:
    """The Triton kernel with the prologue in one block configuration: the tensor-core kernel
    (``triton_skinny.launch``) or, with ``row``, the one-row CUDA-core kernel (``launch_row``)."""
    from spmd.runtime import triton_skinny as ts

    bn, bk, warps, stages = config
    prologue = ts.PROLOGUE_RMS_NORM if pro.kind == "rms-norm" else ts.PROLOGUE_SWIGLU
    launch = ts.launch_row if row else ts.launch

    def fused(f_ops: list[Tensor], w: Tensor, out: Tensor) -> None:
        x, g = _kernel_args(pro, f_ops, out)
        launch(x, w, out.view(x.shape[0], w.shape[0]), accumulate=accumulate, block_n=bn, block_k=bk,
               num_warps=warps, num_stages=stages, prologue=prologue, g=g, eps=pro.eps, divisor=pro.divisor)
    return fused


def _inductor(f_ops: list[Tensor], w: Tensor, out: Tensor, accumulate: bool, fusion_body) -> Kernel:
    """One row: the fusion and the product as one graph for Inductor, which generates one reduction
    over K with the fusion's elementwise work in its loads where it can (SwiGLU), as gpt-fast's
    decode kernels come out of ``torch.compile`` (accumulating: into a fresh row, then one add)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    eager = kf.interpreter(fusion_body, out.device)
    n = len(f_ops)

    def graph(*args: Tensor) -> Tensor:
        x = eager(*args[:n]).reshape(1, -1)
        return (x.float() * args[n].float()).sum(-1).unsqueeze(0).to(out.dtype)

    gm = make_fx(graph)(*f_ops, w)
    compiled = torch._inductor.compile(gm, [*f_ops, w], options=kg._OPTIONS)

    def generated(f_ops: list[Tensor], w: Tensor, out: Tensor) -> None:
        r = compiled(*f_ops, w)
        r = r[0] if isinstance(r, (tuple, list)) else r
        o = out.view(r.shape)
        if accumulate:
            o.add_(r)
        else:
            o.copy_(r)
    return generated


def _choose(pro: Prologue, f_ops: list[Tensor], w: Tensor, out: Tensor, accumulate: bool,
            unfused, fusion_body) -> Kernel | None:
    """The fastest correct fused candidate on this device, or None where the op-by-op pair is fastest."""
    def pair(f_ops: list[Tensor], w: Tensor, out: Tensor) -> None:
        unfused(f_ops, w, out, out if accumulate else None)

    def run(kernel: Kernel, result: Tensor) -> None:
        kernel(f_ops, w, result)

    with kf.COMPILE_LOCK, torch.no_grad(), metrics.timer("gemv.compile"):
        want = out.clone()
        run(pair, want)  # also makes the pair's own product choice before it is captured
        names, kernels = ["unfused"], [pair]
        if fusion_body is not None and out.numel() == out.shape[-1]:  # one row
            kernel = kg.checked(lambda: _inductor(f_ops, w, out, accumulate, fusion_body), run, out, want)
            if kernel is not None:
                names.append("inductor")
                kernels.append(kernel)
        try:
            import spmd.runtime.triton_skinny  # noqa: F401 - only the pair without Triton
            configs = [(c, False) for c in kg.SKINNY_CONFIGS]
            configs += [(c, True) for c in kg.ROW_CONFIGS] if out.numel() == out.shape[-1] else []
        except ImportError:
            configs = []
        for config, row in configs:
            kernel = kg.checked(lambda config=config, row=row: _triton(pro, accumulate, config, row), run, out, want)
            if kernel is None:
                metrics.counter("gemv.fallback").inc()
                continue
            names.append(("row" if row else "triton") + "-{}x{}-w{}-s{}".format(*config))
            kernels.append(kernel)
    times = kg._median_us(tuple(kernels), run, out.clone())
    best = min(range(len(times)), key=times.__getitem__)
    x = _kernel_args(pro, f_ops, out)[0]
    kg.DECISIONS.append(kg.Decision(tuple(w.shape), x.shape[0], str(x.dtype), accumulate,
                                    tuple(zip(names, times, strict=True)), names[best], prologue=pro.kind))
    metrics.counter("gemv.unfused" if best == 0 else "gemv.prologue").inc()
    return None if best == 0 else kernels[best]
