"""ATen -> HLO-lite converter for ``conv1d``: the ``conv1d`` custom call plus a broadcast bias add.

``F.conv1d(x, weight, bias, stride, padding, dilation, groups)`` with x ``[N, C_in, L]`` or
unbatched ``[C_in, L]``; padding an int (one-element list) or ``"same"`` / ``"valid"``. GPT-2's
``Conv1D`` module is ``addmm`` and needs nothing here. Sharding: ``spmd.passes.rules_conv``.
"""

from __future__ import annotations

import torch

from spmd.frontend.aten_common import out_dims, out_dtype, register
from spmd.frontend.emitter import Emitter
from spmd.ir.hlo import Instruction, Shape

aten = torch.ops.aten


def _single(value, name: str):
    """An int from an int or a one-element list (ValueError naming ``name`` otherwise)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"conv1d {name}: expected one value, got {list(value)}")
        value = value[0]
    return value if isinstance(value, str) else int(value)


@register(aten.conv1d.default, aten.conv1d.padding)
def _conv1d(em: Emitter, a: dict, val) -> Instruction:
    x, w = a["input"], a["weight"]
    dtype = out_dtype(val)
    if x.shape.dtype != w.shape.dtype:
        raise TypeError(f"conv1d: expected input and weight of one dtype (as PyTorch requires), got "
                        f"{x.shape.dtype} and {w.shape.dtype}")
    unbatched = x.shape.rank == 2
    if unbatched:
        x = em.reshape(x, (1, *x.shape.dims))
    config = {"stride": _single(a["stride"], "stride"), "padding": _single(a["padding"], "padding"),
              "dilation": _single(a["dilation"], "dilation"), "groups": int(a["groups"])}
    dims = out_dims(val)
    batched_dims = (1, *dims) if unbatched else dims
    y = em.custom_call("conv1d", [x, w], Shape(dtype, batched_dims), config)
    if a.get("bias") is not None:
        b = em.broadcast(em.convert(a["bias"], dtype), batched_dims, (1,))
        y = em.binary("add", y, b)
    return em.reshape(y, dims) if unbatched else y


