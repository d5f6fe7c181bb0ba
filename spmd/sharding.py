"""User-facing shardings: ``PartitionSpec`` and ``NamedSharding``.

Semantics follow JAX (``jax.sharding.PartitionSpec`` / ``NamedSharding``):
a spec has one entry per leading tensor dim, each ``None`` (not split), a
mesh axis name, or a tuple of axis names (split over their product, major to
minor). Fewer entries than dims leave the trailing dims unsplit; ``P()`` is
fully replicated. Mesh axes not named by the spec replicate the value.

In addition, ``NamedSharding.partial`` lists mesh axes over which the
per-device values are a pending sum (as DTensor's ``Partial``): the global
value is the sum over those axes of the per-device values.

Inside the compiler a sharding is a device-free ``TensorSharding``
(``spmd.ir.sharding``); ``to_tensor_sharding`` / ``from_tensor_sharding``
convert.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spmd.ir.sharding import TensorSharding
from spmd.mesh import Mesh


class PartitionSpec(tuple):
    """Per tensor dim: ``None``, a mesh axis name, or a tuple of axis names.

    ``PartitionSpec(None, "tp")`` splits dim 1 over mesh axis ``tp``;
    ``PartitionSpec(("dp", "tp"))`` splits dim 0 over both (``dp`` major).
    Entries are normalized: ``()`` becomes ``None`` and a one-name tuple
    becomes the name. A ``tuple`` subclass, so it compares equal to the tuple
    of its normalized entries. Raises TypeError for other entry types.
    """

    def __new__(cls, *entries):
        return super().__new__(cls, (_normalize_entry(e) for e in entries))

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def __reduce__(self):
        return (PartitionSpec, tuple(self))


P = PartitionSpec


def _normalize_entry(entry):
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)):
        if any(not isinstance(a, str) for a in entry):
            raise TypeError(f"PartitionSpec entry: expected None, an axis name or a tuple of names, got {entry!r}")
        if not entry:
            return None
        return entry[0] if len(entry) == 1 else tuple(entry)
    raise TypeError(f"PartitionSpec entry: expected None, an axis name or a tuple of names, got {entry!r}")


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one normalized spec entry (``None`` -> ``()``)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else entry


def check_spec(
    mesh: Mesh,
    spec: PartitionSpec,
    partial: tuple[str, ...] = (),
    *,
    shape: Sequence[int] | None = None,
    argname: str = "spec",
) -> None:
    """Check a spec (and partial axes) against ``mesh`` and, if given, an array ``shape``.

    Raises:
      ValueError naming ``argname``: an axis not in the mesh (lists the mesh
        axes), an axis used twice (in the spec and ``partial`` together), more
        spec entries than ``len(shape)`` dims.
    """
    used = [a for e in spec for a in entry_axes(e)] + list(partial)
    for axis in used:
        if axis not in mesh.shape.axis_names:
            raise ValueError(
                f"{argname}: unknown mesh axis {axis!r} in {_describe(spec, partial)}; "
                f"mesh axes are {mesh.shape.axis_names}"
            )
    for axis in used:
        if used.count(axis) > 1:
            raise ValueError(
                f"{argname}: mesh axis {axis!r} is used {used.count(axis)} times in {_describe(spec, partial)}; "
                f"expected at most once"
            )
    if shape is not None and len(spec) > len(shape):
        raise ValueError(
            f"{argname}: {spec!r} has {len(spec)} entries but the array has {len(shape)} dims "
            f"(shape {tuple(shape)}); expected at most {len(shape)} entries"
        )


def _describe(spec: PartitionSpec, partial: tuple[str, ...]) -> str:
    return f"{spec!r}" + (f" with partial={partial}" if partial else "")


@dataclass(frozen=True, eq=False)
class NamedSharding:
    """A ``PartitionSpec`` over a ``Mesh``, plus optional pending-sum axes.

    Fields:
      mesh: the device mesh.
      spec: a ``PartitionSpec`` (a plain tuple/list is converted).
      partial: mesh axes over which per-device values are a pending sum.

    The constructor checks the axes (``check_spec`` with argname ``spec``):
    ValueError for an unknown axis or one used twice; TypeError when ``mesh``
    is not a ``Mesh``. Whether the spec fits an array is checked by
    ``validate(shape, argname)``.

    Equality and hash ignore trailing ``None`` entries of the spec (as in
    JAX, ``P("tp")`` and ``P("tp", None)`` are the same layout), so a
    sharding can key caches.
    """

    mesh: Mesh
    spec: PartitionSpec = PartitionSpec()
    partial: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh: expected a spmd.Mesh, got {type(self.mesh).__name__}")
        if not isinstance(self.spec, PartitionSpec):
            if not isinstance(self.spec, (tuple, list)):
                raise TypeError(f"spec: expected a PartitionSpec, got {type(self.spec).__name__}")
            object.__setattr__(self, "spec", PartitionSpec(*self.spec))
        partial = (self.partial,) if isinstance(self.partial, str) else tuple(self.partial)
        if any(not isinstance(a, str) for a in partial):
            raise TypeError(f"partial: expected a tuple of mesh axis names, got {self.partial!r}")
        object.__setattr__(self, "partial", partial)
        check_spec(self.mesh, self.spec, self.partial, argname="spec")
        spec = tuple(self.spec)
        while spec and spec[-1] is None:
            spec = spec[:-1]
        key = (self.mesh, spec, self.partial)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash(key))

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, NamedSharding):
            return NotImplemented
        return self._hash == other._hash and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # Rebuild on unpickling: the cached hash of str fields differs between processes.
        return (NamedSharding, (self.mesh, self.spec, self.partial))

    @staticmethod
    def replicated(mesh: Mesh) -> NamedSharding:
        """The fully replicated sharding over ``mesh`` (``P()``)."""
        return NamedSharding(mesh, PartitionSpec())

    def validate(self, shape: Sequence[int], argname: str) -> None:
        """Check that this sharding fits an array of ``shape``.

        Raises ValueError naming ``argname`` for an unknown mesh axis, an axis
        used twice, or more spec entries than dims.
        """
        check_spec(self.mesh, self.spec, self.partial, shape=shape, argname=argname)

    def to_tensor_sharding(self, rank: int) -> TensorSharding:
        """The device-free ``TensorSharding`` of a rank-``rank`` array.

        Raises ValueError when the spec has more than ``rank`` entries.
        """
        if len(self.spec) > rank:
            raise ValueError(f"rank: {self.spec!r} has {len(self.spec)} entries, expected at most rank={rank}")
        dims = tuple(entry_axes(e) for e in self.spec) + ((),) * (rank - len(self.spec))
        return TensorSharding(dims, self.partial)

    @staticmethod
    def from_tensor_sharding(mesh: Mesh, ts: TensorSharding) -> NamedSharding:
        """The ``NamedSharding`` of ``ts`` over ``mesh``; trailing unsplit dims are left out of the spec.

        Raises ValueError when ``ts`` names an axis ``mesh`` lacks.
        """
        entries = [None if not d else (d[0] if len(d) == 1 else d) for d in ts.dims]
        while entries and entries[-1] is None:
            entries.pop()
        return NamedSharding(mesh, PartitionSpec(*entries), ts.partial)

    def shard_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """Padded per-device shard shape: ``ceil(n / k)`` for a dim of size n split k ways.

        Raises ValueError (argname ``global_shape``) when the spec does not fit.
        """
        self.validate(global_shape, "global_shape")
        ts = self.to_tensor_sharding(len(global_shape))
        return ts.shard_dims(tuple(global_shape), self.mesh.shape)

    def shard_index(self, global_shape: Sequence[int], partition_id: int) -> tuple[slice, ...]:
        """Per dim, the ``slice`` of the global array that device ``partition_id`` holds (no padding)."""
        ts = self.to_tensor_sharding(len(global_shape))
        return tuple(slice(a, b) for a, b in ts.shard_slices(tuple(global_shape), self.mesh.shape, partition_id))

    @property
    def is_replicated(self) -> bool:
        """True when no dim is split over an axis of size > 1 and no axis of size > 1 is partial."""
        used = [a for e in self.spec for a in entry_axes(e)] + list(self.partial)
        return all(self.mesh.shape.size(a) == 1 for a in used)

    @property
    def num_devices(self) -> int:
        """Number of devices of the mesh."""
        return self.mesh.num_devices

    def __repr__(self) -> str:
        axes = dict(zip(self.mesh.shape.axis_names, self.mesh.shape.axis_sizes, strict=True))
        part = f", partial={self.partial}" if self.partial else ""
        return f"NamedSharding(mesh={axes}, spec={self.spec!r}{part})"
