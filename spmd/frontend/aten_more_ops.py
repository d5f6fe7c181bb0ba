"""ATen -> HLO-lite converters for log1p/expm1, prod, any/all, flip and constant padding.

- ``log1p`` / ``expm1`` map to XLA's ``log-plus-one`` / ``exponential-minus-one`` unary opcodes
  (exact near 0, unlike ``log(1 + x)``).
- ``prod`` is a reduce with a multiply computation; ``any`` / ``all`` are or / and reduces of
  ``x != 0``. A product or boolean reduce over a sharded dim gathers that dim first
  (``spmd.passes.sharding_rules``), so the result matches one device exactly.
- ``flip`` is a rows-form gather along each flipped dim with the constant indices ``n-1, ..., 0``.
- ``constant_pad_nd`` (``F.pad(mode="constant")``) is XLA ``pad``; negative amounts crop, as in
  PyTorch (a slice after the pad).
- ``new_empty_strided`` (the autograd engine's buffer for a gradient whose strides differ from
  its input's, then copied into): zeros, one choice of its unspecified contents; strides are a
  memory layout, which HLO-lite values do not have.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from spmd.frontend.aten_common import UnsupportedOpError, norm_dim, norm_dims, operand, out_dims, out_dtype, register
from spmd.frontend.emitter import Emitter
from spmd.ir.hlo import Instruction, Shape

aten = torch.ops.aten


# --------------------------------------------------------------------------- elementwise
def _unary(opcode: str):
    def convert(em: Emitter, a: dict, val) -> Instruction:
        dtype, dims = out_dtype(val), out_dims(val)
        return em.emit(opcode, Shape(dtype, dims), [operand(em, a["self"], dtype, dims)])
    return convert


register(aten.log1p.default)(_unary("log-plus-one"))
register(aten.expm1.default)(_unary("exponential-minus-one"))


# --------------------------------------------------------------------------- reductions
@register(aten.prod.default, aten.prod.dim_int)
def _prod(em: Emitter, a: dict, val) -> Instruction:
    """``x.prod()`` / ``x.prod(dim, keepdim)`` in the result dtype PyTorch picks (ints -> int64); a
    16-bit float product accumulates in float32 and rounds once, as PyTorch's kernels do."""
    x = em.convert(a["self"], out_dtype(val))
    dims = norm_dims(a.get("dim"), x.shape.rank)
    wide = em.convert(x, "f32") if x.shape.dtype in ("f16", "bf16") else x
    return em.reshape(em.convert(em.reduce(wide, dims, "multiply"), x.shape.dtype), out_dims(val))


def _bool_reduce(kind: str):
    def convert(em: Emitter, a: dict, val) -> Instruction:
        x = a["self"]
        if x.shape.dtype != "pred":
            x = em.compare(x, em.scalar(0, x.shape.dtype, x.shape.dims), "NE")
        dims = a.get("dim")
        dims = norm_dims(dims, x.shape.rank) if dims is not None else tuple(range(x.shape.rank))
        r = em.reshape(em.reduce(x, dims, kind), out_dims(val))
        return em.convert(r, out_dtype(val))  # any/all of uint8 return uint8
    return convert


_ANY = [getattr(aten.any, o) for o in ("default", "dim", "dims") if hasattr(aten.any, o)]
_ALL = [getattr(aten.all, o) for o in ("default", "dim", "dims") if hasattr(aten.all, o)]
register(*_ANY)(_bool_reduce("or"))
register(*_ALL)(_bool_reduce("and"))


# --------------------------------------------------------------------------- flip
def _reverse(em: Emitter, x: Instruction, d: int) -> Instruction:
    """``x`` reversed along dim ``d``: a rows-form gather of indices ``n-1, ..., 0``."""
    n, r = x.shape.dims[d], x.shape.rank
    if n <= 1:
        return x
    index = em.constant(torch.arange(n - 1, -1, -1, dtype=torch.int64))
    attrs = {"offset_dims": tuple(range(d)) + tuple(range(d + 1, r)), "collapsed_slice_dims": (d,),
             "start_index_map": (d,), "index_vector_dim": 1,
             "slice_sizes": tuple(1 if i == d else m for i, m in enumerate(x.shape.dims))}
    return em.emit("gather", x.shape, [x, index], attrs)


@register(aten.flip.default)
def _flip(em: Emitter, a: dict, val) -> Instruction:
    x = a["self"]
    if x.shape.rank == 0:
        return x
    for d in sorted({norm_dim(d, x.shape.rank) for d in a["dims"]}):
        x = _reverse(em, x, d)
    return x


