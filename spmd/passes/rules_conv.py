"""Sharding rule of the ``conv1d`` custom call (rule kind ``"convolution"``).

x ``[N, C_in, L]``, weight ``[C_out, C_in / groups, K]`` -> ``[N, C_out, L_out]``. As for a dot
(GSPMD, Xu et al. 2021, arXiv:2105.04663 §3.4; XLA ``xla/service/spmd/convolution_handler.cc``):

- the batch dim N keeps the axes x (or the wanted result) has;
- with ``groups == 1``, input channels sharded on x and/or the weight (the other side is sliced
  locally, no communication) are contracted per device and the result is ``partial`` over those
  axes; only an even split is used, so no padding channels enter the sums;
- with ``groups == 1``, the weight's output channels keep their axes (the result's channel dim
  is sharded alike);
- the length and kernel dims are unsharded (no halo exchange), and so are channels when
  ``groups > 1``.

Each mesh axis is used once, in the order batch, input channels, output channels.
"""

from __future__ import annotations

from spmd.ir.hlo import Instruction
from spmd.ir.sharding import MeshShape, TensorSharding
from spmd.passes.plan_base import Plan, _d, _Picker


def _contracted(x: TensorSharding | None, w: TensorSharding | None, c_in: int, mesh: MeshShape):
    """The axes the input channels are split over, or None."""
    cx, cw = _d(x, 1), _d(w, 1)
    axes = cx if cx and (cw == cx or not cw) else (cw if cw and not cx else None)
    if axes and c_in % mesh.axes_size(axes) == 0:
        return axes
    return None


def plan_conv1d(inst: Instruction, current: list[TensorSharding | None], out: TensorSharding | None,
                mesh: MeshShape) -> Plan:
    """Operand shardings (x, weight) and the local result's sharding (see the module docstring)."""
    x, w = current[0], current[1]
    grouped = int((inst.attrs.get("backend_config") or {}).get("groups", 1)) != 1
    picker = _Picker()
    batch = picker.pick(_d(x, 0), _d(out, 0))
    contract = () if grouped else picker.pick(_contracted(x, w, inst.operands[0].shape.dims[1], mesh))
    c_out = () if grouped else picker.pick(_d(w, 0), _d(out, 1))
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    partial = tuple(sorted(contract, key=order.__getitem__))
    return Plan((TensorSharding((batch, contract, ())), TensorSharding((c_out, contract, ()))),
                TensorSharding((batch, c_out, ()), partial))
