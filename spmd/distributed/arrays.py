"""Building and gathering ``ShardedArray``s on a mesh that spans processes.

The analogues of ``jax.make_array_from_process_local_data``, ``jax.make_array_from_callback`` and
``jax.experimental.multihost_utils.process_allgather``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence

import torch

from spmd.array import ShardedArray
from spmd.distributed.errors import fmt_ranks, ranks_by_value
from spmd.distributed.state import current, require
from spmd.distributed.store import all_gather_str
from spmd.sharding import NamedSharding, PartitionSpec


def make_array_from_callback(global_shape: Sequence[int], sharding: NamedSharding,
                             data_callback: Callable[[tuple[slice, ...]], torch.Tensor]) -> ShardedArray:
    """An array of ``global_shape`` laid out as ``sharding``, each local shard from ``data_callback(index)``.

    ``index`` is, per dim, the ``slice`` of the global array the shard covers; the callback returns
    that piece (unpadded, on any device: it is moved to the shard's device). Only this process's
    partitions are asked for.

    Raises:
      TypeError: ``global_shape`` not a tuple (or list) of ints, ``sharding`` not a NamedSharding,
        ``data_callback`` not callable or returning something other than a tensor; as
        ``ShardedArray.from_shards`` does.
      ValueError: a negative dim in ``global_shape``, a sharding that does not fit it; a piece of
        the wrong shape or dtype (names ``shards[k]``).
    """
    shape = _shape_arg(global_shape, "global_shape")
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"sharding: expected a NamedSharding, got {type(sharding).__name__}")
    if not callable(data_callback):
        raise TypeError(f"data_callback: expected a callable index -> torch.Tensor, got "
                        f"{type(data_callback).__name__} {data_callback!r}")
    sharding.validate(shape, "sharding")
    mesh = sharding.mesh
    ts = sharding.to_tensor_sharding(len(shape))
    pieces = []
    for pid in mesh.local_pids:
        index = tuple(slice(a, b) for a, b in ts.shard_slices(shape, mesh.shape, pid))
        piece = data_callback(index)
        if not isinstance(piece, torch.Tensor):
            raise TypeError(f"data_callback: expected a torch.Tensor for index {index}, got {type(piece).__name__}")
        pieces.append(piece.to(mesh.devices[pid]))
    return ShardedArray.from_shards(pieces, sharding, shape)


def make_array_from_process_local_data(sharding: NamedSharding, local_data: torch.Tensor,
                                       global_shape: Sequence[int] | None = None) -> ShardedArray:
    """A global array from each process's piece of it (``jax.make_array_from_process_local_data``).

    ``local_data`` is the block of the global array that this process's partitions cover (e.g. a
    per-process batch when the batch dim is split over an axis spanning processes; the whole array
    along dims that no process-spanning axis splits). ``global_shape`` defaults to the local shape
    scaled by the number of such blocks per dim (give it for blocks of unequal size). On a mesh
    spanning processes every process calls it: a bounded exchange of each rank's global shape,
    dtype and block check makes every rank raise the same error when any rank's input is wrong.

    Raises:
      TypeError: ``sharding`` not a NamedSharding, ``local_data`` not a tensor, ``global_shape`` not
        a tuple (or list) of ints.
      ValueError: a partial sharding; a partition spec with more entries than ``local_data`` has
        dims; a ``global_shape`` with a negative dim or another number of dims than ``local_data``;
        a ``local_data`` that is not this process's block of the global array; on a multi-process
        mesh, any of these on another rank, or global shapes or dtypes that differ across ranks
        (names the ranks).
    """
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"sharding: expected a NamedSharding, got {type(sharding).__name__}")
    if not isinstance(local_data, torch.Tensor):
        raise TypeError(f"local_data: expected a torch.Tensor, got {type(local_data).__name__}")
    error, shape, bounds = None, None, []
    try:
        shape, bounds = _block_layout(sharding, local_data, global_shape)
    except ValueError as e:
        error = e
    mesh = sharding.mesh
    if mesh.is_multi_process and current() is not None:
        _agree(local_data, shape, error)
    if error is not None:
        raise error
    start = tuple(min(b[d][0] for b in bounds) for d in range(len(shape)))
    pieces = [local_data[tuple(slice(a - s, b - s) for (a, b), s in zip(bd, start, strict=True))]
              .to(mesh.devices[p]) for bd, p in zip(bounds, mesh.local_pids, strict=True)]
    return ShardedArray.from_shards(pieces, sharding, shape)


def process_allgather(array: ShardedArray) -> torch.Tensor:
    """The global value of ``array`` as a CPU tensor, on every process (call it on every process).

    The array is resharded to replicated on device (collectives across processes), then this
    process's first replica is copied to the host. Fully addressable arrays just return
    ``array.to_torch()``. Raises TypeError for a non-array, DeletedArrayError for a dead one,
    ValueError for an array of a multi-process mesh when no run is joined (after ``shutdown``).
    """
    if not isinstance(array, ShardedArray):
        raise TypeError(f"array: expected a ShardedArray, got {type(array).__name__}")
    array._check_alive("process_allgather")
    if array.is_fully_addressable:
        return array.to_torch()
    require("process_allgather")
    full = array.reshard(NamedSharding(array.mesh, PartitionSpec()))
    full.block_until_ready()
    shard = full.addressable_shards[0].data
    return shard.cpu().clone() if shard.device.type != "cpu" else shard.clone()


def _blocks_per_dim(sharding: NamedSharding, nd: int) -> tuple[int, ...]:
    """Per dim, how many distinct process blocks split it (1 when only local axes split it)."""
    mesh = sharding.mesh
    ts = sharding.to_tensor_sharding(nd)
    out = []
    for d in range(nd):
        axes = ts.dims[d] if d < len(ts.dims) else ()
        total = math.prod(mesh.shape.size(a) for a in axes)
        local = {tuple(mesh.shape.coords(p)[a] for a in axes) for p in mesh.local_pids}
        out.append(total // max(len(local), 1))
    return tuple(out)


def _shape_arg(value, what: str) -> tuple[int, ...]:
    """``value`` (a tuple, list or ``torch.Size`` of ints) as a tuple; TypeError naming ``what`` for
    another type (an int or a str included) or a non-int entry, ValueError for a negative one."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{what}: expected a tuple of ints such as (8, 4), got {type(value).__name__} {value!r}")
    if any(isinstance(d, bool) or not isinstance(d, int) for d in value):
        raise TypeError(f"{what}: expected a tuple of ints, got {tuple(value)!r}")
    if any(d < 0 for d in value):
        raise ValueError(f"{what}: expected non-negative dims, got {tuple(value)!r}")
    return tuple(value)


