"""Lowering of multi-output fusions (``spmd.passes.multi_output_fusion``): one kernel, N results.

A tuple-shaped ``fusion`` lowers to one op whose slot holds the tuple of its N element tensors;
each ``get-tuple-element`` of it lowers to an op that reads its element out of that slot (no
kernel, no memory of its own: a view of the fusion's result, ``Op.extra["view"]``). Buffers
(donated parameters' buffers from ``spmd.runtime.donation``) are planned for the
get-tuple-element ops, the values the program returns, and then moved to the fusion op
(``move_buffers``), whose kernel stores each element straight into its buffer
(``spmd.runtime.thunks.MultiOutputKernelThunk``). For donation the fusion op is the writer of
every element (``Op.extra["writer"]``): a parameter it reads is safe to write over only if
nothing reads the parameter after the fusion.
"""

from __future__ import annotations


def mark(op, multi_ops: dict) -> None:
    """Tag ``op`` (a ``lower.Op`` just created) if it is a multi-output fusion or one of its elements.

    ``multi_ops`` maps the result slot of each multi-output fusion op lowered so far to the op.
    """
    inst = op.inst
    if inst.opcode == "fusion" and inst.shape.is_tuple:
        op.extra["elements"] = len(inst.shape.tuple_shapes)
        multi_ops[op.out] = op
    elif inst.opcode == "get-tuple-element" and op.ins and op.ins[0] in multi_ops:
        op.extra["view"] = True
        op.extra["work"] = 0
        op.extra["writer"] = multi_ops[op.ins[0]]


def writer_index(ops: list, k: int) -> int:
    """Index of the op that writes op ``k``'s result memory: the fusion for an element, else ``k``."""
    writer = ops[k].extra.get("writer")
    if writer is None:
        return k
    for i in range(k - 1, -1, -1):
        if ops[i] is writer:
            return i
    return k


def move_buffers(ops: list, op_buffers: dict[int, int]) -> None:
    """Move the buffers planned for elements (get-tuple-element ops) to their fusion op.

    Sets ``extra["element_buffers"]`` (per element: a view index or -1) on every multi-output
    fusion op and drops the elements' entries from ``op_buffers`` (they only read the tuple).
    """
    index = {id(op): k for k, op in enumerate(ops)}
    for op in ops:
        if "elements" in op.extra:
            op.extra["element_buffers"] = [-1] * op.extra["elements"]
    for k, op in enumerate(ops):
        writer = op.extra.get("writer")
        if writer is None or id(writer) not in index:
            continue
        b = op_buffers.pop(k, -1)
        if b >= 0:
            slots = writer.extra["element_buffers"]
            i = op.inst.attrs["index"]
            slots[i] = b if slots[i] < 0 else slots[i]
    for op in ops:
        if "element_buffers" in op.extra:
            op.extra["element_buffers"] = tuple(op.extra["element_buffers"])
