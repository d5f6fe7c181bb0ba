"""Host folding: the values the lowering computes once per device instead of on every call.

The lowering (``spmd.runtime.lower``) evaluates some instructions on the host when it builds a
program, once per local device, and keeps the results as persistent tensors: a call runs no
kernel for them, they get no arena bytes (``spmd.passes.assign_buffers``), are never views
(``spmd.passes.views``), are not fused (``spmd.passes.fuse_elementwise``), and a
dynamic-slice reads its folded offsets from a host copy. Those four must agree on which values
are folded, so the rule lives here and nowhere else:

- ``constant``: always, whatever its size (its literal is held anyway);
- ``partition-id``: always (one u32 per device, the device's partition number);
- ``iota`` and every other computing opcode: when every operand is folded and the result has at
  most ``FOLD_MAX_NUMEL`` elements. An iota has no operands, so it folds up to the size limit;
  a larger one stays a kernel. The limit is in the spirit of XLA's HloConstantFolding
  (xla/hlo/transforms/simplifiers/hlo_constant_folding.cc), which leaves broadcasts and iotas
  to run time because folding them grows constants: here small ones (offset arithmetic,
  scalars, short index vectors) fold and large ones run;
- never: parameters, custom calls and fusions (run-time kernels), collectives and their
  ``*-start`` forms (transfers), ``async-start`` (its called computation is inlined), and any
  tuple-shaped value.

Aliases denote what they alias, as the lowering resolves them: a ``get-tuple-element`` of a
``tuple`` (or of a collective start's operand half) is its element, an ``*-done`` is its
start's result (for ``async-done``, the called computation's root), and a parameter of an
``async-start``'s called computation is the start's operand. So a value read through a tuple
is folded exactly when the value is, and an instruction of a called computation folds by the
same rule as an entry instruction.
"""

from __future__ import annotations

from spmd.ir.hlo import ASYNC_DONE_OPCODES, ASYNC_START_OPCODES, COLLECTIVE_OPCODES, Computation, Instruction

FOLD_MAX_NUMEL = 1024  # elements: a value computed only from folded values up to this size is folded
ALWAYS_FOLDED = frozenset({"constant", "partition-id"})
NEVER_FOLDED = (frozenset({"parameter", "custom-call", "fusion", "tuple", "get-tuple-element"})
                | COLLECTIVE_OPCODES | ASYNC_START_OPCODES | ASYNC_DONE_OPCODES)
_PAIR_STARTS = frozenset({"all-gather-start", "collective-permute-start"})

# What the lowering binds to an instruction: folded or not, or a tuple of those (nested).
_Ref = bool | tuple


def is_foldable(inst: Instruction, operands_folded: bool) -> bool:
    """Whether the lowering computes ``inst`` on the host (see the module docstring).

    Args:
      inst: any instruction; only its opcode and shape are read.
      operands_folded: whether every operand of ``inst`` denotes a folded value (vacuously
        true for an instruction without operands, e.g. ``iota``).
    Returns:
      True for a constant or partition-id; False for a tuple shape or an opcode in
      ``NEVER_FOLDED`` (aliases, parameters, custom calls, fusions, collectives, async ops);
      otherwise ``operands_folded`` and at most ``FOLD_MAX_NUMEL`` result elements.
    Raises nothing.
    """
    op = inst.opcode
    if op in NEVER_FOLDED or inst.shape.is_tuple:
        return False
    if op in ALWAYS_FOLDED:
        return True
    return operands_folded and inst.shape.numel <= FOLD_MAX_NUMEL


def folded_instructions(comp: Computation) -> set[int]:
    """ids of the instructions of ``comp`` whose value the lowering holds as a folded value.

    Walks ``comp`` in order (it must be topologically sorted, as every computation is) and the
    called computation of every ``async-start`` at the start's position. Contains the folded
    instructions of ``comp`` and of those called computations, and the aliases
    (get-tuple-element, ``*-done``, called-computation parameters) that denote a folded value.
    Never contains a tuple-valued instruction. Instructions the lowering never reaches (dead
    code) are classified by the same rule.

    Raises:
      KeyError: an operand that is not defined earlier in its computation.
    """
    refs: dict[int, _Ref] = {}
    _walk(comp, refs)
    return {k for k, r in refs.items() if r is True}


def _walk(comp: Computation, refs: dict[int, _Ref]) -> None:
    for inst in comp.instructions:
        if inst.opcode == "parameter" and id(inst) in refs:
            continue  # a called computation's parameter, bound to the start's operand
        refs[id(inst)] = _ref(inst, refs)


def _ref(inst: Instruction, refs: dict[int, _Ref]) -> _Ref:
    """What the lowering binds to ``inst`` (``spmd.runtime.lower._Lowerer.lower_inst``)."""
    op = inst.opcode
    operands = [refs[id(o)] for o in inst.operands]
    if op == "tuple":
        return tuple(operands)
    if op == "get-tuple-element" and isinstance(operands[0], tuple):
        return operands[0][inst.attrs["index"]]
    if op in ASYNC_DONE_OPCODES:
        return operands[0][1] if isinstance(operands[0], tuple) else operands[0]
    if op == "async-start":
        body: Computation = inst.attrs["calls"]
        for p in body.parameters:
            refs[id(p)] = operands[p.attrs["parameter_number"]]
        _walk(body, refs)
        return (tuple(operands), refs[id(body.root)])
    if op in _PAIR_STARTS:
        return (operands[0], False)  # (the operand, the received value)
    return is_foldable(inst, all(r is True for r in operands))
