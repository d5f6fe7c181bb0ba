"""Stream joins and slot lifetimes of a lowered program.

``stream_joins`` decides which ops need an event recorded after them and which ops each op
must wait for (vector clocks over streams skip waits an earlier join already implies — the
JoinExecutionThreads idea of XLA's multi-stream GPU runtime). ``attach_releases`` drops a
slot after its last reader when only one stream ever touches its memory. A view (an op that
may return an operand's memory, such as the views of ``spmd.passes.views``) holds that
memory: its slot counts the streams of the memory it views, so memory allocated on one
stream and read through a view on another is kept until the end of the call.
"""

from __future__ import annotations

from spmd.runtime import fusions
from spmd.runtime.thunks import CollectiveThunk, KernelThunk, Thunk


def stream_joins(ops: list) -> tuple[set[int], dict[int, list[int]]]:
    """Which ops need an event recorded after them, and which ops each op must wait for.

    A vector clock per stream (stream -> index of the last op of that stream known complete)
    skips a wait already implied by an earlier join. Parameters and persistent values are
    ready on every stream (the executor forks every stream from the main stream at the start).
    The ops of one async unit (``extra["unit"]``) take all their cross-stream waits before the
    unit's first op: the buffer assignment assumes an async computation starts only after all
    of its operands are ready, so a unit's first op may overwrite bytes that the producers of
    a later op's operands (on other streams) were still using.
    """
    producer: dict[int, int] = {op.out: k for k, op in enumerate(ops)}
    unit_reads: dict[str, list[int]] = {}
    for op in ops:
        if "unit" in op.extra:
            unit_reads.setdefault(op.extra["unit"], []).extend(_reads(op))
    seen_units: set[str] = set()
    clocks: dict[int, dict[int, int]] = {}
    snaps: list[dict[int, int]] = []
    record_after: set[int] = set()
    waits: dict[int, list[int]] = {}
    for k, op in enumerate(ops):
        a = op.stream
        clock = clocks.setdefault(a, {})
        reads = _reads(op)
        unit = op.extra.get("unit")
        if unit is not None and unit not in seen_units:
            seen_units.add(unit)
            reads = unit_reads[unit]
        # latest producer first: its join often implies the earlier ones
        for p in sorted({producer[s] for s in reads if s in producer}, reverse=True):
            if p >= k or ops[p].stream == a or clock.get(ops[p].stream, -1) >= p:
                continue
            record_after.add(p)
            waits.setdefault(k, []).append(p)
            for st, idx in snaps[p].items():
                if clock.get(st, -1) < idx:
                    clock[st] = idx
        clock[a] = k
        snaps.append(dict(clock))
    return record_after, waits


def _reads(op) -> list[int]:
    """Slots an op reads, the memory it updates in place included."""
    return list(op.ins) + ([op.alias_of] if op.alias_of >= 0 else [])


def _storage_streams(lw) -> dict[int, set[int]]:
    """Per slot, the streams that may have allocated the memory it refers to (views included)."""
    out: dict[int, set[int]] = {}
    for op in lw.ops:
        streams = {op.stream}
        if op.alias_of >= 0:
            streams |= out.get(op.alias_of, set())
        if "spec" not in op.extra and not fusions.is_fresh(op.inst):
            for s in op.ins:
                streams |= out.get(s, set())
        out[op.out] = streams
    return out


def attach_releases(thunks: list[Thunk], lw, outputs: set[int], gpu: bool) -> None:
    """Set ``release`` on each slot's last reader when dropping it early is safe."""
    last: dict[int, int] = {}
    readers: dict[int, set[int]] = {}
    for k, th in enumerate(thunks):
        ins = th.ins if isinstance(th, KernelThunk) else (th.in_,) if isinstance(th, CollectiveThunk) else ()
        for s in ins:
            last[s] = k
            readers.setdefault(s, set()).add(th.stream_id)
    storage = _storage_streams(lw) if gpu else {}
    per_thunk: dict[int, list[int]] = {}
    for s, k in last.items():
        if s in outputs or s in lw.folded:
            continue
        if gpu and len(readers[s] | storage.get(s, {0})) > 1:
            continue
        per_thunk.setdefault(k, []).append(s)
    for k, slots in per_thunk.items():
        thunks[k].release = tuple(slots)
