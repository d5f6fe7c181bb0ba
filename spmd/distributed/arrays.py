"""Building and gathering ``ShardedArray``s on a mesh that spans processes.

The analogues of ``jax.make_array_from_process_local_data``, ``jax.make_array_from_callback`` and
``jax.experimental.multihost_utils.process_allgather``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from spmd.array import ShardedArray
from spmd.distributed.errors import fmt_ranks
from spmd.distributed.state import current
from spmd.distributed.store import all_gather_str
from spmd.sharding import NamedSharding, PartitionSpec


def make_array_from_callback(global_shape: Sequence[int], sharding: NamedSharding,
                             data_callback: Callable[[tuple[slice, ...]], torch.Tensor]) -> ShardedArray:
    """An array of ``global_shape`` laid out as ``sharding``, each local shard from ``data_callback(index)``.

    ``index`` is, per dim, the ``slice`` of the global array the shard covers; the callback returns
    that piece (unpadded, on any device: it is moved to the shard's device). Only this process's
    partitions are asked for. Raises TypeError / ValueError as ``ShardedArray.from_shards`` does
    (a piece of the wrong shape or dtype names ``shards[k]``), and TypeError for a callback that
    does not return a tensor.
    """
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"sharding: expected a NamedSharding, got {type(sharding).__name__}")
    shape = tuple(global_shape)
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
    scaled by the number of such blocks per dim. Every process calls it (a bounded exchange checks
    that the processes agree).

    Raises:
      TypeError: ``sharding`` not a NamedSharding, ``local_data`` not a tensor.
      ValueError: a partial sharding; ``local_data`` whose shape does not fit the sharding, or
        whose global shape or dtype disagrees across ranks (names the ranks and their shapes).
    """
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"sharding: expected a NamedSharding, got {type(sharding).__name__}")
    if not isinstance(local_data, torch.Tensor):
        raise TypeError(f"local_data: expected a torch.Tensor, got {type(local_data).__name__}")
    if sharding.partial:
        raise ValueError(f"sharding: expected a sharding without partial axes, got partial={sharding.partial}")
    mesh, nd = sharding.mesh, local_data.dim()
    ts = sharding.to_tensor_sharding(nd)
    blocks = _blocks_per_dim(sharding, nd)
    shape = tuple(global_shape) if global_shape is not None else tuple(
        n * k for n, k in zip(local_data.shape, blocks, strict=True))
    _agree(local_data, shape)
    sharding.validate(shape, "sharding")
    bounds = [ts.shard_slices(shape, mesh.shape, p) for p in mesh.local_pids]
    start = tuple(min(b[d][0] for b in bounds) for d in range(nd))
    extent = tuple(max(b[d][1] for b in bounds) - start[d] for d in range(nd))
    if tuple(local_data.shape) != extent:
        raise ValueError(f"local_data: expected shape {list(extent)} (this process's block of global shape "
                         f"{list(shape)} laid out as {sharding}), got {list(local_data.shape)}")
    pieces = [local_data[tuple(slice(a - s, b - s) for (a, b), s in zip(bd, start, strict=True))]
              .to(mesh.devices[p]) for bd, p in zip(bounds, mesh.local_pids, strict=True)]
    return ShardedArray.from_shards(pieces, sharding, shape)


def process_allgather(array: ShardedArray) -> torch.Tensor:
    """The global value of ``array`` as a CPU tensor, on every process (call it on every process).

    The array is resharded to replicated on device (collectives across processes), then this
    process's first replica is copied to the host. Fully addressable arrays just return
    ``array.to_torch()``. Raises TypeError for a non-array, DeletedArrayError for a dead one.
    """
    if not isinstance(array, ShardedArray):
        raise TypeError(f"array: expected a ShardedArray, got {type(array).__name__}")
    array._check_alive("process_allgather")
    if array.is_fully_addressable:
        return array.to_torch()
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


def _agree(local_data: torch.Tensor, shape: tuple[int, ...]) -> None:
    """ValueError naming the ranks when processes' global shapes or dtypes differ."""
    state = current()
    if state is None:
        return
    seq = state.next_id("local_data")
    mine = f"{str(local_data.dtype).removeprefix('torch.')}{list(shape)} (local {list(local_data.shape)})"
    got = all_gather_str(state, f"local_data/{seq}", mine, "make_array_from_process_local_data")
    if len(set(got)) > 1:
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(got):
            groups.setdefault(v, []).append(r)
        said = "; ".join(f"{fmt_ranks(rs)} give global {v}" for v, rs in groups.items())
        raise ValueError(f"local_data: processes disagree on the global array: {said}; expected the same global "
                         "shape and dtype on every rank")
