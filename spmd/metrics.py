"""Process-wide counters and timers, printable as a report.

Modelled on PyTorch/XLA's metrics (``torch_xla.debug.metrics``): a counter
has a value; a timer (XLA's "metric") keeps the number of samples, the
accumulated time, the rate (samples per second since its first sample) and
percentiles over a bounded reservoir of the most recent samples.

    from spmd import metrics
    metrics.counter("compile_cache.hit").inc()
    with metrics.timer("execute"):
        ...
    metrics.timer("transfer").record(elapsed_s)
    print(metrics.report())

Every call is thread-safe. The hot path (``Counter.inc``, ``Timer.record``)
takes one uncontended lock and does O(1) work (about 1 µs in CPython);
percentiles are computed only by ``report`` / ``snapshot``.
"""

from __future__ import annotations

import threading
import time
from collections import deque

PERCENTILES = (1, 5, 10, 20, 50, 80, 90, 95, 99)
RESERVOIR_SIZE = 1024

_lock = threading.Lock()
_counters: dict[str, Counter] = {}
_timers: dict[str, Timer] = {}


class Counter:
    """A monotonically increased integer (``inc``); read ``value``."""

    __slots__ = ("name", "_value", "_lock")

    def __init__(self, name: str) -> None:
        self.name = name
        self._value = 0
        self._lock = threading.Lock()

    def inc(self, n: int = 1) -> None:
        """Add ``n`` (default 1)."""
        lock = self._lock
        lock.acquire()
        try:
            self._value += n
        finally:
            lock.release()

    @property
    def value(self) -> int:
        """The current count."""
        return self._value

    def _reset(self) -> None:
        with self._lock:
            self._value = 0


