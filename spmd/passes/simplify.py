"""simplify: algebraic simplification of the shape ops the partitioner leaves behind.

Modelled on XLA's AlgebraicSimplifier (xla/service/algebraic_simplifier.cc), restricted to
data-movement ops. The partitioner turns a replicated value that a sharded user reads into
a full-size op followed by a ``dynamic-slice`` at a partition-id offset: for a ``broadcast``
(an attention mask ``f32[8,128]`` broadcast to the scores ``f32[8,12,128,128]`` and split on
the heads dim) that materializes the whole broadcast on every device and then copies a
slice of it, although every slice of a dim that the broadcast introduced holds the same
values. Before (2 devices)::

    %b = f32[8,12,128,128] broadcast(%m), dimensions={0,3}, sharding={replicated}
    %pid = s32[] convert(%partition-id)
    %off = s32[] multiply(%pid, %six)
    %ds = f32[8,6,128,128] dynamic-slice(%b, %zero, %off, %zero, %zero), dynamic_slice_sizes={8,6,128,128},
        sharding={devices=[1,2,1,1]<=[2]}

after::

    %ds = f32[8,6,128,128] broadcast(%m), dimensions={0,3}, sharding={devices=[1,2,1,1]<=[2]}

Rewrites (each instruction is replaced by one of the same shape):

- ``dynamic-slice(broadcast(x), starts...)`` where every dim that is sliced (slice size <
  operand size) is a dim the broadcast introduced (not in its ``dimensions``) ->
  ``broadcast(x)`` straight to the slice shape; the starts no longer matter. The same for a
  static ``slice`` of a broadcast (any start, limit and stride on the introduced dims, the
  whole range with stride 1 on the others). XLA: HandleDynamicSlice / HandleSlice.
- ``reshape(reshape(x))`` -> ``reshape(x)``; ``transpose(transpose(x))`` -> one transpose of
  x by the composed permutation; ``broadcast(broadcast(x))`` -> one broadcast of x by the
  composed dims map. XLA: HandleReshape / HandleTranspose / HandleBroadcast.
- ``dynamic-update-slice(broadcast(s), update, starts...)`` of a scalar ``s`` at constant starts
  -> ``pad(update, s)`` with the update's position as low / high padding (XLA:
  HandleDynamicUpdateSlice). ``aten.slice_scatter`` into ``new_zeros`` (the backward of a
  slice: rotary embeddings' ``rotate_half``) imports as such an update; as a pad it is no
  longer a copy of a full-size zero buffer plus an in-place write, and ``fuse-elementwise``
  fuses it into its consumer.
- an ``all-reduce`` / ``all-gather`` / ``reduce-scatter`` / ``all-to-all`` whose replica groups
  are single devices (a mesh axis of size 1) -> the operand (XLA: AllReduceSimplifier).
- a ``reshape`` to the operand's own dims, a ``transpose`` by the identity permutation, a
  ``broadcast`` to the operand's own dims in order, a ``slice`` of the whole operand with
  stride 1 and a ``dynamic-slice`` of the whole operand do nothing -> the operand. (A
  combined rewrite above that does nothing, as a transpose composed with its inverse, gives
  x itself.)

A new instruction takes the name, sharding, stream id and source location of the one it
replaces (the location of the absorbed operand where the replaced one has none: the
partitioner's dynamic-slices carry none). Replacing a program output (the root, or an
element of a root tuple) by an existing value is skipped: outputs carry the global sharding
the runtime lays the result out by, and a parameter is no output. Instructions left without
users are removed (parameters and the root stay).

Shardings are global annotations; after partitioning every op above computes on the local
shard, where these identities hold for any annotation (a reshape between equal local dims
moves no element), so the pass runs on partitioned modules only. Padding rows of padded
shard dims (docs/architecture.md) keep their unspecified contents.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.builder import Builder
from spmd.ir.hlo import Computation, Instruction, Module


@dataclass(frozen=True)
class Simplify:
    """The simplify pass (see the module docstring).

    ``run(module)`` rewrites every computation of ``module`` in place and returns it.
    Raises ValueError (in ``run``) for a module that is not partitioned.
    """

    name: ClassVar[str] = "simplify"

    def run(self, module: Module) -> Module:
        if not module.is_partitioned:
            raise ValueError(f"module {module.name!r} is not partitioned; simplify runs after spmd-partition")
        for comp in module.all_computations():
            simplify_computation(module, comp)
        return module


@dataclass(frozen=True)
class NewOp:
    """A replacement to create: ``opcode(operand)`` with ``dimensions`` (None: no attribute).

    ``absorbed`` is the operand instruction the rewrite folds away (its location is the
    fallback source location of the new instruction).
    """

    opcode: str
    operand: Instruction
    dimensions: tuple[int, ...] | None
    absorbed: Instruction
    more: tuple[Instruction, ...] = ()  # operands after ``operand``
    attrs: tuple[tuple[str, object], ...] = ()  # attributes other than ``dimensions``


def simplify_computation(module: Module, comp: Computation) -> int:
    """Apply the rewrites to ``comp`` (of ``module``) until none applies; the number applied.

    Sweeps in instruction order, so a value is simplified before its users look at it.
    """
    builder = Builder(module, comp)
    total = 0
    while True:
        applied, absorbed = _sweep(builder, comp)
        total += applied
        remove_unused(comp, absorbed)
        if not applied:
            return total


def _sweep(builder: Builder, comp: Computation) -> tuple[int, list[Instruction]]:
    """One pass over ``comp``: (rewrites applied, operands of replaced instructions)."""
    outputs = output_ids(comp)
    applied, absorbed = 0, []
    for inst in list(comp.instructions):
        found = simplified(inst)
        if found is None:
            continue
        if isinstance(found, Instruction):
            if id(inst) in outputs:
                continue
            new = found
        else:
            new = _create(builder, inst, found)
            if id(inst) in outputs:
                outputs.add(id(new))
        _replace(comp, inst, new)
        if not isinstance(found, Instruction):
            new.name = inst.name  # the builder derived a fresh name from it; inst is gone now
        absorbed += inst.operands
        applied += 1
    return applied, absorbed


def simplified(inst: Instruction) -> Instruction | NewOp | None:
    """What ``inst`` simplifies to: an existing instruction, a ``NewOp`` of ``inst``'s shape, or None."""
    if inst.shape.is_tuple or not inst.operands or inst.operands[0].shape.is_tuple:
        return None
    rule = _RULES.get(inst.opcode)
    return rule(inst) if rule is not None else None


