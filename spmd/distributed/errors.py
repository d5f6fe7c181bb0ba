"""Errors of multi-process runs."""

from __future__ import annotations


class DistributedTimeoutError(TimeoutError):
    """A cross-process wait did not complete within ``spmd.distributed.initialize(timeout_s=...)``.

    The message names the operation, the program and the ranks that did not arrive.
    Attributes: ``op`` (str), ``program`` (str), ``missing_ranks`` (tuple of ints).
    """

    def __init__(self, message: str, op: str = "", program: str = "", missing_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.op, self.program, self.missing_ranks = op, program, tuple(missing_ranks)


class ProgramMismatchError(ValueError):
    """Processes compiled different programs (shapes, options or code differ) for the same call."""


def ranks_by_value(values) -> dict:
    """Each distinct value of ``values`` (one per rank, in rank order) -> the ranks that hold it, in
    order of first appearance: what an error about ranks that disagree lists."""
    groups: dict = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return groups


def fmt_ranks(ranks) -> str:
    """``ranks [0, 2]`` / ``rank 1``."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
