"""Process-wide state of a multi-process run: rank, world size, hosts, store and timeout.

Set by ``spmd.distributed.initialize`` (explicitly, or automatically the first time a mesh is
built under ``torchrun``), cleared by ``spmd.distributed.shutdown``. Every cross-process wait of
``spmd`` is bounded by ``timeout_s`` (the process group's timeout and the store's).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any


@dataclass(frozen=True)
class ProcessInfo:
    """This process's place in the run.

    Fields:
      rank: this process's rank in the default ``torch.distributed`` group.
      world_size: number of processes.
      node_of_rank: per rank, the index of its host (node); ranks of one host share it.
      timeout_s: bound of every cross-process wait, in seconds.
      backend: the default process group's backend string (``"gloo"``, ``"nccl"``, ...).
    """

    rank: int
    world_size: int
    node_of_rank: tuple[int, ...]
    timeout_s: float
    backend: str

    @property
    def num_nodes(self) -> int:
        """Number of distinct hosts."""
        return len(set(self.node_of_rank))


@dataclass
class _State:
    info: ProcessInfo
    store: Any  # a torch.distributed Store (prefixed "spmd/")
    groups: dict = field(default_factory=dict)  # sorted rank tuple -> process group, created once
    counters: dict = field(default_factory=lambda: {})
    failed: bool = False  # a cross-process wait of this run timed out or lost a peer
    uncaught: bool = False  # the process is exiting on an uncaught exception (shutdown does not wait for peers)

    def next_id(self, kind: str) -> int:
        """A per-process sequence number of ``kind`` (equal on every rank that runs the same program)."""
        it = self.counters.setdefault(kind, itertools.count())
        return next(it)

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.info.timeout_s)


_STATE: _State | None = None
_GENERATION = 0


def current() -> _State | None:
    """The state, or None when no multi-process run is initialised."""
    return _STATE


def set_state(state: _State | None) -> None:
    global _STATE, _GENERATION
    _STATE = state
    _GENERATION += 1


def generation() -> int:
    """A number that changes whenever this process joins or leaves a run.

    Programs compiled for a multi-process mesh hold the run's communicators: they are valid only
    while the generation they were compiled in lasts (``spmd.jit`` objects recompile when it
    changed, ``Compiled`` programs raise ValueError).
    """
    return _GENERATION


def require(what: str) -> _State:
    """The state; raises ValueError naming ``what`` when ``spmd.distributed`` is not initialised."""
    if _STATE is None:
        raise ValueError(f"{what}: needs a multi-process run; call spmd.distributed.initialize() first "
                         "(or launch with torchrun)")
    return _STATE


def run_ended(what: str) -> None:
    """Raise ValueError naming ``what``, a program compiled in a run that has ended: the message of
    ``require`` when no run is joined now, else one that asks to compile it again."""
    require(what)
    raise ValueError(f"{what}: compiled for a multi-process run that has ended (spmd.distributed.shutdown); "
                     f"compile it again in this run (an spmd.jit function does so when called)")
