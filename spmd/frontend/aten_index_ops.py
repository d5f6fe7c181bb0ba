"""ATen -> HLO-lite converters for gathers and scatters (``spmd.ir.index_shapes`` forms).

==========================================  ===============================================
ATen op                                     HLO-lite
==========================================  ===============================================
``gather(x, dim, index)``                   along-form ``gather`` (x sliced to index's dims)
``index_select(x, dim, index)``             rows-form ``gather`` along dim
``scatter`` / ``scatter_add`` /             along-form ``scatter`` (replace / add / maximum /
``scatter_reduce`` (include_self=True)      minimum / multiply), into x's slice of index's dims
``index_add(x, dim, index, src, alpha)``    rows-form ``scatter`` with add
``index_put`` (several positions,           rows-form ``scatter`` over the indexed dims
accumulate or not), ``index_copy``          flattened into one (replace, or add)
``slice_scatter`` with a step > 1           rows-form ``scatter`` at constant positions
==========================================  ===============================================

Index values: ``index_put`` (and so ``x[idx] = v``, ``x[idx] += v`` as export writes it) wraps
negative indices as PyTorch does. The other ops take indices in ``[0, n)`` as PyTorch requires;
spmd does not check them on the device (it would need a host sync per call): where PyTorch
eager raises, a gather clamps the index into range and a scatter drops the update (XLA's rules).
Index tensors must be int64 / int32 (int64 for ``one_hot``; int64 / int32 / bool for ``index_put``),
as PyTorch requires: another dtype raises ``InvalidArgumentError`` (a float index is never truncated).
With repeated indices, ``add`` sums every update (embedding backward); a replacing scatter keeps
one of them, unspecified which, as PyTorch documents for ``index_put_`` / ``scatter_``.
"""

from __future__ import annotations

import torch

from spmd.frontend.aten_common import LONG, check_index, norm_dim, out_dims, out_dtype, register
from spmd.frontend.aten_update_ops import dynamic_update, wrap_index
from spmd.frontend.emitter import Emitter
from spmd.ir.hlo import Computation, Instruction, Shape

aten = torch.ops.aten

_REDUCE_KINDS = {"sum": "add", "add": "add", "prod": "multiply", "multiply": "multiply",
                 "amax": "maximum", "amin": "minimum"}


def combiner(em: Emitter, kind: str, dtype: str) -> Computation:
    """The scatter ``to_apply`` of ``kind``: add / maximum / minimum / multiply, or replace ``(x, y) -> y``."""
    if kind != "replace":
        return em.reducer(kind, dtype)
    key = ("replace", dtype)
    if key not in em._reducers:
        name = em.fresh(f"replace.{dtype}")
        s = Shape(dtype)
        x = Instruction(f"{name}.x", "parameter", s, (), {"parameter_number": 0})
        y = Instruction(f"{name}.y", "parameter", s, (), {"parameter_number": 1})
        comp = Computation(name, [x, y], y)
        em.computations.append(comp)
        em._reducers[key] = comp
    return em._reducers[key]


def scatter_rows(em: Emitter, x: Instruction, a: int, idx: Instruction, upd: Instruction, kind: str) -> Instruction:
    """Rows-form scatter: ``upd[i...]`` (a row of x without dim a) combined into ``x`` at row ``idx[i...]``.

    idx ``[*batch]`` integer, upd ``[*batch, *x dims without a]`` (converted to x's dtype).
    """
    nb = idx.shape.rank
    attrs = {"update_window_dims": tuple(range(nb, nb + x.shape.rank - 1)), "inserted_window_dims": (a,),
             "scatter_dims_to_operand_dims": (a,), "index_vector_dim": nb,
             "to_apply": combiner(em, kind, x.shape.dtype)}
    return em.emit("scatter", x.shape, [x, idx, em.convert(upd, x.shape.dtype)], attrs)


def index_scatter(em: Emitter, x: Instruction, d: int, index: Instruction, src: Instruction, kind: str) -> Instruction:
    """``x`` with ``src`` (x's dims, dim d of size len(index)) combined in at rows ``index`` along d."""
    if index.shape.rank == 0:
        index = em.reshape(index, (1,))
    src = em.broadcast_to(src, x.shape.dims[:d] + (index.shape.dims[0],) + x.shape.dims[d + 1:])
    perm = [d] + [i for i in range(x.shape.rank) if i != d]
    return scatter_rows(em, x, d, index, em.transpose(src, perm), kind)


