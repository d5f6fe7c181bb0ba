"""propagate-sharding: give every instruction of an unpartitioned module a TensorSharding.

Input: a module whose parameters (optionally the root and ``Sharding`` custom calls) carry
user shardings; those are fixed. Output: the same module, every array-shaped instruction of
the entry computation with ``sharding`` set (tuple-shaped ones keep None; their elements'
shardings are their operands').

Algorithm (GSPMD, Xu et al. 2021, arXiv:2105.04663 §3.4, ``xla/service/sharding_propagation.cc``;
Shardy's named-axis propagation): forward and backward sweeps with the per-op rules of
``spmd.passes.sharding_rules.plan`` until nothing changes. A sharding, once chosen, is not
revised, so the first (highest-priority) source wins:

1. forward from operands whose shardings are known (the data flow: no communication);
2. backward from users into instructions still unknown (constants, iota, broadcasts of
   scalars, unannotated parameters);
3. whatever is still unknown becomes replicated, and the sweeps run again.

Backward propagation never makes an operand ``partial``; a dot whose lhs and rhs contracting
dims are split over the same axes gives a ``partial`` result, which stays partial through
ops linear in it (see ``sharding_rules``). An unannotated root is never left partial.

Example (mesh {tp=4})::

    %x = f32[8,16] parameter(0), sharding={replicated}
    %w1 = f32[16,32] parameter(1), sharding={devices=[1,4]<=[4]}
    %w2 = f32[32,16] parameter(2), sharding={devices=[4,1]<=[4]}
    %h = f32[8,32] dot(%x, %w1)            ->  sharding={devices=[1,4]<=[4]}
    %g = f32[8,32] custom-call(%h), gelu   ->  sharding={devices=[1,4]<=[4]}
    %y = f32[8,16] dot(%g, %w2)            ->  partial over tp (all-reduced at the root)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.hlo import Instruction, Module
from spmd.ir.sharding import TensorSharding
from spmd.passes.reshard import normalize
from spmd.passes.sharding_rules import HALF_FLOATS, plan


@dataclass(frozen=True)
class PropagateSharding:
    """The propagate-sharding pass (see the module docstring).

    Attributes:
      max_sweeps: bound on forward+backward sweep pairs per phase.
      dot_gather_discount: weight of the bytes of an all-gather feeding a dot, when choosing
        which dot operand keeps a contested mesh axis (below 1 when a windowed einsum can hide
        that all-gather behind the dot).
      float32_partial_sums: a 16-bit dot is never left partial (spmd-partition sums its float32
        partial products at the dot; ``CompileOptions.float32_partial_sums``).
    Raises (from ``run``):
      ValueError: a user sharding names an axis the mesh lacks or has the wrong rank.
    """

    name: ClassVar[str] = "propagate-sharding"
    max_sweeps: int = 64
    dot_gather_discount: float = 1.0
    float32_partial_sums: bool = True

    def run(self, module: Module) -> Module:
        """Set ``sharding`` on every array-shaped entry instruction; returns ``module``."""
        if module.is_partitioned:
            raise ValueError(f"module {module.name!r}: expected an unpartitioned module")
        comp = module.entry
        state = _State(module, self.dot_gather_discount, self.float32_partial_sums)
        state.hints = _constraint_hints(comp)
        for phase in range(2):
            for _ in range(self.max_sweeps):
                changed = state.forward(comp.instructions)
                changed |= state.backward(reversed(comp.instructions))
                if not changed:
                    break
            if phase == 0:
                state.default_replicated(comp.instructions)
        root = comp.root
        if root is not None and id(root) not in state.fixed and root.sharding is not None and root.sharding.partial:
            root.sharding = root.sharding.with_partial(())
        return module


def _constraint_hints(comp) -> dict[int, TensorSharding]:
    """Instruction -> the sharding a user constraint (a ``Sharding`` custom-call, its only user) wants.

    The forward sweep then plans the op for what the user asked for (e.g. ``out_shardings``
    or a sequence-parallel constraint): a dot weighs the all-to-all a plan would add later, and
    a bias add after a row-parallel dot reduce-scatters its partial operand instead of
    all-reducing it and slicing.
    """
    hints: dict[int, TensorSharding] = {}
    for inst, users in comp.users().items():
        if len(users) == 1 and users[0].opcode == "custom-call" and users[0].sharding is not None \
                and users[0].attrs.get("custom_call_target") == "Sharding":
            hints[id(inst)] = users[0].sharding
    return hints


class _State:
    """Known shardings plus the set of fixed (user) ones."""

    def __init__(self, module: Module, gather_discount: float = 1.0, float32_partial_sums: bool = True) -> None:
        self.mesh = module.mesh
        self.gather_discount = gather_discount
        self.fixed: set[int] = set()
        self.float32_partial_sums = float32_partial_sums
        for inst in module.entry.instructions:
            if inst.sharding is not None:
                _check(inst, self.mesh)
                inst.sharding = normalize(inst.sharding, self.mesh)
                self.fixed.add(id(inst))

    def sharding(self, inst: Instruction) -> TensorSharding | None:
        if inst.opcode == "get-tuple-element":
            src = inst.operands[0]
            if src.opcode == "tuple":
                return self.sharding(src.operands[inst.attrs["index"]])
        return inst.sharding

    def _set(self, inst: Instruction, s: TensorSharding) -> bool:
        if inst.sharding is not None or id(inst) in self.fixed or inst.shape.is_tuple:
            return False
        if inst.opcode == "parameter" or (inst.opcode == "dot" and inst.shape.dtype in HALF_FLOATS
                                          and self.float32_partial_sums):
            s = s.with_partial(())  # a 16-bit dot's partial sum is reduced in float32 at the dot (spmd-partition)
        inst.sharding = normalize(s, self.mesh)
        return True

    def forward(self, insts) -> bool:
        changed = False
        for inst in insts:
            if inst.sharding is not None or inst.shape.is_tuple or not inst.operands:
                continue
            if inst.opcode == "get-tuple-element":
                s = self.sharding(inst)
                changed |= s is not None and self._set(inst, s)
                continue
            if any(o.shape.is_tuple for o in inst.operands):
                continue
            hint = self.hints.get(id(inst))
            p = plan(inst, [self.sharding(o) for o in inst.operands], hint, self.mesh, self.gather_discount)
            if p is not None:
                changed |= self._set(inst, p.result)
        return changed

    def backward(self, insts) -> bool:
        changed = False
        for inst in insts:
            out = inst.sharding
            if out is None or inst.shape.is_tuple or not inst.operands:
                continue
            if inst.opcode == "get-tuple-element":
                src = inst.operands[0]
                if src.opcode == "tuple":
                    changed |= self._set(src.operands[inst.attrs["index"]], out.with_partial(()))
                continue
            if any(o.shape.is_tuple for o in inst.operands):
                continue
            current = [self.sharding(o) for o in inst.operands]
            if all(c is not None for c in current):
                continue
            p = plan(inst, current, out, self.mesh, self.gather_discount)
            for o, c, want in zip(inst.operands, current, p.operands, strict=False):
                if c is None:
                    changed |= self._set(o, want.with_partial(()))
        return changed

    def default_replicated(self, insts) -> None:
        for inst in insts:
            if inst.sharding is None and not inst.shape.is_tuple:
                self._set(inst, TensorSharding.replicated(inst.shape.rank))


def _check(inst: Instruction, mesh) -> None:
    s = inst.sharding
    if inst.shape.is_tuple:
        raise ValueError(f"%{inst.name}: a tuple-shaped instruction cannot carry sharding {s}")
    if s.rank != inst.shape.rank:
        raise ValueError(f"%{inst.name}: sharding {s} has rank {s.rank}, expected {inst.shape.rank} "
                         f"for shape {inst.shape}")
    for a in s.used_axes():
        if a not in mesh.axis_names:
            raise ValueError(f"%{inst.name}: sharding {s} names axis {a!r}; mesh axes are {mesh.axis_names}")
