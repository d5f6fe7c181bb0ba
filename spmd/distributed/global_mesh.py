"""A mesh over every process's devices (``Mesh.create`` in a multi-process run).

Each process names its *local* devices (``"cpu:2"``: two virtual CPU devices per process,
``"cuda"``: all its GPUs, a list of its ``torch.device``s); the mesh lists all of them ordered by
(rank, local device), as ``jax.devices()`` orders by process. The processes agree on their device
counts through the store (a bounded exchange), so a mismatch is an error naming the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from spmd.distributed.errors import fmt_ranks
from spmd.distributed.state import _State
from spmd.distributed.store import all_gather_str
from spmd.ir.sharding import MeshShape


def create_global(state: _State, names: tuple[str, ...], sizes: tuple[int, ...] | None, devices):
    """The global ``Mesh`` with axes ``names`` / ``sizes`` over every process's ``devices``.

    Raises:
      ValueError: a device of another process named in ``devices``; processes naming different
        numbers or kinds of devices (names the ranks); axis sizes that do not multiply to the world
        size times the local device count (names the world size).
    """
    from spmd.mesh import Mesh, _parse_devices

    info = state.info
    world = info.world_size
    needed = None if sizes is None else math.prod(sizes)
    per_process = needed // world if needed is not None and needed % world == 0 else None
    _check_local_list(devices, info.rank)
    platform, ids = _parse_devices(devices, per_process if per_process else 1)
    seq = state.next_id("mesh")
    views = all_gather_str(state, f"mesh/{seq}", f"{platform}:{len(ids)}", "Mesh.create")
    if len(set(views)) != 1:
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(views):
            groups.setdefault(v, []).append(r)
        said = "; ".join(f"{fmt_ranks(rs)} {v}" for v, rs in groups.items())
        raise ValueError(f"devices: every process must name the same number of local devices, got {said}")
    total = world * len(ids)
    if sizes is None:
        sizes = (total,)
    if math.prod(sizes) != total:
        axes = dict(zip(names, sizes, strict=True))
        raise ValueError(f"axes: sizes {axes} multiply to {math.prod(sizes)} devices, but the run has world size "
                         f"{world} x {len(ids)} local devices ({platform}:{len(ids)} per process) = {total}; "
                         f"launch {math.prod(sizes) // len(ids) if math.prod(sizes) % len(ids) == 0 else '?'} "
                         f"processes or change the mesh")
    procs = tuple(r for r in range(world) for _ in ids)
    return Mesh(MeshShape(names, tuple(sizes)), platform, tuple(ids) * world, procs)


def _check_local_list(devices, rank: int) -> None:
    """ValueError for a listed CUDA device this process does not have (it belongs to another process)."""
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence):
        return
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for d in devices:
        index = d if isinstance(d, int) and not isinstance(d, bool) else getattr(d, "index", None)
        kind = "cuda" if isinstance(d, int) else getattr(d, "type", None)
        if kind == "cuda" and index is not None and index >= present:
            raise ValueError(f"devices: cuda:{index} is not a device of this process (rank {rank} has {present} "
                             f"GPUs); in a multi-process run devices= names each process's local devices and the "
                             f"mesh orders them by (rank, local device)")