# --------------------------------------------------------------------------- padding
@register(aten.constant_pad_nd.default)
def _constant_pad(em: Emitter, a: dict, val) -> Instruction:
    """``F.pad(x, pad, value=v)``: ``pad`` lists (lo, hi) pairs from the last dim backwards."""
    x, pad, value = a["self"], list(a["pad"]), a.get("value", 0)
    if len(pad) % 2 or len(pad) // 2 > x.shape.rank:
        raise ValueError(f"F.pad: pad must have an even length of at most 2 * {x.shape.rank}, got {pad}")
    amounts = [(0, 0)] * x.shape.rank
    for k in range(len(pad) // 2):
        amounts[x.shape.rank - 1 - k] = (int(pad[2 * k]), int(pad[2 * k + 1]))
    if all(p == (0, 0) for p in amounts):
        return x
    grow = tuple((max(lo, 0), max(hi, 0), 0) for lo, hi in amounts)
    if any(p != (0, 0, 0) for p in grow):
        dims = tuple(n + lo + hi for n, (lo, hi, _) in zip(x.shape.dims, grow, strict=True))
        fill = _fill_value(em, value, x.shape.dtype)
        x = em.emit("pad", x.shape.with_dims(dims), [x, fill], {"padding": grow})
    crop = [(-min(lo, 0), n + min(hi, 0), 1) for n, (lo, hi) in zip(x.shape.dims, amounts, strict=True)]
    return em.slice(x, crop)


def _fill_value(em: Emitter, value: Any, dtype: str) -> Instruction:
    if isinstance(value, Instruction):
        raise UnsupportedOpError("F.pad: a tensor pad value is not supported; pass a Python number")
    return em.scalar(value if value is not None else 0, dtype)


# --------------------------------------------------------------------------- order statistics
def _order_statistic(em: Emitter, x: Instruction, d: int, k: int, nan_first: bool) -> tuple[Instruction, Instruction]:
    """Value and s64 index of the ``k``-th smallest (0-based) element along ``d``, kept as a size-1 dim.

    A stable ascending sort (custom call ``sort``, NaN last as in PyTorch) then a slice at ``k``;
    with ``nan_first`` (median) a row holding a NaN answers NaN and the index of its first NaN.
    """
    from spmd.frontend.aten_sort_ops import arg_reduce

    config = {"dim": d, "descending": False, "stable": True}
    dims = x.shape.dims
    values = em.custom_call("sort", [x], Shape(x.shape.dtype, dims), {**config, "output": "values"})
    idx = em.custom_call("sort", [x], Shape("s64", dims), {**config, "output": "indices"})
    spec = [(k, k + 1, 1) if i == d else (0, n, 1) for i, n in enumerate(dims)]
    v, i = em.slice(values, spec), em.slice(idx, spec)
    if nan_first and x.shape.dtype.startswith(("f", "bf")):
        isnan = em.compare(x, x, "NE")
        kept = v.shape.dims
        has_nan = em.reshape(em.reduce(isnan, (d,), "or"), kept)
        _, first = arg_reduce(em, em.convert(isnan, "s32"), d, "maximum")
        first = em.reshape(em.convert(first, "s64"), kept)
        v = em.select(has_nan, em.scalar(float("nan"), x.shape.dtype, kept), v)
        i = em.select(has_nan, first, i)
    return v, i


def _stat_args(em: Emitter, a: dict) -> tuple[Instruction, int]:
    x = a["self"]
    x = em.reshape(x, (1,)) if x.shape.rank == 0 else x
    return x, norm_dim(a.get("dim", -1), x.shape.rank)


@register(aten.kthvalue.default)
def _kthvalue(em: Emitter, a: dict, val) -> tuple[Instruction, Instruction]:
    """``torch.kthvalue(x, k, dim, keepdim)``: the k-th smallest (1-based) value and its index."""
    x, d = _stat_args(em, a)
    k = int(a["k"])
    if not 1 <= k <= x.shape.dims[d]:
        raise ValueError(f"kthvalue: expected k in [1, {x.shape.dims[d]}] (the size of dim {d}), got {k}")
    v, i = _order_statistic(em, x, d, k - 1, nan_first=False)
    return em.reshape(v, out_dims(val[0])), em.reshape(i, out_dims(val[1]))


@register(aten.median.dim)
def _median_dim(em: Emitter, a: dict, val) -> tuple[Instruction, Instruction]:
    """``x.median(dim, keepdim)``: the lower of the two middle values (PyTorch's), NaN if the row has one."""
    x, d = _stat_args(em, a)
    if x.shape.dims[d] == 0:  # torch raises too
        raise ValueError(f"median: expected a non-empty dim {d}, got shape {list(x.shape.dims)}")
    v, i = _order_statistic(em, x, d, (x.shape.dims[d] - 1) // 2, nan_first=True)
    return em.reshape(v, out_dims(val[0])), em.reshape(i, out_dims(val[1]))


@register(aten.median.default)
def _median(em: Emitter, a: dict, val) -> Instruction:
    x = em.reshape(a["self"], (a["self"].shape.numel,))
    if x.shape.numel == 0:  # torch: the median of no elements is NaN
        if not x.shape.torch_dtype.is_floating_point:
            raise ValueError(f"median: expected a non-empty tensor of dtype {x.shape.torch_dtype}, got shape [0]")
        return em.scalar(math.nan, x.shape.dtype)
    v, _ = _order_statistic(em, x, 0, (x.shape.dims[0] - 1) // 2, nan_first=True)
    return em.reshape(v, ())


# --------------------------------------------------------------------------- isnan / isinf
@register(aten.isnan.default)
def _isnan(em: Emitter, a: dict, val) -> Instruction:
    """``torch.isnan``: ``x != x`` for floating x (IEEE), all False for integers and bools."""
    x = a["self"]
    if not x.shape.torch_dtype.is_floating_point:
        return em.scalar(False, "pred", x.shape.dims)
    return em.compare(x, x, "NE")


@register(aten.isinf.default)
def _isinf(em: Emitter, a: dict, val) -> Instruction:
    """``torch.isinf``: ``|x| == inf`` for floating x, all False for integers and bools."""
    x = a["self"]
    if not x.shape.torch_dtype.is_floating_point:
        return em.scalar(False, "pred", x.shape.dims)
    return em.compare(em.unary("abs", x), em.scalar(math.inf, x.shape.dtype, x.shape.dims), "EQ")


# --------------------------------------------------------------------------- uninitialised buffers
@register(aten.new_empty_strided.default)
def _new_empty_strided(em: Emitter, a: dict, val) -> Instruction:
    """``x.new_empty_strided(size, stride)``: zeros of ``size`` (its contents are unspecified)."""
    return em.scalar(0, out_dtype(val), out_dims(val))
