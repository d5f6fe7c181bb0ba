"""async-collectives: collectives with an independent GEMM to hide under become async on the comm stream.

The "bulk" overlap of independent pairs in a training step: the re-gather of a saved
sequence-parallel activation shard under the dgrad GEMM, the reduce-scatter of dX under the
wgrad GEMM, a data-parallel / FSDP gradient all-reduce or reduce-scatter of layer L under the
backward of layer L-1, the FSDP all-gather of the next layer's parameters under this layer.
A synchronous all-gather, all-reduce or reduce-scatter becomes a start / done pair on the
communication stream when at least ``min_overlap_dots`` GEMMs lie between the point its
operands are ready and its first use (in program order, so none of them depends on it).
``schedule`` then issues the start as early as its operands allow and waits at the done as
late as its first use allows, as XLA's latency-hiding scheduler does for async collectives
(xla/service/latency_hiding_scheduler.cc; Jangda et al., "Breaking the Computation and
Communication Abstraction Barrier", ASPLOS 2022, on the overlap it buys). Before::

    %dx = f32[8,16] dot(%dy, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
    %dx.rs = f32[4,16] reduce-scatter(%dx), dimensions={0}, to_apply=%add, replica_groups={{0,1}}
    %dw = f32[32,16] dot(%dy, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}
    ROOT %out = (f32[4,16], f32[32,16]) tuple(%dx.rs, %dw)

after (the reduce-scatter has no async opcode of its own: it runs as an ``async-start`` of a
computation holding it, like XLA's generic async wrapping)::

    %dx.rs.body (dx.rs.arg0: f32[8,16]) -> f32[4,16] { ... reduce-scatter(...) }
    %dx = f32[8,16] dot(%dy, %w), ..., stream_id=0
    %dx.rs-start = ((f32[8,16]), f32[4,16]) async-start(%dx), calls=%dx.rs.body, stream_id=1
    %dx.rs = f32[4,16] async-done(%dx.rs-start), stream_id=1
    %dw = f32[32,16] dot(%dy, %x), ..., stream_id=0

Layout ops (transpose, reshape, copy, convert) around a picked collective move with it: the
ones only it reads (the transposed shard of an FSDP weight) are hoisted to where their own
operands are ready, and the ones reading its result (the ``[B*S, H]`` view of a gathered saved
activation) sink to their first real reader, so the window is measured between real
producers and consumers.

An all-gather-start carries ``backend_config={"prefetch_dots": k}``: ``schedule`` issues it no
earlier than ``k`` GEMMs before its done (``bound_prefetch``), so an FSDP parameter or a saved
activation is gathered one layer ahead rather than all at the start of the step (the memory
bound XLA's scheduler keeps with its memory limit). The communication stream is the one
``assign-streams`` already uses for collective-permutes or split-batch all-reduces, else one
past the highest stream id. Collectives are issued in one order on every device (the
schedule is the same program), so transfers on the one communication stream match up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.builder import NameSet
from spmd.ir.hlo import Computation, Instruction, Module, Shape

PREFETCH_KEY = "prefetch_dots"  # backend_config key of an all-gather-start: GEMMs it may run ahead
_COMM_STARTS = frozenset({"collective-permute-start", "all-reduce-start", "all-gather-start"})
_GEMM_TARGETS = frozenset({"attention", "conv1d"})
_LAYOUT = frozenset({"transpose", "reshape", "copy", "convert"})


@dataclass(frozen=True)
class AsyncCollectives:
    """The async-collectives pass (see the module docstring).

    enabled: False leaves the module as it is.
    min_overlap_dots: GEMMs that must lie between a collective's operands and its first use.
    prefetch_dots: how many GEMMs ahead of its first use an all-gather may start.
    Raises ValueError for ``min_overlap_dots`` or ``prefetch_dots`` < 1.
    """

    name: ClassVar[str] = "async-collectives"
    enabled: bool = True
    min_overlap_dots: int = 1
    prefetch_dots: int = 2

    def __post_init__(self) -> None:
        for what in ("min_overlap_dots", "prefetch_dots"):
            v = getattr(self, what)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{what} must be an int >= 1, got {v!r}")

    def run(self, module: Module) -> Module:
        if not self.enabled:
            return module
        comp = module.entry
        picked = self._picked(comp)
        if not picked:
            return module
        stream = comm_stream(comp)
        names = NameSet(module)
        out: list[Instruction] = []
        repl: dict[int, Instruction] = {}
        for inst in comp.instructions:
            if id(inst) not in picked:
                out.append(inst)
                continue
            pair = self._split(module, inst, stream, names)
            repl[id(inst)] = pair[1]
            out.extend(pair)
        for inst in out:
            inst.operands = [repl.get(id(o), o) for o in inst.operands]
        comp.root = repl.get(id(comp.root), comp.root)
        out = _hoist_chains(out, [repl[k].operands[0] for k in picked])
        comp.instructions = _sink_layout_users(out, [repl[k] for k in picked], comp.root)
        return module

    def _picked(self, comp: Computation) -> set[int]:
        """ids of the collectives with at least ``min_overlap_dots`` GEMMs they could hide under."""
        pos = {id(i): k for k, i in enumerate(comp.instructions)}
        gemm_before = [0]
        for i in comp.instructions:
            gemm_before.append(gemm_before[-1] + is_gemm(i))
        users = comp.users()
        picked = set()
        for inst in comp.instructions:
            if inst.opcode not in ("all-gather", "all-reduce", "reduce-scatter") or inst.shape.is_tuple:
                continue
            if inst.stream_id not in (None, 0) or inst.attrs.get("backend_config"):
                continue
            chain = layout_chain(inst, users)
            inside = {id(c) for c in chain}
            lo = max((pos[id(o)] for c in (*chain, inst) for o in c.operands if id(o) in pos and id(o) not in inside),
                     default=-1)
            layout, real = layout_users(inst, users)
            hi = min((pos[id(u)] for u in real), default=len(comp.instructions))
            if inst is comp.root or comp.root in layout:
                hi = len(comp.instructions)
            if gemm_before[hi] - gemm_before[lo + 1] >= self.min_overlap_dots:
                picked.add(id(inst))
        return picked

    def _split(self, module: Module, inst: Instruction, stream: int, names: NameSet) -> list[Instruction]:
        """[start, done] on ``stream`` for ``inst``; the done takes its name and sharding."""
        attrs = dict(inst.attrs)
        if inst.opcode == "all-reduce":
            start = Instruction(names.fresh(f"{inst.name}-start"), "all-reduce-start", inst.shape, inst.operands,
                                attrs, stream_id=stream)
            done_op = "all-reduce-done"
        elif inst.opcode == "all-gather":
            attrs["backend_config"] = {PREFETCH_KEY: self.prefetch_dots}
            shape = Shape.tuple([inst.operands[0].shape, inst.shape])
            start = Instruction(names.fresh(f"{inst.name}-start"), "all-gather-start", shape, inst.operands, attrs,
                                stream_id=stream)
            done_op = "all-gather-done"
        else:
            start = _wrap(module, inst, stream, names)
            done_op = "async-done"
        done = Instruction(inst.name, done_op, inst.shape, [start], sharding=inst.sharding, stream_id=stream,
                           location=inst.location)
        return [start, done]


def _wrap(module: Module, inst: Instruction, stream: int, names: NameSet) -> Instruction:
    """An async-start running a computation that holds a copy of ``inst`` on ``stream``."""
    params = [Instruction(names.fresh(f"{inst.name}.arg{k}"), "parameter", o.shape, attrs={"parameter_number": k})
              for k, o in enumerate(inst.operands)]
    op = Instruction(names.fresh(f"{inst.name}.op"), inst.opcode, inst.shape, params, dict(inst.attrs))
    body = Computation(names.fresh(f"{inst.name}.body"), [*params, op], op)
    module.computations.append(body)
    shape = Shape.tuple([Shape.tuple([o.shape for o in inst.operands]), inst.shape])
    return Instruction(names.fresh(f"{inst.name}-start"), "async-start", shape, inst.operands, {"calls": body},
                       stream_id=stream)


def comm_stream(comp: Computation) -> int:
    """The communication stream of ``comp``: the stream of its async collectives, else a new one."""
    for i in comp.instructions:
        if i.opcode in _COMM_STARTS and i.stream_id is not None:
            return i.stream_id
    return 1 + max((i.stream_id or 0 for i in comp.instructions), default=0)


def is_gemm(inst: Instruction) -> bool:
    """True for a dot, an attention / conv custom call, or an async unit holding a dot."""
    if inst.opcode == "dot":
        return True
    if inst.opcode == "custom-call":
        return inst.attrs.get("custom_call_target") in _GEMM_TARGETS
    if inst.opcode == "async-start":
        return any(b.opcode == "dot" for b in inst.attrs["calls"].instructions)
    return False


def layout_chain(inst: Instruction, users) -> list[Instruction]:
    """The layout ops (transpose, reshape, copy, convert) that only ``inst`` reads, transitively, in
    def-before-use order: the transposed weight shard an FSDP all-gather reads moves with it."""
    chain: list[Instruction] = []
    members = {id(inst)}
    stack = list(inst.operands)
    while stack:
        o = stack.pop()
        readers = users.get(o, ())
        if o.opcode in _LAYOUT and id(o) not in members and readers and all(id(u) in members for u in readers):
            chain.append(o)
            members.add(id(o))
            stack.extend(o.operands)
    return chain[::-1]


def layout_users(inst: Instruction, users) -> tuple[list[Instruction], list[Instruction]]:
    """(the layout ops reading ``inst`` transitively, through layout ops only; the other readers of
    ``inst`` and of those layout ops): a saved activation's gather and its reshape can both wait
    until the backward reads the reshape."""
    layout: list[Instruction] = []
    real: list[Instruction] = []
    seen: set[int] = set()
    stack = list(users.get(inst, ()))
    while stack:
        u = stack.pop()
        if id(u) in seen:
            continue
        seen.add(id(u))
        if u.opcode in _LAYOUT:
            layout.append(u)
            stack.extend(users.get(u, ()))
        else:
            real.append(u)
    return layout, real


def _sink_layout_users(insts: list[Instruction], dones: list[Instruction], root: Instruction) -> list[Instruction]:
    """Move the layout ops reading each done (transitively) down to just before their first reader, so
    the schedule waits at the done only where a real consumer needs it."""
    out = list(insts)
    users = _users(out)
    for done in dones:
        layout, _ = layout_users(done, users)
        if root in layout:
            continue
        order = {id(i): k for k, i in enumerate(out)}
        for lay in sorted(layout, key=lambda i: order[id(i)], reverse=True):  # readers first
            out.remove(lay)
            at = min((out.index(u) for u in users[lay]), default=len(out))
            out.insert(at, lay)
    return out


def _users(insts: list[Instruction]) -> dict[Instruction, list[Instruction]]:
    out: dict[Instruction, list[Instruction]] = {i: [] for i in insts}
    for i in insts:
        for o in i.operands:
            if o in out:
                out[o].append(i)
    return out


def _hoist_chains(insts: list[Instruction], starts: list[Instruction]) -> list[Instruction]:
    """Move each start's layout chain right after the last instruction the chain reads (so the
    schedule can issue the start there); the rest keeps its order."""
    users = _users(insts)
    out = list(insts)
    for s in starts:
        chain = layout_chain(s, users)
        if not chain:
            continue
        inside = {id(c) for c in chain}
        for c in chain:
            out.remove(c)
        pos = {id(i): k for k, i in enumerate(out)}
        at = 1 + max((pos[id(o)] for c in chain for o in c.operands if id(o) not in inside and id(o) in pos),
                     default=-1)
        out[at:at] = chain
    return out


def bound_prefetch(insts: list[Instruction]) -> list[Instruction]:
    """``insts`` (scheduled) with every all-gather-start marked ``prefetch_dots: k`` moved down to just
    before the k-th GEMM preceding its done, where it sat earlier than that (never earlier: moving a
    start later keeps its operands before it), together with its layout chain (``layout_chain``).
    Returns a new list."""
    out = list(insts)
    starts = [i for i in out if i.opcode == "all-gather-start" and PREFETCH_KEY in i.attrs.get("backend_config", {})]
    if not starts:
        return out
    users = _users(out)
    done_of = {id(i.operands[0]): i for i in out if i.opcode == "all-gather-done" and i.operands}
    for s in starts:
        done = done_of.get(id(s))
        if done is None:
            continue
        k = s.attrs["backend_config"][PREFETCH_KEY]
        lo, at = out.index(s), out.index(done)
        t, seen = at, 0
        while t - 1 > lo and seen < k:
            t -= 1
            seen += is_gemm(out[t])
        if seen < k or t <= lo + 1:
            continue
        anchor = out[t]
        group = [*layout_chain(s, users), s]
        for g in group:
            out.remove(g)
        k_at = out.index(anchor)
        out[k_at:k_at] = group
    return out
