"""The matmul-only anchor: a workload's matrix products alone, timed in the same rounds as the rest.

A row's *compute floor* divides its FLOPs by the dense GEMM rate of a short burst; on a card that
runs at its power cap under sustained load (the H200 does on the Llama 4 × 2048 row) that burst
rate is not reached by anything that runs for seconds. This anchor measures the sustained floor
instead: the GEMMs and attention calls of one eager forward (same shapes, strides, dtypes and
ATen kernels, on fresh random operands), replayed back to back without any other kernel, in one
CUDA graph on a GPU, and timed interleaved with the variants it bounds. A program that runs
these products and anything else cannot, in the same rounds, be faster than this call.

Used by ``benchmarks.one_gpu`` as the ``matmul-only`` column.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: ATen overloads that count as matrix products (GEMMs and fused attention).
_MATMUL_OPS = (
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
)


@dataclass(frozen=True)
class TensorSpec:
    """Shape, strides and dtype of one tensor operand (its values are not kept)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any


@dataclass(frozen=True)
class MatmulCall:
    """One recorded matrix product: the ATen overload and its arguments, tensors as ``TensorSpec``."""

    op: Any
    args: tuple
    kwargs: tuple[tuple[str, Any], ...]


def record_matmuls(fn: Callable[[], Any]) -> list[MatmulCall]:
    """The matrix products (``_MATMUL_OPS``) that one call of ``fn`` dispatches, in order.

    Raises:
        ValueError: ``fn`` dispatches no matrix product.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    def spec(x):
        return TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype) if isinstance(x, torch.Tensor) else x

    calls: list[MatmulCall] = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func._schema.name in _MATMUL_OPS:
                calls.append(MatmulCall(func, tree_map(spec, tuple(args)),
                                        tuple(sorted(tree_map(spec, kwargs).items()))))
            return func(*args, **kwargs)

    with torch.no_grad(), Recorder():
        fn()
    if not calls:
        raise ValueError("fn: expected a call that runs at least one matrix product, got none")
    return calls


def build_replay(calls: list[MatmulCall], device) -> Callable[[], Any]:
    """A zero-argument call that runs ``calls`` back to back on fresh random operands on ``device``.

    On CUDA the sequence is captured once into a CUDA graph (no launch gaps) and the call replays
    it; on the CPU it runs the ATen calls directly. Operands are allocated once, with the
    recorded strides (a transposed weight stays transposed, an expanded bias stays expanded),
    filled from a normal distribution scaled by 1/sqrt(last dim) so that no product overflows in
    bf16.
    """
    import torch
    from torch.utils._pytree import tree_map

    def make(x):
        if not isinstance(x, TensorSpec):
            return x
        # a buffer that covers every element the strides reach (an expanded operand has stride 0),
        # filled, then viewed with the recorded layout
        extent = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride, strict=True)) if all(x.shape) else 0
        base = torch.empty(extent, dtype=x.dtype, device=device)
        if base.is_floating_point():
            base.normal_(0.0, 1.0 / max(1, x.shape[-1] if x.shape else 1) ** 0.5)
        else:
            base.zero_()
        return base.as_strided(x.shape, x.stride)

    bound = [(c.op, tree_map(make, c.args), dict(tree_map(make, dict(c.kwargs)))) for c in calls]

    def run():
        out = None
        for op, args, kwargs in bound:
            out = op(*args, **kwargs)
        return out

    if device.type != "cuda":
        return run
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()  # warm up: cuBLAS handles and workspaces exist before capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def matmul_only(fn: Callable[[], Any], device) -> Callable[[], Any]:
    """``build_replay(record_matmuls(fn), device)``: the matmul-only anchor of the call ``fn``."""
    return build_replay(record_matmuls(fn), device)
