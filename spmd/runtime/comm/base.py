"""The communicator interface of the runtime.

A communicator executes a ``CollectiveSpec`` (``spmd.runtime.thunks``) over the devices the
executable drives: all of the mesh in one process (virtual CPU devices, local CUDA GPUs), or
one device per process (``torch.distributed``). Semantics are XLA's
(https://openxla.org/xla/operation_semantics): replica groups list partition ids; the
device at position ``i`` of a group owns chunk ``i`` of a scatter / gather; a
collective-permute target that no pair names receives zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from spmd.runtime.thunks import CollectiveSpec

Tensor = torch.Tensor

REDUCE_OPS = ("add", "maximum", "minimum", "multiply")


class Communicator(Protocol):
    """Runs collectives over the executable's local devices.

    ``pids[k]`` is the partition id of local device ``k``; ``inputs[k]`` its operand.
    """

    pids: tuple[int, ...]

    def run(self, spec: CollectiveSpec, inputs: Sequence[Tensor], stream_id: int, envs: Sequence[Any]) -> list[Tensor]:
        """Run ``spec``; return one fresh result tensor per local device (never aliases)."""
        ...


def reduce_stack(values: Sequence[Tensor], op: str) -> Tensor:
    """Elementwise reduction of equal-shape tensors in list order (same device), in their dtype.

    Raises:
      ValueError: ``op`` is not one of ``REDUCE_OPS``.
    """
    stacked = torch.stack(list(values))
    if op == "add":
        r = stacked.sum(0)
    elif op == "maximum":
        r = stacked.amax(0)
    elif op == "minimum":
        r = stacked.amin(0)
    elif op == "multiply":
        r = stacked.prod(0)
    else:
        raise ValueError(f"reduce op: expected one of {REDUCE_OPS}, got {op!r}")
    return r.to(values[0].dtype)


def chunk_index(dims: tuple[int, ...], dim: int, parts: int, k: int) -> tuple[int, int]:
    """(start, length) of chunk ``k`` of ``parts`` equal chunks along ``dim``.

    Raises:
      ValueError: ``dims[dim]`` is not divisible by ``parts``.
    """
    if dims[dim] % parts:
        raise ValueError(f"dim {dim} of size {dims[dim]} is not divisible into {parts} equal chunks")
    size = dims[dim] // parts
    return k * size, size
