"""all-reduce-reuse: an all-reduce of a value that is also reduce-scattered becomes an all-gather of it.

An all-reduce is a reduce-scatter followed by an all-gather (the ring all-reduce, Patarasuk and
Yuan, JPDC 2009; XLA splits it the same way in its reduce-scatter decomposition). In a
training step the partitioner sometimes reduces one partial weight gradient twice: AdamW needs
the gradient sharded like its parameter (a reduce-scatter) and also ``grad * grad`` for the
second moment, for which it all-reduces the same partial dot. Reusing the reduce-scatter moves
2(P-1)/P of the gradient's bytes per device instead of 3(P-1)/P, and leaves the dot with one
user, the reduce-scatter, which ``windowed-einsum`` can decompose. Before::

    %mm = f32[32,16] dot(%dh, %x), ...
    %rs = f32[8,16] reduce-scatter(%mm), dimensions={0}, to_apply=%add, replica_groups={{0,1,2,3}}
    %ar = f32[32,16] all-reduce(%mm), to_apply=%add, replica_groups={{0,1,2,3}}

after::

    %rs = f32[8,16] reduce-scatter(%mm), dimensions={0}, to_apply=%add, replica_groups={{0,1,2,3}}
    %ar = f32[32,16] all-gather(%rs), dimensions={0}, replica_groups={{0,1,2,3}}

Applies where both sum (``to_apply`` add) over the same replica groups and the reduce-scatter
splits one dim evenly. Rounding: every device then holds the sum the reduce-scatter computed
for each chunk, which an all-reduce may order differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.hlo import Instruction, Module
from spmd.passes.windowed_einsum import stable_toposort


@dataclass(frozen=True)
class AllReduceReuse:
    """The all-reduce-reuse pass (see the module docstring). ``enabled=False`` leaves the module as is."""

    name: ClassVar[str] = "all-reduce-reuse"
    enabled: bool = True

    def run(self, module: Module) -> Module:
        if not self.enabled or not module.is_partitioned:
            return module
        comp = module.entry
        n = module.num_partitions
        scatters: dict[int, list[Instruction]] = {}
        for i in comp.instructions:
            if i.opcode == "reduce-scatter" and _sums(i) and len(i.operands) == 1 and _even(i, n):
                scatters.setdefault(id(i.operands[0]), []).append(i)
        changed = False
        for k, ar in enumerate(comp.instructions):
            if ar.opcode != "all-reduce" or not _sums(ar) or len(ar.operands) != 1 or ar.attrs.get("backend_config"):
                continue
            rs = next((r for r in scatters.get(id(ar.operands[0]), []) if _groups(r, n) == _groups(ar, n)), None)
            if rs is None or ar.shape != ar.operands[0].shape:
                continue
            attrs = {"dimensions": tuple(rs.attrs["dimensions"]), "replica_groups": rs.attrs.get("replica_groups")}
            if attrs["replica_groups"] is None:
                del attrs["replica_groups"]
            ag = Instruction(ar.name, "all-gather", ar.shape, [rs], attrs, sharding=ar.sharding, location=ar.location)
            comp.instructions[k] = ag
            comp.replace_all_uses(ar, ag)
            changed = True
        if changed:
            comp.instructions = stable_toposort(comp.instructions)
        return module


def _sums(inst: Instruction) -> bool:
    reducer = inst.attrs.get("to_apply")
    return reducer is None or reducer.root.opcode == "add"


def _groups(inst: Instruction, n: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in (inst.attrs.get("replica_groups") or (tuple(range(n)),)))


def _even(rs: Instruction, n: int) -> bool:
    dims = rs.attrs.get("dimensions", ())
    groups = _groups(rs, n)
    if len(dims) != 1 or len({len(g) for g in groups}) != 1 or rs.shape.is_tuple:
        return False
    return rs.operands[0].shape.dims[dims[0]] == len(groups[0]) * rs.shape.dims[dims[0]]
