"""schedule: a latency-hiding list scheduler over the entry computation.

Three classes of instructions:

- ``*-start`` (async-start, collective-permute-start, all-gather-start,
  all-reduce-start) are issued as soon as their operands are: right after the
  last of them, communication starts before compute starts when several become
  ready together, otherwise in program order;
- ``*-done`` wait as late as possible: a done is placed only when a later
  instruction needs it (directly, or through a start that needs it), right
  before that instruction; dones nothing needs go to the end;
- everything else keeps its original relative order (stable).

An all-gather-start of ``spmd.passes.async_collectives`` (``backend_config={"prefetch_dots": k}``)
then moves down to k GEMMs before its done (``bound_prefetch``): a prefetch, not a gather of
every FSDP parameter at the start of the step.

So the first transfer of a windowed einsum ring is issued before the first dot,
and every wait sits just before its first consumer. This is the idea of XLA's
latency-hiding scheduler (xla/service/latency_hiding_scheduler.cc) reduced to a
greedy one-pass order: it uses no cost model. Before (after assign-streams)::

    %d.0 = async-done(%d.0-start)
    %cp-start = collective-permute-start(%x)
    %cp = collective-permute-done(%cp-start)
    %y = negate(%d.0)

after::

    %cp-start = collective-permute-start(%x)      # moved up: %x was ready
    %d.0 = async-done(%d.0-start)                 # right before its consumer
    %y = negate(%d.0)
    %cp = collective-permute-done(%cp-start)      # nothing needs it: at the end
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.hlo import ASYNC_DONE_OPCODES, ASYNC_START_OPCODES, Instruction, Module
from spmd.passes.async_collectives import bound_prefetch

_COMM_STARTS = frozenset({"collective-permute-start", "all-gather-start", "all-reduce-start"})


@dataclass(frozen=True)
class Schedule:
    """The schedule pass: reorders ``module.entry.instructions`` (see the module docstring)."""

    name: ClassVar[str] = "schedule"

    def run(self, module: Module) -> Module:
        comp = module.entry
        comp.instructions = bound_prefetch(schedule_instructions(comp.instructions))
        return module


def schedule_instructions(insts: list[Instruction]) -> list[Instruction]:
    """The latency-hiding order of ``insts`` (a def-before-use list; operands outside it are ignored).

    Returns a permutation of ``insts`` in def-before-use order.
    """
    index = {id(i): k for k, i in enumerate(insts)}
    ops = {id(i): [o for o in dict.fromkeys(i.operands) if id(o) in index] for i in insts}
    users: dict[int, list[Instruction]] = {id(i): [] for i in insts}
    for i in insts:
        for o in ops[id(i)]:
            users[id(o)].append(i)
    remaining = {id(i): len(ops[id(i)]) for i in insts}
    done: set[int] = set()
    out: list[Instruction] = []
    ready: list[tuple[int, int, Instruction]] = []

    def push_if_ready_start(i: Instruction) -> None:
        if i.opcode in ASYNC_START_OPCODES and remaining[id(i)] == 0 and id(i) not in done:
            heapq.heappush(ready, (0 if i.opcode in _COMM_STARTS else 1, index[id(i)], i))

    def emit(i: Instruction) -> None:
        if id(i) in done:
            return
        done.add(id(i))
        out.append(i)
        for u in users[id(i)]:
            remaining[id(u)] -= 1
            push_if_ready_start(u)
        while ready:
            emit(heapq.heappop(ready)[2])

    def need(i: Instruction) -> None:
        """Emit ``i`` after everything it needs that is not emitted yet (dones pulled here)."""
        stack = [(i, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in done:
                continue
            if expanded:
                emit(node)
                continue
            stack.append((node, True))
            stack.extend((o, False) for o in reversed(ops[id(node)]) if id(o) not in done)

    for i in insts:
        push_if_ready_start(i)
    while ready:
        emit(heapq.heappop(ready)[2])
    for i in insts:
        if i.opcode not in ASYNC_START_OPCODES and i.opcode not in ASYNC_DONE_OPCODES:
            need(i)
    for i in insts:
        need(i)
    assert len(out) == len(insts)
    return out
