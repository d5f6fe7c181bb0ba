"""``spmd.trace``: a Chrome / Perfetto timeline of one execution of a compiled program.

    path = spmd.trace(f, x, w, path="trace.json")        # f: spmd.jit object or Compiled
    with spmd.tracing(f, path="trace.json") as run:       # several calls, one timeline
        y = run(x, w)
        y = run(y, w)

Open the file in https://ui.perfetto.dev (or chrome://tracing). The JSON follows the Chrome
trace-event format ("JSON Object Format" of the Trace Event Format document, Google, 2016):
one *process* per device of the mesh (``"device cuda:0"``), one *thread* (track) per execution
stream of that device (``"stream 0 (main)"``, ``"stream 1 (compute)"``,
``"stream 3 (communication)"``), and one complete event (``"ph": "X"``) per thunk run, named by
its instruction (``"matmul.1.op"``, ``"all-gather.chunk1-start"``), with the opcode, result and
operand shapes, the stream and the partition id in ``args``. Times are microseconds from the
start of the first traced call.

Timing comes from the runtime (``spmd.runtime.trace_events``): on virtual CPU devices every
thunk is timed on the host as it runs (streams are labels there, nothing runs concurrently on
one device); on GPU with CUDA timing events on the thunk's stream, so the tracks show what the
devices did. A traced call runs eagerly (never from a CUDA graph) and gives the same results
as an untraced call.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.utils._pytree as pytree

from spmd.compiled import COLLECTIVES, Compiled
from spmd.runtime.trace_events import TraceEvent, TraceRecorder

_EVENT_THUNKS = {"record.": "record-event", "wait.": "wait-event"}


def trace(fn_or_compiled: Any, *args: Any, path: str | os.PathLike = "trace.json") -> str:
    """Run ``fn_or_compiled(*args)`` once with tracing on and write its timeline to ``path``.

    Args:
      fn_or_compiled: an ``spmd.jit`` object (compiled for ``args`` first if needed, through
        its cache), a ``Compiled``, or an ``spmd.parallelize`` ``ParallelModule`` (``args``
        are then the forward's inputs).
      args: the call's arguments, as the function takes them (tensors, ShardedArrays,
        pytrees). Donated arguments are consumed as in an untraced call.
      path: where to write the Chrome trace-event JSON (a file, not an existing folder);
        missing parent folders are created.
    Returns:
      ``str(path)``.
    Raises:
      TypeError: ``fn_or_compiled`` is none of the accepted kinds, or ``path`` is not a
        str / PathLike.
      ValueError: ``path`` is an existing folder, or its folder cannot be created or written
        (raised before the call runs), and everything the call itself raises for bad arguments.
    """
    with tracing(fn_or_compiled, path=path) as run:
        run(*args)
    return str(path)


@contextlib.contextmanager
def tracing(fn_or_compiled: Any, path: str | os.PathLike = "trace.json") -> Iterator[TracedCalls]:
    """Context manager form of ``trace``: every call of the yielded callable is traced.

    The calls share one timeline (later calls start where the host started them, and never
    before the previous call's last event); the file is written when the block exits, also
    when it exits by an exception after at least one call. See ``trace`` for the arguments
    and errors.
    """
    runner = TracedCalls(fn_or_compiled)
    out = _check_path(path)
    _check_writable_dir(out)  # before anything runs (donated arguments would be consumed)
    try:
        yield runner
    finally:
        if runner.calls:
            write_chrome_trace(runner.chrome_trace(), out)


class TracedCalls:
    """Runs a jitted function / ``Compiled`` / ``ParallelModule`` with tracing on.

    ``__call__(*args)`` returns what an untraced call returns; ``events()`` gives the
    ``TraceEvent``s of all calls so far (times shifted onto one timeline, microseconds);
    ``chrome_trace()`` the JSON object (instruction details from the program of the latest
    call, which is every call's program unless the argument shapes changed between calls).
    Raises TypeError for an object that is none of the accepted kinds.
    """

    def __init__(self, fn_or_compiled: Any) -> None:
        _target_kind(fn_or_compiled)
        self.target = fn_or_compiled
        self.calls = 0
        self._events: list[TraceEvent] = []
        self._compiled: Compiled | None = None
        self._first_start_s: float | None = None
        self._end_us = 0.0

    def __call__(self, *args: Any) -> Any:
        compiled, call_args = _resolve(self.target, args)
        recorder = TraceRecorder()
        traced = copy.copy(compiled)
        traced.executable = _TracedExecutable(compiled.executable, recorder)
        start_s = recorder.origin_s
        out = traced(*call_args)
        events = recorder.events()  # GPU: waits for the timing events of this call
        if self._first_start_s is None:
            self._first_start_s = start_s
        shift = max((start_s - self._first_start_s) * 1e6, self._end_us if self.calls else 0.0)
        shifted = [TraceEvent(e.device, e.stream_id, e.name, e.start_us + shift, e.end_us + shift) for e in events]
        self._events.extend(shifted)
        self._end_us = max([self._end_us] + [e.end_us for e in shifted])
        self._compiled = compiled
        self.calls += 1
        return out

    def events(self) -> list[TraceEvent]:
        """The recorded events of every call so far, sorted by (device, start)."""
        return sorted(self._events, key=lambda e: (e.device, e.start_us))

    def chrome_trace(self) -> dict:
        """The Chrome trace-event JSON object of all calls (see ``build_chrome_trace``).

        Raises ValueError before the first call.
        """
        if self._compiled is None:
            raise ValueError("chrome_trace: no call has been traced yet")
        return build_chrome_trace(self.events(), self._compiled)


@dataclass(frozen=True)
class _TracedExecutable:
    """Forwards ``run`` to an executable with ``trace=recorder``; every other attribute as is."""

    inner: Any
    recorder: TraceRecorder

    def run(self, args, arg_ready=None, donated=frozenset(), trace=None):
        return self.inner.run(args, arg_ready, donated, trace=self.recorder)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _target_kind(obj: Any) -> str:
    from spmd.jit import Jitted

    if isinstance(obj, Compiled):
        return "compiled"
    if isinstance(obj, Jitted):
        return "jitted"
    if all(hasattr(obj, a) for a in ("lower", "params", "compiled", "mesh")):
        return "parallel"
    raise TypeError(f"fn_or_compiled: expected an spmd.jit object, a Compiled or a ParallelModule, "
                    f"got {type(obj).__name__}")


def _resolve(target: Any, args: tuple) -> tuple[Compiled, tuple]:
    """The ``Compiled`` for these arguments and the arguments to call it with."""
    kind = _target_kind(target)
    if kind == "compiled":
        return target, args
    if kind == "parallel":
        target.lower(*args)
        return target.compiled, (target.params, *args)
    leaves, tree = pytree.tree_flatten(args)
    key = target._key(args, leaves, tree)
    compiled = target._cache.get(key)
    if compiled is None:
        compiled = target._cache[key] = target.lower(*args).compile()
    return compiled, args


def _check_path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}")
    return Path(path)


def _check_writable_dir(path: Path) -> None:
    """Create ``path``'s parent folders; ValueError naming ``path`` when it is a folder, or its
    parent folders cannot be made or written."""
    if path.is_dir():
        raise ValueError(f"path: expected a file path for the trace, got the existing folder {str(path)!r}")
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"path: cannot create the folder {str(parent)!r} for the trace {str(path)!r}: "
                         f"{e.strerror or e}") from None
    if not os.access(parent, os.W_OK):
        raise ValueError(f"path: folder {str(parent)!r} is not writable; expected a writable place for the trace "
                         f"{str(path)!r}")


# ------------------------------------------------------------------ JSON building
def stream_kinds(compiled: Compiled, events: Sequence[TraceEvent] = ()) -> dict[int, str]:
    """Per execution stream id, ``"main"`` (0), ``"communication"`` or ``"compute"``.

    A stream other than 0 is a communication stream when every kernel or collective it runs
    is a collective (event record/wait thunks aside), else a compute stream. Streams come
    from the lowered program (``executable.program``) and from ``events``.
    """
    ops: dict[int, list[str]] = {}
    program = getattr(compiled.executable, "program", None)
    insts = _instructions(compiled)
    names = [(t.stream_id, t.name) for t in getattr(program, "thunks", ())]
    names += [(e.stream_id, e.name) for e in events]
    for sid in getattr(program, "stream_ids", (0,)):
        ops.setdefault(sid, [])
    for sid, name in names:
        ops.setdefault(sid, []).append(_opcode(name, insts))
    out = {}
    for sid, opcodes in ops.items():
        real = [op for op in opcodes if op not in _EVENT_THUNKS.values()]
        comm = real and all(op.removesuffix("-start") in COLLECTIVES for op in real)
        out[sid] = "main" if sid == 0 else "communication" if comm else "compute"
    return out


def build_chrome_trace(events: Sequence[TraceEvent], compiled: Compiled) -> dict:
    """Chrome trace-event JSON object for ``events`` of ``compiled``'s program.

    Returns ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``: process
    and thread name / sort-index metadata events (``"ph": "M"``) for every device and stream
    of the mesh, then one complete event (``"ph": "X"``, ``ts``/``dur`` in µs) per record, its
    ``cat`` ``"compute"``, ``"communication"`` or ``"sync"`` (event record/wait) and its
    ``args`` the instruction's opcode, shape and operand shapes.
    """
    mesh = compiled.mesh
    kinds = stream_kinds(compiled, events)
    insts = _instructions(compiled)
    ran = {e.name for e in events}
    pids = sorted({e.device for e in events} | set(range(len(mesh.device_ids))))
    out: list[dict] = []
    for pid in pids:
        label = f"device {mesh.platform}:{mesh.device_ids[pid]}" if pid < len(mesh.device_ids) else f"device {pid}"
        out.append(_meta("process_name", pid, 0, {"name": label}))
        out.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        for sid, kind in sorted(kinds.items()):
            out.append(_meta("thread_name", pid, sid, {"name": f"stream {sid} ({kind})"}))
            out.append(_meta("thread_sort_index", pid, sid, {"sort_index": sid}))
    for e in events:
        out.append({"name": e.name, "cat": _category(_opcode(e.name, insts)), "ph": "X", "pid": e.device,
                    "tid": e.stream_id, "ts": round(e.start_us, 3), "dur": round(max(e.end_us - e.start_us, 0.0), 3),
                    "args": _event_args(e, insts, ran)})
    other = {"program": compiled.name, "mesh": repr(mesh), "platform": mesh.platform,
             "num_partitions": compiled.module.num_partitions}
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(obj: dict, path: str | os.PathLike) -> str:
    """Write a trace-event JSON object to ``path`` (parent folders created); returns ``str(path)``.

    Writes a temporary file next to ``path`` and renames it; the temporary file is removed
    when the write or the rename fails. Raises ValueError naming ``path`` when it is a folder
    or its folder cannot be created or written.
    """
    p = _check_path(path)
    _check_writable_dir(p)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}.{time.monotonic_ns()}")
    try:
        tmp.write_text(json.dumps(obj))
        tmp.replace(p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return str(p)


def _category(opcode: str) -> str:
    """``"communication"`` for collectives, ``"sync"`` for event record/wait, else ``"compute"``."""
    if opcode.removesuffix("-start") in COLLECTIVES:
        return "communication"
    return "sync" if opcode in _EVENT_THUNKS.values() else "compute"


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _instructions(compiled: Compiled) -> dict[str, Any]:
    """Instruction name -> Instruction over all computations of the final module."""
    return {i.name: i for c in compiled.module.all_computations() for i in c.instructions}


def _opcode(name: str, insts: dict[str, Any]) -> str:
    inst = insts.get(name)
    if inst is not None:
        return inst.opcode
    for prefix, op in _EVENT_THUNKS.items():
        if name.startswith(prefix) and name[len(prefix):] in insts:
            return op
    return "unknown"


def _event_args(e: TraceEvent, insts: dict[str, Any], ran: set[str]) -> dict:
    """``args`` of one event; ``fused`` lists operand dots that ran inside this thunk."""
    args: dict[str, Any] = {"opcode": _opcode(e.name, insts), "stream": e.stream_id, "partition": e.device}
    inst = insts.get(e.name)
    if inst is None:
        return args
    args["shape"] = str(inst.shape)
    args["operands"] = [f"%{o.name}: {o.shape}" for o in inst.operands]
    fused = [o.name for o in inst.operands if o.opcode == "dot" and o.name not in ran]
    if fused:
        args["fused"] = fused
    for key in ("source_target_pairs", "replica_groups", "dimensions"):
        if key in inst.attrs and inst.opcode.removesuffix("-start") in COLLECTIVES:
            args[key] = str(inst.attrs[key])
    loc = inst.location
    if loc is not None and loc.op_name:
        args["op_name"] = loc.op_name
    if loc is not None and loc.source_file:
        args["source"] = f"{loc.source_file}:{loc.source_line}"
    return args