class Timer:
    """Durations in seconds: total samples, accumulated time, rate, percentiles.

    Use as a context manager (``with timer("x"): ...``, nesting and threads
    are fine: start times are kept per thread) or call ``record(elapsed_s)``.
    Percentiles cover the last ``RESERVOIR_SIZE`` samples.
    """

    __slots__ = ("name", "_lock", "_count", "_total_s", "_first_t", "_samples", "_local")

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._local = threading.local()
        self._reset()

    def record(self, elapsed_s: float) -> None:
        """Add one sample of ``elapsed_s`` seconds."""
        lock = self._lock
        lock.acquire()
        try:
            if not self._count:
                self._first_t = time.perf_counter() - elapsed_s
            self._count += 1
            self._total_s += elapsed_s
            self._samples.append(elapsed_s)
        finally:
            lock.release()

    def __enter__(self) -> Timer:
        stack = getattr(self._local, "starts", None)
        if stack is None:
            stack = self._local.starts = []
        stack.append(time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        self.record(time.perf_counter() - self._local.starts.pop())

    @property
    def total_samples(self) -> int:
        """Number of samples recorded since the last reset."""
        return self._count

    @property
    def accumulator_s(self) -> float:
        """Sum of all samples since the last reset, in seconds."""
        return self._total_s

    def rate(self) -> float:
        """Samples per second since the first sample (0.0 with no samples)."""
        with self._lock:
            if not self._count:
                return 0.0
            return self._count / max(time.perf_counter() - self._first_t, 1e-9)

    def percentiles(self) -> dict[int, float]:
        """``{p: seconds}`` for p in ``PERCENTILES`` over the reservoir ({} with no samples).

        Linear interpolation between closest ranks (numpy's default
        ``percentile`` method): rank ``p/100 * (n-1)`` of the sorted samples.
        """
        with self._lock:
            samples = sorted(self._samples)
        return {p: _percentile(samples, p) for p in PERCENTILES} if samples else {}

    def _reset(self) -> None:
        with self._lock:
            self._count = 0
            self._total_s = 0.0
            self._first_t = 0.0
            self._samples: deque[float] = deque(maxlen=RESERVOIR_SIZE)


def _percentile(sorted_samples: list[float], p: float) -> float:
    rank = p / 100 * (len(sorted_samples) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(sorted_samples) - 1)
    return sorted_samples[lo] + (sorted_samples[hi] - sorted_samples[lo]) * (rank - lo)


def _check_name(name: object) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name: expected a non-empty str, got {type(name).__name__} {name!r}")
    if not name:
        raise ValueError("name: expected a non-empty str, got ''")


def counter(name: str) -> Counter:
    """The process-wide counter ``name`` (created at first use).

    Raises:
      TypeError: ``name`` is not a str.
      ValueError: ``name`` is empty.
    """
    _check_name(name)
    c = _counters.get(name)
    if c is None:
        with _lock:
            c = _counters.setdefault(name, Counter(name))
    return c


def timer(name: str) -> Timer:
    """The process-wide timer ``name`` (created at first use).

    Raises:
      TypeError: ``name`` is not a str.
      ValueError: ``name`` is empty.
    """
    _check_name(name)
    t = _timers.get(name)
    if t is None:
        with _lock:
            t = _timers.setdefault(name, Timer(name))
    return t


def reset() -> None:
    """Zero every counter and timer (objects stay registered, so held references keep working)."""
    with _lock:
        items = list(_counters.values()) + list(_timers.values())
    for m in items:
        m._reset()


def snapshot() -> dict:
    """Current values as plain data.

    Returns ``{"counters": {name: value}, "timers": {name: {"total_samples": int,
    "accumulator_s": float, "rate_per_s": float, "percentiles_s": {p: float}}}}``,
    names sorted; timers without samples are left out.
    """
    with _lock:
        counters = dict(_counters)
        timers = dict(_timers)
    out_timers = {}
    for name in sorted(timers):
        t = timers[name]
        if t.total_samples:
            out_timers[name] = {
                "total_samples": t.total_samples,
                "accumulator_s": t.accumulator_s,
                "rate_per_s": t.rate(),
                "percentiles_s": t.percentiles(),
            }
    return {"counters": {n: counters[n].value for n in sorted(counters)}, "timers": out_timers}


def format_seconds(s: float) -> str:
    """``1.500s``, ``12.300ms``, ``4.000us``: three decimals in the largest unit below the value."""
    if s >= 1:
        return f"{s:.3f}s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f}ms"
    return f"{s * 1e6:.3f}us"


def report() -> str:
    """A readable report, one block per timer then per counter, like PyTorch/XLA's::

        Metric: execute
          TotalSamples: 3
          Accumulator: 6.000ms
          Rate: 1.2 / second
          Percentiles: 1%=1.020ms; 5%=1.100ms; ...; 99%=2.980ms
        Counter: compile_cache.hit
          Value: 2
    """
    snap = snapshot()
    lines = []
    for name, t in snap["timers"].items():
        pct = "; ".join(f"{p}%={format_seconds(v)}" for p, v in t["percentiles_s"].items())
        lines += [
            f"Metric: {name}",
            f"  TotalSamples: {t['total_samples']}",
            f"  Accumulator: {format_seconds(t['accumulator_s'])}",
            f"  Rate: {t['rate_per_s']:.4g} / second",
            f"  Percentiles: {pct}",
        ]
    for name, value in snap["counters"].items():
        if value:
            lines += [f"Counter: {name}", f"  Value: {value}"]
    return "\n".join(lines) + ("\n" if lines else "")


def print_report(console=None) -> None:
    """Print the report as a table with the ``rich`` library (plain text if rich is missing)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a dependency
        print(report(), end="")
        return
    snap = snapshot()
    table = Table(title="spmd metrics")
    for col in ("name", "samples / value", "total", "rate /s", "p50", "p90", "p99"):
        table.add_column(col)
    for name, t in snap["timers"].items():
        p = t["percentiles_s"]
        table.add_row(name, str(t["total_samples"]), format_seconds(t["accumulator_s"]), f"{t['rate_per_s']:.4g}",
                      format_seconds(p[50]), format_seconds(p[90]), format_seconds(p[99]))
    for name, value in snap["counters"].items():
        if value:
            table.add_row(name, str(value), "", "", "", "", "")
    (console or Console()).print(table)
