"""assign-buffers: offsets in one per-device arena, aware of concurrently running streams.

Liveness over the schedule (the entry computation's instruction order), with the
execution model of the lowering (``spmd.runtime.lower``): every op runs on its stream
in program order; an op that reads a value produced on another stream first waits
for that producer (record-event / wait-event), which also makes everything the
producer had waited for visible. An async-start runs its called computation on its
stream at its own position; ``*-done``, ``tuple`` and ``get-tuple-element`` are
aliases, not ops; constants, partition-id and small values computed only from them
are folded by the runtime (``spmd.passes.folding``): they get no bytes and carry no
synchronisation.

Two values may share bytes only if every access (write or read) of one happens
before the first write of the other, where "a happens before b" is: same stream and
earlier, or b's stream has (transitively) waited for a's stream at or after a
(vector clocks over streams). A value read on a stream that is never joined back is
therefore live to the end: this is the seed hazard of XLA's multi-stream windowed
einsum (openxla/xla#8707), where two GEMMs on different streams must not share
memory. Because the runtime may fuse a dot into its single same-stream add /
dynamic-update-slice user (``spmd.runtime.fusions``; an add also through a reshape view
that is the dot's only user), the dot's operands count as read at that user too, and the
dot's waits are taken at the user.

A view (``spmd.passes.views``: a reshape, transpose, broadcast or slice that runs as a
torch view of its operand) gets no bytes: like ``tuple`` it denotes its operand's values,
but it is an op on its stream (it waits for the operand's producer there), and every read
of the view is a read of the underlying values at the reader's position and stream, so
they stay live, across streams too, until the view's last reader.

A dynamic-update-slice reuses the bytes of its operand 0 (in place) when it is
that value's only reader (a read through a view counts as a reader). An ``add``
reuses the bytes of an arena operand of its shape whose every other access happens
before it (XLA's elementwise buffer sharing): a residual sum accumulates in one buffer,
and the runtime's addmm of a dot and that residual runs in place (cuBLAS accumulates
into C) instead of copying C first. Groups that contain an output are left to the
runtime, and so are the results the runtime's kernels allocate themselves
(``HEAP_OPCODES``: collectives, whose communicators return new tensors; fusions and
custom calls, PyTorch functions without an ``out=`` form; ``spmd.runtime.lower`` never
gives them an arena view): placing them would reserve arena bytes nobody writes. A
multi-output fusion (``spmd.passes.multi_output_fusion``) has one value per tuple element
(``element_name``), each read through its ``get-tuple-element``.
Placement is best-fit over the conflicting groups, largest first (in the spirit of
tinygrad's memory planner). Keys are the names of the writing instructions: for an
async-start, the instructions of its called computation; for a collective start,
the start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from spmd.ir.hlo import Computation, Instruction, Module, ancestor_ids
from spmd.passes.folding import folded_instructions
from spmd.passes.views import view_instructions

ALIGN_BYTES = 256
_ALIASES = frozenset({"tuple", "get-tuple-element", "all-gather-done", "collective-permute-done",
                      "all-reduce-done", "async-done"})
_PAIR_STARTS = frozenset({"collective-permute-start", "all-gather-start"})
# Results the runtime allocates outside the arena (see the module docstring).
HEAP_OPCODES = frozenset({"fusion", "custom-call", "all-gather", "all-gather-start", "all-reduce", "all-reduce-start",
                          "reduce-scatter", "all-to-all", "collective-permute", "collective-permute-start"})


@dataclass(frozen=True)
class BufferAssignment:
    """Arena placement of the temporaries of a partitioned module (one arena per device).

    offsets_bytes: instruction name -> byte offset in the arena (256-byte aligned).
    sizes_bytes: instruction name -> size of its value in bytes.
    arena_size_bytes: bytes the arena needs.
    Names not present (parameters, outputs, tuples, aliases, views, folded constants) are
    allocated by the runtime.
    """

    offsets_bytes: Mapping[str, int]
    sizes_bytes: Mapping[str, int]
    arena_size_bytes: int


@dataclass(frozen=True)
class AssignBuffers:
    """The assign-buffers pass: computes ``assign_buffers(module)`` and leaves the module unchanged.

    Use ``assign_buffers`` for the result (the pass form keeps the pipeline's shape).
    """

    name: ClassVar[str] = "assign-buffers"

    def run(self, module: Module) -> Module:
        assign_buffers(module)
        return module


@dataclass
class _Value:
    name: str
    size: int
    write: tuple[int, int]                       # (position, stream) of the writing op
    accesses: list[tuple[int, int]] = field(default_factory=list)
    readers: list[Instruction] = field(default_factory=list)


class _Liveness:
    """Values, their accesses and the vector clocks of one scheduled entry computation."""

    def __init__(self, module: Module, view_names: frozenset[str] | set[str] | None = None) -> None:
        self.comp = module.entry
        self.values: dict[str, _Value] = {}
        self.src: dict[int, list[str]] = {}       # id(instruction) -> value names it denotes
        self.producer: dict[str, int] = {}        # value name -> position of its writer
        self.vc: list[dict[int, int]] = []        # per position: clock before the op runs
        self.inplace: list[tuple[str, Instruction]] = []  # (operand value, DUS writer)
        self.accumulate: list[tuple[str, Instruction]] = []  # (operand value, add of its shape)
        self.heap: set[str] = set()  # values the runtime allocates outside the arena (HEAP_OPCODES)
        self.folded = folded_instructions(self.comp)  # computed on the host by the lowering: no bytes, no op
        names = view_instructions(module) if view_names is None else view_names
        self.views = {id(i) for i in self.comp.instructions if i.name in names}
        self._walk()

    def _walk(self) -> None:
        clocks: dict[int, dict[int, int]] = {}
        snaps: list[dict[int, int]] = []
        deferred: dict[int, list[str]] = {}
        users = self.comp.users()
        for pos, inst in enumerate(self.comp.instructions):
            stream = inst.stream_id or 0
            clock = clocks.setdefault(stream, {})
            self.vc.append(dict(clock))
            reads = self._visit(inst, pos, stream, users, deferred)
            for name in reads + deferred.pop(pos, []):
                p = self.producer.get(name)
                if p is not None and p < pos and self._stream_at(p) != stream:
                    for st, idx in snaps[p].items():
                        clock[st] = max(clock.get(st, -1), idx)
            if self._is_op(inst):
                clock[stream] = pos
            self.vc[pos] = {k: v for k, v in clock.items() if k != stream or v < pos}
            snaps.append(dict(clock))

    def _stream_at(self, pos: int) -> int:
        return self.comp.instructions[pos].stream_id or 0

    def _is_op(self, inst: Instruction) -> bool:
        return inst.opcode not in _ALIASES and inst.opcode != "parameter" and id(inst) not in self.folded

    def _visit(self, inst: Instruction, pos: int, stream: int, users, deferred) -> list[str]:
        """Record ``inst``'s values and reads; returns the values whose producers it waits for now."""
        op = inst.opcode
        if op == "parameter":
            self.src[id(inst)] = []
            return []
        if op in _ALIASES:
            self.src[id(inst)] = self._alias(inst)
            return []
        if id(inst) in self.folded:
            self.src[id(inst)] = []
            return []
        if id(inst) in self.views:
            return self._view(inst, (pos, stream))
        reads = [n for o in inst.operands for n in self.src[id(o)]]
        at = (pos, stream)
        for o in inst.operands if op != "async-start" else ():  # the called computation reads those
            for n in self.src[id(o)]:
                self._read(n, at, inst)
        user = users[inst][0] if len(users[inst]) == 1 else None
        if op == "dot" and user is not None and id(user) in self.views and len(users[user]) == 1:
            user = users[user][0]  # a reshape view between the dot and its add: the runtime's addmm goes through it
        if (op == "dot" and user is not None and (user.stream_id or 0) == stream
                and user.opcode in ("add", "dynamic-update-slice")):
            upos = self.comp.instructions.index(user)
            for n in reads:
                self._read(n, (upos, stream), inst)
            deferred.setdefault(upos, []).extend(reads)
            reads = []
        if op == "async-start":
            self._async_body(inst, at)
        elif op in _PAIR_STARTS:
            self._new(inst.name, inst.shape.tuple_shapes[1].size_bytes, at, op)
            self.src[id(inst)] = [inst.name]
        elif op == "fusion" and inst.shape.is_tuple:  # a multi-output fusion: one value per element
            self.src[id(inst)] = [element_name(inst.name, k) for k in range(len(inst.shape.tuple_shapes))]
            for name, shape in zip(self.src[id(inst)], inst.shape.tuple_shapes, strict=True):
                self._new(name, shape.size_bytes, at, op)
        elif not inst.shape.is_tuple:
            self._new(inst.name, inst.shape.size_bytes, at, op)
            self.src[id(inst)] = [inst.name]
            if op == "dynamic-update-slice" and len(self.src[id(inst.operands[0])]) == 1:
                self.inplace.append((self.src[id(inst.operands[0])][0], inst))
            elif op == "add":
                # a single-use dot operand runs inside the runtime's addmm: the other operand is C
                fused = [o for o in inst.operands if o.opcode == "dot" and len(users[o]) == 1]
                fused += [o for o in inst.operands if id(o) in self.views and o.opcode == "reshape"
                          and len(users[o]) == 1 and o.operands[0].opcode == "dot" and len(users[o.operands[0]]) == 1]
                dots = [o.operands[0] if o.opcode == "reshape" else o for o in fused]
                gemm_reads = {n for d in dots for x in d.operands for n in self.src[id(x)]}  # A and B
                self.accumulate += [(self.src[id(o)][0], inst) for o in inst.operands
                                    if len(self.src[id(o)]) == 1 and o.shape == inst.shape and o not in fused
                                    and id(o) not in self.views  # read in place, not through a transpose
                                    and self.src[id(o)][0] not in gemm_reads]
        else:
            self.src[id(inst)] = []
        return reads

    def _view(self, inst: Instruction, at: tuple[int, int]) -> list[str]:
        """A view denotes the values of its operand 0 and reads them at its own position."""
        names = list(self.src[id(inst.operands[0])])
        for n in names:
            self._read(n, at, inst)
        self.src[id(inst)] = names
        return names

    def _async_body(self, start: Instruction, at: tuple[int, int]) -> None:
        """Values of the called computation: written and read at the start's position and stream."""
        body = start.attrs["calls"]
        local: dict[int, list[str]] = {}
        for b in body.instructions:
            if b.opcode == "parameter":
                local[id(b)] = self.src[id(start.operands[b.attrs["parameter_number"]])]
                continue
            if id(b) in self.folded:  # the lowering folds it too: no bytes
                local[id(b)] = []
                continue
            for o in b.operands:
                for n in local.get(id(o), []):
                    self._read(n, at, b)
            if b.shape.is_tuple or b.opcode in _ALIASES:
                local[id(b)] = [n for o in b.operands for n in local.get(id(o), [])]
                continue
            self._new(b.name, b.shape.size_bytes, at, b.opcode)
            local[id(b)] = [b.name]
            if b.opcode == "dynamic-update-slice" and len(local.get(id(b.operands[0]), [])) == 1:
                self.inplace.append((local[id(b.operands[0])][0], b))
        self.src[id(start)] = local[id(body.root)]

    def _alias(self, inst: Instruction) -> list[str]:
        o = inst.operands[0]
        if inst.opcode == "tuple":
            return [n for x in inst.operands for n in self.src[id(x)]]
        if inst.opcode == "get-tuple-element" and o.opcode == "tuple":
            return self.src[id(o.operands[inst.attrs["index"]])]
        if inst.opcode == "get-tuple-element" and o.opcode == "fusion":
            return [self.src[id(o)][inst.attrs["index"]]]
        return self.src[id(o)]

    def _new(self, name: str, size: int, at: tuple[int, int], opcode: str = "") -> None:
        self.values[name] = _Value(name, size, at, [at])
        self.producer[name] = at[0]
        if opcode in HEAP_OPCODES:
            self.heap.add(name)

    def _read(self, name: str, at: tuple[int, int], reader: Instruction) -> None:
        v = self.values[name]
        v.accesses.append(at)
        v.readers.append(reader)

    def happens_before(self, a: tuple[int, int], b: tuple[int, int]) -> bool:
        """Access ``a`` (position, stream) completes before access ``b`` starts."""
        if a[1] == b[1]:
            return a[0] < b[0]
        return self.vc[b[0]].get(a[1], -1) >= a[0]


def element_name(fusion_name: str, index: int) -> str:
    """The value name of element ``index`` of a multi-output fusion (no instruction has such a name)."""
    return f"{fusion_name}#{index}"


def _live_part(module: Module) -> Module:
    """``module`` without the entry instructions its root does not depend on: the runtime never
    runs them (``lower`` walks the same set), so a wait between streams that only a dead
    instruction makes must not order two values that share bytes (a dead async-start reading a
    value on another stream once let two streams write one buffer unordered)."""
    entry = module.entry
    seen = ancestor_ids([entry.root])
    if len(seen) == len(entry.instructions):
        return module
    live = Computation(entry.name, [i for i in entry.instructions if id(i) in seen], entry.root)
    return Module(module.name, live, module.computations, module.mesh, is_partitioned=module.is_partitioned)


def _groups(live: _Liveness, outputs: set[str]) -> list[list[_Value]]:
    """Alias groups: a dynamic-update-slice with its operand 0 when it is that value's only reader."""
    parent = {n: n for n in live.values}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for operand, dus in live.inplace:
        v, w = live.values[operand], live.values[dus.name]
        if len(v.readers) == 1 and v.readers[0] is dus and v.size == w.size:
            parent[find(dus.name)] = find(operand)
    for operand, add in live.accumulate:
        v, w = live.values[operand], live.values[add.name]
        if add.name in outputs or operand in outputs or operand in live.heap or find(add.name) != add.name \
                or v.size != w.size:
            continue
        if all(a == w.write or live.happens_before(a, w.write) for a in v.accesses):
            parent[find(add.name)] = find(operand)
    groups: dict[str, list[_Value]] = {}
    for n, v in live.values.items():
        groups.setdefault(find(n), []).append(v)
    return [g for g in groups.values() if not any(v.name in outputs or v.name in live.heap for v in g)]


def _before(live: _Liveness, first: list[_Value], second: list[_Value]) -> bool:
    last: dict[int, int] = {}
    for v in first:
        for pos, st in v.accesses:
            last[st] = max(last.get(st, -1), pos)
    return all(live.happens_before((pos, st), v.write) for v in second for st, pos in last.items())


def may_overlap_in_time(live: _Liveness, a: list[_Value], b: list[_Value]) -> bool:
    """Whether the lifetimes of two groups of values may overlap under the stream semantics."""
    return not (_before(live, a, b) or _before(live, b, a))


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def assign_buffers(module: Module) -> BufferAssignment:
    """Place the temporaries of ``module``'s scheduled entry computation in one arena.

    Raises ValueError if the module is not partitioned.
    """
    if not module.is_partitioned:
        raise ValueError(f"module {module.name!r} is not partitioned; assign-buffers needs per-device shapes")
    views = view_instructions(module)  # as the lowering decides them: over the whole module
    module = _live_part(module)
    live = _Liveness(module, views)
    outputs = set(live.src[id(module.entry.root)])
    groups = sorted(_groups(live, outputs), key=lambda g: (-g[0].size, g[0].write[0]))
    placed: list[tuple[int, int, list[_Value]]] = []  # (offset, aligned size, group)
    offsets: dict[str, int] = {}
    arena = 0
    for g in groups:
        size = _align(max(v.size for v in g))
        busy = sorted((off, off + n) for off, n, h in placed if may_overlap_in_time(live, g, h))
        best, cursor = None, 0
        for lo, hi in busy:
            if lo - cursor >= size and (best is None or lo - cursor < best[1]):
                best = (cursor, lo - cursor)
            cursor = max(cursor, hi)
        off = best[0] if best is not None else cursor
        placed.append((off, size, g))
        arena = max(arena, off + size)
        for v in g:
            offsets[v.name] = off
    sizes = {v.name: v.size for g in groups for v in g}
    return BufferAssignment(offsets, sizes, arena)
