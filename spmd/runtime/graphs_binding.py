"""Argument bindings and output sets of the CUDA-graph runner (``spmd.runtime.graphs``).

A ``_Binding`` says how one parameter enters the graphs (the caller's own tensors, adopted, or
static buffers the call copies into); an ``_OutputSet`` is one captured graph and the liveness
of its static outputs (storage use counts), which decides when "rotate" may replay it again.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

Tensor = torch.Tensor


@dataclass(eq=False)
class _Binding:
    """How parameter ``i`` enters the graphs: the caller's own tensors, or static buffers."""

    adopted: bool
    tensors: list[Tensor]
    ptrs: tuple


class _OutputSet:
    """One captured graph and the liveness of its static outputs (tracked for "rotate")."""

    def __init__(self, captured: Any, track: bool, aliased: frozenset[int] = frozenset()) -> None:
        self.captured = captured
        self.refs: list = []
        self.baseline: list[int] = []
        if track:  # an aliased output (a donated static buffer) is shared by every set: not tracked
            from torch.multiprocessing.reductions import StorageWeakRef

            self.refs = [StorageWeakRef(t.untyped_storage()).cdata for j, per in enumerate(captured.outputs)
                         if j not in aliased for t in per]
            self.baseline = [_use_count(r) for r in self.refs]

    def free(self) -> bool:
        """No tensor or view of the static outputs is alive outside the runner."""
        return all(map(operator.le, map(_use_count, self.refs), self.baseline))


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _same(per: Sequence[Tensor], b: _Binding) -> bool:
    """Whether ``per`` still is the adopted binding: the same tensors, or the same addresses."""
    for t, u in zip(per, b.tensors):
        if t is not u:
            return _ptrs(per) == b.ptrs
    return True


def _ptrs(per: Sequence[Tensor]) -> tuple:
    return tuple((t.data_ptr(), t.stride()) for t in per)


def _staged_binding(per: Sequence[Tensor]) -> _Binding:
    bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in per]
    return _Binding(False, bufs, _ptrs(bufs))


def _ready_per_device(arg_ready: Sequence[Any] | None, n: int) -> list[list[Any]]:
    """``arg_ready[i][k]`` (entries or whole rows may be None) -> per device, its events."""
    out: list[list[Any]] = [[] for _ in range(n)]
    if arg_ready is None:
        return out
    for per in arg_ready:
        if per is None:
            continue
        for k, ev in enumerate(per):
            if ev is not None:
                out[k].append(ev)
    return out
