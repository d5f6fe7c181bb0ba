"""Shrink a failing case without hypothesis: edit its recorded choice sequence and replay it.

The generator draws everything through ``tests.fuzz.draw``; a ``RandomDraw`` records its choices,
and ``ReplayDraw`` rebuilds a case from an edited sequence (values past the end become the simplest
answer). ``shrink`` greedily deletes whole ops (the spans the generator marks), then tries shorter
sequences and smaller values (as hypothesis does, in a much simpler form), and keeps an edit when
the replayed case still fails with the same signature.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tests.fuzz.case import Case
from tests.fuzz.draw import ReplayDraw
from tests.fuzz.oracle import Outcome


def size(case: Case) -> tuple:
    """Smaller is simpler: fewer ops, fewer inputs, fewer devices, lower ranks, fewer lines."""
    return (len(case.ops), len(case.inputs), case.num_devices, sum(len(i.shape) for i in case.inputs),
            len(case.body))


def shrink(choices: list[int], make: Callable[[ReplayDraw], Case], run: Callable[[Case], Outcome],
           signature: str, budget_s: float = 120.0, max_runs: int = 200) -> tuple[Case, Outcome]:
    """The simplest case found from ``choices`` that still fails with ``signature``.

    ``make(draw)`` builds a case from a draw; ``run(case)`` judges it. Stops after ``budget_s``
    seconds or ``max_runs`` replays.
    """
    best = list(choices)
    draw = ReplayDraw(best)
    best_case = make(draw)
    best_marks, count_at = draw.marks, draw.count_at
    best_out = run(best_case)
    start, runs = time.monotonic(), 0

    def attempt(cand: list[int]) -> bool:
        nonlocal best, best_case, best_out, best_marks, runs
        if runs >= max_runs or time.monotonic() - start > budget_s:
            return False
        runs += 1
        draw = ReplayDraw(cand)
        try:
            case = make(draw)
        except Exception:  # noqa: BLE001 - an edit the generator cannot build
            return False
        if size(case) > size(best_case) or (size(case) == size(best_case) and cand >= best):
            return False
        out = run(case)
        if out.signature != signature:
            return False
        best, best_case, best_out, best_marks = cand, case, out, draw.marks
        return True

    improved = True
    while improved and runs < max_runs and time.monotonic() - start <= budget_s:
        improved = False
        k = len(best_marks) - 2
        while k >= 0:  # delete whole ops (the spans between the generator's marks), last first
            a, b = best_marks[k], best_marks[k + 1]
            cand = list(best)
            if count_at is not None and count_at < a and cand[count_at] > 0:
                cand[count_at] -= 1  # one op fewer to draw
            if b > a and attempt(cand[:a] + cand[b:]):
                improved = True
            k = min(k, len(best_marks) - 2) - 1
        for block in (16, 8, 4, 2, 1):  # delete blocks of choices (drops whole ops when aligned)
            i = 0
            while i < len(best):
                if attempt(best[:i] + best[i + block:]):
                    improved = True
                else:
                    i += 1
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
