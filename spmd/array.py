"""``ShardedArray``: a global array laid out over the devices of a mesh.

The analogue of ``jax.Array`` / IFRT's ``Array``: a global ``shape`` and
``dtype``, a ``NamedSharding``, and one **padded** buffer per device of the
mesh, indexed by partition id. A dim of size ``n`` split ``k`` ways has
``ceil(n / k)`` rows in every buffer; rows past the end of the global dim are
padding with unspecified contents (``device_put`` and ``from_shards`` fill
them with zeros, compiled programs may leave anything there).

With a ``partial`` sharding, the global value is the sum of the buffers over
the partial axes (``device_put`` puts the value on the first device of each
partial group and zeros on the others).

Ownership: an array owns its buffers. ``delete()`` frees them, and donating an
array to an executable (``spmd.jit(..., donate_argnums=...)``) kills it: any
later use raises ``DeletedArrayError`` saying why. Arrays are values: nothing in
``spmd`` writes into a live array's buffers except a donating call. Aliasing:

- ``shards[pid].data`` is a view of buffer ``pid``; it stays valid (and keeps the
  memory alive) after the array is deleted or donated, but a donating call may
  then overwrite it. Mutate it only while you own the array and have not
  donated it; every array sharing the buffers sees the change.
- ``from_shards`` adopts padded shards without a copy: the tensors passed in
  become the new array's buffers (the caller must not mutate them afterwards,
  and donating the array lets a call overwrite them). Unpadded shards that need
  padding are copied.
- ``device_put`` always copies; ``reshard`` to the array's own sharding returns
  the array itself, any other reshard fresh buffers; outputs of a compiled
  program never alias its undonated inputs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spmd import metrics
from spmd.compile_lock import CAPTURE_LOCK
from spmd.ir.hlo import hlo_dtype
from spmd.ir.sharding import unshard_tensors
from spmd.sharding import NamedSharding

# Transfer metrics: ``transfer.to_device`` / ``transfer.from_device`` timers (seconds per
# device_put / to_torch) with byte counters of the global values moved, and the
# ``wait_for_devices`` timer (time block_until_ready / to_torch spend waiting).
_TO_DEVICE = metrics.timer("transfer.to_device")
_TO_DEVICE_BYTES = metrics.counter("transfer.to_device.bytes")
_FROM_DEVICE = metrics.timer("transfer.from_device")
_FROM_DEVICE_BYTES = metrics.counter("transfer.from_device.bytes")
_WAIT = metrics.timer("wait_for_devices")


class DeletedArrayError(ValueError):
    """Use of a ``ShardedArray`` after ``delete()`` or after it was donated."""


@dataclass(frozen=True)
class Shard:
    """One device's piece of a ``ShardedArray``.

    Fields:
      device: the torch device holding it.
      index: per dim, the ``slice`` of the global array it covers.
      data: the unpadded piece, a **view** of the array's buffer (it aliases
        the array: mutate it only if you own the array and it is not donated;
        for a partial sharding it is the device's addend, not the global value).
      partition_id: the device's partition id in the mesh.
    """

    device: torch.device
    index: tuple[slice, ...]
    data: torch.Tensor
    partition_id: int


class ShardedArray:
    """A global array of ``shape`` and ``dtype`` split over a mesh as ``sharding``.

    Create one with ``spmd.device_put`` or ``ShardedArray.from_shards``; a
    compiled program returns them. ``_buffers[pid]`` is the padded buffer of
    partition ``pid`` (on ``sharding.mesh.devices[pid]``); ``_ready_events``
    holds per-device ``torch.cuda.Event``s (or None) recorded by the runtime
    after asynchronous dispatch.
    """

    __slots__ = ("_buffers", "_sharding", "_shape", "_dtype", "_ready_events", "_deleted_reason", "__weakref__")

    @classmethod
    def _from_buffers(cls, buffers, sharding: NamedSharding, shape, dtype: torch.dtype, ready_events=None):
        """Wrap padded per-partition ``buffers`` without any check (runtime hot path)."""
        self = object.__new__(cls)
        self._buffers = buffers
        self._sharding = sharding
        self._shape = shape if type(shape) is torch.Size else torch.Size(shape)
        self._dtype = dtype
        self._ready_events = ready_events
        self._deleted_reason = None
        return self

    # ------------------------------------------------------------ metadata

    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        return self._shape

    global_shape = shape

    @property
    def dtype(self) -> torch.dtype:
        """The element type (a torch dtype)."""
        return self._dtype

    @property
    def sharding(self) -> NamedSharding:
        """How the array is laid out over its mesh."""
        return self._sharding

    @property
    def mesh(self):
        """The mesh of ``sharding``."""
        return self._sharding.mesh

    @property
    def ndim(self) -> int:
        """Number of global dims."""
        return len(self._shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the global value (not counting replicas or padding)."""
        return math.prod(self._shape) * self._dtype.itemsize

    @property
    def addressable_devices(self) -> tuple[torch.device, ...]:
        """The devices of this process's buffers (per partition id of ``mesh.local_pids``)."""
        return self._sharding.mesh.local_devices

    @property
    def is_fully_addressable(self) -> bool:
        """Whether this process holds every shard (False on a mesh spanning several processes)."""
        return not self._sharding.mesh.is_multi_process

    @property
    def is_deleted(self) -> bool:
        """True after ``delete()`` or donation."""
        return self._deleted_reason is not None

    def _type_text(self) -> str:
        """``f32[8,32]``."""
        try:
            dt = hlo_dtype(self._dtype)
        except TypeError:
            dt = str(self._dtype)
        return f"{dt}[{','.join(map(str, self._shape))}]"

    def __repr__(self) -> str:
        dead = f", {self._deleted_reason}" if self._deleted_reason else ""
        return f"ShardedArray({self._type_text()}, {self._sharding!r}{dead})"

    # ------------------------------------------------------------ lifetime

    def _check_alive(self, what: str = "array") -> None:
        """Raise DeletedArrayError naming ``what`` if the array was deleted or donated."""
        if self._deleted_reason is not None:
            raise DeletedArrayError(
                f"{what}: the ShardedArray {self._type_text()} was {self._deleted_reason} and can no longer be "
                f"used; expected a live array"
            )

    def delete(self, reason: str = "deleted") -> None:
        """Free the buffers; any later use raises ``DeletedArrayError`` quoting ``reason``.

        The runtime passes ``reason="donated to <executable name>"`` after a
        donating call. Deleting twice is allowed (the first reason is kept).
        """
        if self._deleted_reason is None:
            self._deleted_reason = reason
            self._buffers = None
            self._ready_events = None

    def block_until_ready(self) -> ShardedArray:
        """Wait until every buffer's value is computed; returns ``self``.

        Per device: waits on the runtime's ready event where one is set, else
        synchronizes the CUDA device (nothing to wait for on CPU devices).
        Raises DeletedArrayError for a deleted or donated array.
        """
        self._check_alive("block_until_ready")
        mesh = self._sharding.mesh
        start = time.perf_counter()
        events = self._ready_events or (None,) * len(mesh.local_pids)
        for index, event in zip((mesh.device_ids[p] for p in mesh.local_pids), events, strict=True):
            if event is not None:
                event.synchronize()
            elif mesh.platform == "cuda":
                with CAPTURE_LOCK:  # not while another thread captures a CUDA graph (it would fail)
                    torch.cuda.synchronize(index)
        _WAIT.record(time.perf_counter() - start)
        return self

    # ------------------------------------------------------------ contents

    def _tensor_sharding(self):
        return self._sharding.to_tensor_sharding(len(self._shape))

    def __array__(self, dtype=None, copy=None):
        """The global value as a NumPy array (through ``to_torch``: waits for the devices)."""
        out = self.to_torch().numpy()
        return out if dtype is None else out.astype(dtype)

    def to_torch(self) -> torch.Tensor:
        """The global value as a new tensor **on the CPU** (waits for the devices first).

        Replicas are read once; partial addends are summed; padding is
        dropped. On a mesh spanning processes this works when this process's
        shards hold the whole value (e.g. a replicated array, or one split
        only over axes inside the process), as ``np.asarray`` of a fully
        replicated ``jax.Array``. Raises DeletedArrayError for a deleted or
        donated array, ValueError when other processes hold parts of the value
        (gather those with ``spmd.distributed.process_allgather``).
        """
        self._check_alive("to_torch")
        if not self.is_fully_addressable and not self._locally_complete():
            raise ValueError(_not_addressable(self, "to_torch"))
        self.block_until_ready()
        start = time.perf_counter()
        mesh = self._sharding.mesh
        if self.is_fully_addressable:
            out = unshard_tensors(self._buffers, self._tensor_sharding(), mesh.shape, tuple(self._shape))
        else:
            out = self._local_value()
        out = out.cpu() if out.device.type != "cpu" else out
        _FROM_DEVICE.record(time.perf_counter() - start)
        _FROM_DEVICE_BYTES.inc(out.nbytes)
        return out

    def _tile_key(self, pid: int) -> tuple:
        ts, coords = self._tensor_sharding(), self._sharding.mesh.shape.coords(pid)
        return tuple(coords[a] for d in ts.dims for a in d)

    def _locally_complete(self) -> bool:
        """Whether this process's shards hold every tile of a non-partial value."""
        mesh = self._sharding.mesh
        if self._tensor_sharding().partial:
            return False
        local = {self._tile_key(p) for p in mesh.local_pids}
        return local == {self._tile_key(p) for p in range(mesh.num_devices)}

    def _local_value(self) -> torch.Tensor:
        """The global value assembled from this process's shards (``_locally_complete`` holds)."""
        out = None
        for shard in self.addressable_shards:
            if out is None:
                out = torch.empty(tuple(self._shape), dtype=self._dtype, device=shard.data.device)
            out[shard.index] = shard.data
        return out

    @property
    def shards(self) -> list[Shard]:
        """Per partition id, its ``Shard`` (unpadded views aliasing the buffers).

        Raises DeletedArrayError for a deleted or donated array, ValueError for an array that is
        not fully addressable (use ``addressable_shards``).
        """
        self._check_alive("shards")
        if not self.is_fully_addressable:
            raise ValueError(_not_addressable(self, "shards") + "; array.addressable_shards lists this process's")
        return self.addressable_shards

    @property
    def addressable_shards(self) -> list[Shard]:
        """The ``Shard``s of this process's partitions (``mesh.local_pids``), in partition-id order.

        Raises DeletedArrayError for a deleted or donated array.
        """
        self._check_alive("addressable_shards")
        ts = self._tensor_sharding()
        mesh = self._sharding.mesh
        out = []
        for pid, buf in zip(mesh.local_pids, self._buffers, strict=True):
            device = mesh.devices[pid]
            bounds = ts.shard_slices(tuple(self._shape), mesh.shape, pid)
            view = buf[tuple(slice(0, b - a) for a, b in bounds)]
            out.append(Shard(device, tuple(slice(a, b) for a, b in bounds), view, pid))
        return out

    def reshard(self, sharding: NamedSharding) -> ShardedArray:
        """The value laid out as ``sharding`` (through collectives on device; see ``spmd.reshard``)."""
        from spmd.reshard import reshard

        self._check_alive("reshard")
        return reshard(self, sharding)

    # ------------------------------------------------------------ creation

    @staticmethod
    def from_shards(shards: Sequence[torch.Tensor], sharding: NamedSharding, global_shape) -> ShardedArray:
        """Assemble an array from per-partition tensors (index = partition id).

        On a mesh spanning processes, pass this process's shards only (one per partition of
        ``mesh.local_pids``, in order); see also ``spmd.distributed.make_array_from_callback``.

        Each shard is either the unpadded piece (``Shard.index`` extents) or
        the padded piece (``sharding.shard_shape(global_shape)``), on the
        mesh device of its partition, all of one dtype. Padded shards are
        taken as buffers without a copy (the array then owns them); unpadded
        ones that need padding are copied into a zero-padded buffer.

        Raises:
          TypeError: ``sharding`` not a NamedSharding, a shard not a Tensor.
          ValueError: wrong number of shards, a shard of the wrong shape,
            dtype or device, a sharding that does not fit ``global_shape``.
        """
        if not isinstance(sharding, NamedSharding):
            raise TypeError(f"sharding: expected a NamedSharding, got {type(sharding).__name__}")
        shape = _check_shape(global_shape, "global_shape")
        sharding.validate(shape, "sharding")
        mesh = sharding.mesh
        pids = mesh.local_pids
        if len(shards) != len(pids):
            raise ValueError(f"shards: expected {len(pids)} shards (one per device of {mesh!r} in this process), "
                             f"got {len(shards)}")
        ts = sharding.to_tensor_sharding(len(shape))
        padded = ts.shard_dims(tuple(shape), mesh.shape)
        dtype = shards[0].dtype if isinstance(shards[0], torch.Tensor) else None
        buffers = []
        for pid, t in zip(pids, shards, strict=True):
            device = mesh.devices[pid]
            bounds = ts.shard_slices(tuple(shape), mesh.shape, pid)
            buffers.append(_shard_buffer(t, pid, device, dtype, padded, tuple(b - a for a, b in bounds)))
        return ShardedArray._from_buffers(buffers, sharding, shape, dtype)


