"""Whether a lowering fusion may move an op's reads later in the op list.

Fusion (d) (``spmd.runtime.fusions_prologue``) runs an RMS norm or SwiGLU fusion inside the
product that reads it, and the epilogue fusion (``spmd.runtime.epilogue_fusion``) runs a product
inside its elementwise reader: either way the moved op reads its operands at the later op's
position. The buffer assignment (``spmd.passes.assign_buffers``) was computed on the program
order before the move: it may give the arena bytes of an operand, dead after its last reader
there, to a value produced in between, and an op in between may update an operand in place.
The move is allowed only when no op between the two positions writes memory that could hold
an operand: none has an arena result or updates a slot in place, and none reads an operand
(an in-place writer, a collective among them, reads the value it overwrites). XLA's fusion
passes run before buffer assignment for the same reason; here the check is the conservative
form of the interference test of its ``BufferAssignment``.
"""

from __future__ import annotations


def reads_can_move(ops: list, src: int, dst: int, slots) -> bool:
    """Whether ``ops[src]``'s reads of ``slots`` (``lower.Op`` list, ``src < dst``) may happen at
    ``ops[dst]`` instead: no op strictly between writes arena memory (``buffer_name``), updates a
    slot in place (``alias_of``) or reads one of ``slots`` or a view of one; view ops (``extra``
    ``"view"``: no memory of their own) are passed."""
    wanted = set(slots)
    for op in ops[src + 1:dst]:
        if "view" in op.extra:  # writes nothing; a view of an operand is then watched as the operand
            if wanted.intersection(op.ins):
                wanted.add(op.out)
            continue
        if op.buffer_name is not None or op.alias_of >= 0 or wanted.intersection(op.ins):
            return False
    return True
