"""A static race checker for lowered programs: every cross-stream memory conflict must be ordered.

The lowering (``spmd.runtime.lower``) emits kernel and collective thunks on several streams
and record-event / wait-event thunks between them. ``find_hazards`` replays one device's
thunk sequence with vector clocks (stream -> index of the last thunk of that stream known
complete) and reports every pair of accesses to overlapping memory, at least one of them a
write, on different streams, where the earlier one is not known complete when the later
one starts: a read of a value before its producer finished (a missing join), or a write
into arena bytes that another stream may still read or write (buffer reuse across streams).

Memory: an op with an arena view (``KernelThunk.buffer``) writes those bytes; an in-place
op writes the memory of the slot it updates; an op that may return a view of an operand
(``Program.shares``: the views of ``spmd.passes.views``, parameter slices, kernels that
return an operand) writes nothing of its own and its readers read the operands' memory;
every other result is fresh memory of its slot. Parameters and persistent values are never
written. Every stream starts a call behind the main stream (the executor's fork), so only
thunks of one call are compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spmd.runtime.thunks import CollectiveThunk, KernelThunk, MultiOutputKernelThunk, RecordEventThunk, WaitEventThunk

_Loc = tuple  # ("arena", lo, hi) | ("slot", s) | ("param", view index)


@dataclass(frozen=True)
class Hazard:
    """An unordered conflict: thunk ``first`` (earlier) and ``second`` touch ``location``."""

    first: str
    second: str
    location: tuple
    kind: str  # "read-after-write" | "write-after-read" | "write-after-write"

    def __str__(self) -> str:
        return f"{self.kind}: {self.second} vs {self.first} on {self.location}"


def _view_bytes(view) -> int:
    n = 1
    for d in view.dims:
        n *= d
    return n * torch.empty((), dtype=view.dtype).element_size()


class _Memory:
    """Locations of slots (what a read touches) and of op results (what a write touches)."""

    def __init__(self, program) -> None:
        self.program = program
        self.own: dict[int, frozenset] = {}

    def write_locs(self, th: KernelThunk | CollectiveThunk) -> frozenset:
        """Locations ``th`` writes; records them as the memory of its result slot."""
        p = self.program
        if isinstance(th, MultiOutputKernelThunk):  # its elements' buffers, else fresh memory
            own = frozenset({("slot", th.out)}).union(*(self._buffer_locs(b) for b in th.buffers if b >= 0))
        elif isinstance(th, KernelThunk) and th.buffer >= 0:
            if th.buffer < len(p.arena_views):
                v = p.arena_views[th.buffer]
                own = frozenset({("arena", v.offset_bytes, v.offset_bytes + _view_bytes(v))})
            else:
                own = frozenset({("param", th.buffer)})
        elif th.out in p.shares:
            own = frozenset()
        elif th.out in p.in_place:
            own = self.locs(p.in_place[th.out])
        else:
            own = frozenset({("slot", th.out)})
        self.own[th.out] = own
        return own

    def _buffer_locs(self, b: int) -> frozenset:
        """Locations of arena view ``b`` (or donated parameter buffer ``b`` past the arena views)."""
        if b < len(self.program.arena_views):
            v = self.program.arena_views[b]
            return frozenset({("arena", v.offset_bytes, v.offset_bytes + _view_bytes(v))})
        return frozenset({("param", b)})

    def locs(self, slot: int) -> frozenset:
        """Every location the value of ``slot`` may occupy."""
        seen: set[int] = set()
        out: set = set()
        stack = [slot]
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            out |= self.own.get(s, frozenset({("slot", s)}))
            stack.extend(self.program.shares.get(s, ()))
        return frozenset(out)


def _overlap(a: tuple, b: tuple) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "arena":
        return a[1] < b[2] and b[1] < a[2]
    return a[1:] == b[1:]


def find_hazards(program) -> list[Hazard]:
    """All unordered cross-stream conflicts of ``program`` (a ``lower.Program`` lowered with gpu=True).

    Returns an empty list for a race-free program. Raises ValueError if a wait names an
    event no earlier thunk recorded.
    """
    mem = _Memory(program)
    clocks: dict[int, dict[int, int]] = {}
    last: dict[int, int] = {}
    events: dict[int, dict[int, int]] = {}
    accesses: list[tuple[tuple, int, int, bool, str]] = []  # (loc, thunk index, stream, write, name)
    found: list[Hazard] = []
    for i, th in enumerate(program.thunks):
        s = th.stream_id
        clock = clocks.setdefault(s, {})
        if isinstance(th, RecordEventThunk):
            snap = dict(clock)
            if s in last:
                snap[s] = last[s]
            events[th.event_id] = snap
            continue
        if isinstance(th, WaitEventThunk):
            if th.event_id not in events:
                raise ValueError(f"thunk {th.name}: waits for event {th.event_id} that nothing recorded")
            for t, j in events[th.event_id].items():
                clock[t] = max(clock.get(t, -1), j)
            continue
        ins = th.ins if isinstance(th, KernelThunk) else (th.in_,)
        reads = frozenset().union(*(mem.locs(x) for x in ins)) if ins else frozenset()
        writes = mem.write_locs(th)
        for loc, write in [*((r, False) for r in reads), *((w, True) for w in writes)]:
            for ploc, j, t, pwrite, pname in accesses:
                if t == s or not (write or pwrite) or clock.get(t, -1) >= j or not _overlap(loc, ploc):
                    continue
                kind = "read-after-write" if pwrite and not write else (
                    "write-after-write" if pwrite else "write-after-read")
                found.append(Hazard(pname, th.name, loc, kind))
            accesses.append((loc, i, s, write, th.name))
        last[s] = i
    return found
