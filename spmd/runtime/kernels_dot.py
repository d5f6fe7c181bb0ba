"""The ``dot`` kernel (XLA DotGeneral) on torch.mm / torch.bmm.

Result dims are the batch dims, then the lhs free dims, then the rhs free dims, each in operand
order (https://openxla.org/xla/operation_semantics#dotgeneral). The operands are permuted
(a view) to ``lhs [B, M, K]`` and ``rhs [B, K, N]``; ``reshape`` stays a view whenever the
strides allow (row-major inputs in the usual layouts: ``x @ w``, ``x @ w.T``, attention's
``q @ k.T``), so the common cases run a single cuBLAS call, writing straight into ``out``.
"""

from __future__ import annotations

import functools
import math

import torch

from spmd.ir.hlo import Instruction
from spmd.runtime import kernels_gemv

Tensor = torch.Tensor


def _split_dims(rank: int, batch: tuple[int, ...], contracting: tuple[int, ...]) -> tuple[int, ...]:
    used = set(batch) | set(contracting)
    return tuple(d for d in range(rank) if d not in used)


def _perm_or_none(perm: tuple[int, ...]) -> tuple[int, ...] | None:
    return None if perm == tuple(range(len(perm))) else perm


def widened_mm(mm, x: Tensor, y: Tensor, dtype: torch.dtype) -> Tensor:
    """``mm(x, y)`` accumulated and returned in the wider float ``dtype`` (a bf16 product with a
    float32 result is not rounded to bf16 first): cuBLAS's ``out_dtype`` GEMM where the device has
    one, else the product of the operands converted to ``dtype`` (exact: products of 16-bit values
    are exact in float32)."""
    if x.is_cuda and dtype == torch.float32 and _has_out_dtype_gemm(x.dtype):
        return mm(x, y, out_dtype=dtype)
    return mm(x.to(dtype), y.to(dtype))


@functools.cache
def _has_out_dtype_gemm(dtype: torch.dtype) -> bool:
    """Whether this PyTorch build's CUDA ``mm`` / ``bmm`` take ``out_dtype=torch.float32`` for ``dtype`` operands."""
    try:
        x = torch.ones(1, 1, 1, dtype=dtype, device="cuda")
        torch.mm(x[0], x[0], out_dtype=torch.float32)
        torch.bmm(x, x, out_dtype=torch.float32)
        return True
    except (RuntimeError, TypeError):
        return False


def build_dot(inst: Instruction, dev=None):
    """Kernel ``(operands, out) -> Tensor`` for a dot instruction.

    Operands: lhs and rhs of the same dtype; the result dtype may differ (e.g. bf16 inputs
    with an f32 result), in which case the product is converted.
    """
    lhs, rhs = inst.operands
    lb, rb = tuple(inst.attrs.get("lhs_batch_dims", ())), tuple(inst.attrs.get("rhs_batch_dims", ()))
    lc, rc = tuple(inst.attrs["lhs_contracting_dims"]), tuple(inst.attrs["rhs_contracting_dims"])
    lf = _split_dims(lhs.shape.rank, lb, lc)
    rf = _split_dims(rhs.shape.rank, rb, rc)
    ld, rd = lhs.shape.dims, rhs.shape.dims
    b = math.prod(ld[d] for d in lb)
    m = math.prod(ld[d] for d in lf)
    k = math.prod(ld[d] for d in lc)
    n = math.prod(rd[d] for d in rf)
    lperm = _perm_or_none(lb + lf + lc)
    rperm = _perm_or_none(rb + rc + rf)
    out_dims = inst.shape.dims
    dtype = inst.shape.torch_dtype
    convert = lhs.shape.dtype != inst.shape.dtype
    widen = convert and dtype.is_floating_point and dtype.itemsize > lhs.shape.torch_dtype.itemsize
    skinny = not lb and m <= kernels_gemv.MAX_ROWS  # a decode-step product: maybe a generated kernel
    if lb:
        a_shape, b_shape, o_shape, mm = (b, m, k), (b, k, n), (b, m, n), torch.bmm
    else:
        a_shape, b_shape, o_shape, mm = (m, k), (k, n), (m, n), torch.mm

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        x, y = ops
        if lperm is not None:
            x = x.permute(lperm)
        if rperm is not None:
            y = y.permute(rperm)
        x = x.reshape(a_shape)
        y = y.reshape(b_shape)
        if out is not None and not convert and out.is_contiguous():
            o = out.view(o_shape)
            if skinny and (w := kernels_gemv.as_weight(y)) is not None and kernels_gemv.gemv(x, w, o, False):
                return out
            mm(x, y, out=o)
            return out
        r = (widened_mm(mm, x, y, dtype) if widen else mm(x, y)).reshape(out_dims)
        if convert:
            r = r.to(dtype)
        if out is None:
            return r
        return out.copy_(r)
    return kernel
