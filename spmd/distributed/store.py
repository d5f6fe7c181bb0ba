"""Bounded exchanges of small values between all processes through the ``torch.distributed`` store.

Every process writes an arrival key ``<key>/<rank>``; waiting for the others is bounded by the
run's timeout, and a timeout names the ranks whose keys are missing (a store-based barrier with
arrival keys, as ``torch.distributed``'s own ``_store_based_barrier`` does).
"""

from __future__ import annotations

from datetime import timedelta

from spmd.distributed.errors import DistributedTimeoutError, fmt_ranks
from spmd.distributed.state import _State


def all_gather_str(state: _State, key: str, value: str, what: str, program: str = "",
                   timeout_s: float | None = None) -> list[str]:
    """Every rank's ``value`` for ``key``, indexed by rank.

    Args:
      state: the run's state.
      key: a key unique to this exchange (every rank passes the same).
      value: this rank's value.
      what: the operation, for errors (e.g. ``"first execution"``).
      program: the program name, for errors.
      timeout_s: the bound (default: the run's timeout).
    Raises:
      DistributedTimeoutError: some ranks did not write their key in time (named).
    """
    info = state.info
    store = state.store
    store.set(f"{key}/{info.rank}", value)
    keys = [f"{key}/{r}" for r in range(info.world_size)]
    missing = wait_keys(state, keys, timeout_s)
    if missing:
        state.failed = True  # shutdown then skips its leave barrier: a peer may be gone
        bound = info.timeout_s if timeout_s is None else timeout_s
        ranks = [r for r, k in enumerate(keys) if k in missing]
        where = f" of program {program!r}" if program else ""
        raise DistributedTimeoutError(
            f"{what}{where}: {fmt_ranks(ranks)} did not arrive within {bound:g} s "
            f"(rank {info.rank} waited; world size {info.world_size}); a process died, hangs, or runs a "
            f"different sequence of spmd calls", op=what, program=program, missing_ranks=tuple(ranks))
    return [store.get(k).decode() for k in keys]


def wait_keys(state: _State, keys: list[str], timeout_s: float | None = None) -> set[str]:
    """Wait (bounded) until every key exists; returns the keys still missing (empty on success)."""
    bound = state.info.timeout_s if timeout_s is None else timeout_s
    try:
        state.store.wait(keys, timedelta(seconds=bound))
        return set()
    except Exception:  # the store raises DistStoreError / RuntimeError on timeout
        return {k for k in keys if not state.store.check([k])}
