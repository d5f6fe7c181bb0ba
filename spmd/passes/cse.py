"""cse: common-subexpression elimination.

After XLA's HloCSE (xla/service/hlo_cse.cc). Two instructions of one computation that are
equal compute the same value, so the later one is dropped and its users read the first (in
instruction order). Equal means: the same opcode, result shape, operands (identical
instructions, after the replacements made earlier in the same sweep, so whole equal
subexpressions collapse in one pass), attributes (called computations compared by
identity, ``backend_config`` as a JSON value, literals of constants by dtype, shape and
bit pattern), sharding and stream id. Source locations (metadata) are not compared; the
kept instruction keeps its own.

Each transformer layer of a model with an attention mask broadcasts the same mask bias to
the scores' shape (after ``simplify`` on a partitioned module, one ``broadcast`` of the mask
per layer, with equal operand, dims and sharding); CSE leaves one broadcast for the model.
Before::

    %mask.0 = f32[8,6,128,128] broadcast(%bias), dimensions={0,3}, sharding={devices=[1,2,1,1]<=[2]}
    ...
    %mask.1 = f32[8,6,128,128] broadcast(%bias), dimensions={0,3}, sharding={devices=[1,2,1,1]<=[2]}
    %attention.1 = f32[8,6,128,32] custom-call(%q.1, %k.1, %v.1, %mask.1), custom_call_target="attention", ...

after::

    %mask.0 = f32[8,6,128,128] broadcast(%bias), dimensions={0,3}, sharding={devices=[1,2,1,1]<=[2]}
    ...
    %attention.1 = f32[8,6,128,32] custom-call(%q.1, %k.1, %v.1, %mask.0), custom_call_target="attention", ...

Never merged: parameters; collectives and their async start / done forms, and
``async-start`` / ``async-done`` (each is one transfer or one launch on a stream, with a
matching partner); custom calls other than the pure targets of ``spmd.ir.custom_calls``
(``PURE_CUSTOM_CALLS``: softmax, layer-norm, attention, attention-forward, attention-backward, gelu, silu,
sort, topk, cumsum, cumprod, conv1d and random, whose values depend on their operands and
backend_config only; the ``Sharding`` call carries a constraint and is left alone). ``partition-id``
is the same value wherever it is read on a device, so it merges. Instructions left without users are
removed (parameters and the root stay). The pass runs on any module, partitioned or not.

One deliberate difference from HloCSE: a ``broadcast`` of a scalar (a rank-0 operand) is not
merged unless ``merge_scalar_broadcasts`` is set. Repeating one costs a fill or a stride-0
view, while merging gives one value many users; the later pattern passes match single-use
chains (fuse-attention needs the broadcast of a softmax scale to be used by that scale
only), and XLA gets the same back by duplicating such broadcasts into each fusion. Their
scalar operands (constants) still merge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from spmd.ir.custom_calls import CUSTOM_CALLS
from spmd.ir.hlo import (
    ASYNC_DONE_OPCODES,
    ASYNC_START_OPCODES,
    COLLECTIVE_OPCODES,
    Computation,
    Instruction,
    Module,
)
from spmd.passes.simplify import remove_unused

#: Custom-call targets whose result depends on their operands and config only.
PURE_CUSTOM_CALLS = frozenset({"softmax", "layer-norm", "attention", "gelu", "silu", "sort", "topk", "cumsum",
                               "cumprod", "cummax", "cummin", "conv1d", "random", "attention-forward",
                               "attention-backward"}) & frozenset(CUSTOM_CALLS)
NEVER_MERGED = frozenset({"parameter"}) | COLLECTIVE_OPCODES | ASYNC_START_OPCODES | ASYNC_DONE_OPCODES


@dataclass(frozen=True)
class CSE:
    """The cse pass (see the module docstring).

    merge_scalar_broadcasts: also merge equal broadcasts of rank-0 operands (off by default).
    ``run(module)`` rewrites every computation of ``module`` in place and returns it.
    Raises TypeError for a non-bool ``merge_scalar_broadcasts``.
    """

    name: ClassVar[str] = "cse"
    merge_scalar_broadcasts: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.merge_scalar_broadcasts, bool):
            raise TypeError(f"merge_scalar_broadcasts must be a bool, got {self.merge_scalar_broadcasts!r}")

    def run(self, module: Module) -> Module:
        for comp in module.all_computations():
            cse_computation(comp, self.merge_scalar_broadcasts)
        return module


def cse_computation(comp: Computation, merge_scalar_broadcasts: bool = False, structural_calls: bool = False) -> int:
    """Merge the equal instructions of ``comp`` (see the module docstring); the number dropped.

    ``structural_calls``: called computations are equal when they compute the same thing
    (``computation_key``), not only when they are the same object, so two fusions the
    fuse-elementwise pass outlined from equal chains merge.
    ``comp.instructions`` must be in def-before-use order (it stays so: the kept instruction
    of each group is its first).
    """
    kept: dict[int, Instruction] = {}  # id(dropped) -> the equal instruction kept
    first: dict[tuple, Instruction] = {}
    for inst in comp.instructions:
        inst.operands = [kept.get(id(o), o) for o in inst.operands]
        if not mergeable(inst, merge_scalar_broadcasts):
            continue
        key = instruction_key(inst, structural_calls)
        earlier = first.setdefault(key, inst)
        if earlier is not inst:
            kept[id(inst)] = earlier
    if not kept:
        return 0
    comp.root = kept.get(id(comp.root), comp.root)
    dropped = [i for i in comp.instructions if id(i) in kept]
    remove_unused(comp, dropped)
    return len(dropped)


def mergeable(inst: Instruction, merge_scalar_broadcasts: bool = False) -> bool:
    """Whether ``inst`` may be merged with an equal instruction (see the module docstring)."""
    if inst.opcode in NEVER_MERGED:
        return False
    if inst.opcode == "broadcast" and not merge_scalar_broadcasts:
        return inst.operands[0].shape.rank > 0
    if inst.opcode == "custom-call":
        return inst.attrs.get("custom_call_target") in PURE_CUSTOM_CALLS
    return True


def instruction_key(inst: Instruction, structural_calls: bool = False) -> tuple:
    """A hashable value equal for two instructions exactly when CSE treats them as equal.

    Operands enter by identity (``id``): the caller keeps them alive while keys are in use.
    """
    attrs = tuple(sorted((k, _freeze(v, structural_calls)) for k, v in inst.attrs.items()))
    return (inst.opcode, inst.shape, tuple(id(o) for o in inst.operands), attrs, inst.sharding, inst.stream_id)


def computation_key(comp: Computation) -> tuple:
    """A hashable value equal for two computations that compute the same function of their
    parameters: opcodes, shapes, operand positions and attributes in order, ignoring names."""
    pos = {id(inst): k for k, inst in enumerate(comp.instructions)}
    rows = tuple((i.opcode, i.shape, tuple(pos[id(o)] for o in i.operands),
                  tuple(sorted((k, _freeze(v, True)) for k, v in i.attrs.items()))) for i in comp.instructions)
    return rows, pos[id(comp.root)]


def _freeze(value: Any, structural_calls: bool = False) -> Any:
    """``value`` as a hashable value that is equal exactly when the attribute values are equal.

    Type names are part of the result so that ``1``, ``1.0`` and ``True`` stay apart; floats
    compare by ``repr`` (``-0.0`` is not ``0.0``); tensors by dtype, shape and bytes;
    computations by identity.
    """
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return ("tensor", str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _freeze(v, structural_calls)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v, structural_calls) for v in value))
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, Computation):
        return ("computation", computation_key(value)) if structural_calls else ("computation", id(value))
    return (type(value).__name__, value)
