"""Which slots of a lowered program share memory: views, operand-returning kernels, outputs.

Helpers of ``spmd.runtime.lower`` on its ``Op`` list (``lw`` is the lowering's state: ``ops``,
``module``, ``folded``, ``param_slots``):

- ``mark_analysis_views``: the entry instructions ``spmd.passes.views`` decides are views
  (XLA's bitcasts) run a view kernel and get no arena buffer (``Op.extra["view"]``);
- ``mark_parameter_views``: slices of parameters are views too (their kernels return one);
- ``shares``: per result slot, the operand slots whose memory it may be a view of (what
  ``spmd.runtime.hazards`` and the slot releases read);
- ``output_clones``: which outputs must be copied before they are returned;
- ``layout_views``: reshapes of an attention result (through view ops) that get no arena view,
  so that they stay a view of the kernel's output whenever its layout allows.
"""

from __future__ import annotations

from typing import Any

from spmd.passes.views import view_instructions
from spmd.runtime import fusions


def mark_analysis_views(lw, buffers: Any) -> set[int]:
    """Mark the entry ops ``spmd.passes.views`` decides are views; returns their operand slots.

    With a buffer assignment, an instruction it placed is not a view (the assignment then
    did not keep the operand live for the view's readers).
    """
    names = view_instructions(lw.module)
    placed = getattr(buffers, "offsets_bytes", {}) if buffers is not None else {}
    entry = {id(i) for i in lw.module.entry.instructions if i.name in names and i.name not in placed}
    sources: set[int] = set()
    for op in lw.ops:
        if id(op.inst) in entry and op.fn is None:
            op.extra["view"] = True
            op.extra["work"] = 0
            sources.add(op.ins[0])
    return sources


def output_clones(lw, output_slots: list[int], op_buffers: dict[int, int],
                  donated: frozenset[int], plan: dict[int, int]) -> tuple[bool, ...]:
    """Per output, whether it is copied before it is returned.

    An output that may share memory (through views, kernels returning an operand, in-place
    updates) with the arena, a persistent folded value or an undonated parameter is copied:
    the arena is reused by the next call, and outputs never alias the caller's inputs (a
    later donation or in-place update of the input would change them). An output that may share
    memory with an earlier output (the same value returned twice, or a view of another output)
    is copied too. An output written into a donated parameter's buffer is not.

    Args:
      op_buffers: op index -> arena view index (before donated buffers are added).
      plan: op index -> donated parameter whose buffer receives its result.
    """
    links = shares(lw.ops, op_buffers)
    for op in lw.ops:
        if op.alias_of >= 0:
            links[op.out] = (*links.get(op.out, ()), op.alias_of)
    held = set(lw.folded) | {lw.ops[k].out for k in op_buffers}
    held |= {s for n, s in lw.param_slots.items() if n not in donated}
    written = {lw.ops[k].out for k in plan}
    clones, returned = [], set()
    for s in output_slots:
        # an output written into a donated buffer owns that buffer (``plan`` gives each its own);
        # a tuple slot (a multi-output fusion's result) is no memory of its own
        memory = {s} if s in written else {m for m in _memory_of(s, links) if not _is_tuple(lw, m)}
        # two outputs never share memory (XLA's copy insertion gives every output its own
        # buffer): donating or updating one must not change the other
        clones.append(bool(memory & returned) or (s not in written and bool(memory & held)))
        if not clones[-1]:
            returned |= memory
    return tuple(clones)


def _is_tuple(lw, slot: int) -> bool:
    inst = lw.slot_inst.get(slot)
    return inst is not None and inst.shape.is_tuple


def _memory_of(slot: int, links: dict[int, tuple[int, ...]]) -> set[int]:
    """``slot`` and every slot whose memory it may share (transitively through ``links``)."""
    seen: set[int] = set()
    stack = [slot]
    while stack:
        s = stack.pop()
        if s not in seen:
            seen.add(s)
            stack.extend(links.get(s, ()))
    return seen


def shares(ops: list, op_buffers: dict[int, int]) -> dict[int, tuple[int, ...]]:
    """Per result slot, the operand slots whose memory the result may be a view of.

    An op that is not ``fusions.is_fresh``, not in place and without an arena view may
    return a view of any operand (reshape, slice, dynamic-slice, ...).
    """
    out: dict[int, tuple[int, ...]] = {}
    for k, op in enumerate(ops):
        if (op.alias_of < 0 and "spec" not in op.extra and k not in op_buffers and op.fn is None
              and not fusions.is_fresh(op.inst) and "materialize" not in op.extra):
            out[op.out] = tuple(op.ins)
    return out


