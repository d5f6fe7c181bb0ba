"""``Mesh``: devices in an n-d grid with named axes.

A mesh is a ``MeshShape`` (axis names and sizes) plus the devices, listed in
partition-id order: row-major over the axes, so device ``pid`` sits at mesh
coordinate ``mesh.shape.coords(pid)``.

Devices are local CUDA GPUs (``platform == "cuda"``) or virtual CPU devices
(``platform == "cpu"``). Virtual CPU devices are all ``torch.device("cpu")``;
they play the part of XLA's forced host device count
(``--xla_force_host_platform_device_count``) so every code path runs on a
machine without GPUs. They are told apart by ``device_ids`` (``0..N-1``).

Example::

    mesh = Mesh.create({"dp": 2, "tp": 4}, devices="cpu:8")
    mesh.shape            # MeshShape(axis_names=('dp', 'tp'), axis_sizes=(2, 4))
    repr(mesh)            # Mesh({'dp': 2, 'tp': 4}, devices=cpu:0-7)
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from spmd.ir.sharding import MeshShape

PLATFORMS = ("cpu", "cuda")
#: Most virtual CPU devices one mesh (per process) may have: each is a partition the runtime drives.
MAX_CPU_DEVICES = 4096


@dataclass(frozen=True)
class Mesh:
    """An n-d grid of devices with named axes.

    Fields:
      shape: axis names and sizes; ``shape.num_devices == len(device_ids)``.
      platform: ``"cpu"`` (virtual host devices) or ``"cuda"`` (local GPUs).
      device_ids: per partition id, the device ordinal (the CUDA index for
        ``"cuda"``; the virtual device number for ``"cpu"``) on its process.
      process_ids: empty for a mesh of this process's devices; for a mesh over
        several processes (``spmd.distributed``), per partition id the rank
        that drives it. Partitions are ordered by (rank, local device).

    Equality and hash are by (shape, platform, device_ids), so a mesh can key
    compile caches. Build meshes with ``Mesh.create``; the constructor takes the
    fields themselves (a list of ids is kept as a tuple), checks them and raises
    TypeError for a field of the wrong type (``shape`` not a ``MeshShape``, ids not
    ints) and ValueError for inconsistent ones, both pointing to ``Mesh.create``.
    """

    shape: MeshShape
    platform: str
    device_ids: tuple[int, ...]
    process_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_field_types(self)
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform: expected one of {PLATFORMS}, got {self.platform!r}")
        if len(self.device_ids) != self.shape.num_devices:
            raise ValueError(
                f"mesh {self.shape} needs {self.shape.num_devices} devices, got {len(self.device_ids)} device ids; "
                f"{_USE_CREATE}"
            )
        if self.process_ids:
            _check_processes(self)
        elif len(set(self.device_ids)) != len(self.device_ids):
            raise ValueError(f"device_ids: expected distinct devices, got {self.device_ids}")
        if any(i < 0 for i in self.device_ids):
            raise ValueError(f"device_ids: expected non-negative ordinals, got {self.device_ids}")
        object.__setattr__(self, "_hash", hash((self.shape, self.platform, self.device_ids, self.process_ids)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # Rebuild on unpickling: the cached hash of str fields differs between processes.
        return (Mesh, (self.shape, self.platform, self.device_ids, self.process_ids))

    # ----------------------------------------------------------------- create

    @staticmethod
    def create(axes: Mapping[str, int] | Sequence[str] | str, devices: str | Sequence = "cpu:4") -> Mesh:
        """Build a mesh.

        Args:
          axes: a dict axis name -> size (sizes multiply to the device count),
            a tuple of (name, size) pairs, or a tuple of axis names: one name takes all devices; several
            names need sizes (pass a dict). A bare string is one axis.
          devices: ``"cpu:N"`` (N virtual CPU devices), ``"cpu"`` (as many
            virtual CPU devices as the axes need), ``"cuda"`` (all local GPUs),
            ``"cuda:N"`` (the first N GPUs), or a list of ``torch.device`` /
            int CUDA ordinals, in partition-id order. In a multi-process run
            (under torchrun, or after ``spmd.distributed.initialize()``) this
            names each process's local devices and the mesh spans all of
            them, ordered by (rank, local device).
        Raises:
          ValueError: duplicate axis names, sizes < 1, a size product that
            differs from the device count, more devices than present (or CUDA
            devices asked for with none present), more than ``MAX_CPU_DEVICES``
            virtual CPU devices, negative CUDA ordinals, duplicate or
            mixed-platform devices, malformed device strings. In a
            multi-process run also processes that name different axes or
            device counts, raised on every rank (``spmd.distributed.global_mesh``).
          TypeError: ``axes`` or ``devices`` of the wrong type.
        """
        from spmd.distributed.init import maybe_initialize

        state = maybe_initialize()
        if state is not None and state.info.world_size > 1:
            from spmd.distributed.global_mesh import create_global

            return create_global(state, axes, devices)
        names, sizes = _parse_axes(axes)
        platform, ids = _parse_devices(devices, math.prod(sizes) if sizes is not None else None)
        if sizes is None:
            sizes = (len(ids),)
        if math.prod(sizes) != len(ids):
            raise ValueError(
                f"axes: sizes {dict(zip(names, sizes, strict=True))} multiply to {math.prod(sizes)} devices, "
                f"but devices gives {len(ids)} ({_fmt_ids(platform, ids)})"
            )
        return Mesh(MeshShape(names, sizes), platform, ids)

    @staticmethod
    def local_devices_count(platform: str) -> int:
        """Number of local devices of ``platform``.

        ``"cuda"``: ``torch.cuda.device_count()`` (0 without CUDA). ``"cpu"``:
        the number of host CPU cores; virtual CPU devices are not limited by
        it (``cpu:N`` accepts any N). Raises ValueError for another platform.
        """
        if platform == "cuda":
            return torch.cuda.device_count() if torch.cuda.is_available() else 0
        if platform == "cpu":
            return os.cpu_count() or 1
        raise ValueError(f"platform: expected one of {PLATFORMS}, got {platform!r}")

    # ------------------------------------------------------------- properties

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Mesh axis names, major to minor."""
        return self.shape.axis_names

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        """Mesh axis sizes, in ``axis_names`` order."""
        return self.shape.axis_sizes

    @property
    def kind(self) -> str:
        """Same as ``platform``."""
        return self.platform

    @property
    def num_devices(self) -> int:
        """Number of devices (product of the axis sizes)."""
        return len(self.device_ids)

    @property
    def is_multi_process(self) -> bool:
        """Whether the mesh spans several processes (some partitions are not this process's)."""
        return bool(self.process_ids)

    @property
    def process_count(self) -> int:
        """Number of processes driving the mesh (1 for a local mesh)."""
        return len(set(self.process_ids)) if self.process_ids else 1

    @cached_property
    def local_pids(self) -> tuple[int, ...]:
        """Partition ids this process drives (all of them for a local mesh), ascending."""
        if not self.process_ids:
            return tuple(range(len(self.device_ids)))
        from spmd.distributed.state import current

        state = current()
        rank = state.info.rank if state is not None else -1
        return tuple(p for p, r in enumerate(self.process_ids) if r == rank)

    @cached_property
    def local_devices(self) -> tuple[torch.device, ...]:
        """The torch devices of ``local_pids``, in order."""
        return tuple(self.devices[p] for p in self.local_pids)

    def axis_size(self, axis: str) -> int:
        """Size of mesh axis ``axis``. Raises ValueError for an unknown axis."""
        return self.shape.size(axis)

    @cached_property
    def devices(self) -> tuple[torch.device, ...]:
        """Per partition id, the torch device (all ``cpu`` for virtual CPU devices)."""
        if self.platform == "cpu":
            return (torch.device("cpu"),) * len(self.device_ids)
        return tuple(torch.device("cuda", i) for i in self.device_ids)

    def device(self, partition_id: int) -> torch.device:
        """The torch device of partition ``partition_id``.

        Raises:
          TypeError: ``partition_id`` is not an int.
          ValueError: ``partition_id`` is outside ``0 .. num_devices - 1`` (negative ids
            are not partition ids and are rejected, not counted from the end).
        """
        if not isinstance(partition_id, int) or isinstance(partition_id, bool):
            raise TypeError(f"partition_id: expected an int, got {type(partition_id).__name__} {partition_id!r}")
        n = len(self.device_ids)
        if not 0 <= partition_id < n:
            raise ValueError(f"partition_id: expected 0 <= partition_id < {n} (the mesh's devices), got {partition_id}")
        return self.devices[partition_id]

    def __repr__(self) -> str:
        axes = dict(zip(self.shape.axis_names, self.shape.axis_sizes, strict=True))
        if self.process_ids:
            per = len(self.device_ids) // self.process_count
            return (f"Mesh({axes}, devices={self.process_count} processes x "
                    f"{_fmt_ids(self.platform, self.device_ids[:per])})")
        return f"Mesh({axes}, devices={_fmt_ids(self.platform, self.device_ids)})"


