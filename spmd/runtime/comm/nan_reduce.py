"""NaN-propagating maximum / minimum reductions over transports whose float max drops NaN.

``torch.amax`` / ``torch.max`` propagate NaN; a cross-device max must too (XLA's ``maximum`` is
NaN-propagating as well). NCCL's float max/min (``fmaxf``-style) and gloo's ``std::max`` return
the other operand or depend on the order, so a sharded ``x.amax(dim)`` would drop a NaN that one
device holds. ``pack`` folds a NaN flag into the same collective instead of running a second one
(these all-reduces are small and latency-bound, so one collective of twice the bytes costs about
what one of the plain bytes does):

    payload = [x with NaN -> -inf (max) / +inf (min), flatten] ++ [isnan(x) as +1 (max) / -1 (min)]

reduced with the same op: the flag half is nonzero exactly where some device held a NaN, the
value half is the max/min of the others; ``unpack`` puts NaN back where the flag is set. A
reduce-scatter packs each of its ``n`` chunks the same way, so chunk ``i`` still goes to member
``i`` of the group. Integer and bool reductions and ``add``/``multiply`` (which propagate NaN in
every transport) are left alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from spmd.runtime.thunks import CollectiveSpec

Tensor = torch.Tensor

__all__ = ["needs_packing", "pack", "run_nan_safe"]


def needs_packing(spec: CollectiveSpec) -> bool:
    """Whether ``spec`` is a float max/min all-reduce or reduce-scatter (which ``pack`` rewrites)."""
    return (spec.kind in ("all-reduce", "reduce-scatter") and spec.reduce_op in ("maximum", "minimum")
            and spec.dtype.is_floating_point)


def pack(spec: CollectiveSpec, inputs: Sequence[Tensor]) -> tuple[CollectiveSpec, list[Tensor],
                                                                   Callable[[list], list]]:
    """(packed spec, packed inputs, unpack) for a ``needs_packing`` spec (module docstring).

    ``inputs[k]``: device ``k``'s operand (``spec``'s per-device input shape; for a reduce-scatter
    over groups of ``n``, ``n`` times ``spec.out_dims`` along ``spec.dim``). The packed collective
    has 1-d operands of twice the elements, the same kind, groups and op; ``unpack`` maps its
    per-device results (None for a device in no group stays None) to ``spec.out_dims`` tensors.
    """
    fill, sign = (-math.inf, 1.0) if spec.reduce_op == "maximum" else (math.inf, -1.0)
    parts = len(spec.groups[0]) if spec.kind == "reduce-scatter" else 1
    chunk = math.prod(spec.out_dims)
    packed = [None if x is None else _pack_one(x, spec, parts, fill, sign) for x in inputs]
    pspec = dataclasses.replace(spec, dim=0, out_dims=(2 * chunk,))

    def unpack(results: list) -> list:
        return [None if r is None else _unpack_one(r, spec, chunk) for r in results]

    return pspec, packed, unpack


def run_nan_safe(spec: CollectiveSpec, inputs: Sequence[Tensor],
                 run: Callable[[CollectiveSpec, list], list]) -> list:
    """``run(spec, inputs)``, through ``pack`` / unpack when ``needs_packing(spec)``."""
    if not needs_packing(spec):
        return run(spec, list(inputs))
    pspec, packed, unpack = pack(spec, inputs)
    return unpack(run(pspec, packed))


def _pack_one(x: Tensor, spec: CollectiveSpec, parts: int, fill: float, sign: float) -> Tensor:
    if spec.kind == "reduce-scatter":  # [parts, chunk...] in group order, one row per member
        x = torch.stack(torch.chunk(x, parts, dim=spec.dim))
    rows = x.reshape(parts, -1)
    nan = torch.isnan(rows)
    values = rows.masked_fill(nan, fill)
    flags = nan.to(x.dtype) * sign
    return torch.cat([values, flags], dim=1).reshape(-1)


def _unpack_one(r: Tensor, spec: CollectiveSpec, chunk: int) -> Tensor:
    values, flags = r[:chunk], r[chunk:]
    out = values.masked_fill(flags != 0, math.nan)
    return out.reshape(spec.out_dims)