# --------------------------------------------------------------------------- rules
def _reshape(inst: Instruction) -> Instruction | NewOp | None:
    x = inst.operands[0]
    if x.shape == inst.shape:
        return x
    if x.opcode == "reshape":
        y = x.operands[0]
        return y if y.shape == inst.shape else NewOp("reshape", y, None, x)
    return None


def _transpose(inst: Instruction) -> Instruction | NewOp | None:
    x, perm = inst.operands[0], tuple(inst.attrs["dimensions"])
    if perm == tuple(range(len(perm))):
        return x
    if x.opcode == "transpose":
        inner = tuple(x.attrs["dimensions"])
        composed = tuple(inner[p] for p in perm)  # out dim i = x dim perm[i] = y dim inner[perm[i]]
        y = x.operands[0]
        return y if composed == tuple(range(len(composed))) else NewOp("transpose", y, composed, x)
    return None


def _broadcast(inst: Instruction) -> Instruction | NewOp | None:
    x, dims = inst.operands[0], tuple(inst.attrs["dimensions"])
    if _is_identity_broadcast(x, inst, dims):
        return x
    if x.opcode == "broadcast":
        y = x.operands[0]
        composed = tuple(dims[d] for d in x.attrs["dimensions"])  # y dim i -> x dim -> inst dim
        return y if _is_identity_broadcast(y, inst, composed) else NewOp("broadcast", y, composed, x)
    return None


def _slice(inst: Instruction) -> Instruction | NewOp | None:
    x = inst.operands[0]
    sliced = {d for d, (a, b, c) in enumerate(inst.attrs["slice"]) if (a, b, c) != (0, x.shape.dims[d], 1)}
    return _slice_of(inst, x, sliced)


def _dynamic_slice(inst: Instruction) -> Instruction | NewOp | None:
    x = inst.operands[0]
    sizes = inst.attrs["dynamic_slice_sizes"]
    sliced = {d for d, (s, n) in enumerate(zip(sizes, x.shape.dims, strict=True)) if s < n}
    return _slice_of(inst, x, sliced)


