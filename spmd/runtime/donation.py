"""Donated parameter buffers: outputs written straight into the caller's given-up inputs.

When the caller donates parameter ``i`` (JAX's ``donate_argnums``), an output of the same
shard shape and dtype may be computed into that parameter's buffer (``out=`` of its kernel)
instead of fresh memory. That is safe only when nothing reads the parameter, or any value
that may share its memory (views through reshape, transpose, slice, ...: every op that may
return an operand, ``spmd.passes.views`` included), after the writing kernel, and
when every earlier reader is on the writing kernel's stream (so it is ordered before the
write). The writing kernel itself may read the parameter only as a dynamic-update-slice's
operand 0 (updated in place: the KV-cache update of LLM decoding) or as an elementwise operand.
"""

from __future__ import annotations

from collections.abc import Sequence

from spmd.ir.hlo import ELEMENTWISE_OPCODES, Shape
from spmd.runtime.fusions import is_fresh
from spmd.runtime.multi_output import writer_index


def plan_donation(ops: list, param_slots: Sequence[int], output_slots: Sequence[int],
                  donated: frozenset[int], param_shapes: Sequence[Shape]) -> dict[int, int]:
    """Map op index -> donated parameter index whose buffer receives that op's (output) result.

    A donated buffer receives an output only when the output's per-device shape equals the
    parameter's exactly (dims and dtype; both row-major), whether or not the program reads the
    parameter; otherwise it is simply not reused (donation is a permission, as in XLA's
    ``donate_argnums``: it never changes a result). Among the donated parameters of that shape,
    the ones the producing op reads come first (an optimizer update ``p' = f(p, g)`` goes into
    ``p``'s buffer): a greedy match by parameter number alone could give an output the buffer of
    a parameter the program still reads later and leave later outputs without one.

    Args:
      ops: the lowering's ``Op`` list (after fusion).
      param_slots: slot of each parameter, by parameter number.
      output_slots: slots of the outputs.
      donated: donated parameter numbers.
      param_shapes: per-device (padded shard) shape of each parameter, by parameter number.
    """
    producer = {op.out: k for k, op in enumerate(ops)}
    outputs = set(output_slots)
    used: set[int] = set()
    plan: dict[int, int] = {}
    for slot in output_slots:
        p = producer.get(slot)
        if p is None or p in plan or "spec" in ops[p].extra or ops[p].inst.shape.is_tuple:
            continue
        w = writer_index(ops, p)  # a multi-output fusion writes its elements' buffers itself
        reads = set(ops[w].ins)  # the parameter an update reads first (an in-place update), then in order
        own = _updated_slot(ops, p, w)  # the buffer a fused dynamic-update-slice output updates, first of all
        for i in sorted(donated - used, key=lambda i: (param_slots[i] != own, param_slots[i] not in reads, i)):
            if param_shapes[i] != ops[p].inst.shape:
                continue
            aliases = _aliases(ops, param_slots[i])
            if aliases & outputs or not _safe(ops, w, param_slots[i], aliases):
                continue
            plan[p] = i
            used.add(i)
            break
    return plan


def _updated_slot(ops: list, p: int, w: int) -> int:
    """The slot of the operand that op ``p``'s value updates in place when it is a fusion's (or a
    multi-output fusion's element's, written by op ``w``) dynamic-update-slice output; else -1."""
    inst = ops[w].inst
    if inst.opcode != "fusion":
        return -1
    root = inst.attrs["calls"].root
    if root.opcode == "tuple":
        if w == p or ops[p].inst.opcode != "get-tuple-element":
            return -1
        root = root.operands[ops[p].inst.attrs["index"]]
    buf = root.operands[0] if root.opcode == "dynamic-update-slice" else None
    if buf is None or buf.opcode != "parameter":
        return -1
    return ops[w].ins[buf.attrs["parameter_number"]]


def _aliases(ops: list, slot: int) -> set[int]:
    """Slots that may share memory with ``slot`` (views, in-place fusions)."""
    out = {slot}
    for op in ops:
        if op.alias_of in out or ("spec" not in op.extra and not is_fresh(op.inst)
                                  and op.fn is None and any(s in out for s in op.ins)):
            out.add(op.out)
    return out


def _safe(ops: list, p: int, param_slot: int, aliases: set[int]) -> bool:
    writer = ops[p]
    for r, op in enumerate(ops):
        hits = [k for k, s in enumerate(op.ins) if s in aliases]
        if not hits:
            continue
        if r > p or op.stream != writer.stream:
            return False
        if r == p and not _reads_in_place(op, hits, param_slot):
            return False
    return True


def _reads_in_place(op, hits: list[int], param_slot: int) -> bool:
    if any(op.ins[k] != param_slot for k in hits):
        return False
    if op.inst.opcode == "dynamic-update-slice":
        return hits == [0]
    # a fusion's kernel computes its whole result before copying it into the donated buffer
    return op.fn is None and (op.inst.opcode in ELEMENTWISE_OPCODES or op.inst.opcode == "fusion")


def reusable(donated: frozenset[int], args) -> frozenset[int]:
    """The donated parameters whose buffers can be written as outputs: ``donated`` minus any whose
    per-device tensor is not contiguous (row-major, no overlapping elements) or shares memory with
    the same parameter's tensor on another local device.

    ``args[i][k]`` is parameter ``i`` on local device ``k``. A buffer left out is simply not
    reused: the program variant without it computes the same result into fresh memory.
    """
    keep = []
    for i in donated:
        if not (isinstance(i, int) and 0 <= i < len(args)):
            keep.append(i)  # the caller reports it
            continue
        per = args[i]
        ptrs = {t.data_ptr() for t in per}
        if len(ptrs) == len(per) and all(t.is_contiguous() for t in per):
            keep.append(i)
    return donated if len(keep) == len(donated) else frozenset(keep)
