"""spmd-partition handlers of ``gather`` and ``scatter`` (plans from ``spmd.passes.rules_index``).

With the indexed operand dim ``a`` split over axes ``A`` (padded shard size ``m``), the device
at index ``k`` along ``A`` holds global rows ``[k*m, k*m + m)``:

- gather: ``local = clamp(idx, 0, n-1) - k*m``; the local gather reads row ``local`` (clamped
  by the kernel) and the result is zeroed where ``local`` is outside ``[0, m)``; the plan marks
  the result partial over ``A`` (Megatron-LM's VocabParallelEmbedding, arXiv:1909.08053);
- scatter: ``local = idx - k*m``; the kernel drops the updates whose local index is outside
  ``[0, m)`` (they belong to another shard), XLA's out-of-range rule.

Index padding rows (uneven splits of index dims) are set to 0 for a gather (their results are
padding too) and to -1 for a scatter (dropped).
"""

from __future__ import annotations

from spmd.ir.hlo import Instruction, Shape
from spmd.ir.index_shapes import gather_form, scatter_form
from spmd.passes.plan_base import Plan
from spmd.passes.reshard import local_shape, mask_padding
from spmd.passes.rules_index import gather_dims

__all__ = ["partition_dus", "partition_gather", "partition_scatter"]


def _shard_start(em, axes, m: int, idx: Instruction) -> Instruction:
    """``axis_index(axes) * m`` as idx's dtype, broadcast to idx's shape."""
    start = em.emit("multiply", Shape("s32"), [em.axis_index(axes), em.constant(m)])
    start = em.emit("convert", Shape(idx.shape.dtype), [start])
    return em.broadcast_scalar(start, idx.shape)


def _index_batch_dims(inst: Instruction) -> tuple[int, ...]:
    idx = inst.operands[1].shape
    ivd = inst.attrs.get("index_vector_dim", idx.rank)
    return tuple(d for d in range(idx.rank) if d != ivd)


def partition_gather(part, inst: Instruction, ops: list[Instruction], p: Plan):
    """Local gather on the planned shards; masked lookup when the indexed dim is split."""
    em, mesh = part.em, part.mesh
    form = gather_form(inst)
    table_sh, idx_sh = p.operands
    idx = mask_padding(em, ops[1], idx_sh, inst.operands[1].shape.dims, _index_batch_dims(inst), 0)
    attrs = dict(inst.attrs)
    local_table = table_sh.shard_dims(inst.operands[0].shape.dims, mesh)
    if form is not None and form.kind == "rows":
        attrs["slice_sizes"] = tuple(local_table[d] if table_sh.dims[d] and d != form.axis else s
                                     for d, s in enumerate(inst.attrs["slice_sizes"]))
    axes = table_sh.dims[form.axis] if form is not None else ()
    if not axes:
        return part._emit_local(inst, [ops[0], idx], p.result, attrs), p.result
    n, m = inst.operands[0].shape.dims[form.axis], local_table[form.axis]
    dtype, pred = idx.shape.dtype, idx.shape.with_dtype("pred")
    zero, last = em.constant(0, dtype), em.constant(n - 1, dtype)
    clamped = em.emit("clamp", idx.shape, [zero, idx, last])
    local = em.emit("subtract", idx.shape, [clamped, _shard_start(em, axes, m, idx)])
    size = em.broadcast_scalar(em.constant(m, dtype), idx.shape)
    below = em.emit("compare", pred, [local, size], {"direction": "LT"})
    above = em.emit("compare", pred, [local, em.broadcast_scalar(zero, idx.shape)], {"direction": "GE"})
    valid = em.emit("and", below.shape, [below, above])
    g = part._emit_local(inst, [ops[0], local], p.result, attrs)
    if form.kind == "rows":
        out_batch, idx_batch, _, _ = gather_dims(inst)
        keep = Shape("pred", tuple(valid.shape.dims[d] for d in idx_batch))
        valid = em.emit("reshape", keep, [valid]) if keep.dims != valid.shape.dims else valid
        valid = em.emit("broadcast", g.shape.with_dtype("pred"), [valid], {"dimensions": out_batch})
    zeros = em.broadcast_scalar(em.constant(0, g.shape.dtype), g.shape)
    masked = em.emit("select", g.shape, [valid, g, zeros], sharding=p.result, name=inst.name + ".masked")
    return masked, p.result


def partition_scatter(part, inst: Instruction, ops: list[Instruction], p: Plan):
    """Local scatter on the planned shards; indices shifted into the shard when the indexed dim is split."""
    em, mesh = part.em, part.mesh
    form = scatter_form(inst)
    x_sh, idx_sh, _ = p.operands
    idx = mask_padding(em, ops[1], idx_sh, inst.operands[1].shape.dims, _index_batch_dims(inst), -1)
    axes = x_sh.dims[form.axis] if form is not None else ()
    if axes:
        m = x_sh.shard_dims(inst.operands[0].shape.dims, mesh)[form.axis]
        idx = em.emit("subtract", idx.shape, [idx, _shard_start(em, axes, m, idx)])
    shape = local_shape(inst.shape, p.result, mesh)
    assert shape == ops[0].shape, (shape, ops[0].shape)
    return part._emit_local(inst, [ops[0], idx, ops[2]], p.result), p.result


def partition_dus(part, inst: Instruction, ops: list[Instruction], p: Plan):
    """Local dynamic-update-slice; a one-row update along a split dim is written by the shard owning it.

    For each such dim: ``local = clamp(start, 0, n-1) - k*m`` (the start clamped as the unpartitioned
    op clamps it); the write goes to ``clamp(local, 0, m-1)`` and, on
    shards that do not own the row, writes back the values already there (a dynamic-slice of the
    update's size), so the cost stays that of the update, not of the operand (XLA's partitioner
    handles single-element updates of a partitioned dim the same way, with a select).
    """
    em, mesh = part.em, part.mesh
    x_sh = p.operands[0]
    local_dims = x_sh.shard_dims(inst.operands[0].shape.dims, mesh)
    x, upd, starts = ops[0], ops[1], list(ops[2:])
    owned = None
    for d, axes in enumerate(x_sh.dims):
        if not axes or inst.operands[1].shape.dims[d] == inst.operands[0].shape.dims[d]:
            continue  # a dim the update covers whole: the shards line up
        s = starts[d]
        dtype = Shape(s.shape.dtype)
        zero, last = em.constant(0, s.shape.dtype), em.constant(local_dims[d] - 1, s.shape.dtype)
        s = em.emit("clamp", dtype, [zero, s, em.constant(inst.operands[0].shape.dims[d] - 1, s.shape.dtype)])
        off = em.emit("multiply", Shape("s32"), [em.axis_index(axes), em.constant(local_dims[d])])
        local = em.emit("subtract", dtype, [s, em.emit("convert", dtype, [off])])
        inside = em.emit("and", Shape("pred"), [
            em.emit("compare", Shape("pred"), [local, zero], {"direction": "GE"}),
            em.emit("compare", Shape("pred"), [local, last], {"direction": "LE"})])
        owned = inside if owned is None else em.emit("and", Shape("pred"), [owned, inside])
        starts[d] = em.emit("clamp", dtype, [zero, local, last])
    if owned is not None:
        old = em.emit("dynamic-slice", upd.shape, [x, *starts], {"dynamic_slice_sizes": upd.shape.dims})
        upd = em.emit("select", upd.shape, [em.broadcast_scalar(owned, upd.shape.with_dtype("pred")), upd, old])
    return part._emit_local(inst, [x, upd, *starts], p.result), p.result
