"""``initialize`` / ``shutdown``: join a multi-process run (the analogue of ``jax.distributed.initialize``).

Under ``torchrun`` the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``GROUP_RANK``) says everything; ``Mesh.create`` then calls ``initialize()`` itself. Elsewhere pass
``init_method``, ``rank`` and ``world_size`` as to ``torch.distributed.init_process_group``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import math
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from spmd.distributed import state as st
from spmd.distributed.errors import DistributedTimeoutError
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
        the torchrun environment. ``init_method`` is ``tcp://host:port``, ``file:///path`` or
        ``env://``; ``tcp://`` and ``file://`` need ``rank`` and ``world_size``.
    An already initialised default group is adopted as it is (its own timeout then bounds its
    collectives; ``timeout_s`` still bounds ``spmd``'s store exchanges and new sub-groups).

    Returns:
      This process's ``ProcessInfo`` (idempotent: a second call returns the first result).
    Raises:
      ValueError: ``timeout_s`` (or ``$SPMD_DISTRIBUTED_TIMEOUT_S``) not a positive finite number;
        ``world_size`` < 1 or ``rank`` outside ``0 .. world_size - 1``; a backend that is unknown or
        not available here (``"nccl"`` without CUDA); an ``init_method`` of another scheme, or a
        ``tcp://`` / ``file://`` one without ``rank`` and ``world_size``, a ``file://`` path in a
        missing directory; ``rank`` / ``world_size`` other than the launcher's ``RANK`` /
        ``WORLD_SIZE``; a second run of this process on the launcher's store (``env://``: pass a
        fresh ``init_method``); no launcher environment and no ``init_method``.
      TypeError: ``backend`` or ``init_method`` not a str, ``rank`` or ``world_size`` not an int.
      DistributedTimeoutError: some ranks did not join within ``timeout_s`` (also two processes with
        one rank, or processes that disagree on ``world_size``).
    """
    state = st.current()
    if state is not None:
        return state.info
    timeout_s = _timeout(timeout_s)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend: expected a str such as 'gloo' or 'nccl', got {type(backend).__name__}")
    _check_ranks(rank, world_size)
    if not dist.is_initialized():
        if init_method is None and not all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT")):
            raise ValueError("initialize: expected a torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, "
                             "MASTER_PORT) or init_method=..., got neither; launch with "
                             "'torchrun --nproc-per-node N script.py'")
        _check_init_method(init_method, rank, world_size)
        backend = backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        _check_backend(backend)
        _import_group_defaults()
        _join(backend, init_method, rank, world_size, timeout_s)
        # The group spmd created is destroyed at exit while the interpreter still runs (a no-op
        # after ``shutdown``; a group the caller initialised stays theirs): see ``shutdown``.
        atexit.register(_shutdown_at_exit)
    store = dist.PrefixStore("spmd", dist.distributed_c10d._get_default_store())
    info = ProcessInfo(dist.get_rank(), dist.get_world_size(), (), timeout_s, str(dist.get_backend()))
    state = _State(info, store)
    node = os.environ.get("GROUP_RANK") or socket.gethostname()
    nodes = all_gather_str(state, "init/node", node, "spmd.distributed.initialize")
    index = {n: i for i, n in enumerate(dict.fromkeys(nodes))}
    state.info = ProcessInfo(info.rank, info.world_size, tuple(index[n] for n in nodes), timeout_s, info.backend)
    st.set_state(state)
    _install_excepthook()
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
    ``DistributedTimeoutError``) the barrier is skipped; a process exiting on an uncaught
    exception (``_install_excepthook``) marks itself as left and does not wait for the others.

    ``spmd``'s own references to the groups are dropped before ``destroy_process_group``, so that
    it frees them while the interpreter runs: a gloo group stops its worker threads only when it is
    freed, and a worker thread that is still alive when the interpreter finalizes can abort the
    process (see ``_import_group_defaults``). Programs compiled for the run stay with the ``jit``
    objects that hold them, but calling them raises ValueError (``state.generation``).
    """
    state = st.current()
    st.set_state(None)
    _forget_programs()
    if state is None:
        return
    _LEAVES[0] += 1
    info = state.info
    if info.world_size > 1 and not state.failed:
        with contextlib.suppress(Exception):  # leaving never fails: a missing peer only bounds the wait
            state.store.set(f"leave/{_LEAVES[0]}/{info.rank}", "1")
            if state.uncaught:
                print(f"spmd.distributed: rank {info.rank} exits on an uncaught exception; it leaves the run "
                      f"without waiting for the other ranks", file=sys.stderr, flush=True)
            else:
                wait_keys(state, [f"leave/{_LEAVES[0]}/{r}" for r in range(info.world_size)],
                          min(LEAVE_BARRIER_S, info.timeout_s))
    state.groups.clear()
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


_ENV_RUNS = [0]  # default groups this process created on the launcher's store (env://): not reusable


def _join(backend: str, init_method: str | None, rank: int | None, world_size: int | None, timeout_s: float) -> None:
    """``init_process_group`` (the rendezvous), with its failures as spmd's errors: a rendezvous that
    did not complete within ``timeout_s`` (ranks missing, two processes with one rank, a world size
    the processes disagree on) is a ``DistributedTimeoutError``."""
    on_env = init_method is None or init_method.startswith("env://")
    if on_env and _ENV_RUNS[0]:
        raise ValueError("init_method: this process already left a run (spmd.distributed.shutdown); another run "
                         "on the launcher's store (env://) can read the connection keys the ended run left there, "
                         "got init_method=None; pass a fresh one (tcp://host:NEW_PORT or file:///NEW_FILE)")
    if on_env:
        for name, value, env in (("rank", rank, "RANK"), ("world_size", world_size, "WORLD_SIZE")):
            if value is not None and os.environ.get(env, str(value)) != str(value):
                raise ValueError(f"{name}: the launcher set {env}={os.environ[env]}, got {name}={value}; leave it "
                                 "out under torchrun")
    try:
        dist.init_process_group(backend, init_method=init_method, rank=-1 if rank is None else rank,
                                world_size=-1 if world_size is None else world_size,
                                timeout=timedelta(seconds=timeout_s))
    except dist.DistStoreError as e:
        raise DistributedTimeoutError(
            f"initialize: not every process joined within {timeout_s:g} s (rank {rank}, world_size {world_size}): "
            f"{str(e).splitlines()[0][:300]}; every process must pass the same world_size and its own rank",
            op="initialize") from e
    _ENV_RUNS[0] += on_env


def _check_ranks(rank, world_size) -> None:
    """TypeError for a ``rank`` / ``world_size`` that is not an int; ValueError for ``world_size`` < 1
    or a ``rank`` outside ``0 .. world_size - 1`` (before torch.distributed tries to rendezvous)."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1 (the number of processes), got {world_size}")
    if rank is not None and rank < 0:
        raise ValueError(f"rank: expected an int >= 0, got {rank}")
    if rank is not None and world_size is not None and rank >= world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")