# ------------------------------------------------------------------ helpers

_USE_CREATE = "build meshes with Mesh.create(axes, devices), e.g. Mesh.create(('tp',), 'cpu:2')"


def _check_field_types(mesh: Mesh) -> None:
    """TypeError for constructor fields of the wrong type; a sequence of ids becomes a tuple."""
    if not isinstance(mesh.shape, MeshShape):
        raise TypeError(f"Mesh: shape must be a spmd.ir.sharding.MeshShape, got {type(mesh.shape).__name__} "
                        f"{mesh.shape!r}; {_USE_CREATE}")
    if not isinstance(mesh.platform, str):
        raise TypeError(f"Mesh: platform must be one of {PLATFORMS}, got {type(mesh.platform).__name__} "
                        f"{mesh.platform!r}; {_USE_CREATE}")
    ids = mesh.device_ids
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or any(
            not isinstance(i, int) or isinstance(i, bool) for i in ids):
        raise TypeError(f"Mesh: device_ids must be a tuple of int device ordinals, got {type(ids).__name__} "
                        f"{ids!r}; {_USE_CREATE}")
    if not isinstance(ids, tuple):
        object.__setattr__(mesh, "device_ids", tuple(ids))


def _check_processes(mesh: Mesh) -> None:
    """ValueError unless ``process_ids`` has one rank >= 0 per partition and distinct (rank, device) pairs."""
    procs = mesh.process_ids
    if not isinstance(procs, tuple):
        object.__setattr__(mesh, "process_ids", procs := tuple(procs))
    if len(procs) != len(mesh.device_ids) or any(not isinstance(r, int) or r < 0 for r in procs):
        raise ValueError(f"process_ids: expected one non-negative rank per partition ({len(mesh.device_ids)}), "
                         f"got {procs}; {_USE_CREATE}")
    pairs = list(zip(procs, mesh.device_ids, strict=True))
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"device_ids: expected distinct (process, device) pairs, got {pairs}")