def _not_addressable(array: ShardedArray, what: str) -> str:
    mesh = array.mesh
    return (f"{what}: the ShardedArray {array._type_text()} spans {mesh.process_count} processes and this process "
            f"holds partitions {list(mesh.local_pids)} of {mesh.num_devices}; expected a fully addressable array "
            f"(gather it with spmd.distributed.process_allgather(array), called on every process)")


def _check_shape(shape, argname: str) -> torch.Size:
    if not isinstance(shape, (Sequence, torch.Size)) or any(
        not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape
    ):
        raise ValueError(f"{argname}: expected a sequence of non-negative ints, got {shape!r}")
    return torch.Size(shape)


def _shard_buffer(t, pid: int, device: torch.device, dtype, padded: tuple, unpadded: tuple) -> torch.Tensor:
    """Check one ``from_shards`` input and return its padded buffer."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"shards[{pid}]: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"shards[{pid}]: expected dtype {dtype} (that of shards[0]), got {t.dtype}")
    if not _same_device(t.device, device):
        raise ValueError(f"shards[{pid}]: expected a tensor on {device}, got one on {t.device}")
    got = tuple(t.shape)
    if got == padded:
        return t.contiguous()
    if got != unpadded:
        raise ValueError(f"shards[{pid}]: expected shape {list(unpadded)} (unpadded) or {list(padded)} (padded), "
                         f"got {list(got)}")
    buf = torch.zeros(padded, dtype=dtype, device=device)
    buf[tuple(slice(0, n) for n in unpadded)] = t
    return buf


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether a tensor on ``a`` sits on mesh device ``b`` (any CPU tensor is on every virtual CPU device)."""
    return a.type == b.type and (a.type == "cpu" or a.index == b.index)