#: URL schemes of ``init_method`` (torch.distributed's rendezvous handlers).
INIT_SCHEMES = ("tcp://", "file://", "env://")


def _check_init_method(init_method, rank, world_size) -> None:
    """TypeError for a non-str ``init_method``; ValueError for another scheme than ``INIT_SCHEMES``, or a
    ``tcp://`` / ``file://`` one that gives neither the argument nor the URL query's ``rank`` / ``world_size``."""
    if init_method is None:
        return
    if not isinstance(init_method, str):
        raise TypeError(f"init_method: expected a str such as 'tcp://host:port', got {type(init_method).__name__}")
    if not init_method.startswith(INIT_SCHEMES):
        raise ValueError(f"init_method: expected a URL starting with one of {list(INIT_SCHEMES)}, "
                         f"got {init_method!r}")
    if init_method.startswith("env://"):
        return
    if init_method.startswith("file://"):
        folder = os.path.dirname(init_method[len("file://"):].partition("?")[0]) or "."
        if not os.path.isdir(folder):
            raise ValueError(f"init_method: expected a file:// path in an existing directory, got {init_method!r} "
                             f"({folder!r} does not exist)")
    query = init_method.partition("?")[2]
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is None and f"{name}=" not in query:
            raise ValueError(f"{name}: init_method {init_method.split('://')[0]}:// needs rank= and world_size=, "
                             f"got {name}=None")


def _check_backend(backend: str) -> None:
    """ValueError for a backend (or, in ``"cpu:gloo,cuda:nccl"`` form, a part of it) that torch.distributed
    does not know or that is not available here: not built in, or ``"nccl"`` without CUDA."""
    usable = _usable_backends()
    devices = dist.Backend.default_device_backend_map
    for part in backend.split(","):
        device, _, name = part.strip().rpartition(":")
        name = name.lower()
        if ":" in part and device.lower() not in devices:
            raise ValueError(f"backend: expected device:backend pairs with a device of {sorted(devices)}, got "
                             f"{backend!r} ({device!r} is no such device)")
        if usable.get(name, False):
            continue
        why = ("unknown" if name not in usable else "not available here: it needs CUDA devices, and none is present"
               if name == "nccl" and dist.is_nccl_available() else "not built into this PyTorch")
        raise ValueError(f"backend: expected one of the backends available here "
                         f"{[b for b, ok in usable.items() if ok]}, got {backend!r} ({name!r} is {why})")


def _usable_backends() -> dict[str, bool]:
    """Every backend name torch.distributed knows -> whether it can run here (registered third-party ones: True)."""
    checks = {"gloo": dist.is_gloo_available, "mpi": dist.is_mpi_available, "ucc": dist.is_ucc_available,
              "nccl": lambda: dist.is_nccl_available() and torch.cuda.is_available(),
              "xccl": lambda: getattr(dist, "is_xccl_available", lambda: False)(), "undefined": lambda: False}
    return {name: checks[name]() if name in checks else True for name in dist.Backend.backend_list}


def _import_group_defaults() -> None:
    """Import, before the default group exists, the torch module whose functions take it as a default argument.

    ``torch.distributed.nn.functional`` evaluates ``group=group.WORLD`` when it is imported, and
    ``torch._dynamo`` imports it, so the first ``torch.export`` of an ``spmd.jit`` program does:
    imported after ``init_process_group``, its ten functions' defaults hold the default group, which
    ``destroy_process_group`` then cannot free. A gloo group stops its worker threads only when it is
    freed, so they stay alive until the process exits; a worker that releases a finished collective's
    tensors then takes the GIL, and doing so while the interpreter finalizes ends the thread inside a
    destructor, which aborts the process ("terminate called without an active exception", exit code
    -6). Imported first, the defaults are None.
    """
    importlib.import_module("torch.distributed.nn.functional")


_HOOKED = [False]


def _install_excepthook() -> None:
    """Wrap ``sys.excepthook`` (once per process): an uncaught exception marks the run's state, so the
    ``shutdown`` at exit writes this rank's leave key without waiting for the others (its peers,
    blocked on it or not, are not kept waiting either). The previous hook still prints the error."""
    if _HOOKED[0]:
        return
    _HOOKED[0] = True
    previous = sys.excepthook

    def hook(kind, value, tb):
        state = st.current()
        if state is not None:
            state.uncaught = True
        previous(kind, value, tb)

    sys.excepthook = hook


# At import too: a default group the caller creates after importing spmd (and adopts through
# ``initialize``) is then not held by those defaults either.
_import_group_defaults()
