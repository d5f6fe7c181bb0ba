"""Process-wide registry of weight prologues: programs whose prologues are equal share one.

``spmd.passes.hoist_weights`` gives each compiled program a *prologue* that computes the
hoisted values (merged Q/K/V and gate/up weights, casts, transposes) from the weights it reads,
and only from those (its parameters are the weights it reads, renumbered from 0). Two programs
of one model -- a ``Generator``'s prefill and decode, Generators of other batch sizes -- thus
get prologues that compute the same values from the same weights, and differ only in names
and source locations. ``shared_prologue`` maps each prologue to one ``SharedPrologue`` per
*computation and mesh*: its key is the prologue's text with every instruction and computation
renamed by position and the source locations dropped (``prologue_key``), together with the
``Mesh`` (shape, platform, device ids, process ids: on other devices, or with other shardings,
which the text holds, nothing is shared). Memoisation of equal computations, as XLA's
compilation cache keys executables by the module's fingerprint.

A ``SharedPrologue`` holds the prologue's ``Executable`` (one, with its arena, for every
program) and, per set of weight arguments, the device values of the latest version
(``spmd.runtime.weight_cache.HoistedValues``: one copy of the hoisted values and one prologue
run per weight version for every program that passes those weights). The registry holds
neither strongly (weak references): a ``SharedPrologue`` lives as long as some
``WeightCache`` (held by a ``Compiled``) holds it, and each weight set's values as long as a
``WeightCache`` last given those weights holds them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from spmd.ir.builder import clone_module
from spmd.ir.hlo import Module
from spmd.ir.text import print_module

_PROLOGUES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # prologue_key -> SharedPrologue
_LOCK = threading.Lock()


class SharedPrologue:
    """One prologue computation on one mesh: its executable and the hoisted values per weight set.

    Attributes:
      executable: the prologue's ``spmd.runtime.executor.Executable`` (parameters: the weights it
        reads, in the order of ``WeightCache.inputs``; outputs: the hoisted values, per device).
      key: the registry key (``prologue_key``), or None for a prologue not in the registry.
      lock: guards ``entries`` and every ``HoistedValues`` of this prologue (checks and refreshes).
      entries: per tuple of weight-argument ids, a weak reference to their ``HoistedValues``
        (the ids only index: an entry matches after its weak references name the same objects).
      runs: how many times the prologue ran, for all programs together.
    """

    def __init__(self, executable: Any, key: tuple | None = None) -> None:
        self.executable = executable
        self.key = key
        self.lock = threading.Lock()
        self.entries: dict[tuple[int, ...], weakref.ref] = {}
        self.runs = 0

    @property
    def size_bytes(self) -> int:
        """Device bytes held by the hoisted values of every live weight set (summed over local devices)."""
        with self.lock:
            live = [ref() for ref in self.entries.values()]
        return sum(e.size_bytes for e in live if e is not None)


def prologue_key(module: Module, mesh: Any) -> tuple:
    """``(canonical text, mesh)``: equal for prologues computing the same values on the same devices.

    The text is ``print_module`` of a copy of ``module`` whose module is named ``prologue``, whose
    computations and instructions are named by position (``c0``, ``v0``, ...; the entry ``main``)
    and whose source locations are dropped; shapes, opcodes, attributes, literals, shardings,
    stream ids and parameter numbers stay.
    """
    canon = clone_module(module)
    canon.name = "prologue"
    for j, comp in enumerate(canon.all_computations()):
        comp.name = "main" if comp is canon.entry else f"c{j}"
        for k, inst in enumerate(comp.instructions):
            inst.name, inst.location = f"v{k}", None
    return print_module(canon), mesh


def shared_prologue(module: Module, mesh: Any, build: Callable[[Module], Any]) -> SharedPrologue:
    """The ``SharedPrologue`` of ``module`` on ``mesh``: an existing one of an equal prologue, else new.

    Args:
      module: the prologue module (``spmd.passes.hoist_weights``).
      mesh: the ``spmd.Mesh`` it runs on.
      build: makes the executable of ``module`` (called only when no equal prologue is alive).
    """
    key = prologue_key(module, mesh)
    with _LOCK:
        found = _PROLOGUES.get(key)
    if found is not None:
        return found
    made = SharedPrologue(build(module), key)
    with _LOCK:  # another thread may have built an equal one meanwhile: keep the first
        return _PROLOGUES.setdefault(key, made)
