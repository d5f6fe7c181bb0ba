"""Resharding a ``ShardedArray`` on device.

``reshard(array, sharding)`` compiles (once per source/target sharding, shape
and dtype) the identity program with the array's sharding in and ``sharding``
out. The partitioner lowers the change of sharding to collectives (all-gather,
all-to-all, reduce-scatter, all-reduce) and local slicing, so the data never
goes through the host.
"""

from __future__ import annotations

from spmd import metrics
from spmd.sharding import NamedSharding

_RESHARDERS: dict = {}


def _identity(x):
    return x


def reshard(array, sharding: NamedSharding):
    """A new ShardedArray with ``array``'s value laid out as ``sharding``.

    Raises:
      TypeError: ``sharding`` is not a NamedSharding.
      ValueError: ``sharding`` is on another mesh than the array, or does not
        fit its shape (names the argument, expected vs got).
    """
    from spmd.jit import jit

    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"sharding must be an spmd.NamedSharding, got {type(sharding).__name__}")
    array._check_alive("reshard argument")
    if sharding.mesh != array.sharding.mesh:
        raise ValueError(f"sharding: expected a sharding on the array's mesh {array.sharding.mesh}, got {sharding.mesh}")
    sharding.validate(tuple(array.shape), "sharding")
    metrics.counter("reshards").inc()
    if sharding == array.sharding:
        return array
    fn = _RESHARDERS.get(sharding)
    if fn is None:
        fn = _RESHARDERS[sharding] = jit(_identity, mesh=sharding.mesh, out_shardings=sharding)
    return fn(array)
