"""Per-thunk timing records of an execution, for Chrome / Perfetto traces.

Pass a ``TraceRecorder`` as ``Executable.run(..., trace=recorder)``; without one the
executor runs its untraced loop (no cost). On CPU every thunk is timed with
``time.perf_counter``; on GPU with a pair of timing CUDA events on the thunk's stream,
resolved (one device synchronisation) by ``TraceRecorder.events()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TraceEvent:
    """One thunk execution: partition id, stream id, thunk name, start/end in microseconds.

    Times are relative to the start of the traced call on that device (GPU: to an event
    recorded on the device's main stream when the call began).
    """

    device: int
    stream_id: int
    name: str
    start_us: float
    end_us: float


class TraceRecorder:
    """Collects ``TraceEvent``s of the calls it is passed to."""

    def __init__(self) -> None:
        self._cpu: list[TraceEvent] = []
        self._gpu: list[tuple[int, int, str, Any, Any, Any]] = []
        self.origin_s = time.perf_counter()

    def add_cpu(self, device: int, stream_id: int, name: str, start_s: float, end_s: float) -> None:
        """Record a host-timed thunk (``perf_counter`` seconds)."""
        self._cpu.append(TraceEvent(device, stream_id, name, (start_s - self.origin_s) * 1e6,
                                    (end_s - self.origin_s) * 1e6))

    def add_gpu(self, device: int, stream_id: int, name: str, base: Any, start: Any, end: Any) -> None:
        """Record a thunk timed by CUDA events ``start``/``end`` relative to event ``base``."""
        self._gpu.append((device, stream_id, name, base, start, end))

    def events(self) -> list[TraceEvent]:
        """All records, sorted by (device, start). Synchronises pending CUDA events once."""
        out = list(self._cpu)
        for device, stream_id, name, base, start, end in self._gpu:
            end.synchronize()
            out.append(TraceEvent(device, stream_id, name, base.elapsed_time(start) * 1e3,
                                  base.elapsed_time(end) * 1e3))
        return sorted(out, key=lambda e: (e.device, e.start_us))

    def chrome_trace(self) -> dict:
        """The records as a Chrome trace-event JSON object (pid = device, tid = stream)."""
        return {"traceEvents": [
            {"name": e.name, "ph": "X", "pid": e.device, "tid": e.stream_id, "ts": e.start_us,
             "dur": max(e.end_us - e.start_us, 0.0)} for e in self.events()]}