def _slice_of(inst: Instruction, x: Instruction, sliced: set[int]) -> Instruction | NewOp | None:
    """A slice ``inst`` of ``x`` that changes the dims ``sliced``: x itself, a narrower broadcast, or None."""
    if not sliced:
        return x
    if x.opcode == "broadcast" and not sliced & set(x.attrs["dimensions"]):
        return NewOp("broadcast", x.operands[0], tuple(x.attrs["dimensions"]), x)
    return None


def _is_identity_broadcast(x: Instruction, inst: Instruction, dims: tuple[int, ...]) -> bool:
    return x.shape == inst.shape and dims == tuple(range(len(dims)))


def _dynamic_update_slice(inst: Instruction) -> Instruction | NewOp | None:
    """An update into a broadcast scalar at constant starts -> a pad of the update with that scalar."""
    base, update, starts = inst.operands[0], inst.operands[1], inst.operands[2:]
    if (base.opcode != "broadcast" or base.operands[0].shape.rank != 0 or update.shape.is_tuple
            or any(s.opcode != "constant" or s.shape.rank != 0 for s in starts)):
        return None
    padding = []
    for s, n, u in zip(starts, inst.shape.dims, update.shape.dims, strict=True):
        lo = min(max(int(s.attrs["literal"]), 0), n - u)  # HLO clamps the start into [0, n - u]
        padding.append((lo, n - u - lo, 0))
    return NewOp("pad", update, None, base, more=(base.operands[0],), attrs=(("padding", tuple(padding)),))


def _collective(inst: Instruction) -> Instruction | NewOp | None:
    """A collective whose every replica group is one device moves and reduces nothing -> the operand."""
    groups = inst.attrs.get("replica_groups")
    if not groups or any(len(g) != 1 for g in groups) or len(inst.operands) != 1:
        return None
    x = inst.operands[0]
    return x if x.shape == inst.shape else None


_RULES = {
    "all-reduce": _collective,
    "all-gather": _collective,
    "reduce-scatter": _collective,
    "all-to-all": _collective,
    "reshape": _reshape,
    "transpose": _transpose,
    "broadcast": _broadcast,
    "slice": _slice,
    "dynamic-slice": _dynamic_slice,
    "dynamic-update-slice": _dynamic_update_slice,
}


# --------------------------------------------------------------------------- editing
def _create(builder: Builder, old: Instruction, new: NewOp) -> Instruction:
    """``new`` as an instruction before ``old``, with old's shape, sharding, stream and location."""
    attrs = {"dimensions": new.dimensions} if new.dimensions is not None else {}
    attrs.update(new.attrs)
    location = old.location if old.location is not None else new.absorbed.location
    with builder.insert_before(old):
        return builder.add(new.opcode, [new.operand, *new.more], attrs, shape=old.shape, name=old.name,
                           sharding=old.sharding, stream_id=old.stream_id, location=location)


def _replace(comp: Computation, old: Instruction, new: Instruction) -> None:
    """Users of ``old`` (and the root) read ``new``; ``old`` leaves ``comp``."""
    comp.replace_all_uses(old, new)
    comp.instructions = [i for i in comp.instructions if i is not old]


def output_ids(comp: Computation) -> set[int]:
    """ids of ``comp``'s outputs: the root and, for a tuple root, its elements."""
    root = comp.root
    if root is None:
        return set()
    return {id(root), *(id(o) for o in root.operands)} if root.opcode == "tuple" else {id(root)}


def remove_unused(comp: Computation, candidates: Iterable[Instruction]) -> int:
    """Drop each of ``candidates`` that nothing in ``comp`` uses, then its operands likewise.

    Parameters and the root are kept; returns the number of instructions removed.
    """
    uses = Counter(id(o) for inst in comp.instructions for o in inst.operands)
    present = {id(i) for i in comp.instructions}
    gone: set[int] = set()
    stack = list(candidates)
    while stack:
        x = stack.pop()
        if id(x) not in present or id(x) in gone or uses[id(x)] or x is comp.root or x.opcode == "parameter":
            continue
        gone.add(id(x))
        for o in x.operands:
            uses[id(o)] -= 1
            stack.append(o)
    if gone:
        comp.instructions = [i for i in comp.instructions if id(i) not in gone]
    return len(gone)
