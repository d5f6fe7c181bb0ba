"""The device cache of hoisted weight values: the prologue runs once per weight version.

``spmd.passes.hoist_weights`` splits a program into a *prologue* (values computed only from
weights; its parameters are the weights it reads) and the per-call main program, which takes
the prologue's outputs as extra parameters. A ``WeightCache`` (one per compiled program) gives
every call the outputs for the weights that call passes, running the prologue again only when
they changed.

Sharing: programs whose prologues compute the same values on the same mesh share one
``SharedPrologue`` (``spmd.runtime.prologue_registry``: a ``Generator``'s prefill and decode,
Generators of one model for other batch sizes), and programs that pass it the same weight
arguments share one ``HoistedValues``: one copy of the hoisted values on the devices and one
prologue run per weight version for all of them (a prologue of weight values and constant-only
values is split in two first, ``WeightCache.constants``: the prefill's mask tables depend on its
shapes, its merged weights are the decode's). A program given other weights (another
model, replaced arrays) moves to the values of those weights, or to new values of its own;
values it held alone are re-keyed and refreshed in place instead (the tensors it captured stay
valid). Values no program holds any more are freed (the registry holds weak references).

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
tensor's ``.data``, which has a version counter of its own) are not noticed; the arrays ``spmd``
hands out never receive them. An in-place update seen by one program refreshes the shared values
for all of them: the others pass the same (updated) objects.

Memory: per weight set, the hoisted values of its latest version (per-device bytes:
``WeightCache.size_bytes``), once for every program sharing them. Merged weights are thus held
twice (the arguments and their concatenation): the price of not concatenating on every call.

CUDA graphs: with a ``GraphRunner`` the hoisted values are captured as adopted inputs (the same
tensors on every call). When any program sharing the values has set ``copy_into``, a refresh
writes the new values *into* the cached tensors (``copy_`` on each device's current stream),
so every sharer's captured graphs stay valid and nothing is captured again. Ordering of an
in-place refresh: the refreshing thread's current streams first wait for the prologue and for
the last call of *every* program reading the values (``WeightCache.note_call`` keeps each
program's last ready events; a graph replay, which returns none, gets an event recorded on
the caller's current stream), so no in-flight read of another program sees a half-written
value; each program's next call, on whatever thread, first makes its current streams wait for
the refresh's events (recorded after the copies). Without graphs the new outputs simply
replace the old ones (calls in flight keep their own references until their work is done).
Updating weights in place while a call that reads them is being issued is the caller's race,
as in PyTorch.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Sequence
from itertools import chain, repeat
from typing import Any

import torch

from spmd import metrics
from spmd.array import ShardedArray
from spmd.runtime.prologue_registry import SharedPrologue

Tensor = torch.Tensor
_VERSION = operator.attrgetter("_version")
_PTR = torch.Tensor.data_ptr
_DEREF = getattr(operator, "call", weakref.ref.__call__)  # a weak reference's referent (C-level)
_RUNS = metrics.counter("hoist.prologue_runs")
_SHARED = metrics.counter("hoist.shared_hits")
_STAMPS = itertools.count(1)  # refresh stamps, unique in the process (a program moving between values compares them)


class HoistedValues:
    """The hoisted values of one set of weight arguments (latest version), shared by programs.

    Attributes:
      values: ``[value][device]`` tensors, or None before the first run.
      ready: per local device, the event after the last refresh (None entries on CPU), or None.
      generation: the stamp of the last refresh (unique in the process; 0 before the first).
      readers: the ``WeightCache``s whose last call read these values (weak set).
    All access holds the owning ``SharedPrologue.lock``.
    """

    def __init__(self) -> None:
        self.values: list[list[Tensor]] | None = None
        self.ready: Sequence[Any] | None = None
        self.generation = 0
        self.readers: weakref.WeakSet = weakref.WeakSet()
        self._arg_refs: list[weakref.ref] = []
        self._tensor_refs: list[weakref.ref] = []
        self._versions: list[int] = []
        self._ptrs: list[int] = []  # data_ptr of each buffer: ``t.data = other`` swaps storage, not _version

    @property
    def size_bytes(self) -> int:
        """Device bytes of the values, summed over local devices (0 before the first run)."""
        return sum(t.numel() * t.element_size() for per in self.values or () for t in per)

    def same_args(self, picked: Sequence[Any]) -> bool:
        """Whether the values were last computed for these argument objects (any version)."""
        return len(picked) == len(self._arg_refs) and all(map(operator.is_, map(_DEREF, self._arg_refs), picked))

    def matches(self, picked: Sequence[Any], tensors: list[Tensor]) -> bool:
        """Whether the values are current for these arguments and buffers (C-level loops)."""
        return (self.values is not None and len(tensors) == len(self._tensor_refs)
                and all(map(operator.is_, map(_DEREF, self._arg_refs), picked))
                and all(map(operator.is_, map(_DEREF, self._tensor_refs), tensors))
                and list(map(_VERSION, tensors)) == self._versions
                and list(map(_PTR, tensors)) == self._ptrs)

    def key_on(self, picked: Sequence[Any], tensors: list[Tensor]) -> None:
        """Record ``picked`` / ``tensors`` (weakly) and their addresses and versions as the key."""
        self._arg_refs = [weakref.ref(a) for a in picked]
        self._tensor_refs = [weakref.ref(t) for t in tensors]
        self._versions = list(map(_VERSION, tensors))
        self._ptrs = list(map(_PTR, tensors))


class WeightCache:
    """The hoisted values one compiled program passes to its calls, keyed by the weights' identity and version.

    Args:
      prologue: the prologue's ``Executable`` (parameters: the weights it reads, in the order of
        ``inputs``; outputs: the hoisted values, padded shard shapes per device), or the
        ``SharedPrologue`` holding it (``spmd.runtime.prologue_registry.shared_prologue``: then
        programs with equal prologues share their values; an ``Executable`` shares nothing).
      inputs: the program's parameter numbers the prologue reads, in prologue parameter order.
      copy_into: refresh by writing into the cached tensors (needed when the main program is
        a CUDA-graph ``GraphRunner`` that captured them); else replace them. Values shared with
        a program that set it are refreshed in place for all.
    Attributes:
      runs: how many times this program ran the prologue (all programs: ``shared.runs`` and the
        ``hoist.prologue_runs`` metrics counter; a program finding values another computed for
        the same weights counts ``hoist.shared_hits``).
      last_ready: the ready events of this program's last call (``note_call``).
      constants: the ``WeightCache`` of the program's constant-only values when its prologue was
        split (``spmd.compiled``: a prefill's mask tables are its own, its merged weights shared
        with the decode), else None; ``values``, ``note_call``, ``copy_into``, ``fork`` and
        ``size_bytes`` include it, ``runs`` and ``entry`` do not.
    Thread-safe: the check and the refresh hold the shared prologue's lock.
    """

    def __init__(self, prologue: Any, inputs: Sequence[int], copy_into: bool = False) -> None:
        self.shared = prologue if isinstance(prologue, SharedPrologue) else SharedPrologue(prologue)
        self.prologue = self.shared.executable
        self.inputs = tuple(inputs)
        self.constants: WeightCache | None = None  # the cache of the constant-only values, if split off
        self._copy_into = copy_into
        self._joined: tuple = (None, None, None)  # (weight values, constant values, their concatenation)
        self.runs = 0
        self.last_ready: Sequence[Any] | None = None  # the main program's ready events (copy_into)
        self._entry: HoistedValues | None = None
        self._seen = 0  # the entry's generation this program's streams were ordered after
        self._call_events: list[Any] | None = None  # reused per-device events for replays (CUDA)
        self._cuda = any(d.type == "cuda" for d in getattr(self.prologue, "devices", ()))
        self._pick = (operator.itemgetter(*self.inputs) if len(self.inputs) > 1
                      else _single(self.inputs[0]) if self.inputs else _none)

    def fork(self) -> WeightCache:
        """A cache of the same prologue for another program (its own weights: shares values only when equal)."""
        out = WeightCache(self.shared, self.inputs, self.copy_into)
        if self.constants is not None:
            out.constants = self.constants.fork()
        return out

    @property
    def copy_into(self) -> bool:
        """Whether the program's graphs captured the values (refreshes then write into them)."""
        return self._copy_into

    @copy_into.setter
    def copy_into(self, value: bool) -> None:
        self._copy_into = value
        if self.constants is not None:
            self.constants.copy_into = value

    @property
    def entry(self) -> HoistedValues | None:
        """The ``HoistedValues`` of this program's last call (shared with the programs that passed the same weights)."""
        return self._entry

    @property
    def size_bytes(self) -> int:
        """Device bytes of the cached values this program reads, summed over local devices (0 before the first call)."""
        entry = self._entry
        own = entry.size_bytes if entry is not None else 0
        return own + (self.constants.size_bytes if self.constants is not None else 0)

    def values(self, args: Sequence[Any], buffers: Sequence[Sequence[Tensor]],
               events: Sequence[Sequence[Any]] | None) -> list[list[Tensor]]:
        """The hoisted values (``[value][device]``) for this call's weights; runs the prologue if stale.

        The weight values come first, then those of ``constants`` (the main program's order).

        Args:
          args: the call's arguments as the caller passed them (``ShardedArray``s, or tensors
            placed at every call: the key holds what the caller holds, so an array resharded
            or placed for the call still hits the cache).
          buffers: the per-device buffers bound to each parameter (``buffers[i][k]``).
          events: per parameter, per device ready events, or None.
        """
        picked = self._pick(args)
        tensors = _tensors(picked)
        with self.shared.lock:  # C-level loops: about 0.3 us per weight and device
            entry = self._entry
            if entry is None or not entry.matches(picked, tensors):
                entry = self._find(picked)
                if not entry.matches(picked, tensors):
                    self._refresh(entry, picked, tensors, buffers, events)
                elif entry.generation != self._seen:
                    _SHARED.inc()
            if entry.generation != self._seen:  # another program refreshed them: order after its copies
                self._wait(entry.ready)
                self._seen = entry.generation
            values = entry.values
        if self.constants is None:
            return values
        consts = self.constants.values(args, buffers, events)
        joined = self._joined
        if joined[0] is not values or joined[1] is not consts:  # the same list objects while unchanged
            joined = self._joined = (values, consts, values + consts)
        return joined[2]

    def note_call(self, ready: Sequence[Any]) -> None:
        """Record the ready events of this program's call (a refresh in place waits for them).

        A call that returned none (a CUDA-graph replay, ordered on the caller's current
        streams) gets events recorded on the current streams of its CUDA devices.
        """
        if self._cuda and ready and ready[0] is None:
            ready = self._call_events = _record(self.prologue.devices, self._call_events)
        self.last_ready = ready
        if self.constants is not None:
            self.constants.last_ready = ready

    def _find(self, picked: Sequence[Any]) -> HoistedValues:
        """The values to use for ``picked`` (lock held): those of the same arguments, this program's
        own re-keyed when it holds them alone, or new ones; this program becomes their reader."""
        entries = self.shared.entries
        ident = tuple(map(id, picked))
        ref = entries.get(ident)
        found = ref() if ref is not None else None
        if found is None or not found.same_args(picked):
            own = self._entry
            found = own if own is not None and set(own.readers) <= {self} else HoistedValues()
            for k in [k for k, r in entries.items() if r() is None or r() is found]:
                del entries[k]
            entries[ident] = weakref.ref(found)
        if found is not self._entry:
            if self._entry is not None:
                self._entry.readers.discard(self)
            found.readers.add(self)
            self._entry = found
        return found

    def _refresh(self, entry: HoistedValues, picked: Sequence[Any], tensors: list[Tensor],
                 buffers: Sequence[Sequence[Tensor]], events: Any) -> None:
        outs, ready = self.prologue.run([buffers[i] for i in self.inputs],
                                        [events[i] for i in self.inputs] if events is not None else None)
        self.runs += 1
        self.shared.runs += 1
        _RUNS.inc()
        # later work on the callers' streams (copies, replays, calls) follows the prologue
        self._wait(ready)
        outs = [[t if t.is_contiguous() else t.contiguous() for t in per] for per in outs]
        if entry.values is not None and any(r.copy_into for r in entry.readers):
            for reader in list(entry.readers):  # every sharer's last call has read the old values
                self._wait(reader.last_ready)
            for old, new in zip(entry.values, outs, strict=True):
                for o, n in zip(old, new, strict=True):
                    o.copy_(n)
                    if n.is_cuda:  # freed after this call: not reused before the copy has read it
                        n.record_stream(torch.cuda.current_stream(n.device))
            ready = _record(self.prologue.devices)
        else:
            entry.values = outs
        entry.ready = ready
        entry.generation = next(_STAMPS)
        self._seen = entry.generation
        entry.key_on(picked, tensors)

    def _wait(self, events: Sequence[Any] | None) -> None:
        """Make each local device's current stream wait for its event (None entries: CPU, nothing)."""
        for dev, ev in zip(self.prologue.devices, events or (), strict=False):
            if ev is not None:
                torch.cuda.current_stream(dev).wait_event(ev)


_BUFFERS = operator.attrgetter("_buffers")


def _record(devices: Sequence[torch.device], events: list[Any] | None = None) -> list[Any]:
    """Per device, an event recorded on its current stream (None for a CPU device): ``events``
    recorded again when given (no allocation per call), else new ones."""
    if events is None:
        events = [torch.cuda.Event() if dev.type == "cuda" else None for dev in devices]
    for dev, ev in zip(devices, events, strict=True):
        if ev is not None:
            ev.record(torch.cuda.current_stream(dev))
    return events


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
