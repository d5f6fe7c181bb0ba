"""A mesh over every process's devices (``Mesh.create`` in a multi-process run).

Each process names its *local* devices (``"cpu:2"``: two virtual CPU devices per process,
``"cuda"``: all its GPUs, a list of its ``torch.device``s); the mesh lists all of them ordered by
(rank, local device), as ``jax.devices()`` orders by process. The processes agree on their device
counts through the store (a bounded exchange), so a mismatch is an error naming the ranks.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import torch

from spmd.distributed.errors import fmt_ranks, ranks_by_value
from spmd.distributed.state import _State
from spmd.distributed.store import all_gather_str
from spmd.ir.sharding import MeshShape


def create_global(state: _State, axes, devices):
    """The global ``Mesh`` with ``axes`` (as ``Mesh.create`` takes them) over every process's ``devices``.

    Every rank takes part in one bounded exchange of its axes, its device count and any error its
    own arguments raised, so that every rank raises (the same error, naming the ranks) when one
    rank's arguments are wrong or the ranks disagree.

    Raises:
      ValueError: processes creating meshes of different axes (names or sizes; names the ranks); a
        device of another process named in ``devices``; processes naming different numbers or kinds
        of devices (names the ranks); axis sizes that do not multiply to the world size times the
        local device count (names the world size); on every rank, any error of ``Mesh.create``'s
        arguments on some rank (this rank's own error is raised as it is, TypeError included).
    """
    from spmd.mesh import Mesh, _parse_axes, _parse_devices

    info = state.info
    world = info.world_size
    names, sizes, platform, ids, error = (), None, "", (), None
    try:
        names, sizes = _parse_axes(axes)
        needed = None if sizes is None else math.prod(sizes)
        per_process = needed // world if needed is not None and needed % world == 0 else None
        _check_local_list(devices, info.rank)
        platform, ids = _parse_devices(devices, per_process if per_process else 1)
        if platform == "cuda":
            ids = _own_gpus(devices, ids)
    except (TypeError, ValueError) as e:
        error = e
    seq = state.next_id("mesh")
    mine = {"axes": _fmt_axes(names, sizes), "devices": f"{platform}:{len(ids)}", "error": error and str(error)}
    views = [json.loads(v) for v in all_gather_str(state, f"mesh/{seq}", json.dumps(mine), "Mesh.create")]
    if error is not None:
        raise error
    failed = [r for r, v in enumerate(views) if v["error"]]
    if failed:
        raise ValueError(f"Mesh.create failed on {fmt_ranks(failed)}: {views[failed[0]]['error']}")
    for what, expected in (("axes", "the same mesh axes (names and sizes, in order)"),
                           ("devices", "the same number of local devices")):
        if len({v[what] for v in views}) != 1:
            said = "; ".join(f"{fmt_ranks(rs)} {v}" for v, rs in ranks_by_value(v[what] for v in views).items())
            raise ValueError(f"{what}: every process must name {expected}, got {said}")
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


def _fmt_axes(names: tuple[str, ...], sizes: tuple[int, ...] | None) -> str:
    """``{'dp': 2, 'tp': 2}``, or ``('x',)`` for one axis that takes every device."""
    return str(names) if sizes is None else str(dict(zip(names, sizes, strict=True)))


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


def _own_gpus(devices, ids: tuple[int, ...]) -> tuple[int, ...]:
    """This process's share of the host's GPUs for ``"cuda"`` / ``"cuda:N"`` when several processes share a host.

    torchrun's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` split the GPUs: ``"cuda"`` takes GPUs
    ``[LOCAL_RANK * k, (LOCAL_RANK + 1) * k)`` with ``k = GPUs // LOCAL_WORLD_SIZE``; ``"cuda:N"``
    takes ``N`` GPUs from ``LOCAL_RANK * N``. An explicit list is used as given. The first one becomes
    the current CUDA device (NCCL's device for this process). Raises ValueError when the host has too few.
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if isinstance(devices, str) and local_world > 1:
        present = torch.cuda.device_count()
        k = present // local_world if devices == "cuda" else len(ids)
        if k < 1 or (local_rank + 1) * k > present:
            raise ValueError(f"devices: {devices!r} for local rank {local_rank} of {local_world} processes on this "
                             f"host needs GPUs {local_rank * max(k, 1)}..{(local_rank + 1) * max(k, 1) - 1}, but "
                             f"{present} are present")
        ids = tuple(range(local_rank * k, (local_rank + 1) * k))
    torch.cuda.set_device(ids[0])
    return ids
