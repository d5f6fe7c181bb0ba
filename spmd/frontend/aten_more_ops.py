"""ATen -> HLO-lite converters for log1p/expm1, prod, any/all, flip and constant padding.

- ``log1p`` / ``expm1`` map to XLA's ``log-plus-one`` / ``exponential-minus-one`` unary opcodes
  (exact near 0, unlike ``log(1 + x)``).
- ``prod`` is a reduce with a multiply computation; ``any`` / ``all`` are or / and reduces of
  ``x != 0``. A product or boolean reduce over a sharded dim gathers that dim first
  (``spmd.passes.sharding_rules``), so the result matches one device exactly.
- ``flip`` is a rows-form gather along each flipped dim with the constant indices ``n-1, ..., 0``.
- ``constant_pad_nd`` (``F.pad(mode="constant")``) is XLA ``pad``; negative amounts crop, as in
  PyTorch (a slice after the pad).
"""

from __future__ import annotations

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
    """``x.prod()`` / ``x.prod(dim, keepdim)`` in the result dtype PyTorch picks (ints -> int64)."""
    x = em.convert(a["self"], out_dtype(val))
    dims = norm_dims(a.get("dim"), x.shape.rank)
    return em.reshape(em.reduce(x, dims, "multiply"), out_dims(val))


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
