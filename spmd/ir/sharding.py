"""Device-free sharding values used inside the compiler.

``MeshShape`` is a mesh without devices: axis names and sizes. Partition ids
(device indices in collectives' ``replica_groups``) number the mesh's devices
in row-major order over the axes.

``TensorSharding`` says, per tensor dim, which mesh axes split it (major to
minor, as a JAX ``PartitionSpec`` entry), and over which axes the value is a
pending sum (``partial``, as DTensor's ``Partial``). Axes that neither split a
dim nor are partial replicate the value.

Uneven dims are split as XLA does: every shard has ``ceil(dim / n)`` rows
(the padded shard size); shard ``k`` holds global rows
``[k * size, min((k + 1) * size, dim))`` and the rest of it is padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MeshShape:
    """Axis names and sizes of a device mesh, e.g. ``MeshShape(("dp", "tp"), (2, 4))``."""

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.axis_names) != len(self.axis_sizes):
            raise ValueError(f"axis_names {self.axis_names} and axis_sizes {self.axis_sizes} differ in length")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"axis names must be unique, got {self.axis_names}")
        if any(s < 1 for s in self.axis_sizes):
            raise ValueError(f"axis sizes must be >= 1, got {self.axis_sizes}")

    @property
    def num_devices(self) -> int:
        return math.prod(self.axis_sizes)

    def size(self, axis: str) -> int:
        """Size of mesh axis ``axis``. Raises ValueError for an unknown axis."""
        try:
            return self.axis_sizes[self.axis_names.index(axis)]
        except ValueError:
            raise ValueError(f"unknown mesh axis {axis!r}; mesh axes are {self.axis_names}") from None

    def axes_size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.size(a) for a in axes)

    def coords(self, partition_id: int) -> dict[str, int]:
        """Mesh coordinate of a device, axis name -> index."""
        out: dict[str, int] = {}
        for name, size in reversed(list(zip(self.axis_names, self.axis_sizes))):
            out[name] = partition_id % size
            partition_id //= size
        return out

    def partition_id(self, coords: dict[str, int]) -> int:
        pid = 0
        for name, size in zip(self.axis_names, self.axis_sizes):
            pid = pid * size + coords[name]
        return pid

    def axis_index(self, partition_id: int, axes: tuple[str, ...]) -> int:
        """Linear index of a device along ``axes`` (major to minor)."""
        c = self.coords(partition_id)
        idx = 0
        for a in axes:
            idx = idx * self.size(a) + c[a]
        return idx

    def groups(self, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Replica groups over ``axes``: devices that differ only along ``axes``.

        Each group lists partition ids ordered by ``axis_index(pid, axes)``;
        groups are ordered by their first member.
        """
        buckets: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for pid in range(self.num_devices):
            c = self.coords(pid)
            key = tuple(c[a] for a in self.axis_names if a not in axes)
            buckets.setdefault(key, []).append((self.axis_index(pid, axes), pid))
        groups = [tuple(p for _, p in sorted(b)) for b in buckets.values()]
        return tuple(sorted(groups))

    def __str__(self) -> str:
        return "{" + ",".join(f"{n}={s}" for n, s in zip(self.axis_names, self.axis_sizes)) + "}"


@dataclass(frozen=True)
class TensorSharding:
    """Per-dim mesh axes plus pending-sum axes of one tensor value.

    ``dims[i]`` is the tuple of mesh axes that split tensor dim ``i``, major to
    minor (``()`` = not split). ``partial`` lists mesh axes over which the
    per-device values must still be summed. An axis appears at most once in
    ``dims`` and ``partial`` together.
    """

    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        used = [a for d in self.dims for a in d] + list(self.partial)
        if len(set(used)) != len(used):
            raise ValueError(f"a mesh axis is used twice in sharding {self}")

    @staticmethod
    def replicated(rank: int) -> TensorSharding:
        return TensorSharding(((),) * rank)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def is_replicated(self) -> bool:
        return not self.partial and all(not d for d in self.dims)

    def used_axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d) + self.partial

    def shard_dims(self, global_dims: tuple[int, ...], mesh: MeshShape) -> tuple[int, ...]:
        """Padded per-device shard dims of a tensor of ``global_dims``."""
        assert len(global_dims) == self.rank, (global_dims, self)
        return tuple(math.ceil(n / mesh.axes_size(axes)) for n, axes in zip(global_dims, self.dims))

    def shard_slices(
        self, global_dims: tuple[int, ...], mesh: MeshShape, partition_id: int
    ) -> tuple[tuple[int, int], ...]:
        """Per dim, the global ``[start, stop)`` rows device ``partition_id`` holds (without padding)."""
        out = []
        for n, size, axes in zip(global_dims, self.shard_dims(global_dims, mesh), self.dims):
            k = mesh.axis_index(partition_id, axes)
            start = min(k * size, n)
            out.append((start, min(start + size, n)))
        return tuple(out)

    def with_dim(self, dim: int, axes: tuple[str, ...]) -> TensorSharding:
        dims = list(self.dims)
        dims[dim] = tuple(axes)
        return TensorSharding(tuple(dims), self.partial)

    def with_partial(self, partial: tuple[str, ...]) -> TensorSharding:
        return TensorSharding(self.dims, tuple(partial))

    def __str__(self) -> str:
        dims = ", ".join("[" + ",".join(d) + "]" for d in self.dims)
        part = f" partial={{{','.join(self.partial)}}}" if self.partial else ""
        return f"<{dims}{part}>"


def shard_tensor(value, sharding: TensorSharding, mesh: MeshShape, partition_id: int):
    """The padded shard of global tensor ``value`` that device ``partition_id`` holds.

    Args:
      value: a torch.Tensor of the global shape (any dtype/device).
      sharding: its sharding; ``partial`` axes are not allowed here (a global
        value has no pending sum).
    Returns:
      A new contiguous tensor of ``sharding.shard_dims(value.shape, mesh)``;
      padding rows are zero.
    """
    import torch

    assert not sharding.partial, "cannot shard a global value as partial"
    piece = value
    for dim, (start, stop) in enumerate(sharding.shard_slices(tuple(value.shape), mesh, partition_id)):
        piece = piece.narrow(dim, start, stop - start)
    shard_dims = sharding.shard_dims(tuple(value.shape), mesh)
    if tuple(piece.shape) == shard_dims:
        return piece.clone(memory_format=torch.contiguous_format)
    out = torch.zeros(shard_dims, dtype=value.dtype, device=value.device)
    out[tuple(slice(0, s) for s in piece.shape)] = piece
    return out


def unshard_tensors(shards, sharding: TensorSharding, mesh: MeshShape, global_dims: tuple[int, ...]):
    """Reassemble a global tensor from per-device padded shards (list indexed by partition id).

    Pieces of devices that hold the same tile are replicas (taken once) unless
    they differ along a ``partial`` axis, in which case they are summed.
    Padding is dropped. Returns a tensor on the first shard's device.
    """
    import torch

    first = shards[0]
    out = torch.zeros(global_dims, dtype=first.dtype, device=first.device)
    seen: set[tuple] = set()
    for pid, shard in enumerate(shards):
        coords = mesh.coords(pid)
        key = tuple(coords[a] for d in sharding.dims for a in d) + tuple(coords[a] for a in sharding.partial)
        if key in seen:
            continue
        seen.add(key)
        slices = sharding.shard_slices(global_dims, mesh, pid)
        region = tuple(slice(a, b) for a, b in slices)
        local = shard[tuple(slice(0, b - a) for a, b in slices)].to(out.device)
        if sharding.partial:
            out[region] += local
        else:
            out[region] = local
    return out