def device_put(tensor: torch.Tensor, sharding: NamedSharding) -> ShardedArray:
    """Copy ``tensor`` (any device) onto the devices of ``sharding.mesh``, laid out as ``sharding``.

    Every device gets a fresh, zero-padded buffer (never a view of
    ``tensor``). With ``sharding.partial``, the first device of each partial
    group gets the value and the others zeros, so the pending sum is the
    value. A ``ShardedArray`` input is resharded instead. On a mesh spanning
    processes every process passes the same global value and keeps the shards
    of its own partitions (as ``jax.device_put`` in a multi-controller run).

    Raises:
      TypeError: ``tensor`` not a Tensor / ShardedArray, ``sharding`` not a NamedSharding.
      ValueError: ``tensor`` is a meta tensor (it has no data).
      ValueError (argname ``sharding``): unknown mesh axis, an axis used
        twice, more spec entries than ``tensor`` has dims.
    """
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"sharding: expected a NamedSharding, got {type(sharding).__name__}")
    if isinstance(tensor, ShardedArray):
        return tensor.reshard(sharding)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_meta:
        raise ValueError("tensor: a meta tensor has no data to place; expected a tensor on the CPU or a GPU "
                         "(meta tensors are fine for Jitted.lower)")
    if tensor.layout != torch.strided:
        raise TypeError(f"tensor: expected a dense (torch.strided) tensor, got layout {tensor.layout}; "
                        f"convert it with .to_dense()")
    sharding.validate(tuple(tensor.shape), "sharding")
    start = time.perf_counter()
    value = tensor.detach()
    mesh = sharding.mesh
    ts = sharding.to_tensor_sharding(value.dim())
    padded = ts.shard_dims(tuple(value.shape), mesh.shape)
    buffers = []
    for pid in mesh.local_pids:
        device = mesh.devices[pid]
        bounds = ts.shard_slices(tuple(value.shape), mesh.shape, pid)
        local = tuple(b - a for a, b in bounds)
        coords = mesh.shape.coords(pid) if ts.partial else None
        if local != padded or (coords and any(coords[a] for a in ts.partial)):
            buf = torch.zeros(padded, dtype=value.dtype, device=device)
        else:
            buf = torch.empty(padded, dtype=value.dtype, device=device)
        if not coords or not any(coords[a] for a in ts.partial):
            piece = value[tuple(slice(a, b) for a, b in bounds)]
            buf[tuple(slice(0, n) for n in local)].copy_(piece)
        buffers.append(buf)
    _TO_DEVICE.record(time.perf_counter() - start)
    _TO_DEVICE_BYTES.inc(value.nbytes)
    return ShardedArray._from_buffers(buffers, sharding, value.shape, value.dtype)
