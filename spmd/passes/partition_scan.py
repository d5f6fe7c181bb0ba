"""Partitioning of ``cumsum`` / ``cumprod`` custom calls along a sharded dim: a parallel prefix.

With the scanned dim d split over mesh axes A (k shards), each device (Blelloch-style two-level
scan, as XLA's SPMD partitioner does for a windowed reduce along a partitioned dim):

1. masks its padding rows along d with the identity (0 for cumsum, 1 for cumprod) and scans its
   shard locally;
2. all-gathers the shards' totals (the last row of each local scan) along d over A: ``k`` rows;
3. scans ``[identity, totals[0:k-1]]`` (an exclusive prefix of the totals), takes its own row at
   ``axis_index(A)`` with a dynamic-slice, and combines it into every row of its local scan.

Communication is one all-gather of ``k`` rows instead of gathering the whole operand. Floating
results differ from the sequential scan by rounding only (the sum is associated per shard).
Other custom calls, scans along unsharded dims and scans along an empty dim run locally (the
partitioner's generic rule).
"""

from __future__ import annotations

from spmd.ir.hlo import Instruction, Shape
from spmd.passes.plan_base import Plan
from spmd.passes.reshard import local_shape, mask_padding

_SCANS = {"cumsum": ("add", 0.0), "cumprod": ("multiply", 1.0)}


def partition_custom_call(partitioner, inst: Instruction, ops, p: Plan):
    """The partitioner's handler of ``custom-call``: parallel prefix for a scan along a sharded dim."""
    target = inst.attrs.get("custom_call_target")
    config = dict(inst.attrs.get("backend_config") or {})
    if target not in _SCANS or inst.shape.rank == 0:
        return partitioner._generic(inst, ops, p)
    d = int(config.get("dim", -1)) % inst.shape.rank
    axes = p.result.dims[d]
    if not axes or inst.shape.dims[d] == 0:  # an empty scanned dim has no totals to carry
        return partitioner._generic(inst, ops, p)
    combine, identity = _SCANS[target]
    em, mesh = partitioner.em, partitioner.mesh
    x = mask_padding(em, ops[0], p.operands[0], inst.operands[0].shape.dims, (d,), identity)
    local = partitioner._emit_local(inst, [x], p.result)
    shape = local_shape(inst.shape, p.result, mesh)
    n, k = shape.dims[d], mesh.axes_size(axes)
    row = tuple((n - 1, n, 1) if i == d else (0, s, 1) for i, s in enumerate(shape.dims))
    total = em.emit("slice", _with(shape, d, 1), [local], {"slice": row})
    totals = em.emit("all-gather", _with(shape, d, k), [total],
                     {"replica_groups": mesh.groups(axes), "dimensions": (d,)})
    first = em.broadcast_scalar(em.constant(identity, shape.dtype), _with(shape, d, 1))
    if k > 1:
        head = tuple((0, k - 1, 1) if i == d else (0, s, 1) for i, s in enumerate(totals.shape.dims))
        rest = em.emit("slice", _with(shape, d, k - 1), [totals], {"slice": head})
        first = em.emit("concatenate", totals.shape, [first, rest], {"dimensions": (d,)})
    prefix = em.emit("custom-call", first.shape, [first], {"custom_call_target": target, "backend_config": config})
    zero = em.constant(0)
    starts = [em.axis_index(axes) if i == d else zero for i in range(shape.rank)]
    mine = em.emit("dynamic-slice", _with(shape, d, 1), [prefix, *starts],
                   {"dynamic_slice_sizes": _with(shape, d, 1).dims})
    keep = tuple(i for i in range(shape.rank) if i != d)
    mine = em.emit("reshape", shape.with_dims(tuple(shape.dims[i] for i in keep)), [mine])
    spread = em.emit("broadcast", shape, [mine], {"dimensions": keep})
    return em.emit(combine, shape, [local, spread], sharding=p.result), p.result


def _with(shape: Shape, d: int, size: int) -> Shape:
    return shape.with_dims(tuple(size if i == d else s for i, s in enumerate(shape.dims)))
