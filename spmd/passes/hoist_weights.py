"""hoist-weights: values computed only from weights move to a prologue run once per weight version.

Constant folding of parameter-only subgraphs, keyed by the weights' version instead of done at
compile time: XLA folds constant-only subgraphs (xla/hlo/transforms/simplifiers/
hlo_constant_folding.cc) and JAX hoists parameter-only work out of loops (``while-loop
invariant code motion``); inference servers pre-pack weights once (TensorRT, FasterTransformer's
fused QKV weights). Here the entry computation is split in two:

- the **prologue**: a module whose parameters are the entry's parameters the hoisted values
  read (only those, renumbered from 0 in the entry's order: ``WeightSplit.inputs`` maps them
  back) and whose root is a tuple of the *hoisted values*. Programs that hoist the same values
  from the same weights (a ``Generator``'s prefill and decode) so get equal prologues, which the
  runtime shares (``spmd.runtime.prologue_registry``). The values that read weights come first,
  the constant-only ones after (``WeightSplit.num_weight_values``): the runtime runs them as two
  prologues (``select_outputs``), so that a prefill's shape-dependent tables do not keep its
  merged weights from being shared with the decode;
- the **main** program: the entry with each hoisted value replaced by a new parameter, numbered
  after the original ones in hoisted order; the work that only fed hoisted values is dropped.

The runtime (``spmd.runtime.weight_cache``) runs the prologue when the weights it reads change
and passes its cached outputs to every call of the main program.

Which values: an instruction is *weight-only* when it is a parameter of a weight (the pass's
``weights``: ``spmd.jit``'s ``weight_argnums``, ``spmd.parallelize``'s parameters, never a
donated argument: the call may reuse a donated buffer, so a value derived from it would go
stale; per-call inputs are not weights: their values would be computed again on every call,
by a second program), or when every operand is weight-only or *constant-only* (constants, iota,
partition-id and values of those) and at least one is weight-only. Never weight-only: collectives
and async ops (transfers: a gathered weight cached on every device would cost the group size
times its shard memory), tuples and get-tuple-element, fusions, and a ``broadcast`` of a
weight-dependent value (it is a free view that would only grow the cached memory).

A weight-only instruction is *hoisted* when it is not a parameter, some user is not weight-only
(or it is an output), and it pays: its weight-dependent chain holds an op that is not a view op
(reshape, transpose, broadcast, slice: those cost nothing, see ``spmd.passes.views``). Before,
with the concatenation of merge-dots::

    %wq = f32[8,6] parameter(1)
    %wk = f32[8,6] parameter(2)
    %c = f32[8,12] concatenate(%wq, %wk), dimensions={1}
    %m = f32[4,12] dot(%x, %c), lhs_contracting_dims={1}, rhs_contracting_dims={0}

after, the main program::

    %wq = f32[8,6] parameter(1)
    %wk = f32[8,6] parameter(2)
    %c.hoisted = f32[8,12] parameter(3)
    %m = f32[4,12] dot(%x, %c.hoisted), lhs_contracting_dims={1}, rhs_contracting_dims={0}

and the prologue, of the two weights it reads (``inputs`` (1, 2))::

    %wq = f32[8,6] parameter(0)
    %wk = f32[8,6] parameter(1)
    %c = f32[8,12] concatenate(%wq, %wk), dimensions={1}
    ROOT %hoisted = (f32[8,12]) tuple(%c)

Constant-only values that cost kernels are hoisted too when the pass has weights (the
prologue then computes them once per weight version, XLA's constant folding on the device):
a constant-only instruction that is not a view op, a constant, an iota or partition-id, that
the lowering does not fold on the host (``spmd.passes.folding``: small values), whose
constant-only chain reads no partition-id (per-device values stay in the program), and whose
value reaches a per-call instruction or an output directly or through constant view ops.
Rotary embeddings' angle table (``cos`` / ``sin`` of an ``iota``-built [S, D] table) is the
example: three kernels per call before.

Runs after merge-dots and fuse-attention (their concatenations are the prime example) and
before fuse-elementwise (a cast of a weight is cut out before it could be fused with per-call
work). The prologue's instructions run on stream 0; it is partitioned like the main program
(the hoisted values are per-device shards, with the instruction's global sharding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from spmd.ir.builder import clone_module
from spmd.ir.hlo import (
    ASYNC_DONE_OPCODES,
    ASYNC_START_OPCODES,
    COLLECTIVE_OPCODES,
    Instruction,
    Module,
    Shape,
    ancestor_ids,
)
from spmd.passes.folding import folded_instructions

VIEW_OPCODES = frozenset({"reshape", "transpose", "broadcast", "slice"})
NEVER_HOISTED = (frozenset({"parameter", "tuple", "get-tuple-element", "fusion"})
                 | COLLECTIVE_OPCODES | ASYNC_START_OPCODES | ASYNC_DONE_OPCODES)
_CONST, _WEIGHT = "const", "weight"


@dataclass(frozen=True)
class WeightSplit:
    """The result of ``HoistWeights.split``.

    main: the per-call module (the input module, rewritten in place).
    prologue: the module computing the hoisted values, or None when nothing is hoisted.
    hoisted: names of the hoisted values (the main program's new parameters, in order).
    inputs: the main program's parameter numbers the prologue reads, in the prologue's parameter
      order (prologue parameter k is main parameter ``inputs[k]``; the key of its cache).
    num_weight_values: how many of the hoisted values (the first ones) read weights; the others
      are constant-only (``select_outputs`` splits the prologue in the two: a prefill's
      mask and rotary tables depend on its shapes, its merged weights are the decode's).
    """

    main: Module
    prologue: Module | None = None
    hoisted: tuple[str, ...] = ()
    inputs: tuple[int, ...] = ()
    num_weight_values: int = 0


@dataclass(frozen=True)
class HoistWeights:
    """The hoist-weights pass (see the module docstring).

    enabled: False leaves every module unchanged (``CompileOptions.hoist_weights``).
    weights: parameter numbers of the weights (never a donated parameter: the call may reuse
      its buffers, so a value derived from it would go stale).
    Raises TypeError for a non-bool ``enabled``; ``split`` / ``run`` raise ValueError for a module
    that is not partitioned.
    """

    name: ClassVar[str] = "hoist-weights"
    enabled: bool = True
    weights: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(self.enabled).__name__}")
        object.__setattr__(self, "weights", frozenset(self.weights))

    def run(self, module: Module) -> Module:
        """The main program (the prologue is dropped; ``split`` keeps it)."""
        return self.split(module).main

    def split(self, module: Module) -> WeightSplit:
        """Split ``module`` into prologue and main program (``module`` is rewritten in place)."""
        if not module.is_partitioned:
            raise ValueError(f"hoist-weights: expected a partitioned module, got {module.name!r} before spmd-partition")
        if not self.enabled:
            return WeightSplit(module)
        comp = module.entry
        kinds = _kinds(comp.instructions, self.weights)
        users = comp.users()
        outputs = _outputs(comp.root)
        consts = _hoisted_constants(comp, kinds, users, outputs) if self.weights else set()
        hoisted = [inst for inst in comp.instructions
                   if (kinds.get(inst) == _WEIGHT and inst.opcode != "parameter"
                       and (id(inst) in outputs or any(kinds.get(u) != _WEIGHT for u in users[inst]))
                       and _pays(inst, kinds)) or id(inst) in consts]
        if not hoisted:
            return WeightSplit(module)
        weighted = [inst for inst in hoisted if kinds.get(inst) == _WEIGHT]
        hoisted = weighted + [inst for inst in hoisted if kinds.get(inst) != _WEIGHT]
        prologue, inputs = _prologue(module, hoisted)
        names = _replace_with_parameters(module, hoisted)
        return WeightSplit(module, prologue, names, inputs, len(weighted))


def _kinds(instructions: list[Instruction], weights: frozenset[int]) -> dict[Instruction, str]:
    """Per instruction that depends on no per-call value: ``_CONST`` or ``_WEIGHT`` (see the module doc)."""
    kinds: dict[Instruction, str] = {}
    for inst in instructions:
        if inst.opcode == "parameter":
            if inst.attrs["parameter_number"] in weights:
                kinds[inst] = _WEIGHT
            continue
        if inst.opcode in NEVER_HOISTED or inst.shape.is_tuple:
            continue
        ops = [kinds.get(o) for o in inst.operands]
        if None in ops:
            continue
        if _WEIGHT not in ops:
            kinds[inst] = _CONST
        elif inst.opcode != "broadcast":
            kinds[inst] = _WEIGHT
    return kinds


def _outputs(root: Instruction) -> set[int]:
    return {id(o) for o in root.operands} if root.opcode == "tuple" else {id(root)}


def _pays(inst: Instruction, kinds: dict[Instruction, str]) -> bool:
    """Whether the weight-dependent chain computing ``inst`` holds an op that is not a view."""
    stack, seen = [inst], set()
    while stack:
        cur = stack.pop()
        if id(cur) in seen or kinds.get(cur) != _WEIGHT or cur.opcode == "parameter":
            continue
        seen.add(id(cur))
        if cur.opcode not in VIEW_OPCODES:
            return True
        stack.extend(cur.operands)
    return False



_FREE_CONST_OPCODES = VIEW_OPCODES | {"constant", "iota", "partition-id"}


def _hoisted_constants(comp, kinds: dict[Instruction, str], users: dict, outputs: set[int]) -> set[int]:
    """ids of the constant-only instructions to hoist (see the module docstring)."""
    folded = folded_instructions(comp)
    per_device: set[int] = set()  # constant-only values that read partition-id
    for inst in comp.instructions:
        if kinds.get(inst) == _CONST and (inst.opcode == "partition-id"
                                          or any(id(o) in per_device for o in inst.operands)):
            per_device.add(id(inst))
    memo: dict[int, bool] = {}

    def reaches_call(inst: Instruction) -> bool:
        if id(inst) not in memo:
            memo[id(inst)] = id(inst) in outputs or any(
                kinds.get(u) is None or (kinds.get(u) == _CONST and u.opcode in VIEW_OPCODES and reaches_call(u))
                for u in users.get(inst, ()))
        return memo[id(inst)]

    return {id(inst) for inst in comp.instructions
            if kinds.get(inst) == _CONST and inst.opcode not in _FREE_CONST_OPCODES and id(inst) not in folded
            and id(inst) not in per_device and reaches_call(inst)}


def _prologue(module: Module, hoisted: list[Instruction]) -> tuple[Module, tuple[int, ...]]:
    """A module computing ``hoisted`` from the parameters they read (root: a tuple of them), and
    the entry's parameter numbers of its parameters (prologue parameter k is entry parameter inputs[k])."""
    needed = ancestor_ids(hoisted)
    names = {inst.name for inst in module.entry.instructions if id(inst) in needed}
    pro = clone_module(module)
    pro.name = f"{module.name}.prologue"
    comp = pro.entry
    comp.instructions = [inst for inst in comp.instructions if inst.name in names]
    params = sorted((i for i in comp.instructions if i.opcode == "parameter"),
                    key=lambda i: i.attrs["parameter_number"])
    inputs = tuple(p.attrs["parameter_number"] for p in params)
    for k, p in enumerate(params):
        p.attrs["parameter_number"] = k
    by_name = {inst.name: inst for inst in comp.instructions}
    elements = [by_name[h.name] for h in hoisted]
    root = Instruction(pro.fresh_name("hoisted"), "tuple", Shape.tuple([e.shape for e in elements]), elements)
    comp.instructions.append(root)
    comp.root = root
    for inst in comp.instructions:
        if inst.opcode != "parameter":
            inst.stream_id = 0
    called = _called(comp.instructions)
    pro.computations = [c for c in pro.computations if id(c) in called]
    return pro, inputs


def select_outputs(prologue: Module, indices: Sequence[int]) -> tuple[Module, tuple[int, ...]]:
    """The prologue of only the outputs ``indices`` of ``prologue`` (root tuple elements, in that order).

    Returns the module (its parameters: the ones those outputs read, renumbered from 0) and the
    ``prologue`` parameter numbers of its parameters. Raises ValueError for an index outside the
    root tuple.
    """
    elements = prologue.entry.root.operands
    bad = [i for i in indices if not 0 <= i < len(elements)]
    if bad:
        raise ValueError(f"indices: expected outputs of the prologue's {len(elements)}-tuple, got {bad}")
    sub, inputs = _prologue(prologue, [elements[i] for i in indices])
    sub.name = prologue.name
    return sub, inputs


def _called(instructions: list[Instruction]) -> set[int]:
    """ids of the computations ``instructions`` call, transitively."""
    out: set[int] = set()
    stack = [c for inst in instructions for c in inst.called_computations()]
    while stack:
        c = stack.pop()
        if id(c) not in out:
            out.add(id(c))
            stack.extend(cc for inst in c.instructions for cc in inst.called_computations())
    return out


def _replace_with_parameters(module: Module, hoisted: list[Instruction]) -> tuple[str, ...]:
    """Replace each hoisted value of the entry by a new parameter; drop the dead work. Returns the names."""
    comp = module.entry
    num_params = len(comp.parameters)
    new_params = []
    for k, inst in enumerate(hoisted):
        p = Instruction(module.fresh_name(f"{inst.name}.hoisted"), "parameter", inst.shape, [],
                        {"parameter_number": num_params + k}, sharding=inst.sharding, location=inst.location)
        comp.instructions.insert(_after_parameters(comp.instructions, inst), p)
        comp.replace_all_uses(inst, p)
        new_params.append(p)
    comp.remove_dead()
    return tuple(p.name for p in new_params)


def _after_parameters(instructions: list[Instruction], inst: Instruction) -> int:
    """The position after the last parameter that precedes ``inst`` (before ``inst`` and all its users)."""
    pos = instructions.index(inst)
    return max((k + 1 for k in range(pos) if instructions[k].opcode == "parameter"), default=pos)