def index_put_scatter(em: Emitter, x: Instruction, indices: list, values: Instruction, accumulate: bool) -> Instruction:
    """``x[indices] = values`` (``+=`` when accumulate) for integer index tensors, as one rows-form scatter.

    The indexed dims are moved first and flattened; the flat row index is ``sum_j i_j * stride_j``
    with negative ``i_j`` wrapped, and -1 (skipped) where any ``i_j`` is out of range.
    ``values`` must already be broadcast to ``x[indices]``'s dims.
    """
    rank = x.shape.rank
    used = [i for i, t in enumerate(indices) if t is not None]
    rest = [i for i in range(rank) if i not in used]
    batch = tuple(torch.broadcast_shapes(*[indices[i].shape.dims for i in used]))
    flat, ok, stride = None, None, 1
    for i in reversed(used):
        n = x.shape.dims[i]
        idx = wrap_index(em, em.broadcast_to(indices[i], batch), n)
        inside = em.binary("and", em.compare(idx, em.scalar(0, "s64", batch), "GE"),
                           em.compare(idx, em.scalar(n, "s64", batch), "LT"))
        ok = inside if ok is None else em.binary("and", ok, inside)
        if stride != 1:
            idx = em.binary("multiply", idx, em.scalar(stride, "s64", batch))
        flat = idx if flat is None else em.binary("add", flat, idx)
        stride *= n
    flat = em.select(ok, flat, em.scalar(-1, "s64", batch))
    moved = em.reshape(em.transpose(x, used + rest), (stride,) + tuple(x.shape.dims[i] for i in rest))
    nb = len(batch)
    if used == list(range(used[0], used[-1] + 1)) and used[0] > 0:
        u0 = used[0]
        perm = list(range(u0, u0 + nb)) + list(range(u0)) + list(range(u0 + nb, values.shape.rank))
        values = em.transpose(values, perm)
    r = scatter_rows(em, moved, 0, flat, values, "add" if accumulate else "replace")
    r = em.reshape(r, tuple(x.shape.dims[i] for i in used + rest))
    inv = [0] * rank
    for k, i in enumerate(used + rest):
        inv[i] = k
    return em.transpose(r, inv)


# --------------------------------------------------------------------------- gathers
def _narrow_to(em: Emitter, x: Instruction, dims: tuple[int, ...], skip: int) -> Instruction:
    """``x[:dims[0], :dims[1], ...]`` except along ``skip``."""
    return em.slice(x, [(0, n, 1) if i == skip else (0, dims[i], 1) for i, n in enumerate(x.shape.dims)])


def take_along(em: Emitter, x: Instruction, d: int, index: Instruction) -> Instruction:
    """``torch.gather(x, d, index)``: ``out[i] = x[i with dim d replaced by index[i]]``, out of index's dims."""
    src = _narrow_to(em, x, index.shape.dims, d)
    others = tuple(i for i in range(x.shape.rank) if i != d)
    attrs = {"offset_dims": (), "collapsed_slice_dims": (d,), "start_index_map": (d,),
             "index_vector_dim": index.shape.rank, "slice_sizes": (1,) * x.shape.rank,
             "operand_batching_dims": others, "start_indices_batching_dims": others}
    return em.emit("gather", x.shape.with_dims(index.shape.dims), [src, index], attrs)


@register(aten.gather.default)
def _gather(em: Emitter, a: dict, val) -> Instruction:
    x, index = a["self"], a["index"]
    check_index(index)
    if x.shape.rank == 0:
        x, index = em.reshape(x, (1,)), em.reshape(index, (1,))
    d = norm_dim(a["dim"], x.shape.rank)
    return em.reshape(take_along(em, x, d, index), out_dims(val))


@register(aten.index_select.default)
def _index_select(em: Emitter, a: dict, val) -> Instruction:
    """Rows ``index`` (0-d or 1-d) of x along dim: a rows-form gather."""
    x, index = a["self"], a["index"]
    check_index(index)
    if x.shape.rank == 0:
        if index.shape.numel != 1:  # as eager
            raise ValueError(f"index_select: an index into a 0-d tensor can have only 1 value, got "
                             f"{index.shape.numel}")
        x = em.reshape(x, (1,))
    d = norm_dim(a["dim"], x.shape.rank)
    if index.shape.rank == 0:
        index = em.reshape(index, (1,))
    nb, r = index.shape.rank, x.shape.rank
    dims = x.shape.dims[:d] + index.shape.dims + x.shape.dims[d + 1:]
    attrs = {"offset_dims": tuple(range(d)) + tuple(range(d + nb, r - 1 + nb)), "collapsed_slice_dims": (d,),
             "start_index_map": (d,), "index_vector_dim": nb,
             "slice_sizes": tuple(1 if i == d else n for i, n in enumerate(x.shape.dims))}
    return em.reshape(em.emit("gather", x.shape.with_dims(dims), [x, index], attrs), out_dims(val))


