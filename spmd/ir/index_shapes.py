"""Shape inference and supported forms of ``gather`` and ``scatter`` (XLA semantics).

Both follow XLA's operation semantics with batching dims
(https://openxla.org/xla/operation_semantics#gather, #scatter; the ``operand_batching_dims`` /
``start_indices_batching_dims`` and ``input_batching_dims`` / ``scatter_indices_batching_dims``
of StableHLO). Shape inference accepts the general form; the kernels, sharding rules and
partitioner handle two forms of each, which every PyTorch indexing op maps onto:

``rows`` (embedding form), along operand dim ``a``:
  gather: ``start_index_map = collapsed_slice_dims = (a,)``, no batching dims, full slices of
  the other dims, scalar indices (``index_vector_dim`` = indices rank). Result: the operand's
  dims with dim ``a`` replaced by the indices' dims, placed as ``offset_dims`` says.
  (``F.embedding``, ``index_select``, ``x[idx]``.)
  scatter: ``scatter_dims_to_operand_dims = inserted_window_dims = (a,)``, no batching dims,
  updates ``[*indices dims, *operand dims without a]`` (``update_window_dims`` trailing, full
  windows). Row ``updates[i...]`` is combined into operand row ``indices[i...]`` along ``a``.
  (``index_add``, ``index_put`` / ``index_copy``, embedding backward.)

``along`` (take-along form), along operand dim ``a``:
  gather: ``start_index_map = collapsed_slice_dims = (a,)``, every other operand dim a batching
  dim paired with one indices dim, slice sizes all 1, no offset dims: result dims = indices
  dims, ``out[i] = operand[i with dim a replaced by indices[i]]``. (``torch.gather``.)
  scatter: ``scatter_dims_to_operand_dims = inserted_window_dims = (a,)``, the other operand
  dims batching dims paired with indices dims, no window dims, updates dims = indices dims.
  (``torch.scatter``, ``scatter_add``, ``scatter_reduce``.)

Index values: a gather clamps its start index into ``[0, n - 1]``; a scatter skips updates whose
index is outside ``[0, n)`` (both XLA's rules). ``scatter``'s ``to_apply`` combines
``(old, update)``: ``add`` / ``maximum`` / ``minimum`` / ``multiply`` as its root, or a root that
is parameter 1 (the update replaces the value; with repeated indices one of the updates wins,
unspecified which, as in XLA and PyTorch).
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd.ir.hlo import Instruction, Shape

__all__ = ["IndexForm", "gather_form", "infer_gather", "infer_scatter", "scatter_form", "scatter_kind"]

_INT_DTYPES = frozenset({"s8", "s16", "s32", "s64", "u8", "u32"})
SCATTER_KINDS = ("add", "maximum", "minimum", "multiply", "replace")


def _fail(opcode: str, msg: str) -> ValueError:
    return ValueError(f"{opcode}: {msg}")


def _distinct_in(opcode: str, dims, rank: int, what: str) -> None:
    if any(not 0 <= d < rank for d in dims) or len(set(dims)) != len(dims):
        raise _fail(opcode, f"{what} {tuple(dims)} must be distinct dims in [0, {rank})")


def _batch_dims(idx: Shape, ivd: int) -> list[int]:
    return [d for d in range(idx.rank) if d != ivd]


def _index_vector_size(opcode: str, idx: Shape, ivd: int, smap) -> None:
    if not 0 <= ivd <= idx.rank:
        raise _fail(opcode, f"index_vector_dim {ivd} out of range for indices {idx}")
    n = idx.dims[ivd] if ivd < idx.rank else 1
    if n != len(smap):
        raise _fail(opcode, f"index vector of size {n} (indices {idx}, index_vector_dim {ivd}) does not match "
                            f"the {len(smap)} mapped dims {tuple(smap)}")


def _check_batching(opcode: str, x: Shape, idx: Shape, ivd: int, xb, ib) -> None:
    _distinct_in(opcode, xb, x.rank, "operand batching dims")
    _distinct_in(opcode, ib, idx.rank, "indices batching dims")
    if len(xb) != len(ib) or ivd in ib or any(x.dims[a] != idx.dims[b] for a, b in zip(xb, ib, strict=False)):
        raise _fail(opcode, f"batching dims {tuple(xb)} of {x} and {tuple(ib)} of {idx} must pair up with equal "
                            "sizes (and not include index_vector_dim)")


def infer_gather(ops: list[Shape], attrs: dict) -> Shape:
    """XLA gather's result shape. Raises ValueError (and KeyError for a missing attribute)."""
    x, idx = ops
    offset, collapsed = tuple(attrs["offset_dims"]), tuple(attrs["collapsed_slice_dims"])
    sizes, ivd, smap = tuple(attrs["slice_sizes"]), attrs["index_vector_dim"], tuple(attrs["start_index_map"])
    xb, ib = tuple(attrs.get("operand_batching_dims", ())), tuple(attrs.get("start_indices_batching_dims", ()))
    if len(sizes) != x.rank or any(not 0 <= s <= n for s, n in zip(sizes, x.dims, strict=False)) \
            or idx.dtype not in _INT_DTYPES:
        raise _fail("gather", f"slice_sizes {sizes} must fit operand {x}; indices {idx} must be integers")
    _distinct_in("gather", collapsed + xb, x.rank, "collapsed_slice_dims + operand_batching_dims")
    _distinct_in("gather", smap, x.rank, "start_index_map")
    if any(sizes[d] > 1 for d in collapsed + xb):
        raise _fail("gather", f"collapsed and batching dims {collapsed + xb} must have slice size <= 1, got {sizes}")
    _index_vector_size("gather", idx, ivd, smap)
    _check_batching("gather", x, idx, ivd, xb, ib)
    batch = [idx.dims[d] for d in _batch_dims(idx, ivd)]
    kept = [s for d, s in enumerate(sizes) if d not in collapsed and d not in xb]
    rank = len(batch) + len(kept)
    _distinct_in("gather", offset, rank, "offset_dims")
    if len(offset) != len(kept):
        raise _fail("gather", f"offset_dims {offset} must name {len(kept)} result dims (the kept slice dims)")
    kept_it, batch_it = iter(kept), iter(batch)
    return x.with_dims(tuple(next(kept_it) if i in offset else next(batch_it) for i in range(rank)))


