"""multi-output-fusion: loop fusions that share inputs, or feed one another, become one fusion.

After fuse-elementwise, an optimizer update still runs several kernels per parameter: AdamW's
``m' = b1 m + (1 - b1) g``, ``v' = b2 v + (1 - b2) g^2`` and ``p' = p - lr (m' / bc1) / (sqrt(v' /
bc2) + eps) - lr wd p`` are three fusions (m' and v' are outputs of the step, so fuse-elementwise
cannot move them into the parameter update), and each reads the gradient again. A decode step's
rotary embeddings of q and k read the same cos / sin rows in two kernels. This pass is XLA's
multi-output fusion (xla/service/gpu/transforms/multi_output_fusion.cc):

- producer-consumer: a fusion that reads another fusion whose value is also used elsewhere
  absorbs it; the producer's value becomes a second output of the merged fusion;
- sibling: fusions that read the same operand merge into one fusion with both values as outputs,
  where that operand costs memory traffic: it has at least as many elements as each output (the
  gradient an AdamW update reads three times; the q / k / v rows that rotary embeddings read),
  and it is not a constant, broadcast or other view (a bias vector that two halves of a split
  batch both read does not tie them together).

A merged fusion's called computation holds every member's instructions (equal instructions
computed once: a cse sweep) and ends in a ``tuple`` of the values used outside it::

    %fusion = (f32[16,8], f32[16,8], f32[16,8]) fusion(%p, %g, %m, %v, ...), kind=kLoop, calls=%fused_computation
    %get-tuple-element = f32[16,8] get-tuple-element(%fusion), index=0

The runtime (``spmd.runtime.kernels_fusion``) runs it as one generated kernel that stores every
output, each into the buffer assigned to it (a donated parameter's buffer: in place over the
operand it updates, when that operand is read only element for element).

Merge rules (kept simple and safe):

- only ``kind=kLoop`` fusions with an array result, on one stream, whose results have the same
  dims (one iteration space: Inductor emits one pointwise loop for all outputs); a fusion rooted
  at an in-place dynamic-update-slice (``spmd.passes.fuse_update_slice``) iterates over its update
  (a sibling fusion of the update's dims merges with it: the rotary embedding of q beside the k / v
  cache writes, after ``absorb_reshape_siblings`` gave it those dims); an update fusion is never
  absorbed by a consumer (its value is the whole updated buffer);
- in-place updates at the same position: fusions rooted at dynamic-update-slices whose start
  indices are the same values and whose updates have the same dims merge (the k and v cache
  writes of a decode step, one kernel with two in-place stores; XLA's multi-output fusion of
  in-place dynamic-update-slices);
- no cycle: no path from a member to another member through an instruction outside the merged
  set (a merged fusion must be placed after all its inputs and before all its users);
- members lie within ``max_distance`` instructions of each other in program order (merging a
  forward value with a backward one would stretch live ranges over the whole step);
- at most ``max_members`` fusions per merged fusion;
- never a fusion with an equal one (same operands and computation): after ``rematerialize``
  (which runs first) that is a recomputed copy, kept at its far use on purpose.

The merged fusion takes its last member's name (made unique: a recomputed copy's ``.remat`` stays
visible). The entry computation is then put in a def-before-use order again, as close to the previous
order as possible (a merged fusion sits at its last member's place).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.builder import Builder
from spmd.ir.hlo import Computation, Instruction, Module, Shape
from spmd.passes.cse import cse_computation, instruction_key
from spmd.passes.fuse_elementwise import CHEAP_OPCODES, FUSED_COMPUTATION
from spmd.passes.fuse_update_slice import absorb_reshape_siblings, update_roots


@dataclass(frozen=True)
class MultiOutputFusion:
    """The multi-output-fusion pass (see the module docstring).

    enabled: False leaves every module unchanged (``CompileOptions.multi_output_fusion``).
    max_distance: the farthest apart (in entry instructions) two merged fusions may be.
    max_members: the most fusions merged into one.

    ``run(module)`` rewrites the entry computation in place and returns the module.
    Raises ValueError (in ``run``) for a module that is not partitioned.
    """

    name: ClassVar[str] = "multi-output-fusion"
    enabled: bool = True
    max_distance: int = 64
    max_members: int = 8

    def run(self, module: Module) -> Module:
        if not module.is_partitioned:
            raise ValueError(f"module {module.name!r} is not partitioned; "
                             "multi-output-fusion runs after spmd-partition")
        if not self.enabled:
            return module
        comp = module.entry
        reshaped = absorb_reshape_siblings(module, comp)
        sets = _Planner(comp, self.max_distance, self.max_members).plan()
        if not sets:
            if reshaped:
                _drop_unused_computations(module)
            return module
        replace: dict[int, Instruction] = {}
        placed: dict[int, int] = {}
        order = {id(i): k for k, i in enumerate(comp.instructions)}
        builder = Builder(module, comp)
        for members in sets:
            new, extra = _outline(module, builder, comp, members, replace)
            last = max(order[id(m)] for m in members)
            for inst in (new, *extra):
                placed[id(inst)] = last
        for inst in comp.instructions:
            inst.operands = [replace.get(id(o), o) for o in inst.operands]
        if id(comp.root) in replace:
            comp.root = replace[id(comp.root)]
        gone = {id(m) for members in sets for m in members}
        comp.instructions = [i for i in comp.instructions if id(i) not in gone]
        _stable_toposort(comp, order, placed)
        _drop_unused_computations(module)
        return module


def is_loop_fusion(inst: Instruction) -> bool:
    """An array-shaped ``kind=kLoop`` fusion (a candidate for merging)."""
    return (inst.opcode == "fusion" and inst.attrs.get("kind") == "kLoop" and not inst.shape.is_tuple
            and inst.shape.numel > 0)


class _Planner:
    """Chooses the sets of fusions to merge (union-find over candidate fusions)."""

    def __init__(self, comp: Computation, max_distance: int, max_members: int) -> None:
        self.comp, self.max_distance, self.max_members = comp, max_distance, max_members
        self.order = {id(i): k for k, i in enumerate(comp.instructions)}
        self.users = comp.users()
        self.parent: dict[int, int] = {}
        self.keys: dict[int, tuple] = {}
        self.members: dict[int, list[Instruction]] = {}
        for inst in comp.instructions:
            if is_loop_fusion(inst):
                self.parent[id(inst)] = id(inst)
                self.members[id(inst)] = [inst]

    def key(self, inst: Instruction) -> tuple:
        """Equal for fusions that compute the same value (same operands, same called computation)."""
        k = self.keys.get(id(inst))
        if k is None:
            k = self.keys[id(inst)] = instruction_key(inst, structural_calls=True)
        return k

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def plan(self) -> list[list[Instruction]]:
        for c in self.comp.instructions:  # producer-consumer first: it saves a whole write + read
            if id(c) in self.parent:
                for p in dict.fromkeys(c.operands):
                    # an update written in place is never computed inside a consumer's kernel
                    if id(p) in self.parent and update_roots(p.attrs["calls"]) is None:
                        self.try_merge(p, c)
        by_position: dict[tuple, list[Instruction]] = {}  # in-place updates at the same position
        for f in self.comp.instructions:
            if id(f) in self.parent and update_roots(f.attrs["calls"]) is not None:
                by_position.setdefault(_position_key(f), []).append(f)
        for updates in by_position.values():
            for a, b in zip(updates, updates[1:]):
                self.try_merge(a, b)
        for x in self.comp.instructions:  # siblings: fusions reading the same array
            if x.opcode in CHEAP_OPCODES or x.shape.is_tuple or x.shape.numel <= 1:
                continue
            # only where the shared read is as large as an output (the gradient of an update, the
            # q/k/v rows of rotary embeddings): not a bias vector both halves of a split batch read
            readers = [u for u in dict.fromkeys(self.users[x])
                       if id(u) in self.parent and _loop_numel(u) <= x.shape.numel]
            for k, a in enumerate(readers):
                for b in readers[k + 1:]:
                    self.try_merge(a, b)
        sets = [sorted(ms, key=lambda m: self.order[id(m)]) for r, ms in self.members.items()
                if self.find(r) == r and len(ms) > 1]
        return sorted(sets, key=lambda ms: self.order[id(ms[-1])])

    def try_merge(self, a: Instruction, b: Instruction) -> bool:
        ra, rb = self.find(id(a)), self.find(id(b))
        if ra == rb:
            return False
        ma, mb = self.members[ra], self.members[rb]
        if len(ma) + len(mb) > self.max_members:
            return False
        first = ma[0]
        if any(_loop_space(m) != _loop_space(first) or m.stream_id != first.stream_id for m in mb):
            return False
        if any(self.key(x) == self.key(y) for x in ma for y in mb):
            return False  # a recomputed copy (rematerialize) and its original: keep the copy at its far use
        pos = [self.order[id(m)] for m in ma + mb]
        if max(pos) - min(pos) > self.max_distance or self.creates_cycle(ra, rb):
            return False
        self.parent[rb] = ra
        self.members[ra] = ma + mb
        del self.members[rb]
        return True

    def creates_cycle(self, ra: int, rb: int) -> bool:
        """Whether a path leaves the union of the two sets and comes back into it.

        Other merged sets count as single nodes (a path entering one continues from all its members).
        """
        inside = {id(m) for m in self.members[ra] + self.members[rb]}
        stack = [u for r in (ra, rb) for m in self.members[r] for u in self.users[m] if id(u) not in inside]
        seen: set[int] = set()
        while stack:
            inst = stack.pop()
            if id(inst) in inside:
                return True
            if id(inst) in seen:
                continue
            seen.add(id(inst))
            group = self.members[self.find(id(inst))] if id(inst) in self.parent else [inst]
            for g in group:
                seen.add(id(g))
                stack.extend(self.users[g])
        return False


def _loop_space(f: Instruction) -> tuple[int, ...]:
    """The iteration space of fusion ``f``'s kernel: the update's dims for an in-place update
    (``spmd.passes.fuse_update_slice``), else its dims."""
    roots = update_roots(f.attrs["calls"])
    return roots[0].operands[1].shape.dims if roots is not None else f.shape.dims


def _loop_numel(f: Instruction) -> int:
    n = 1
    for d in _loop_space(f):
        n *= d
    return n


def _position_key(f: Instruction) -> tuple:
    """Equal for fusions whose in-place updates write at the same starts (the same fusion operands)."""
    (root,) = update_roots(f.attrs["calls"])
    starts = []
    for s in root.operands[2:]:
        if s.opcode != "parameter":
            return (id(f),)  # a start computed inside the fusion: no sibling
        starts.append(id(f.operands[s.attrs["parameter_number"]]))
    return (tuple(starts), root.operands[1].shape.dims, f.stream_id)


def _outline(module: Module, builder: Builder, comp: Computation, members: list[Instruction],
             replace: dict[int, Instruction]) -> tuple[Instruction, list[Instruction]]:
    """Build the merged fusion of ``members`` (in program order) and its get-tuple-elements.

    Records in ``replace`` which new instruction stands for each member used outside the set;
    returns the fusion and the get-tuple-elements (appended to the entry; the caller reorders).
    """
    inside = {id(m) for m in members}
    users = comp.users()
    outputs = [m for m in members if m is comp.root or any(id(u) not in inside for u in users[m])]
    body = Builder.new_computation(module, FUSED_COMPUTATION)
    inputs: list[Instruction] = []
    params: dict[int, Instruction] = {}
    value: dict[int, Instruction] = {}  # member -> its root inside the merged body
    for m in members:
        sub: Computation = m.attrs["calls"]
        local: dict[int, Instruction] = {}
        for p in sub.parameters:
            o = m.operands[p.attrs["parameter_number"]]
            if id(o) in inside:
                local[id(p)] = value[id(o)]
                continue
            if id(o) not in params:
                params[id(o)] = body.param(o.shape, name=f"param_{len(inputs)}", number=len(inputs))
                inputs.append(o)
            local[id(p)] = params[id(o)]
        for i in sub.instructions:
            if i.opcode != "parameter":
                local[id(i)] = body.add(i.opcode, [local[id(o)] for o in i.operands], i.attrs, shape=i.shape,
                                        name=i.name, location=i.location)
        value[id(m)] = local[id(sub.root)]
    roots = [value[id(m)] for m in outputs]
    body.set_root(roots[0] if len(roots) == 1 else body.add("tuple", roots, name="tuple"))
    cse_computation(body.computation)
    builder.append_at_end()
    last = members[-1]
    if len(outputs) == 1:
        fusion = builder.add("fusion", inputs, {"kind": "kLoop", "calls": body.computation}, shape=last.shape,
                             name=last.name, sharding=outputs[0].sharding, stream_id=last.stream_id,
                             location=outputs[0].location)
        replace[id(outputs[0])] = fusion
        return fusion, []
    fusion = builder.add("fusion", inputs, {"kind": "kLoop", "calls": body.computation},
                         shape=Shape.tuple([m.shape for m in outputs]), name=last.name, stream_id=last.stream_id,
                         location=last.location)
    gtes = []
    for k, m in enumerate(outputs):
        gte = builder.add("get-tuple-element", [fusion], {"index": k}, name="get-tuple-element",
                          sharding=m.sharding, stream_id=m.stream_id, location=m.location)
        replace[id(m)] = gte
        gtes.append(gte)
    return fusion, gtes


def _stable_toposort(comp: Computation, order: dict[int, int], placed: dict[int, int]) -> None:
    """Reorder ``comp`` def-before-use, each instruction as close to its old place as possible.

    ``order`` holds the old positions; ``placed`` the position a new instruction takes (its
    last member's). Kahn's algorithm, always taking the ready instruction of lowest position.
    """
    insts = comp.instructions
    key = {id(i): (placed.get(id(i), order.get(id(i), 0)), k) for k, i in enumerate(insts)}
    pending = {id(i): len({id(o) for o in i.operands}) for i in insts}
    users: dict[int, list[Instruction]] = {id(i): [] for i in insts}
    for i in insts:
        for o in {id(o): o for o in i.operands}.values():
            users[id(o)].append(i)
    ready = [(key[id(i)], n, i) for n, i in enumerate(insts) if pending[id(i)] == 0]
    heapq.heapify(ready)
    out = []
    index = {id(i): n for n, i in enumerate(insts)}
    while ready:
        _, _, inst = heapq.heappop(ready)
        out.append(inst)
        for u in users[id(inst)]:
            pending[id(u)] -= 1
            if pending[id(u)] == 0:
                heapq.heappush(ready, (key[id(u)], index[id(u)], u))
    if len(out) != len(insts):
        raise AssertionError("multi-output-fusion: merged fusions form a cycle")
    comp.instructions = out


def _drop_unused_computations(module: Module) -> None:
    """Forget fused computations no instruction calls any more (their fusions were merged)."""
    called = {id(v) for c in module.all_computations() for i in c.instructions for v in i.attrs.values()
              if isinstance(v, Computation)}
    module.computations[:] = [c for c in module.computations if id(c) in called]
