"""sink-scale: a uniform scalar scale between a dot and its reduce-scatter moves after the reduce-scatter.

In a training step the partitioner keeps a weight gradient partial through the optimizer's
linear steps: ``SGD``'s ``lr * grad`` multiplies the partial dot result by a broadcast
scalar, and only then is it reduce-scattered. Since the sum is linear,
``reduce-scatter(dot * s) = reduce-scatter(dot) * s`` when ``s`` is the same on every device
of the group, and the rewritten form is a dot feeding a reduce-scatter directly, the
pattern ``windowed-einsum`` decomposes (the wgrad of a sequence-parallel column-parallel
layer), and multiplies 1/P as many elements. Before::

    %mm = f32[32,16] dot(%dh, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    %lr = f32[32,16] broadcast(%c), dimensions={}
    %g = f32[32,16] multiply(%mm, %lr)
    %rs = f32[16,16] reduce-scatter(%g), dimensions={0}, to_apply=%add, replica_groups={{0,1}}

after::

    %rs.unscaled = f32[16,16] reduce-scatter(%mm), dimensions={0}, to_apply=%add, replica_groups={{0,1}}
    %rs.scale = f32[16,16] broadcast(%c), dimensions={}
    %rs = f32[16,16] multiply(%rs.unscaled, %rs.scale)

Applies where the reduce-scatter sums (``to_apply`` add), the multiply is the
reduce-scatter's operand and has no other user, its other operand is a ``broadcast`` of a
rank-0 value that is uniform over the devices (a constant, or a replicated value that does
not depend on ``partition-id``), and the dot has no other user. Rounding differs from the
unrewritten program by one multiply's rounding at most.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.builder import NameSet
from spmd.ir.hlo import Instruction, Module


@dataclass(frozen=True)
class SinkScale:
    """The sink-scale pass (see the module docstring). ``enabled=False`` leaves the module as is."""

    name: ClassVar[str] = "sink-scale"
    enabled: bool = True

    def run(self, module: Module) -> Module:
        if not self.enabled or not module.is_partitioned:
            return module
        comp = module.entry
        users = comp.users()
        names = NameSet(module)
        for rs in list(comp.instructions):
            match = _match(rs, users, comp.root)
            if match is None:
                continue
            dot, bc = match
            scalar, mul = bc.operands[0], rs.operands[0]
            unscaled = Instruction(names.fresh(f"{rs.name}.unscaled"), "reduce-scatter", rs.shape, [dot],
                                   dict(rs.attrs), sharding=rs.sharding, location=rs.location)
            scale = Instruction(names.fresh(f"{rs.name}.scale"), "broadcast", rs.shape.with_dtype(scalar.shape.dtype),
                                [scalar], {"dimensions": ()}, sharding=None)
            out = Instruction(names.fresh(f"{rs.name}.scaled"), "multiply", rs.shape, [unscaled, scale],
                              sharding=rs.sharding, location=mul.location)
            k = comp.instructions.index(rs)
            comp.instructions[k:k + 1] = [unscaled, scale, out]
            comp.replace_all_uses(rs, out)
            comp.instructions.remove(mul)
            if not any(bc in i.operands for i in comp.instructions) and bc is not comp.root:
                comp.instructions.remove(bc)
            out.name = rs.name
            users = comp.users()
        return module


def _match(rs: Instruction, users, root: Instruction) -> tuple[Instruction, Instruction] | None:
    """(the dot, the broadcast of a uniform rank-0 scalar) of a reduce-scatter(multiply(dot, broadcast)), else None."""
    if rs.opcode != "reduce-scatter" or len(rs.operands) != 1:
        return None
    reducer = rs.attrs.get("to_apply")
    if reducer is not None and reducer.root.opcode != "add":
        return None
    mul = rs.operands[0]
    if mul.opcode != "multiply" or users[mul] != [rs] or mul is root:
        return None
    for side in (0, 1):
        dot, bc = mul.operands[side], mul.operands[1 - side]
        if dot.opcode != "dot" or users[dot] != [mul] or dot is root or bc.opcode != "broadcast":
            continue
        scalar = bc.operands[0]
        if scalar.shape.rank == 0 and bc.shape.dtype == mul.shape.dtype and _uniform(scalar):
            return dot, bc
    return None


def _uniform(scalar: Instruction) -> bool:
    """True if ``scalar`` has one value on every device: a constant, or replicated without partition-id."""
    if scalar.opcode == "constant":
        return True
    if scalar.sharding is None or not scalar.sharding.is_replicated:
        return False
    stack, seen = [scalar], set()
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if cur.opcode in ("partition-id", "all-to-all", "collective-permute", "reduce-scatter"):
            return False
        if cur.opcode == "parameter" and (cur.sharding is None or not cur.sharding.is_replicated):
            return False
        stack.extend(cur.operands)
    return True

