"""Shared benchmark helpers: environment, timing, fresh inputs, child processes (reports: reporting.py).

Timing follows the lent-GPU method (CUDA events around the region, warm-up, many reps, median)
and interleaves variants over rounds (A B C, A B C, ...) because GPU clocks sink under sustained
load: whichever variant ran first would otherwise look faster. On several devices, every rep is
bracketed by an event pair on each device's current stream and the rep's time is the maximum
over devices. On CPU devices the same helpers fall back to the host clock, so the harness logic
is testable without GPUs.

torch is imported lazily so that a JAX child process can use this module without loading it.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Environment every benchmark process and child must run with: NVLink multicast stays off in
#: NCCL, PyTorch and NVSHMEM (it can take a shared host's GPUs out of service), JAX allocates on
#: demand (so that it can share GPUs with torch), and Python output is unbuffered.
REQUIRED_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "PYTHONUNBUFFERED": "1",
}

#: Prefix of a result line printed by a child process (one JSON object after it).
JSON_PREFIX = "BENCH_JSON "


def default_tp(device: str) -> int:
    """Devices to use when ``--tp`` is not given: 2 virtual CPU devices, else every local GPU."""
    import torch

    return 2 if device == "cpu" else max(1, torch.cuda.device_count())


def apply_required_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Set every variable of :data:`REQUIRED_ENV` in ``env`` (default: ``os.environ``).

    Returns the mapping that was updated. Values already set are overwritten: these settings
    are not optional.
    """
    target = os.environ if env is None else env
    for key, value in REQUIRED_ENV.items():
        target[key] = value
    return target  # type: ignore[return-value]


def child_env(extra: Mapping[str, str] | None = None, drop: Sequence[str] = ()) -> dict[str, str]:
    """Environment for a child process: this one's, plus ``extra``, minus ``drop``, plus REQUIRED_ENV.

    The repository root is prepended to ``PYTHONPATH`` so children import ``benchmarks`` and
    ``spmd`` from this checkout.
    """
    env = dict(os.environ)
    for key in drop:
        env.pop(key, None)
    env.update(extra or {})
    old = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + old if old else "")
    return apply_required_env(env)


# ----------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Measurement:
    """Result of timing one variant.

    ``median_ms`` is the median over rounds of each round's median per-rep time (ms), or None
    when the variant failed (``error`` then says why). ``round_ms`` holds each round's median;
    ``wall_ms`` the median over rounds of host wall time per rep with one sync per round (a
    check that the events saw the work: it should not be far above ``median_ms``).
    """

    name: str
    median_ms: float | None
    round_ms: tuple[float, ...] = ()
    wall_ms: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the variant produced a time."""
        return self.median_ms is not None and self.error is None


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence; ValueError on an empty one."""
    if not values:
        raise ValueError("median: expected at least one value, got none")
    return float(statistics.median(values))


def ratio(value: float | None, limit: float | None) -> float | None:
    """``value / limit``, or None when either is missing or the limit is not positive."""
    if value is None or limit is None or not limit > 0:
        return None
    return value / limit


# ----------------------------------------------------------------------------- timing


def _is_cuda(devices: Sequence[Any]) -> bool:
    """True when every device is a CUDA device; an empty list (host-only timing) is not."""
    if not devices or all(str(d).startswith("cpu") for d in devices):
        return False
    import torch

    return all(torch.device(d).type == "cuda" for d in devices)


