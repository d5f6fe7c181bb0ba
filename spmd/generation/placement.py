"""The parameters of a model placed on a mesh once, shared by every ``Generator`` of that model.

Several ``Generator``s built on one ``nn.Module`` and one mesh (for other batch sizes, cache
lengths or sampling) read the same weights: placing them once per Generator would hold every
weight once per Generator on the devices, and their hoisted values once per weight set
(``spmd.runtime.weight_cache``). ``place_params`` returns the arrays an earlier call placed for
the same model, mesh and shardings, as long as some Generator still holds them and the
model's parameters are unchanged: the same parameter tensors (identity, checked through weak
references), at the same addresses (``data_ptr``: ``p.data = other`` moves the storage), with the
same ``_version`` (every in-place write, ``load_state_dict`` included, bumps it). Otherwise the
parameters are placed again (``device_put``), so a Generator built after an update reads the
new weights while an earlier one keeps the copy it was built with. A write that bypasses the
version counter (through ``p.data``, which has a counter of its own, or ``p.numpy()``) changes
none of the three: a Generator built after it reuses the old copy (the contents are not compared;
that would read every weight at every construction).

Memory: the registry holds neither the model nor the arrays (weak references); the arrays
live as long as a ``PlacedParams`` that a Generator holds.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from spmd.array import ShardedArray, device_put
from spmd.sharding import NamedSharding

_REGISTRY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {shardings key: weakref(PlacedParams)}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class PlacedParams:
    """One placement of a model's parameters: ``arrays`` (fqn -> ``ShardedArray``) and its source.

    ``signature``: per placed parameter, (weak reference to the parameter tensor, its
    ``data_ptr()``, its ``_version``) when the arrays were placed.
    """

    arrays: dict[str, ShardedArray]
    signature: tuple

    def matches(self, params: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> bool:
        """Whether ``params`` (fqn -> tensor, for ``names``) still are the tensors placed, unchanged."""
        for name, (ref, ptr, version) in zip(names, self.signature, strict=True):
            p = params[name]
            if ref() is not p or p.data_ptr() != ptr or p._version != version:
                return False
        return True


def place_params(model: torch.nn.Module, shardings: Mapping[str, NamedSharding]) -> PlacedParams:
    """``model``'s parameters named in ``shardings`` placed as ``shardings[fqn]`` (``device_put``), shared.

    Args:
      model: the module whose ``named_parameters()`` are placed.
      shardings: fqn -> ``NamedSharding`` (every fqn a parameter of ``model``).
    Returns:
      A ``PlacedParams``: the one an earlier call returned for the same model and shardings when
      it is still held and the parameters are unchanged (see the module docstring), else new.
      The caller keeps it to keep the arrays alive; the arrays must not be donated or deleted.
    Raises:
      ValueError / TypeError: as ``device_put`` (a sharding that does not fit a parameter).
    """
    names = tuple(shardings)
    key = tuple(shardings.items())
    params = dict(model.named_parameters())
    with _LOCK:
        per_model = _REGISTRY.setdefault(model, {})
        for dead in [k for k, r in per_model.items() if r() is None]:
            del per_model[dead]
        ref = per_model.get(key)
        placed = ref() if ref is not None else None
        if placed is not None and placed.matches(params, names):
            return placed
        with torch.no_grad():
            arrays = {n: device_put(params[n].detach(), shardings[n]) for n in names}
        signature = tuple((weakref.ref(params[n]), params[n].data_ptr(), params[n]._version) for n in names)
        placed = PlacedParams(arrays, signature)
        per_model[key] = weakref.ref(placed)
        return placed
