"""Bounded cross-process collectives: sub-groups created once, failures named.

``guarded(comm, op, ranks)`` wraps one ``torch.distributed`` call of a communicator. The process
group's timeout (``spmd.distributed.initialize(timeout_s=...)``) bounds the call; when it fails
(timeout, or a peer's connection closing because the peer died) every failing rank writes an
arrival key for the collective and waits briefly for the keys of the other participants: those
missing are the ranks that did not arrive (a store-based barrier with arrival keys, as
``torch.distributed``'s ``monitored_barrier`` reports missing ranks). The result is a
``DistributedTimeoutError`` naming the op, the program and those ranks.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from spmd.distributed.errors import DistributedTimeoutError, fmt_ranks
from spmd.distributed.store import wait_keys

#: Longest wait, in seconds, for the other participants' arrival keys after a failure.
GRACE_S = 5.0


def subgroup(state: Any, ranks: tuple[int, ...]):
    """The process group of ``ranks`` (sorted), created at first use and kept for the run.

    Only the members call ``new_group`` (``use_local_synchronization=True``); callers create
    groups in program order, the same on every rank, so creation never deadlocks.
    """
    key = tuple(sorted(ranks))
    pg = state.groups.get(key)
    if pg is None:
        if len(key) == state.info.world_size:
            pg = dist.group.WORLD
        else:
            pg = dist.new_group(list(key), timeout=state.timeout, use_local_synchronization=True)
        state.groups[key] = pg
    return pg


@contextmanager
def guarded(comm: Any, op: str, ranks: tuple[int, ...]):
    """Run the body (one cross-process call of ``comm``); turn a failure into ``DistributedTimeoutError``.

    ``comm`` has ``state``, ``program`` (name), ``comm_id`` and ``calls`` (the index of the running
    collective, equal on every rank).
    """
    try:
        yield
    except DistributedTimeoutError:
        raise
    except Exception as e:  # gloo / NCCL raise RuntimeError (DistBackendError) on timeout or a lost peer
        state = comm.state
        state.failed = True  # shutdown then skips its leave barrier: a peer may be gone
        key = f"fail/{comm.comm_id}/{comm.calls}"
        try:
            state.store.set(f"{key}/{state.info.rank}", "1")
            grace = min(GRACE_S, state.info.timeout_s / 2)
            missing = wait_keys(state, [f"{key}/{r}" for r in ranks], grace)
            gone = sorted(int(k.rsplit("/", 1)[1]) for k in missing)
            who = f"{fmt_ranks(gone)} did not arrive" if gone else f"{fmt_ranks(ranks)} failed together"
        except Exception:  # the store's host process died too: the missing ranks cannot be told
            gone, who = [], f"the store is unreachable, so which of {fmt_ranks(ranks)} failed is unknown"
        cause = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise DistributedTimeoutError(
            f"{op} (collective #{comm.calls}) of program {comm.program!r}: {who} (bound {state.info.timeout_s:g} s; "
            f"rank {state.info.rank} waited, participants {list(ranks)}; cause: {cause})",
            op=op, program=comm.program, missing_ranks=tuple(gone)) from e
