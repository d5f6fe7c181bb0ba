"""``initialize`` / ``shutdown``: join a multi-process run (the analogue of ``jax.distributed.initialize``).

Under ``torchrun`` the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``GROUP_RANK``) says everything; ``Mesh.create`` then calls ``initialize()`` itself. Elsewhere pass
``init_method``, ``rank`` and ``world_size`` as to ``torch.distributed.init_process_group``.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from spmd.distributed import state as st
from spmd.distributed.state import ProcessInfo, _State
from spmd.distributed.store import all_gather_str, wait_keys

TIMEOUT_ENV = "SPMD_DISTRIBUTED_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


def initialize(backend: str | None = None, timeout_s: float | None = None, *, init_method: str | None = None,
               rank: int | None = None, world_size: int | None = None) -> ProcessInfo:
    """Join the run: initialise ``torch.distributed`` (or adopt an initialised default group).

    Args:
      backend: ``torch.distributed`` backend; default ``"gloo"`` without CUDA, else
        ``"cpu:gloo,cuda:nccl"`` (CPU meshes use gloo, GPU meshes NCCL).
      timeout_s: bound in seconds of every cross-process wait (process-group collectives, store
        exchanges, the program fingerprint check); default ``$SPMD_DISTRIBUTED_TIMEOUT_S`` or 300.
      init_method, rank, world_size: as for ``torch.distributed.init_process_group``; default from
        the torchrun environment.
    An already initialised default group is adopted as it is (its own timeout then bounds its
    collectives; ``timeout_s`` still bounds ``spmd``'s store exchanges and new sub-groups).

    Returns:
      This process's ``ProcessInfo`` (idempotent: a second call returns the first result).
    Raises:
      ValueError: ``timeout_s`` (or ``$SPMD_DISTRIBUTED_TIMEOUT_S``) not a positive finite number,
        or no launcher environment and no ``init_method``.
      TypeError: ``backend`` not a str.
      DistributedTimeoutError: some ranks did not join within ``timeout_s``.
    """
    state = st.current()
    if state is not None:
        return state.info
    timeout_s = _timeout(timeout_s)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend: expected a str such as 'gloo' or 'nccl', got {type(backend).__name__}")
    if not dist.is_initialized():
        if init_method is None and not all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT")):
            raise ValueError("initialize: expected a torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, "
                             "MASTER_PORT) or init_method=..., got neither; launch with "
                             "'torchrun --nproc-per-node N script.py'")
        backend = backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, init_method=init_method, rank=-1 if rank is None else rank,
                                world_size=-1 if world_size is None else world_size,
                                timeout=timedelta(seconds=timeout_s))
        # A process that exits with the group alive can abort in gloo's threads during interpreter
        # teardown ("terminate called without an active exception", pytorch/pytorch#190489): the
        # group spmd created is destroyed at exit while the interpreter still runs (a no-op after
        # ``shutdown``; a group the caller initialised stays theirs).
        atexit.register(_shutdown_at_exit)
    store = dist.PrefixStore("spmd", dist.distributed_c10d._get_default_store())
    info = ProcessInfo(dist.get_rank(), dist.get_world_size(), (), timeout_s, str(dist.get_backend()))
    state = _State(info, store)
    node = os.environ.get("GROUP_RANK") or socket.gethostname()
    nodes = all_gather_str(state, "init/node", node, "spmd.distributed.initialize")
    index = {n: i for i, n in enumerate(dict.fromkeys(nodes))}
    state.info = ProcessInfo(info.rank, info.world_size, tuple(index[n] for n in nodes), timeout_s, info.backend)
    st.set_state(state)
    return state.info


def maybe_initialize() -> _State | None:
    """Initialise when launched by torchrun (or when ``torch.distributed`` is initialised with
    several processes); returns the state, or None for a single-process run."""
    state = st.current()
    if state is not None:
        return state
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            initialize()
        return st.current()
    if "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        initialize()
    return st.current()


#: Bound in seconds of the barrier before the groups are destroyed (a dead peer delays exit by this much).
LEAVE_BARRIER_S = 30.0
_LEAVES = [0]  # shutdowns so far in this process: keys of a later run on the same store stay distinct


def shutdown() -> None:
    """Leave the run: wait (bounded) until every rank leaves, then destroy the process groups
    ``spmd`` created and the default group.

    The barrier keeps a rank from destroying its groups while a peer still receives that rank's
    last collective (a destroyed gloo pair can reset the peer's connection, and ranks that call
    ``destroy_process_group`` at different times can hang, pytorch/pytorch#75097). It is a store
    barrier bounded by ``LEAVE_BARRIER_S``: a peer that died or hangs delays this rank's exit by
    at most that long and raises nothing. After a cross-process wait of the run failed (a
    ``DistributedTimeoutError``) the barrier is skipped.
    """
    state = st.current()
    st.set_state(None)
    _forget_programs()
    if state is None:
        return
    _LEAVES[0] += 1
    if state.info.world_size > 1 and not state.failed:
        with contextlib.suppress(Exception):  # leaving never fails: a missing peer only bounds the wait
            state.store.set(f"leave/{_LEAVES[0]}/{state.info.rank}", "1")
            wait_keys(state, [f"leave/{_LEAVES[0]}/{r}" for r in range(state.info.world_size)],
                      min(LEAVE_BARRIER_S, state.info.timeout_s))
    if dist.is_initialized():
        dist.destroy_process_group()


def _shutdown_at_exit() -> None:
    """``shutdown`` at interpreter exit when the run is still joined; never raises (the process is
    ending: a group that cannot be destroyed cleanly is left to the operating system)."""
    if st.current() is None:
        return
    with contextlib.suppress(Exception):  # best-effort cleanup at exit
        shutdown()


def _forget_programs() -> None:
    """Drop cached programs of multi-process meshes: their communicators belong to the run that ended."""
    for name, attr in (("spmd.jit", "_GLOBAL_CACHE"), ("spmd.reshard", "_CACHE")):
        module = sys.modules.get(name)
        cache = getattr(module, attr, None) or {}
        for key, compiled in list(cache.items()):
            if compiled.mesh.is_multi_process:
                del cache[key]


def _timeout(timeout_s) -> float:
    """``timeout_s``, else ``$SPMD_DISTRIBUTED_TIMEOUT_S``, else the default; a bad value is a
    ValueError naming the argument or the environment variable it came from."""
    name, shown = "timeout_s", timeout_s
    if timeout_s is None:
        name, shown = TIMEOUT_ENV, os.environ.get(TIMEOUT_ENV, "")
        try:
            timeout_s = float(shown) if shown else DEFAULT_TIMEOUT_S
        except ValueError:
            timeout_s = None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"{name}: expected a positive finite number of seconds, got {shown!r}")
    return float(timeout_s)