def mark_materialized(lw, op_buffers: dict[int, int]) -> None:
    """Ops that might return a view of arena memory but are not views for the buffer assignment.

    The buffer assignment lets an operand's arena bytes be reused right after its last reader
    unless that reader is a view (``spmd.passes.views``). An op outside that analysis whose
    kernel may still return a view of its operand (a slice or reshape whose result is a
    program output, the identity ``Sharding`` custom call, ...) therefore gets
    ``extra["materialize"]``: its kernel copies a result that shares storage with an operand
    (``materializing``), so later writes into the reused bytes cannot reach it.
    """
    links = shares(lw.ops, op_buffers)
    arena = {lw.ops[k].out for k in op_buffers}
    for op in lw.ops:
        if op.out in links and "view" not in op.extra and any(_memory_of(s, links) & arena for s in op.ins):
            op.extra["materialize"] = True


def materializing(fn):
    """``fn`` (a kernel ``(operands, out) -> result``) that never returns an operand's memory."""
    import torch

    def kernel(ops: list, out: Any) -> Any:
        result = fn(ops, out)
        if out is None and isinstance(result, torch.Tensor):
            ptr = result.untyped_storage().data_ptr()
            if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr for t in ops):
                result = result.clone(memory_format=torch.contiguous_format)
        return result
    return kernel


_PARAM_VIEW_OPCODES = frozenset({"slice", "dynamic-slice"})


def mark_parameter_views(lw, donated: frozenset[int]) -> None:
    """Slices of parameters (static, or at offsets folded at lowering time) stay views.

    Their kernels return a view of the operand when given no arena view, so the slice is
    free (cuBLAS and the peer copies read strided rows); a parameter's memory is the caller's
    and nothing in the call writes it unless it is donated.
    """
    params = {s for n, s in lw.param_slots.items() if n not in donated}
    for op in lw.ops:
        if (op.inst.opcode in _PARAM_VIEW_OPCODES and op.fn is None and op.ins and op.ins[0] in params
                and all(s in lw.folded for s in op.ins[1:])):
            op.extra["view"] = True


# Custom calls whose kernel returns a layout other than row-major that reshapes of the result
# can view: PyTorch's fused SDPA kernels (flash, memory-efficient, cuDNN; the CPU flash kernel)
# allocate the [B, H, S, D] output as [B, S, H, D] memory (the layout of projected q), so the
# transpose back to [B, S, H, D] is a view and the reshape to [B, S, H * D] is one too.
_STRIDED_RESULT_CALLS = frozenset({"attention"})


def layout_views(ops: list) -> set[int]:
    """Indices of the ``reshape`` ops to leave out of the arena: those whose operand is, through
    ops marked ``"view"`` (``mark_analysis_views``), the result of an unfused ``attention`` call
    whose q is itself a view (``_is_view``).

    ``spmd.passes.views`` sees a reshape of a transposed row-major value, which needs a copy; but
    the attention kernel's memory is [B, S, H, D], so without an arena view the reshape kernel
    (``Tensor.reshape``) returns a view and no kernel runs (one copy of the attention output per
    layer saved; a layout that does not allow the view is still copied, into fresh memory). The
    result then may share the attention result's memory, which ``shares`` reports (an op without
    an arena view); that memory is the caching allocator's, never the arena, so nothing in the
    call writes over it.
    """
    producer = {op.out: op for op in ops}
    found: set[int] = set()
    for k, op in enumerate(ops):
        if op.inst.opcode != "reshape" or op.fn is not None or "view" in op.extra or not op.ins:
            continue
        src = producer.get(op.ins[0])
        while src is not None and "view" in src.extra and src.ins:
            src = producer.get(src.ins[0])
        if (src is not None and src.fn is None and src.inst.opcode == "custom-call"
                and src.inst.attrs.get("custom_call_target") in _STRIDED_RESULT_CALLS
                and _is_view(producer.get(src.ins[0]))):
            found.add(k)
    return found


def _is_view(op) -> bool:
    """Whether ``op`` (the producer of the attention's q, or None for a parameter) is a view op: q
    is then a transposed view of a projection ([B, S, H, D] memory), whose layout the kernels give
    their output. A q computed by a kernel (a rotary fusion) is row-major [B, H, S, D], and so is
    the output: its reshape copies either way and keeps its arena view."""
    return op is not None and "view" in op.extra
