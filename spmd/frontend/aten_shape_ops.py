"""ATen -> HLO-lite converters for shape, slicing, creation and bookkeeping ops.

Result dims come from ``val`` (PyTorch's own shape computation), so ``-1`` sizes, negative
dims and ``squeeze`` of non-unit dims need no re-implementation. View ops become ``reshape`` /
``transpose`` / ``broadcast`` / ``slice``; creation ops become a scalar constant broadcast or an
``iota``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from spmd.frontend.aten_common import ATEN_OPS, MASKS, check_index, norm_dim, out_dims, out_dtype, register
from spmd.frontend.constraint import decode_spec
from spmd.frontend.emitter import Emitter
from spmd.ir.hlo import Instruction

aten = torch.ops.aten


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dim,
          aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default, aten.flatten.using_ints,
          aten.unflatten.int, aten.view_as.default, aten.reshape_as.default)
def _reshape(em: Emitter, a: dict, val) -> Instruction:
    return em.reshape(list(a.values())[0], out_dims(val))


@register(aten.permute.default)
def _permute(em: Emitter, a: dict, val) -> Instruction:
    x = a["self"]
    return em.transpose(x, [norm_dim(d, x.shape.rank) for d in a["dims"]])


@register(aten.transpose.int)
def _transpose(em: Emitter, a: dict, val) -> Instruction:
    x = a["self"]
    if x.shape.rank == 0:  # torch allows dims 0 / -1 of a 0-d tensor: nothing to swap
        return x
    perm = list(range(x.shape.rank))
    d0, d1 = norm_dim(a["dim0"], x.shape.rank), norm_dim(a["dim1"], x.shape.rank)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return em.transpose(x, perm)


@register(aten.t.default, aten.numpy_T.default)
def _t(em: Emitter, a: dict, val) -> Instruction:
    x = a["self"]
    return em.transpose(x, list(reversed(range(x.shape.rank))))


@register(aten.expand.default, aten.expand_as.default, aten.broadcast_to.default)
def _expand(em: Emitter, a: dict, val) -> Instruction:
    return em.broadcast_to(a["self"], out_dims(val))


def _slice_dim(em: Emitter, x: Instruction, dim: int, start: int, stop: int, step: int) -> Instruction:
    spec = [(0, n, 1) for n in x.shape.dims]
    spec[dim] = (start, stop, step)
    return em.slice(x, spec)


@register(aten.slice.Tensor)
def _slice(em: Emitter, a: dict, val) -> Instruction:
    x = a["self"]
    d = norm_dim(a["dim"], x.shape.rank)
    start, stop, step = slice(a["start"], a["end"], a["step"]).indices(x.shape.dims[d])
    stop = max(stop, start)
    return _slice_dim(em, x, d, start, stop, step)


@register(aten.select.int)
def _select(em: Emitter, a: dict, val) -> Instruction:
    x = a["self"]
    d = norm_dim(a["dim"], x.shape.rank)
    i = a["index"] % x.shape.dims[d]
    return em.reshape(_slice_dim(em, x, d, i, i + 1, 1), out_dims(val))


@register(aten.narrow.default)
def _narrow(em: Emitter, a: dict, val) -> Instruction:
    x = a["self"]
    d = norm_dim(a["dim"], x.shape.rank)
    start = a["start"] % x.shape.dims[d] if a["start"] < 0 else a["start"]
    return _slice_dim(em, x, d, start, start + a["length"], 1)


@register(aten.cat.default, aten.concat.default, aten.concatenate.default)
def _cat(em: Emitter, a: dict, val) -> Instruction:
    dtype = out_dtype(val)
    xs = [em.convert(x, dtype) for x in a["tensors"] if not (x.shape.rank == 1 and x.shape.dims[0] == 0)]
    return em.concatenate(xs, norm_dim(a["dim"], len(out_dims(val))))


@register(aten.stack.default)
def _stack(em: Emitter, a: dict, val) -> Instruction:
    dims = out_dims(val)
    d = norm_dim(a["dim"], len(dims))
    one = dims[:d] + (1,) + dims[d + 1:]
    return em.concatenate([em.reshape(em.convert(x, out_dtype(val)), one) for x in a["tensors"]], d)


def _pieces(em: Emitter, x: Instruction, dim: int, sizes: list[int]) -> tuple[Instruction, ...]:
    out, start = [], 0
    for n in sizes:
        out.append(_slice_dim(em, x, dim, start, start + n, 1))
        start += n
    return tuple(out)


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.tensor_split.sections)
def _split(em: Emitter, a: dict, val) -> tuple[Instruction, ...]:
    x = a["self"]
    d = norm_dim(a.get("dim", 0), x.shape.rank)
    return _pieces(em, x, d, [int(v.shape[d]) for v in val])


@register(aten.unbind.int)
def _unbind(em: Emitter, a: dict, val) -> tuple[Instruction, ...]:
    x = a["self"]
    d = norm_dim(a["dim"], x.shape.rank)
    return tuple(em.reshape(p, out_dims(v)) for p, v in zip(_pieces(em, x, d, [1] * x.shape.dims[d]), val, strict=True))


@register(aten.index.Tensor)
def _index(em: Emitter, a: dict, val) -> Instruction:
    """``x[i0, i1, ...]`` with integer index tensors (None = the whole dim).

    The indexed dims are moved to the front and flattened; the broadcast index tensors become
    one flat row index (``sum_j i_j * stride_j``) and one embedding-form gather reads the rows.
    """
    x, indices = a["self"], list(a["indices"])
    used = [i for i, t in enumerate(indices) if t is not None]
    for i in used:
        check_index(indices[i], allowed=MASKS)
    if any(indices[i].shape.dtype == "pred" for i in used):
        raise NotImplementedError("aten.index with a boolean mask (data-dependent shape)")
    batch = tuple(torch.broadcast_shapes(*[indices[i].shape.dims for i in used]))
    rest = [i for i in range(x.shape.rank) if i not in used]
    sizes = [x.shape.dims[i] for i in used]
    flat, stride = None, 1
    for i, n in reversed(list(zip(used, sizes, strict=True))):
        idx = em.broadcast_to(em.convert(indices[i], "s64"), batch)
        # negative indices count from the end, as in PyTorch (out-of-range ones are clamped by
        # the gather, as in XLA; PyTorch eager raises for them instead)
        wrapped = em.binary("add", idx, em.scalar(n, "s64", batch))
        idx = em.select(em.compare(idx, em.scalar(0, "s64", batch), "LT"), wrapped, idx)
        if stride != 1:
            idx = em.binary("multiply", idx, em.scalar(stride, "s64", batch))
        flat = idx if flat is None else em.binary("add", flat, idx)
        stride *= n
    moved = em.transpose(x, used + rest)
    moved = em.reshape(moved, (stride,) + tuple(x.shape.dims[i] for i in rest))
    g = em.gather_rows(moved, flat)
    adjacent = used == list(range(used[0], used[-1] + 1))
    if adjacent and used[0] > 0:
        nb, nbefore = len(batch), used[0]
        perm = list(range(nb, nb + nbefore)) + list(range(nb)) + list(range(nb + nbefore, g.shape.rank))
        g = em.transpose(g, perm)
    return em.reshape(g, out_dims(val))


# --------------------------------------------------------------------------- creation
@register(aten.full.default, aten.full_like.default, aten.new_full.default, aten.scalar_tensor.default)
def _full(em: Emitter, a: dict, val) -> Instruction:
    fill = a["fill_value"] if "fill_value" in a else a["s"]
    return em.scalar(fill, out_dtype(val), out_dims(val))


@register(aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.empty.memory_format,
          aten.empty_like.default, aten.new_empty.default)
def _zeros(em: Emitter, a: dict, val) -> Instruction:
    return em.scalar(0, out_dtype(val), out_dims(val))


@register(aten.ones.default, aten.ones_like.default, aten.new_ones.default)
def _ones(em: Emitter, a: dict, val) -> Instruction:
    return em.scalar(1, out_dtype(val), out_dims(val))


@register(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(em: Emitter, a: dict, val) -> Instruction:
    dtype, dims = out_dtype(val), out_dims(val)
    start = a.get("start", 0)
    step = a.get("step", 1)
    r = em.iota(dims, 0, dtype)
    if step != 1:
        r = em.binary("multiply", r, em.scalar(step, dtype, dims))
    if start != 0:
        r = em.binary("add", r, em.scalar(start, dtype, dims))
    return r


# --------------------------------------------------------------------------- bookkeeping
@register(operator.getitem)
def _getitem(em: Emitter, a: dict, val) -> Any:
    return a["self"][a["index"]]


@register(aten._assert_tensor_metadata.default, aten._assert_scalar.default,
          aten.sym_constrain_range_for_size.default, aten._assert_async.msg)
def _assert(em: Emitter, a: dict, val) -> None:
    return None


@register(torch.ops.spmd.sharding_constraint.default)
def _sharding_constraint(em: Emitter, a: dict, val) -> Instruction:
    x = a["x"]
    return em.custom_call("Sharding", [x], x.shape, sharding=decode_spec(a["spec"]))


assert aten.view.default in ATEN_OPS


@register(aten.repeat.default)
def _repeat(em: Emitter, a: dict, val) -> Instruction:
    """``x.repeat(*reps)``: x (left-padded with size-1 dims to ``len(reps)``) broadcast to
    ``[r0, d0, r1, d1, ...]`` and reshaped to ``[r0 * d0, r1 * d1, ...]`` (tiling, as numpy.tile)."""
    x, reps = a["self"], [int(r) for r in a["repeats"]]
    dims = (1,) * (len(reps) - x.shape.rank) + tuple(x.shape.dims)
    x = em.reshape(x, dims)
    tiled = tuple(n for r, d in zip(reps, dims, strict=True) for n in (r, d))
    wide = em.broadcast(x, tiled, tuple(range(1, 2 * len(dims), 2)))
    return em.reshape(wide, out_dims(val))