def infer_scatter(ops: list[Shape], attrs: dict) -> Shape:
    """XLA scatter's result shape (the operand's). Raises ValueError (KeyError: missing attribute)."""
    x, idx, upd = ops
    window, inserted = tuple(attrs["update_window_dims"]), tuple(attrs["inserted_window_dims"])
    smap, ivd = tuple(attrs["scatter_dims_to_operand_dims"]), attrs["index_vector_dim"]
    xb, ib = tuple(attrs.get("input_batching_dims", ())), tuple(attrs.get("scatter_indices_batching_dims", ()))
    if idx.dtype not in _INT_DTYPES or upd.dtype != x.dtype:
        raise _fail("scatter", f"indices {idx} must be integers and updates {upd} of the operand's type {x.dtype}")
    _distinct_in("scatter", inserted + xb, x.rank, "inserted_window_dims + input_batching_dims")
    _distinct_in("scatter", smap, x.rank, "scatter_dims_to_operand_dims")
    _index_vector_size("scatter", idx, ivd, smap)
    _check_batching("scatter", x, idx, ivd, xb, ib)
    _distinct_in("scatter", window, upd.rank, "update_window_dims")
    win_operand = [d for d in range(x.rank) if d not in inserted and d not in xb]
    batch = [idx.dims[d] for d in _batch_dims(idx, ivd)]
    scatter_dims = [d for d in range(upd.rank) if d not in window]
    if len(window) != len(win_operand) or [upd.dims[d] for d in scatter_dims] != batch:
        raise _fail("scatter", f"updates {upd} must have indices batch dims {batch} and {len(win_operand)} window dims")
    if any(upd.dims[w] > x.dims[o] for w, o in zip(window, win_operand, strict=True)):
        raise _fail("scatter", f"update windows of {upd} (dims {window}) do not fit operand {x}")
    return x


