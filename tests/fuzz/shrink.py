"""Shrink a failing case without hypothesis: edit its recorded choice sequence and replay it.

The generator draws everything through ``tests.fuzz.draw``; a ``RandomDraw`` records its choices,
and ``ReplayDraw`` rebuilds a case from an edited sequence (values past the end become the simplest
answer). ``shrink`` greedily tries shorter sequences and smaller values (as hypothesis does, in a
much simpler form) and keeps an edit when the replayed case still fails with the same signature.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tests.fuzz.case import Case
from tests.fuzz.draw import ReplayDraw
from tests.fuzz.oracle import Outcome


def size(case: Case) -> tuple:
    """Smaller is simpler: fewer ops, fewer inputs, fewer devices, fewer elements."""
    return (len(case.ops), len(case.inputs), case.num_devices, sum(len(i.shape) for i in case.inputs),
            len(case.body))


def shrink(choices: list[int], make: Callable[[ReplayDraw], Case], run: Callable[[Case], Outcome],
           signature: str, budget_s: float = 120.0, max_runs: int = 200) -> tuple[Case, Outcome]:
    """The simplest case found from ``choices`` that still fails with ``signature``.

    ``make(draw)`` builds a case from a draw; ``run(case)`` judges it. Stops after ``budget_s``
    seconds or ``max_runs`` replays.
    """
    best = list(choices)
    best_case = make(ReplayDraw(best))
    best_out = run(best_case)
    start, runs = time.monotonic(), 0

    def attempt(cand: list[int]) -> bool:
        nonlocal best, best_case, best_out, runs
        if runs >= max_runs or time.monotonic() - start > budget_s:
            return False
        runs += 1
        try:
            case = make(ReplayDraw(cand))
        except Exception:  # noqa: BLE001 - an edit the generator cannot build
            return False
        if size(case) > size(best_case) or (size(case) == size(best_case) and cand >= best):
            return False
        out = run(case)
        if out.signature != signature:
            return False
        best, best_case, best_out = cand, case, out
        return True

    improved = True
    while improved and runs < max_runs and time.monotonic() - start <= budget_s:
        improved = False
        for block in (8, 4, 2, 1):  # zero blocks of choices (simplest answers)
            i = 0
            while i < len(best):
                if any(best[i:i + block]) and attempt(best[:i] + [0] * block + best[i + block:]):
                    improved = True
                else:
                    i += block
        for i in range(len(best)):  # smaller values one by one
            if best[i] > 0 and attempt(best[:i] + [best[i] // 2] + best[i + 1:]):
                improved = True
    return best_case, best_out
