"""The ``conv1d`` custom call: PyTorch's 1-d convolution, without bias.

Operands: x ``[N, C_in, L]`` and weight ``[C_out, C_in / groups, K]``; result
``[N, C_out, L_out]`` with ``L_out = (L + 2 * padding - dilation * (K - 1) - 1) // stride + 1``
(or ``L`` for padding ``"same"``). backend_config: stride (1), padding (0, or "same" / "valid"),
dilation (1), groups (1). A bias is added by the frontend as a separate broadcast add, so that a
convolution whose input channels are split over devices can return partial sums.

Sharding rule ``"convolution"`` (``spmd.passes.rules_conv``): the batch dim passes any sharding
through; with ``groups == 1`` the weight's output-channel dim may be sharded (result channel
dim sharded alike), and input channels sharded alike on x and weight (evenly) give a result
that is partial over those axes, as a dot contracting a sharded dim does; the length and kernel
dims are unsharded (no halo exchange).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def conv1d_out_length(length: int, kernel: int, config: dict[str, Any]) -> int:
    """``L_out`` of a conv1d over ``length`` with a ``kernel``-wide filter and ``config``."""
    padding = config.get("padding", 0)
    if padding == "same":
        return length
    pad = 0 if padding == "valid" else int(padding)
    stride, dilation = int(config.get("stride", 1)), int(config.get("dilation", 1))
    return (length + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1


def _conv1d(operands: list[torch.Tensor], config: dict[str, Any]) -> torch.Tensor:
    """``F.conv1d(x, weight)`` with config's stride, padding, dilation and groups (no bias).

    A float32 convolution on CUDA runs without TF32 (cuDNN's default allows it, and picks it by
    shape and layout, so the same convolution rounded to 10-bit mantissas or not depending on how
    its operands were laid out: a [2, 12, 1] conv1d differed from eager by 3e-4 on an H200), as the
    float32 dot kernels run: full float32 precision everywhere.
    """
    x, w = operands
    padding = config.get("padding", 0)
    args = dict(stride=int(config.get("stride", 1)), padding=padding if isinstance(padding, str) else int(padding),
                dilation=int(config.get("dilation", 1)), groups=int(config.get("groups", 1)))
    if x.is_cuda and x.dtype == torch.float32:
        cudnn = torch.backends.cudnn
        with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                         allow_tf32=False):
            return F.conv1d(x, w, None, **args)
    return F.conv1d(x, w, None, **args)


#: (target, kernel, sharding-rule kind, unsharded dims, doc): ``spmd.ir.custom_calls`` builds the spec.
CONV_CALLS = (
    ("conv1d", _conv1d, "convolution", None, "1-d convolution of [N, C_in, L] by [C_out, C_in/groups, K]"),
)
