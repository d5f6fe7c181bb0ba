"""The "draw" interface the random-program generator is written against, and its two backends.

A generator asks a ``Draw`` for integers, choices and coin flips; ``HypothesisDraw`` answers from
``hypothesis`` (which then shrinks failing programs), ``RandomDraw`` from ``random.Random(seed)``
(no dependency beyond the standard library, for the sweep runner on machines without hypothesis).
Both keep the sequence of integers they returned (``choices``), so a program can be replayed
from that sequence alone (``ReplayDraw``) and shrunk by editing it (``tests.fuzz.shrink``), the
way hypothesis itself shrinks a choice sequence (MacIver & Donaldson, "Test-Case Reduction via
Test-Case Generation: Insights from the Hypothesis Reducer", ECOOP 2020).

Convention: the first option of every choice, the low end of every integer range and ``False``
are the "simplest" answers; shrinking moves toward them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any


class EmptyRange(ValueError):
    """``integer(lo, hi)`` with ``hi < lo`` (a generator asked for a dim of a 0-d value, say)."""


class Draw:
    """Base class: everything is derived from ``integer(lo, hi)`` (inclusive bounds)."""

    def __init__(self) -> None:
        self.choices: list[int] = []
        self.marks: list[int] = []  # choice indices where a generator unit (an op) starts
        self.count_at: int | None = None  # choice index of the number of units (see ``mark``)

    def mark(self) -> None:
        """Note that a unit the shrinker may delete as a whole starts at the next choice."""
        self.marks.append(len(self.choices))

    def _integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def integer(self, lo: int, hi: int) -> int:
        """An int in ``[lo, hi]`` (both inclusive); shrinks toward ``lo``."""
        if hi < lo:
            raise EmptyRange(f"integer: empty range [{lo}, {hi}]")
        value = lo if hi == lo else self._integer(lo, hi)
        self.choices.append(value - lo)
        return value

    def choice(self, options: Sequence[Any]) -> Any:
        """One of ``options``; shrinks toward ``options[0]``."""
        if not options:
            raise EmptyRange("choice: no options")
        return options[self.integer(0, len(options) - 1)]

    def boolean(self, p: float = 0.5) -> bool:
        """True with probability about ``p``; shrinks toward False."""
        return self.integer(0, 999) >= round(1000 * (1.0 - p))

    def subset(self, options: Sequence[Any], p: float = 0.5) -> list[Any]:
        """Each option kept with probability ``p`` (order kept)."""
        return [o for o in options if self.boolean(p)]

    def permutation(self, n: int) -> list[int]:
        """A permutation of ``range(n)`` (Fisher-Yates; all-zero draws give the identity)."""
        rest = list(range(n))
        return [rest.pop(self.integer(0, len(rest) - 1)) for _ in range(n)]


class RandomDraw(Draw):
    """Draws from ``random.Random(seed)``."""

    def __init__(self, seed: int | str) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def _integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


class ReplayDraw(Draw):
    """Replays a recorded choice sequence; values past its end (or out of range) become the simplest."""

    def __init__(self, choices: Sequence[int]) -> None:
        super().__init__()
        self.recorded = list(choices)

    def _integer(self, lo: int, hi: int) -> int:
        i = len(self.choices)
        offset = self.recorded[i] if i < len(self.recorded) else 0
        return lo + min(max(offset, 0), hi - lo)


class HypothesisDraw(Draw):
    """Draws from a hypothesis ``st.data()`` object (import of hypothesis deferred to here)."""

    def __init__(self, data) -> None:
        super().__init__()
        from hypothesis import strategies as st

        self._st = st
        self.data = data

    def _integer(self, lo: int, hi: int) -> int:
        return self.data.draw(self._st.integers(lo, hi))