def synchronize(devices: Sequence[Any]) -> None:
    """Wait for all work on every CUDA device in ``devices`` (no-op for CPU devices)."""
    import torch

    for d in devices:
        dev = torch.device(d)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def time_reps(fn: Callable[[], Any], devices: Sequence[Any], reps: int) -> tuple[list[float], float]:
    """Time ``reps`` back-to-back calls of ``fn``; returns (per-rep ms, host wall ms per rep).

    On CUDA devices each rep is bracketed by events recorded on every device's current stream;
    the rep's time is the maximum over devices. Work that ``fn`` issues on other streams is
    counted only if it is joined back into the current stream before ``fn`` returns. On CPU
    devices the per-rep time is the host clock around the call.
    """
    if reps < 1:
        raise ValueError(f"time_reps: reps must be >= 1, got {reps}")
    if not _is_cuda(devices):
        per_rep = []
        t_all = time.perf_counter()
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            per_rep.append((time.perf_counter() - t0) * 1e3)
        return per_rep, (time.perf_counter() - t_all) * 1e3 / reps
    import torch

    devs = [torch.device(d) for d in devices]
    streams = [torch.cuda.current_stream(d) for d in devs]
    pairs = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in devs]
             for _ in range(reps)]
    synchronize(devs)
    t_all = time.perf_counter()
    for r in range(reps):
        for (start, _), stream in zip(pairs[r], streams, strict=True):
            start.record(stream)
        fn()
        for (_, end), stream in zip(pairs[r], streams, strict=True):
            end.record(stream)
    synchronize(devs)
    wall = (time.perf_counter() - t_all) * 1e3 / reps
    per_rep = [max(start.elapsed_time(end) for start, end in row) for row in pairs]
    return per_rep, wall


def interleaved(variants: Mapping[str, Callable[[], Any]], devices: Sequence[Any], *, rounds: int = 5,
                warmup: int = 2, reps: int = 10, log: Callable[[str], None] | None = None,
                combine: Callable[[list[float]], list[float]] | None = None) -> dict[str, Measurement]:
    """Time every variant in interleaved rounds (A B C, A B C, ...); median of round medians.

    Each round runs, for every variant in order, ``warmup`` untimed calls then ``reps`` timed
    ones. A variant that raises is recorded with its error and skipped in later rounds; the
    others go on. ``combine`` maps the per-rep times (ms) before the median is taken: a
    multi-process run passes an element-wise maximum over ranks there. Returns one
    :class:`Measurement` per variant name, in input order.
    """
    if rounds < 1 or reps < 1 or warmup < 0:
        raise ValueError(f"interleaved: expected rounds>=1, reps>=1, warmup>=0, got {rounds}, {reps}, {warmup}")
    per_round: dict[str, list[float]] = {name: [] for name in variants}
    walls: dict[str, list[float]] = {name: [] for name in variants}
    errors: dict[str, str] = {}
    t_start = time.perf_counter()
    for r in range(rounds):
        if log and r:
            log(f"round {r}/{rounds} done after {time.perf_counter() - t_start:.1f} s")
        for name, fn in variants.items():
            if name in errors:
                continue
            try:
                for _ in range(warmup):
                    fn()
                times, wall = time_reps(fn, devices, reps)
                if combine is not None:
                    times = combine(times)
            except Exception as exc:  # one variant's failure must not stop the others
                errors[name] = f"{type(exc).__name__}: {exc}"[:500]
                if log:
                    log(f"variant {name} failed: {errors[name]}")
                continue
            per_round[name].append(median(times))
            walls[name].append(wall)
    out = {}
    for name in variants:
        if name in errors or not per_round[name]:
            out[name] = Measurement(name, None, tuple(per_round[name]), None, errors.get(name, "no rounds"))
        else:
            out[name] = Measurement(name, median(per_round[name]), tuple(per_round[name]), median(walls[name]))
    return out


