"""Parent-side helpers of the benchmark scripts: argparse types, JAX child environments, child
status and the report notes of children that failed.

Like ``common``, it imports neither torch nor JAX.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from benchmarks import common


def jax_child_env(device: str, tp: int, flags: str = "") -> tuple[dict[str, str], list[str]]:
    """``(extra, drop)`` for :func:`common.child_env` of a JAX child on ``device`` (``cuda``/``cpu``), ``tp`` devices.

    On CPU, JAX shows one host device unless XLA is told otherwise, so the child gets
    ``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS=--xla_force_host_platform_device_count=<tp>``, followed
    by ``flags``. On GPU the caller's ``XLA_FLAGS`` are dropped (they would change what XLA
    compiles) and replaced by ``flags`` when given. ValueError on another device or ``tp < 1``.
    """
    if device not in ("cuda", "cpu") or tp < 1:
        raise ValueError(f"jax_child_env: expected device 'cuda' or 'cpu' and tp >= 1, got {device!r}, {tp}")
    if device == "cpu":
        xla = " ".join(f for f in (f"--xla_force_host_platform_device_count={tp}", flags) if f)
        return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla}, []
    return ({"XLA_FLAGS": flags}, []) if flags else ({}, ["XLA_FLAGS"])


def name_list(allowed: Sequence[str], allow_empty: bool = True) -> Callable[[str], list[str]]:
    """An argparse ``type``: ``"a,b"`` -> ``["a", "b"]``, each name one of ``allowed``.

    Otherwise it raises ``argparse.ArgumentTypeError``, which argparse shows as a usage error
    (exit status 2) naming the flag, the allowed names and the text given.
    """
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in names if x not in allowed]
        if bad or (not names and not allow_empty):
            raise argparse.ArgumentTypeError(
                f"expected comma-separated names from {', '.join(allowed)}; got {text!r}"
                + (f" (unknown: {', '.join(bad)})" if bad else ""))
        return names

    parse.__name__ = "name list"
    return parse


def not_run(name: str, why: str) -> common.ChildResult:
    """The result of a child that was never started (``why`` says so in its output tail)."""
    return common.ChildResult(name, [], None, False, 0.0, f"not started: {why}")


def child_status(res: common.ChildResult) -> dict[str, Any]:
    """JSON-ready status of a child: name, ok, returncode, timed_out, elapsed_s, records (count),
    ``error`` (when not ok: why, :attr:`common.ChildResult.error`, else the last line of its output
    tail; None when ok) and ``tail`` (the last 1500 characters of its output when not ok)."""
    failed = not res.ok
    return {"name": res.name, "ok": res.ok, "returncode": res.returncode, "timed_out": res.timed_out,
            "elapsed_s": round(res.elapsed_s, 1), "records": len(res.records),
            "error": (res.error or common.last_line(res.tail)) if failed else None,
            "tail": res.tail[-1500:] if failed else ""}


def child_failure_notes(status: Sequence[Mapping[str, Any]]) -> list[str]:
    """One report line per child (a :func:`child_status` dict) that did not finish ok: its name,
    how it ended (timed out after N s, exit code N, or not run) and the last line of its output."""
    lines = []
    for s in status:
        if s.get("ok"):
            continue
        if s.get("timed_out"):
            how = f"timed out after {s.get('elapsed_s')} s"
        elif s.get("returncode") is None:
            how = "not run"
        else:
            rc = s["returncode"]
            how = f"exit code {rc}" + (f", signal {-rc}" if rc < 0 else "")
        err = s.get("error") or common.last_line(s.get("tail") or "") or "no output"
        lines.append(f"child {s.get('name')} failed ({how}): {err}")
    return lines


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (``--calls``, ``--rounds``); otherwise a usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a float >= 0 (seconds); otherwise a usage error naming the value."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value
