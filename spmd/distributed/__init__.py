"""Multi-process runs: ``spmd.jit`` under torchrun on one global mesh (multi-controller, like ``jax.distributed``).

Every process runs the same script; ``Mesh.create`` spans every process's devices (ordered by
(rank, local device)); each process holds the shards of its own partitions and runs the same
compiled program on them, with collectives across processes through ``torch.distributed``::

    # torchrun --nproc-per-node 2 script.py
    import spmd
    from spmd import Mesh, PartitionSpec as P

    spmd.distributed.initialize(timeout_s=60)        # optional under torchrun
    mesh = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:2")   # 2 processes x 2 devices
    x = spmd.distributed.make_array_from_process_local_data(NamedSharding(mesh, P("dp")), local_batch)
    y = spmd.jit(f, mesh=mesh, ...)(x, w)
    full = spmd.distributed.process_allgather(y)     # y.to_torch() would raise: not fully addressable
"""

from spmd.distributed.arrays import make_array_from_callback, make_array_from_process_local_data, process_allgather
from spmd.distributed.errors import DistributedTimeoutError, ProgramMismatchError
from spmd.distributed.init import initialize, shutdown
from spmd.distributed.state import ProcessInfo, current


def is_initialized() -> bool:
    """Whether this process is part of an initialised multi-process run."""
    return current() is not None


def process_index() -> int:
    """This process's rank (0 when not in a multi-process run)."""
    state = current()
    return 0 if state is None else state.info.rank


def process_count() -> int:
    """Number of processes of the run (1 when not in a multi-process run)."""
    state = current()
    return 1 if state is None else state.info.world_size


__all__ = [
    "DistributedTimeoutError",
    "ProcessInfo",
    "ProgramMismatchError",
    "initialize",
    "is_initialized",
    "make_array_from_callback",
    "make_array_from_process_local_data",
    "process_allgather",
    "process_count",
    "process_index",
    "shutdown",
]
