"""The device cache of hoisted weight values: the prologue runs once per weight version.

``spmd.passes.hoist_weights`` splits a program into a *prologue* (values computed only from
weights) and the per-call main program, which takes the prologue's outputs as extra
parameters. A ``WeightCache`` holds the prologue's ``Executable`` and its last outputs, and
gives every call the outputs for the weights that call passes, running the prologue again
only when they changed.

Cache key (checked on every call, a few hundred ns per weight and device): for every argument
the prologue reads, the object the caller passed (a ``ShardedArray``, or a ``torch.Tensor``
placed on the mesh at every call) and each of its per-device buffer tensors (held by weak
reference: the key keeps nothing alive, and an object freed and replaced by a new one at the
same address does not match), each buffer's ``data_ptr()`` (``t.data = other`` moves the
storage) and each buffer's ``_version``, PyTorch's per-tensor counter that every in-place write
bumps (``copy_``, ``add_``, an ``out=`` kernel, a write through a view such as
``ShardedArray.shards[k].data``). So these invalidate it: a replaced argument (another
``ShardedArray``, ``ParallelModule.params[name] = ...``), an argument donated elsewhere (a
deleted array cannot be passed; one made from its buffers is another object), a buffer given
new storage, and an in-place update of a buffer. Writes PyTorch does not see (a CUDA graph
replay or NCCL writing into a tensor, writes through ``Tensor.numpy()`` or through a torch
tensor's ``.data``, which has a version counter of its own) are not noticed; the
arrays ``spmd`` hands out never receive them.

Memory: one entry per executable, the hoisted values of the latest weight version (their
per-device bytes are ``WeightCache.size_bytes``); a new version replaces it. Merged weights
are thus held twice (the arguments and their concatenation): the price of not concatenating
on every call.

CUDA graphs: with a ``GraphRunner`` the hoisted values are captured as adopted inputs (the same
tensors on every call). A refresh then writes the new values *into* the cached tensors
(``copy_`` on each device's current stream, after the prologue and after the previous call's
ready events), so the captured graphs stay valid and nothing is captured again. Without
graphs the new outputs simply replace the old ones (the previous call keeps its own
references until its work is done).
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Sequence
from itertools import chain, repeat
from typing import Any

import torch

from spmd import metrics
from spmd.array import ShardedArray

Tensor = torch.Tensor
_VERSION = operator.attrgetter("_version")
_PTR = torch.Tensor.data_ptr
_DEREF = getattr(operator, "call", weakref.ref.__call__)  # a weak reference's referent (C-level)
_RUNS = metrics.counter("hoist.prologue_runs")


class WeightCache:
    """The hoisted values of one executable, keyed by the identity and version of the weights.

    Args:
      prologue: the ``Executable`` of the prologue module (parameters: the main program's
        original parameters; outputs: the hoisted values, padded shard shapes per device).
      inputs: the parameter numbers the prologue reads (the weights of the key).
      copy_into: refresh by writing into the cached tensors (needed when the main program is
        a CUDA-graph ``GraphRunner`` that captured them); else replace them.
    Attributes:
      runs: how many times the prologue ran (also the ``hoist.prologue_runs`` metrics counter).
    Thread-safe: the check and the refresh hold a lock.
    """

    def __init__(self, prologue: Any, inputs: Sequence[int], copy_into: bool = False) -> None:
        self.prologue = prologue
        self.inputs = tuple(inputs)
        self.copy_into = copy_into
        self.runs = 0
        self._lock = threading.Lock()
        self._arg_refs: list[weakref.ref] = []
        self._tensor_refs: list[weakref.ref] = []
        self._pick = (operator.itemgetter(*self.inputs) if len(self.inputs) > 1
                      else _single(self.inputs[0]) if self.inputs else _none)
        self._versions: list[int] = []
        self._ptrs: list[int] = []  # data_ptr of each buffer: ``t.data = other`` swaps storage, not _version
        self._values: list[list[Tensor]] | None = None
        self.last_ready: Sequence[Any] | None = None  # the main program's ready events (GPU, copy_into)

    @property
    def size_bytes(self) -> int:
        """Device bytes the cached values hold, summed over local devices (0 before the first call)."""
        return sum(t.numel() * t.element_size() for per in self._values or () for t in per)

    def values(self, args: Sequence[Any], buffers: Sequence[Sequence[Tensor]],
               events: Sequence[Sequence[Any]] | None) -> list[list[Tensor]]:
        """The hoisted values (``[value][device]``) for this call's weights; runs the prologue if stale.

        Args:
          args: the call's arguments as the caller passed them (``ShardedArray``s, or tensors
            placed at every call: the key holds what the caller holds, so an array resharded
            or placed for the call still hits the cache).
          buffers: the per-device buffers bound to each parameter (``buffers[i][k]``).
          events: per parameter, per device ready events, or None.
        """
        picked = self._pick(args)
        tensors = _tensors(picked)
        with self._lock:  # C-level loops: about 0.3 us per weight and device
            if (self._values is not None and len(tensors) == len(self._tensor_refs)
                    and all(map(operator.is_, map(_DEREF, self._arg_refs), picked))
                    and all(map(operator.is_, map(_DEREF, self._tensor_refs), tensors))
                    and list(map(_VERSION, tensors)) == self._versions
                    and list(map(_PTR, tensors)) == self._ptrs):
                return self._values
            self._refresh(picked, tensors, buffers, events)
            return self._values

    def _refresh(self, picked: Sequence[Any], tensors: list[Tensor], buffers: Sequence[Sequence[Tensor]],
                 events: Any) -> None:
        outs, ready = self.prologue.run(buffers, events)
        self.runs += 1
        _RUNS.inc()
        # later work on the callers' streams (copies, replays, calls) follows the prologue
        self._wait(ready)
        outs = [[t if t.is_contiguous() else t.contiguous() for t in per] for per in outs]
        if self.copy_into and self._values is not None:
            self._wait(self.last_ready)  # the previous call has read the old values
            for old, new in zip(self._values, outs, strict=True):
                for o, n in zip(old, new, strict=True):
                    o.copy_(n)
        else:
            self._values = outs
        self._arg_refs = [weakref.ref(a) for a in picked]
        self._tensor_refs = [weakref.ref(t) for t in tensors]
        self._versions = list(map(_VERSION, tensors))
        self._ptrs = list(map(_PTR, tensors))

    def _wait(self, events: Sequence[Any] | None) -> None:
        """Make each local device's current stream wait for its event (None entries: CPU, nothing)."""
        for dev, ev in zip(self.prologue.devices, events or (), strict=False):
            if ev is not None:
                torch.cuda.current_stream(dev).wait_event(ev)


_BUFFERS = operator.attrgetter("_buffers")


def _single(i: int):
    def pick(args: Sequence[Any]) -> tuple:
        return (args[i],)

    return pick


def _none(args: Sequence[Any]) -> tuple:
    """No argument: a prologue of constant-only values runs once."""
    return ()


def _tensors(picked: Sequence[Any]) -> list[Tensor]:
    """The buffer tensors of the picked arguments (a tensor argument stands for itself)."""
    if all(map(operator.is_, map(type, picked), repeat(ShardedArray))):
        return list(chain.from_iterable(map(_BUFFERS, picked)))
    return [t for a in picked for t in (a._buffers if type(a) is ShardedArray else (a,))]