@dataclass(frozen=True)
class IndexForm:
    """A supported gather/scatter form (see the module docstring).

    Fields:
      kind: ``"rows"`` or ``"along"``.
      axis: the operand dim ``a`` that is indexed.
      index_of: for ``"along"``, the indices dim paired with each operand dim (operand order;
        entry ``a`` is the indices dim holding the positions); () for ``"rows"``.
    """

    kind: str
    axis: int
    index_of: tuple[int, ...] = ()


def _along(x: Shape, idx: Shape, a: int, xb, ib) -> tuple[int, ...] | None:
    if sorted(xb) != [d for d in range(x.rank) if d != a] or idx.rank != x.rank:
        return None
    pair = dict(zip(xb, ib, strict=True))
    free = [d for d in range(idx.rank) if d not in ib]
    return tuple(pair[d] if d != a else free[0] for d in range(x.rank))


def gather_form(inst: Instruction) -> IndexForm | None:
    """The supported form of a gather instruction, or None."""
    x, idx = inst.operands[0].shape, inst.operands[1].shape
    at = inst.attrs
    smap, collapsed, sizes = tuple(at["start_index_map"]), tuple(at["collapsed_slice_dims"]), tuple(at["slice_sizes"])
    ivd = at.get("index_vector_dim", idx.rank)
    xb, ib = tuple(at.get("operand_batching_dims", ())), tuple(at.get("start_indices_batching_dims", ()))
    if len(smap) != 1 or collapsed != smap or (ivd != idx.rank and idx.dims[ivd] != 1):
        return None
    a = smap[0]
    if not xb:
        full = all(s == (1 if d == a else x.dims[d]) for d, s in enumerate(sizes))
        return IndexForm("rows", a) if full else None
    index_of = _along(x, idx, a, xb, ib) if ivd == idx.rank else None
    if index_of is None or any(s != 1 for s in sizes) or tuple(at["offset_dims"]):
        return None
    return IndexForm("along", a, index_of)


def scatter_form(inst: Instruction) -> IndexForm | None:
    """The supported form of a scatter instruction, or None."""
    x, idx, upd = (o.shape for o in inst.operands)
    at = inst.attrs
    smap, inserted = tuple(at["scatter_dims_to_operand_dims"]), tuple(at["inserted_window_dims"])
    window, ivd = tuple(at["update_window_dims"]), at["index_vector_dim"]
    xb, ib = tuple(at.get("input_batching_dims", ())), tuple(at.get("scatter_indices_batching_dims", ()))
    if len(smap) != 1 or inserted != smap or ivd != idx.rank or scatter_kind(inst) is None:
        return None
    a = smap[0]
    if not xb:
        rest = tuple(n for d, n in enumerate(x.dims) if d != a)
        ok = window == tuple(range(idx.rank, upd.rank)) and upd.dims[idx.rank:] == rest
        return IndexForm("rows", a) if ok else None
    index_of = _along(x, idx, a, xb, ib)
    if index_of is None or window or upd.dims != idx.dims:
        return None
    return IndexForm("along", a, index_of)


def scatter_kind(inst: Instruction) -> str | None:
    """How a scatter combines: add / maximum / minimum / multiply / replace, or None if unsupported."""
    comp = inst.attrs.get("to_apply")
    root = None if comp is None else comp.root
    if root is None:
        return None
    if root.opcode == "parameter":
        return "replace" if root.attrs.get("parameter_number") == 1 else None
    params = comp.parameters
    if root.opcode in SCATTER_KINDS and len(params) == 2 and {id(o) for o in root.operands} == {id(p) for p in params}:
        return root.opcode
    return None
