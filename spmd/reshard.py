"""Resharding a ``ShardedArray`` on device.

``reshard(array, sharding)`` runs the identity program compiled with the
array's sharding in and ``sharding`` out. The partitioner lowers the change of
layout to collectives (all-gather, all-to-all, reduce-scatter, all-reduce,
collective-permute) and local slicing (``dynamic-slice`` with partition-id
offsets), as XLA's SPMD partitioner does for a sharding change between two
instructions (``spmd/passes/reshard.py``), so the data never goes through the
host. The program is compiled once per (source sharding, target sharding,
global shape, dtype) and kept in a process-wide cache; ``resharder`` returns it
for inspection.
"""

from __future__ import annotations

import time

import torch

from spmd import metrics
from spmd.compile_lock import COMPILE_LOCK
from spmd.sharding import NamedSharding

_CACHE: dict[tuple, object] = {}
_RESHARDS = metrics.counter("reshards")
_RESHARD_TIME = metrics.timer("reshard")


def _identity(x):
    return x


def resharder(source: NamedSharding, target: NamedSharding, shape, dtype: torch.dtype):
    """The ``Compiled`` identity program taking ``source`` layout to ``target`` for ``shape`` / ``dtype``.

    Compiled at first use, then cached. ``target`` must not be partial (a
    pending sum is only produced by computations, never by a reshard).

    Raises:
      ValueError: the shardings are on different meshes, ``target`` is
        partial, or either does not fit ``shape``.
    """
    key = (source, target, tuple(shape), dtype)
    compiled = _CACHE.get(key)
    if compiled is not None:
        return compiled
    with COMPILE_LOCK:  # single flight: a thread that waited finds the program compiled
        compiled = _CACHE.get(key)
        if compiled is None:
            compiled = _CACHE[key] = _compile(source, target, shape, dtype)
    return compiled


def _compile(source: NamedSharding, target: NamedSharding, shape, dtype: torch.dtype):
    """The identity program from ``source`` to ``target`` (see ``resharder``)."""
    from spmd.jit import jit

    if source.mesh != target.mesh:
        raise ValueError(f"sharding: expected a sharding on the array's mesh {source.mesh}, got {target.mesh}")
    if target.partial:
        raise ValueError(f"sharding: expected a sharding without partial axes, got partial={target.partial}")
    source.validate(tuple(shape), "array sharding")
    target.validate(tuple(shape), "sharding")
    example = torch.empty(tuple(shape), dtype=dtype, device="meta")
    return jit(_identity, mesh=source.mesh, in_shardings=(source,), out_shardings=target).lower(example).compile()


def reshard(array, sharding: NamedSharding):
    """A new ShardedArray with ``array``'s value laid out as ``sharding``, computed on device.

    Returns ``array`` itself when it already has ``sharding`` (arrays are
    values: no copy is needed). Otherwise the result owns fresh buffers and
    ``array`` is left unchanged. Counted by the ``reshards`` counter and the
    ``reshard`` timer of ``spmd.metrics``.

    Raises:
      TypeError: ``sharding`` is not a NamedSharding.
      DeletedArrayError: ``array`` was deleted or donated.
      ValueError: ``sharding`` is on another mesh than the array, is partial,
        or does not fit the array's shape (names the argument, expected vs got).
    """
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"sharding: expected an spmd.NamedSharding, got {type(sharding).__name__}")
    array._check_alive("reshard argument")
    if sharding.mesh != array.sharding.mesh:
        raise ValueError(f"sharding: expected a sharding on the array's mesh {array.sharding.mesh}, "
                         f"got {sharding.mesh} (resharding stays on one mesh; to move the value to another "
                         f"mesh, copy it through the host: spmd.device_put(array.to_torch(), sharding))")
    sharding.validate(tuple(array.shape), "sharding")
    if sharding == array.sharding:
        return array
    start = time.perf_counter()
    compiled = resharder(array.sharding, sharding, array.shape, array.dtype)
    out = compiled.execute_sharded([array])[0]
    _RESHARDS.inc()
    _RESHARD_TIME.record(time.perf_counter() - start)
    return out