def host_call_times(fn: Callable[[], Any], sync: Callable[[], None], *, calls: int = 200,
                    rounds: int = 5, warmup: int = 20) -> tuple[float, float, float]:
    """Time per call of ``fn`` in µs: (enqueue-only, throughput, synced), each a median over rounds.

    Enqueue-only: host time of ``calls`` calls back to back with no sync, divided by ``calls``
    (the host's own cost, until the device's launch queue fills). Throughput: the same calls
    plus one final ``sync()``, divided by ``calls`` (steady-state time per call: the larger of
    host and device time). Synced: per call, ``fn(); sync()`` timed on the host clock; median
    over the calls of a round.
    """
    if calls < 1 or rounds < 1:
        raise ValueError(f"host_call_times: expected calls>=1, rounds>=1, got {calls}, {rounds}")
    for _ in range(warmup):
        fn()
    sync()
    enqueue, throughput, synced = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        enqueue.append((time.perf_counter() - t0) * 1e6 / calls)
        sync()
        throughput.append((time.perf_counter() - t0) * 1e6 / calls)
        per_call = []
        for _ in range(max(1, calls // 4)):
            t0 = time.perf_counter()
            fn()
            sync()
            per_call.append((time.perf_counter() - t0) * 1e6)
        synced.append(median(per_call))
    return median(enqueue), median(throughput), median(synced)


def fresh_seed() -> int:
    """A fresh random 31-bit seed (from the OS), so that every run sees new inputs."""
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def fresh_randn(shape: Sequence[int], dtype: Any, device: Any, seed: int, scale: float | None = None) -> Any:
    """Standard-normal tensor of ``shape`` scaled by ``scale`` (default ``1/sqrt(shape[-1])``).

    Drawn on ``device`` from a generator seeded with ``seed``; never all zeros (ValueError if a
    zero-size shape is asked for). The default scale keeps matmul outputs O(1) in bf16.
    """
    import torch

    if any(int(s) <= 0 for s in shape):
        raise ValueError(f"fresh_randn: shape must have positive dims, got {tuple(shape)}")
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out = torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32)
    out *= scale if scale is not None else 1.0 / math.sqrt(shape[-1])
    return out.to(dtype)


def rel_error(out: Any, ref: Any) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius, on ``ref``'s device).

    Computed in float64 up to 2**24 elements, in float32 above (to bound memory; the rounding
    of the norms is far below the 1e-3 errors of interest). Returns ``inf`` if the result has
    NaN/inf or ``ref`` is zero; ValueError on shape mismatch.
    """
    import torch

    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"rel_error: shape mismatch, out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    dtype = torch.float64 if ref.numel() <= 2**24 else torch.float32
    o = out.to(device=ref.device, dtype=dtype)
    r = ref.to(dtype)
    den = float(r.norm())
    num = float((o - r).norm())
    if not math.isfinite(num) or den == 0.0:
        return math.inf
    return num / den


def hlo_op_counts(hlo_text: str, ops: Sequence[str] = ("collective-permute", "all-gather", "reduce-scatter",
                                                         "all-reduce")) -> dict[str, int]:
    """How many instructions of each opcode (sync or ``-start`` async form) ``hlo_text`` holds."""
    return {op: hlo_text.count(f" {op}(") + hlo_text.count(f" {op}-start(") for op in ops}


# ----------------------------------------------------------------------------- child processes


def emit(record: Mapping[str, Any]) -> None:
    """Print one result record as a JSON line that :func:`parse_records` picks up."""
    print(JSON_PREFIX + json.dumps(record, default=str), flush=True)


def parse_records(text: str) -> list[dict[str, Any]]:
    """All JSON records printed by :func:`emit` in ``text``; malformed lines are skipped.

    The prefix may come after other text on the line (a launcher such as torchrun may prefix
    each worker line with its rank).
    """
    records = []
    for line in text.splitlines():
        at = line.find(JSON_PREFIX)
        if at >= 0:
            try:
                records.append(json.loads(line[at + len(JSON_PREFIX):]))
            except json.JSONDecodeError:
                continue
    return records


@dataclass(frozen=True)
class ChildResult:
    """Outcome of a child process: its records, exit code (None on timeout), output tail and
    ``error``, the line of its whole output that says why it failed (:func:`error_line`; '' if
    it did not fail or said nothing)."""

    name: str
    records: list[dict[str, Any]] = field(default_factory=list)
    returncode: int | None = None
    timed_out: bool = False
    elapsed_s: float = 0.0
    tail: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        """True when the child exited with status 0 inside its time box."""
        return self.returncode == 0 and not self.timed_out


class Terminated(Exception):
    """Raised in the main thread on SIGTERM once :func:`install_sigterm_handler` ran."""


_TERMINATED: list[bool] = [False]


def install_sigterm_handler() -> None:
    """Turn SIGTERM (e.g. from ``timeout``) into :class:`Terminated`, so partial results get written.

    :func:`run_child` catches it, kills the child's process group and returns what it has;
    :func:`terminated` then stays True so the caller can skip the remaining children.
    """
    def handler(signum, frame):
        _TERMINATED[0] = True
        raise Terminated(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def terminated() -> bool:
    """True once SIGTERM arrived (see :func:`install_sigterm_handler`)."""
    return _TERMINATED[0]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group, then SIGKILL it if it is still there after 5 s."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(name: str, cmd: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None,
              log: Callable[[str], None] | None = None, cwd: Path = REPO_ROOT) -> ChildResult:
    """Run ``cmd`` in its own process group with a time box, streaming its output; never raises.

    Output lines that are not records are passed to ``log`` prefixed with ``[name]`` as they
    come. On timeout (or SIGTERM, see :func:`install_sigterm_handler`) the whole process group
    (torchrun's workers too) is killed and the records printed so far are still returned.
    """
    log = log or (lambda s: print(s, flush=True))
    env = dict(env) if env is not None else child_env()
    if timeout_s <= 1 or terminated():
        return ChildResult(name, [], None, True, 0.0, "not started: no time left")
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(list(cmd), cwd=str(cwd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", bufsize=1, start_new_session=True)
    except OSError as exc:
        return ChildResult(name, [], None, False, 0.0, f"could not start: {exc}")
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if JSON_PREFIX not in line:
                log(f"[{name}] {line.rstrip()}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except (subprocess.TimeoutExpired, Terminated):
        timed_out = True
        _kill_group(proc)
    reader.join(timeout=5.0)
    text = "".join(lines)
    elapsed = time.perf_counter() - t0
    rc = None if timed_out else proc.returncode
    log(f"[{name}] {'timed out' if timed_out else f'exit {rc}'} after {elapsed:.1f} s")
    err = "" if rc == 0 else (last_line(text) if timed_out else error_line(text))
    return ChildResult(name, parse_records(text), rc, timed_out, elapsed, text[-4000:], err)


#: A line that reports an exception: ``[prefix]: pkg.SomeError: message`` (a launcher such as
#: torchrun may prefix worker lines with their rank; an empty message does not count).
_EXCEPTION_LINE = re.compile(r"^(\[[^\]]*\]:?\s*)?([A-Za-z_]\w*\.)*[A-Z]\w*(Error|Exception|Exit|Interrupt): \S")


def last_line(text: str, limit: int = 300) -> str:
    """The last line of a child's output that has a letter or digit and is not a result record
    ('' if none), stripped and cut to ``limit`` characters."""
    for line in reversed(text.splitlines()):
        if any(c.isalnum() for c in line) and JSON_PREFIX not in line:
            return line.strip()[:limit]
    return ""


def error_line(text: str, limit: int = 300) -> str:
    """The line of a failed child's output that says why: the last exception line (``SomeError:
    message``, see :data:`_EXCEPTION_LINE`), else :func:`last_line`. The first choice skips the
    banners a launcher prints after its worker's traceback (torchrun's ``ChildFailedError``)."""
    for line in reversed(text.splitlines()):
        if _EXCEPTION_LINE.match(line.strip()) and JSON_PREFIX not in line:
            return line.strip()[:limit]
    return last_line(text, limit)


class Deadline:
    """A wall-clock deadline: ``left()`` seconds remain; ``expired(margin_s)`` once inside margin."""

    def __init__(self, budget_s: float):
        self.end = time.monotonic() + budget_s

    def left(self) -> float:
        """Seconds until the deadline (may be negative)."""
        return self.end - time.monotonic()

    def expired(self, margin_s: float = 0.0) -> bool:
        """True when fewer than ``margin_s`` seconds remain."""
        return self.left() < margin_s


def require_cuda(tool: str) -> None:
    """Exit with a one-line message (status 2) unless PyTorch sees a CUDA GPU; ``tool`` names the caller."""
    import torch

    if not torch.cuda.is_available():
        print(f"{tool}: needs a CUDA GPU (torch.cuda.is_available() is False here)", file=sys.stderr)
        raise SystemExit(2)