def _fmt_ids(platform: str, ids: tuple[int, ...]) -> str:
    """``cpu:0-3`` for a consecutive run, ``cuda:2`` for one, else ``cuda:[0,2,1,3]``."""
    if len(ids) == 1:
        return f"{platform}:{ids[0]}"
    if ids == tuple(range(ids[0], ids[0] + len(ids))):
        return f"{platform}:{ids[0]}-{ids[-1]}"
    return f"{platform}:[{','.join(map(str, ids))}]"


def _shorten(text: str, limit: int = 40) -> str:
    """``text``, its middle elided beyond ``limit`` characters (a device count of many digits)."""
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 2:]} ({len(text)} characters)"


def _parse_axes(axes) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    """(names, sizes or None when one unsized axis takes all devices)."""
    if isinstance(axes, str):
        axes = (axes,)
    if isinstance(axes, Mapping):
        axes = tuple(axes.items())
    if not isinstance(axes, Sequence):
        raise TypeError(f"axes: expected a dict name -> size or a tuple of names, got {type(axes).__name__}")
    pairs = all(isinstance(a, tuple) and len(a) == 2 for a in axes) and len(axes) > 0
    names = tuple(a[0] for a in axes) if pairs else tuple(axes)
    if not names:
        raise ValueError("axes: expected at least one axis, got none")
    if any(not isinstance(n, str) or not n for n in names):
        raise TypeError(f"axes: expected non-empty str axis names, got {names}")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"axes: expected unique axis names, got {names} ({dup} repeated)")
    if not pairs:
        if len(names) != 1:
            raise ValueError(
                f"axes: a tuple of names can only name one axis (it takes all devices); "
                f"got {len(names)} names {names}; pass a dict name -> size"
            )
        return names, None
    sizes = tuple(a[1] for a in axes)
    if any(not isinstance(n, int) or isinstance(n, bool) for n in sizes):
        raise TypeError(f"axes: expected int sizes, got {dict(axes)}")
    if any(n < 1 for n in sizes):
        raise ValueError(f"axes: expected sizes >= 1, got {dict(axes)}")
    return names, sizes