# --------------------------------------------------------------------------- scatters
def scatter_elements(em: Emitter, x: Instruction, d: int, index: Instruction, src: Instruction,
                     kind: str) -> Instruction:
    """``x.scatter_(d, index, src)`` combining with ``kind``: along-form scatter into x's slice of index's dims."""
    check_index(index)
    if x.shape.rank == 0:
        return em.reshape(scatter_elements(em, em.reshape(x, (1,)), 0, em.reshape(index, (1,)),
                                           em.reshape(src, (1,)), kind), ())
    if index.shape.numel == 0:
        return x
    region = _narrow_to(em, x, index.shape.dims, d)
    upd = em.convert(em.slice(src, [(0, n, 1) for n in index.shape.dims]), x.shape.dtype)
    others = tuple(i for i in range(x.shape.rank) if i != d)
    attrs = {"update_window_dims": (), "inserted_window_dims": (d,), "scatter_dims_to_operand_dims": (d,),
             "index_vector_dim": index.shape.rank, "input_batching_dims": others,
             "scatter_indices_batching_dims": others, "to_apply": combiner(em, kind, x.shape.dtype)}
    r = em.emit("scatter", region.shape, [region, index, upd], attrs)
    return dynamic_update(em, x, r, [0] * x.shape.rank)


def _src(em: Emitter, a: dict, x: Instruction, index: Instruction) -> Instruction:
    src = a.get("src", a.get("value"))
    if isinstance(src, Instruction):
        return src
    return em.scalar(src, x.shape.dtype, index.shape.dims)


@register(aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce)
def _scatter(em: Emitter, a: dict, val) -> Instruction:
    """scatter (replace), and scatter with reduce='add' / 'multiply'."""
    x, index = em.convert(a["self"], out_dtype(val)), a["index"]
    kind = "replace"
    if a.get("reduce") is not None:
        kind = _REDUCE_KINDS.get(a["reduce"])
        if kind not in ("add", "multiply"):
            raise NotImplementedError(f"scatter with reduce={a['reduce']!r}")
    d = norm_dim(a["dim"], max(x.shape.rank, 1))
    return scatter_elements(em, x, d, index, _src(em, a, x, index), kind)


@register(aten.scatter_add.default)
def _scatter_add(em: Emitter, a: dict, val) -> Instruction:
    x, index = em.convert(a["self"], out_dtype(val)), a["index"]
    d = norm_dim(a["dim"], max(x.shape.rank, 1))
    return scatter_elements(em, x, d, index, a["src"], "add")


@register(aten.scatter_reduce.two)
def _scatter_reduce(em: Emitter, a: dict, val) -> Instruction:
    """scatter_reduce with sum / prod / amax / amin and include_self=True."""
    kind = _REDUCE_KINDS.get(a["reduce"])
    if kind is None or not a["include_self"]:
        raise NotImplementedError(f"scatter_reduce with reduce={a['reduce']!r}, include_self={a['include_self']}")
    x, index = em.convert(a["self"], out_dtype(val)), a["index"]
    d = norm_dim(a["dim"], max(x.shape.rank, 1))
    return scatter_elements(em, x, d, index, a["src"], kind)


@register(aten.index_add.default)
def _index_add(em: Emitter, a: dict, val) -> Instruction:
    """``x.index_add(dim, index, source, alpha)``: rows of source (times alpha) added at rows index."""
    check_index(a["index"])
    x = em.convert(a["self"], out_dtype(val))
    if x.shape.rank == 0:
        x = em.reshape(x, (1,))
    d = norm_dim(a["dim"], x.shape.rank)
    src = em.convert(a["source"], x.shape.dtype)
    if a["alpha"] != 1:
        src = em.binary("multiply", src, em.scalar(a["alpha"], x.shape.dtype, src.shape.dims))
    if src.shape.rank == 0:
        src = em.reshape(src, (1,))
    return em.reshape(index_scatter(em, x, d, a["index"], src, "add"), out_dims(val))



@register(aten.one_hot.default)
def _one_hot(em: Emitter, a: dict, val) -> Instruction:
    """``F.one_hot(i, num_classes)``: int64 ``i[..., None] == arange(num_classes)`` (num_classes given).

    An index outside ``[0, num_classes)`` gives an all-zero row (PyTorch eager raises).
    """
    check_index(a["self"], "class index", LONG)
    i = em.convert(a["self"], "s64")
    dims = out_dims(val)
    ids = em.broadcast(i, dims, tuple(range(i.shape.rank)))
    hot = em.compare(ids, em.iota(dims, len(dims) - 1, "s64"), "EQ")
    return em.convert(hot, out_dtype(val))