def _block_layout(sharding: NamedSharding, local_data: torch.Tensor, global_shape) -> tuple[tuple, list]:
    """(global shape, per local partition its per-dim global ``[start, stop)``) of ``local_data`` as this
    process's block; ValueError naming the argument that does not fit (TypeError for a mistyped
    ``global_shape``)."""
    if sharding.partial:
        raise ValueError(f"sharding: expected a sharding without partial axes, got partial={sharding.partial}")
    nd = local_data.dim()
    if len(sharding.spec) > nd:
        raise ValueError(f"local_data: expected at least {len(sharding.spec)} dims (one per entry of the partition "
                         f"spec {sharding.spec!r}), got shape {list(local_data.shape)}")
    if global_shape is None:
        shape = tuple(n * k for n, k in zip(local_data.shape, _blocks_per_dim(sharding, nd), strict=True))
    else:
        shape = _shape_arg(global_shape, "global_shape")
        if len(shape) != nd:
            raise ValueError(f"global_shape: expected {nd} dims, as local_data (shape {list(local_data.shape)}; "
                             f"partition spec {sharding.spec!r}), got {list(shape)} ({len(shape)} dims)")
    sharding.validate(shape, "sharding")
    mesh, ts = sharding.mesh, sharding.to_tensor_sharding(nd)
    bounds = [ts.shard_slices(shape, mesh.shape, p) for p in mesh.local_pids]
    start = tuple(min(b[d][0] for b in bounds) for d in range(nd))
    extent = tuple(max(b[d][1] for b in bounds) - start[d] for d in range(nd))
    if tuple(local_data.shape) != extent:
        raise ValueError(f"local_data: expected shape {list(extent)} (this process's block of global shape "
                         f"{list(shape)} laid out as {sharding}), got {list(local_data.shape)}")
    return shape, bounds


def _agree(local_data: torch.Tensor, shape: tuple[int, ...] | None, error: Exception | None) -> None:
    """Exchange every rank's global shape, dtype and block check; ValueError naming the ranks, the same
    on every rank, when any rank's check failed or the global shapes or dtypes differ."""
    state = current()
    seq = state.next_id("local_data")
    dtype = str(local_data.dtype).removeprefix("torch.")
    mine = json.dumps({"global": None if shape is None else f"{dtype}{list(shape)}",
                       "local": f"{dtype}{list(local_data.shape)}", "error": None if error is None else str(error)})
    got = [json.loads(v) for v in all_gather_str(state, f"local_data/{seq}", mine,
                                                  "make_array_from_process_local_data")]
    failed = ranks_by_value(v["error"] for v in got)
    failed.pop(None, None)
    if failed:
        said = "; ".join(f"{fmt_ranks(rs)} (local_data {got[rs[0]]['local']}): {e}" for e, rs in failed.items())
        raise ValueError(f"make_array_from_process_local_data failed on {fmt_ranks(sum(failed.values(), []))}: {said}")
    views = ranks_by_value(v["global"] for v in got)
    if len(views) > 1:
        said = "; ".join(f"{fmt_ranks(rs)} give global {v}" for v, rs in views.items())
        raise ValueError(f"local_data: processes disagree on the global array: {said}; expected the same global "
                         "shape and dtype on every rank")
