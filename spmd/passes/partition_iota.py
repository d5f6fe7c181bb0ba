"""Partitioning of ``iota``: each device builds its own shard instead of slicing a global iota.

A sharded iota dim becomes a local iota plus the shard's offset along that dim,
``axis_index(axes) * shard_size`` (XLA's SPMD partitioner does the same in
``SpmdPartitioningVisitor::HandleIota``). Other sharded dims need nothing: an iota is constant
along them. Rows past the end of an uneven dim are padding (unspecified contents, here values
past the global size).
"""

from __future__ import annotations

from spmd.ir.hlo import Instruction, Shape
from spmd.passes.plan_base import Plan
from spmd.passes.reshard import local_shape


def partition_iota(partitioner, inst: Instruction, ops, p: Plan):
    """Emit the local iota of ``inst`` under ``p.result`` on ``partitioner``'s emitter.

    Returns (local instruction, its sharding) as the partitioner's per-op handlers do.
    """
    result = p.result.with_partial(())
    em = partitioner.em
    shape = local_shape(inst.shape, result, partitioner.mesh)
    d = inst.attrs["iota_dimension"]
    local = partitioner._emit_local(inst, [], result)
    axes = result.dims[d]
    if not axes:
        return local, result
    offset = em.emit("multiply", Shape("s32"), [em.axis_index(axes), em.constant(shape.dims[d])])
    if shape.dtype != "s32":
        offset = em.emit("convert", shape.with_dims(()), [offset])
    return em.emit("add", shape, [local, em.broadcast_scalar(offset, shape)], sharding=result), result
