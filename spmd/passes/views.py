"""View analysis: layout-changing instructions that run as torch views of their operand.

XLA turns a reshape or transpose that only reinterprets its operand's layout into a
``bitcast`` (xla/service/algebraic_simplifier.cc, ReshapeIsBitcast / TransposeIsBitcast): no
kernel, no buffer, the result aliases the operand's bytes. This module makes the same
decision for the scheduled, partitioned entry computation, in PyTorch's terms: a
``reshape`` (``Tensor.view``), ``transpose`` (``permute``), ``broadcast`` (``expand``) or
static ``slice`` (indexing) becomes a view of its operand 0 when

- the view is expressible on the operand's strides. Every value has static element strides:
  parameters, arena values, collective outputs and kernel outputs are row-major; a view's
  strides follow from its operand's by replaying the torch view op on an
  ``torch.empty_strided(..., device="meta")`` tensor (``Tensor.view`` raises for a reshape
  that needs a copy: that op stays a copy kernel). Values whose runtime layout the
  lowering does not fix (folded constants of rank > 0, outputs, the parameter slices the
  lowering always views) have unknown strides: a reshape of them is no view, the other
  view ops still are (they are views on any strides);
- every user reads strided operands: dots, elementwise ops, reduce, concatenate, pad,
  gather, custom calls whose kernel is a torch function (layer-norm, softmax, gelu, silu,
  attention, the training attention forward / backward), copy kernels of the view opcodes,
  dynamic-slice (operand 0) and dynamic-update-slice (the update). Collectives and their starts, async-starts (windowed
  einsum computations), tuples, a dynamic-update-slice's operand 0 (written in place) and
  the ``Sharding`` identity call do not;
- it is not the root (an output is its own memory) and is not folded by the runtime
  (``spmd.passes.folding``: constants, partition-id and small values computed only from
  them are persistent).

A view of a view is a view when the whole chain is. ``assign-buffers`` gives a view no bytes
and counts every read of it as a read of the underlying value; the lowering
(``spmd.runtime.lower``) runs it as a view kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from spmd.ir.hlo import ELEMENTWISE_OPCODES, Instruction, Module
from spmd.passes.folding import FOLD_MAX_NUMEL as FOLD_MAX_NUMEL  # re-exported: the folding threshold
from spmd.passes.folding import folded_instructions as folded_instructions  # re-exported: the folding rule

VIEW_OPCODES = frozenset({"reshape", "transpose", "broadcast", "slice"})
_STRIDED_READERS = ELEMENTWISE_OPCODES | VIEW_OPCODES | frozenset({"dot", "reduce", "concatenate", "pad", "gather",
                                                                    "fusion"})
#: custom calls whose kernels take strided operands (the attention kernels copy an operand only
#: when its last dim is not dense: ``spmd.ir.custom_calls_attention``)
_STRIDED_CUSTOM_CALLS = frozenset({"softmax", "layer-norm", "attention", "attention-forward", "attention-backward",
                                   "gelu", "silu"})

Strides = tuple[int, ...] | None  # element strides; None = not known statically


@dataclass(frozen=True)
class ViewAnalysis:
    """The views of one entry computation.

    views: names of the instructions that run as views of their operand 0.
    strides: per non-tuple entry instruction name, the element strides of its value at
      run time (None where the lowering does not fix them).
    """

    views: frozenset[str]
    strides: Mapping[str, Strides]


def view_instructions(module: Module) -> frozenset[str]:
    """Names of the entry instructions of ``module`` whose result is a view of operand 0.

    ``module`` should be scheduled (the lowering's issue order); see the module docstring.
    """
    return analyze_views(module).views


def analyze_views(module: Module) -> ViewAnalysis:
    """The ``ViewAnalysis`` of ``module``'s entry computation (one pass in program order)."""
    comp = module.entry
    users = comp.users()
    folded = folded_instructions(comp)
    outputs = _output_ids(comp.root)
    strides: dict[int, Strides] = {}
    names: dict[str, Strides] = {}
    views: set[str] = set()
    for inst in comp.instructions:
        if inst.shape.is_tuple:
            continue
        is_view, got = _as_view(inst, strides, users, folded, outputs)
        if is_view:
            views.add(inst.name)
        strides[id(inst)] = got if is_view else _own_strides(inst, folded, outputs)
        names[inst.name] = strides[id(inst)]
    return ViewAnalysis(frozenset(views), names)


def reads_strided(user: Instruction, index: int) -> bool:
    """Whether ``user``'s kernel reads its operand ``index`` correctly as a strided (or expanded) view."""
    op = user.opcode
    if op in _STRIDED_READERS:
        return True
    if op == "custom-call":
        return user.attrs.get("custom_call_target") in _STRIDED_CUSTOM_CALLS
    if op == "dynamic-slice":
        return index == 0
    if op == "dynamic-update-slice":
        return index == 1
    return False


def contiguous_strides(dims: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of ``dims`` (as torch gives them: a size-0 dim counts as 1)."""
    out, step = [], 1
    for d in reversed(dims):
        out.append(step)
        step *= max(d, 1)
    return tuple(reversed(out))


def view_result_strides(inst: Instruction, operand: tuple[int, ...]) -> Strides:
    """Strides of ``inst`` (a ``VIEW_OPCODES`` instruction) run as a view of an operand with
    strides ``operand``; None when no view expresses it (a reshape needing a copy)."""
    src = inst.operands[0].shape
    x = torch.empty_strided(src.dims, operand, dtype=src.torch_dtype, device="meta")
    try:
        return tuple(_apply_view(inst, x).stride())
    except RuntimeError:
        return None


def _apply_view(inst: Instruction, x: torch.Tensor) -> torch.Tensor:
    op, dims = inst.opcode, inst.shape.dims
    if op == "reshape":
        return x.view(dims)
    if op == "transpose":
        return x.permute(tuple(inst.attrs["dimensions"]))
    if op == "slice":
        return x[tuple(slice(s, e, st) for s, e, st in inst.attrs["slice"])]
    bdims = tuple(inst.attrs["dimensions"])  # broadcast: operand dim i -> result dim bdims[i]
    order = sorted(range(len(bdims)), key=lambda i: bdims[i])
    shape = [1] * len(dims)
    for i in bdims:
        shape[i] = dims[i]
    return x.permute(order).reshape(shape).expand(dims)


def _as_view(inst: Instruction, strides: dict[int, Strides], users, folded: set[int],
             outputs: set[int]) -> tuple[bool, Strides]:
    """(whether ``inst`` is a view, its strides as one)."""
    if (inst.opcode not in VIEW_OPCODES or id(inst) in folded or id(inst) in outputs
            or inst.operands[0].shape.is_tuple):
        return False, None
    for u in users[inst]:
        if not all(reads_strided(u, k) for k, o in enumerate(u.operands) if o is inst):
            return False, None
    operand = strides.get(id(inst.operands[0]))
    if operand is None:  # transpose, broadcast and slice are views on any strides; reshape is not
        return inst.opcode != "reshape", None
    got = view_result_strides(inst, operand)
    return got is not None, got


def _own_strides(inst: Instruction, folded: set[int], outputs: set[int]) -> Strides:
    """Strides of a value that is not a view of this analysis."""
    if id(inst) in folded:
        return () if inst.shape.rank == 0 else None
    if id(inst) in outputs or _runtime_param_slice(inst, folded):
        return None
    return contiguous_strides(inst.shape.dims)


def _runtime_param_slice(inst: Instruction, folded: set[int]) -> bool:
    """A slice of a parameter that the lowering views on its own (``lower._mark_views``)."""
    return (inst.opcode in ("slice", "dynamic-slice") and inst.operands[0].opcode == "parameter"
            and all(id(o) in folded for o in inst.operands[1:]))


def _output_ids(root: Instruction) -> set[int]:
    """ids of the instructions whose values are outputs (the root, through tuples)."""
    out: set[int] = set()
    stack = [root]
    while stack:
        inst = stack.pop()
        out.add(id(inst))
        if inst.opcode == "tuple":
            stack.extend(inst.operands)
    return out
