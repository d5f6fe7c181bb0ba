"""The value a sharding rule returns (``Plan``) and the small helpers every rule uses."""

from __future__ import annotations

from dataclasses import dataclass

from spmd.ir.hlo import Instruction
from spmd.ir.sharding import TensorSharding

Sharding = TensorSharding
Axes = tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """Operand shardings for the local op, and the sharding of its local result."""

    operands: tuple[TensorSharding, ...]
    result: TensorSharding


class _Picker:
    """Chooses per-dim axes, each mesh axis at most once."""

    def __init__(self, used=()) -> None:
        self.used: set[str] = set(used)

    def pick(self, *cands: Axes | None) -> Axes:
        """The first non-empty candidate whose axes are all unused (and marks them used)."""
        for c in cands:
            if c and not (set(c) & self.used):
                self.used.update(c)
                return tuple(c)
        return ()


def _d(s: TensorSharding | None, i: int) -> Axes | None:
    return None if s is None else s.dims[i]


def _rep(inst: Instruction) -> TensorSharding:
    return TensorSharding.replicated(inst.shape.rank)


def _p(s: TensorSharding | None) -> tuple[str, ...]:
    return () if s is None else s.partial