def _parse_devices(devices, needed: int | None) -> tuple[str, tuple[int, ...]]:
    """(platform, device ordinals) for ``Mesh.create``'s ``devices`` argument."""
    if isinstance(devices, torch.device):
        devices = str(devices)
    if isinstance(devices, str):
        return _parse_device_string(devices, needed)
    if not isinstance(devices, Sequence) or not devices:
        raise TypeError(f"devices: expected 'cpu:N', 'cuda', 'cuda:N' or a non-empty list of devices, got {devices!r}")
    negative = [d for d in devices if isinstance(d, int) and not isinstance(d, bool) and d < 0]
    if negative:
        raise ValueError(f"devices: expected non-negative CUDA ordinals, got {list(devices)} ({negative} negative)")
    items = [torch.device("cuda", d) if isinstance(d, int) and not isinstance(d, bool) else d for d in devices]
    if any(not isinstance(d, torch.device) for d in items):
        raise TypeError(f"devices: expected torch.device or int entries, got {devices!r}")
    platforms = {d.type for d in items}
    if len(platforms) != 1 or not platforms <= set(PLATFORMS):
        raise ValueError(f"devices: expected all 'cpu' or all 'cuda' devices, got platforms {sorted(platforms)}")
    platform = platforms.pop()
    if platform == "cpu":  # virtual CPU devices: ordinals in list order; explicit indices must be distinct
        given = [d.index for d in items if d.index is not None]
        if len(set(given)) != len(given):
            raise ValueError(f"devices: expected distinct devices, got {_fmt_ids('cpu', tuple(given))}")
        return "cpu", tuple(range(len(items)))
    ids = tuple(0 if d.index is None else d.index for d in items)
    if len(set(ids)) != len(ids):
        raise ValueError(f"devices: expected distinct devices, got {_fmt_ids('cuda', ids)}")
    present = Mesh.local_devices_count("cuda")
    if present == 0:
        raise ValueError(f"devices: expected CUDA ordinals of local GPUs, but no CUDA device is present; "
                         f"got {list(ids)}")
    missing = [i for i in ids if i >= present]
    if missing:
        raise ValueError(f"devices: expected CUDA ordinals < {present} (devices present), got {list(ids)}")
    return "cuda", ids


def _parse_device_string(spec: str, needed: int | None) -> tuple[str, tuple[int, ...]]:
    platform, _, count = spec.partition(":")
    if platform not in PLATFORMS:
        raise ValueError(f"devices: expected 'cpu:N', 'cpu', 'cuda' or 'cuda:N', got {spec!r}")
    if count:
        if not re.fullmatch("[0-9]+", count) or not count.strip("0"):
            raise ValueError(f"devices: expected a positive device count after '{platform}:', got {spec!r}")
        count = count.lstrip("0")  # int() of thousands of digits raises; such a count is too many anyway
        n = int(count) if len(count) <= len(str(MAX_CPU_DEVICES)) else MAX_CPU_DEVICES + 1
    elif platform == "cpu":
        n = needed if needed is not None else 1
    else:
        n = Mesh.local_devices_count("cuda")
        if n == 0:
            raise ValueError("devices: 'cuda' asks for all local GPUs, but none is present")
    shown = _shorten(count) if count else str(n)
    if platform == "cpu" and n > MAX_CPU_DEVICES:
        raise ValueError(f"devices: expected at most {MAX_CPU_DEVICES} virtual CPU devices, got {shown} "
                         f"(devices={_shorten(spec)!r})")
    if platform == "cuda":
        present = Mesh.local_devices_count("cuda")
        if present == 0:
            raise ValueError(f"devices: {_shorten(spec)!r} asks for {shown} CUDA devices, but no CUDA device is "
                             f"present")
        if n > present:
            raise ValueError(f"devices: the mesh needs {shown} CUDA devices, but {present} are present")
    return platform, tuple(range(n))
