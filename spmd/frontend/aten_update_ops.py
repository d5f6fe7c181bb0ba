"""ATen -> HLO-lite converters for functional in-place updates (what torch.export's
functionalization makes of ``x[:, :4] = y``, ``x[:, i] = y``, ``copy_``, ``index_put_``,
``index_copy_``).

=====================================  ==================================================
ATen op                                HLO-lite
=====================================  ==================================================
``copy(x, src)``                       ``src`` converted to x's dtype, broadcast to x's dims
``slice_scatter`` (step 1)             ``dynamic-update-slice`` at constant starts
``select_scatter``                     ``dynamic-update-slice`` of a size-1 slab
``index_put`` (every index one        ``dynamic-update-slice`` at the (device) positions:
element, accumulate=False)             the KV-cache update ``cache[:, :, pos] = k``
``index_put`` with a boolean mask      ``select(mask, value, x)`` (one value only)
``index_put`` / ``index_copy`` else    ``scatter`` (``spmd.frontend.aten_index_ops``)
=====================================  ==================================================

Index semantics: negative positions count from the end (as in PyTorch). Positions out of
``[-n, n)`` are not checked on the device (that would need a host sync per call): a
``dynamic-update-slice`` clamps its start into range (XLA semantics) where PyTorch eager raises.
Index dtypes are checked as PyTorch checks them (``aten_common.check_index``): int64 for
``index_copy``, int64 / int32 / bool for ``index_put``.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.frontend.aten_common import LONG, MASKS, check_index, norm_dim, out_dims, out_dtype, register
from spmd.frontend.emitter import Emitter
from spmd.ir.hlo import Instruction

aten = torch.ops.aten


def wrap_index(em: Emitter, idx: Instruction, n: int) -> Instruction:
    """``idx`` as s64 with negative entries counting from the end (``idx + n`` where ``idx < 0``)."""
    idx = em.convert(idx, "s64")
    dims = idx.shape.dims
    wrapped = em.binary("add", idx, em.scalar(n, "s64", dims))
    return em.select(em.compare(idx, em.scalar(0, "s64", dims), "LT"), wrapped, idx)


def dynamic_update(em: Emitter, x: Instruction, update: Instruction, starts: list[Any]) -> Instruction:
    """``dynamic-update-slice(x, update, starts...)``; ``starts`` are ints or s64 scalar instructions.

    ``update`` is converted to x's dtype and must have x's rank. Returns x itself when the
    update is empty.
    """
    update = em.convert(update, x.shape.dtype)
    if update.shape.numel == 0:
        return x
    if update.shape.dims == x.shape.dims and all(isinstance(s, int) for s in starts):
        return update
    ops = [s if isinstance(s, Instruction) else em.scalar(int(s), "s64") for s in starts]
    return em.emit("dynamic-update-slice", x.shape, [x, update, *ops])


@register(aten.copy.default)
def _copy(em: Emitter, a: dict, val) -> Instruction:
    """``copy(x, src)``: x's values replaced by ``src`` (broadcast, converted to x's dtype)."""
    return em.broadcast_to(em.convert(a["src"], out_dtype(val)), out_dims(val))


@register(aten.slice_scatter.default)
def _slice_scatter(em: Emitter, a: dict, val) -> Instruction:
    """``x[..., start:end:step, ...] = src`` along ``dim``."""
    x, src = a["self"], a["src"]
    d = norm_dim(a["dim"], x.shape.rank)
    start, stop, step = slice(a["start"], a["end"], a["step"]).indices(x.shape.dims[d])
    if step == 1 or src.shape.dims[d] <= 1:
        starts = [start if i == d else 0 for i in range(x.shape.rank)]
        return dynamic_update(em, x, src, starts)
    from spmd.frontend.aten_index_ops import index_scatter
    index = em.constant(torch.arange(start, max(stop, start), step, dtype=torch.int64))
    return index_scatter(em, x, d, index, src, "replace")


@register(aten.select_scatter.default)
def _select_scatter(em: Emitter, a: dict, val) -> Instruction:
    """``x[..., index, ...] = src`` along ``dim`` (src has x's dims without ``dim``)."""
    x, src = a["self"], a["src"]
    d = norm_dim(a["dim"], x.shape.rank)
    slab = tuple(1 if i == d else n for i, n in enumerate(x.shape.dims))
    starts = [a["index"] % x.shape.dims[d] if i == d else 0 for i in range(x.shape.rank)]
    return dynamic_update(em, x, em.reshape(em.broadcast_to(src, slab[:d] + slab[d + 1:]), slab), starts)


def index_result_dims(x_dims: tuple[int, ...], indices: list[Instruction | None]) -> tuple[int, ...]:
    """Dims of ``x[indices]`` (PyTorch advanced indexing; None = the whole dim).

    The broadcast index dims replace the indexed dims in place when the indexed dims are
    adjacent, else they go first (NumPy rules).
    """
    used = [i for i, t in enumerate(indices) if t is not None]
    batch = tuple(torch.broadcast_shapes(*[indices[i].shape.dims for i in used]))
    rest = [n for i, n in enumerate(x_dims) if i not in used]
    if used == list(range(used[0], used[-1] + 1)):
        return tuple(rest[:used[0]]) + batch + tuple(rest[used[0]:])
    return batch + tuple(rest)


def _mask_put(em: Emitter, x: Instruction, first: int, mask: Instruction, values: Instruction,
              accumulate: bool) -> Instruction:
    """``x[..., mask] = v`` / ``+= v`` for a boolean mask over x's dims ``first, first+1, ...`` and one value."""
    if values.shape.numel != 1:
        raise NotImplementedError("index_put with a boolean mask and more than one value "
                                  "(the number of selected elements is data-dependent)")
    dims = x.shape.dims
    m = em.broadcast(mask, dims, tuple(range(first, first + mask.shape.rank)))
    v = em.broadcast_to(em.reshape(em.convert(values, x.shape.dtype), ()), dims)
    if accumulate:
        return em.binary("add", x, em.select(m, v, em.scalar(0, x.shape.dtype, dims)))
    return em.select(m, v, x)


@register(aten.index_put.default, aten._unsafe_index_put.default)
def _index_put(em: Emitter, a: dict, val) -> Instruction:
    """``x[indices] = values`` (``+=`` with accumulate=True); None entries mean the whole dim."""
    x, values, accumulate = a["self"], a["values"], bool(a["accumulate"])
    indices = list(a["indices"]) + [None] * (x.shape.rank - len(a["indices"]))
    used = [i for i, t in enumerate(indices) if t is not None]
    for i in used:
        check_index(indices[i], allowed=MASKS)
    if not used:
        v = em.broadcast_to(em.convert(values, x.shape.dtype), x.shape.dims)
        return em.binary("add", x, v) if accumulate else v
    if any(indices[i].shape.dtype == "pred" for i in used):
        if len(used) != 1:
            raise NotImplementedError("index_put with a boolean mask combined with other indices")
        return _mask_put(em, x, used[0], indices[used[0]], values, accumulate)
    res = index_result_dims(x.shape.dims, indices)
    values = em.broadcast_to(em.convert(values, x.shape.dtype), res)
    if not accumulate and all(indices[i].shape.numel == 1 for i in used):
        slab = tuple(1 if i in used else n for i, n in enumerate(x.shape.dims))
        starts = [em.reshape(wrap_index(em, indices[i], x.shape.dims[i]), ()) if i in used else 0
                  for i in range(x.shape.rank)]
        return dynamic_update(em, x, em.reshape(values, slab), starts)
    from spmd.frontend.aten_index_ops import index_put_scatter
    return index_put_scatter(em, x, indices, values, accumulate)


@register(aten.index_copy.default)
def _index_copy(em: Emitter, a: dict, val) -> Instruction:
    """``x.index_copy(dim, index, source)``: rows ``index`` of x along dim replaced by source."""
    x = a["self"]
    d = norm_dim(a["dim"], x.shape.rank)
    index = a["index"]
    check_index(index, allowed=LONG)
    if index.shape.rank == 0:
        index = em.reshape(index, (1,))
    indices = [None] * d + [index]
    return _index_put(em, {"self": x, "indices": indices, "values": a["source"], "accumulate": False}, val)

