"""Registry of custom-call targets: a torch kernel plus the sharding rule the partitioner reads.

A ``custom-call`` instruction names its kernel in ``attrs["custom_call_target"]`` and carries
its options in ``attrs["backend_config"]`` (a JSON-style dict). ``CUSTOM_CALLS`` maps each
target to a ``CustomCallSpec``:

=============  ==========================  ===============================================
target         operands                    backend_config (defaults)
=============  ==========================  ===============================================
softmax        x                           dim (-1)
layer-norm     x, weight, bias             normalized_ndim (1), eps (1e-5)
attention      q, k, v[, mask]             is_causal (False), scale (None), has_mask (False)
gelu           x                           approximate ("none" | "tanh")
silu           x                           (none)
Sharding       x                           (none); the constraint is ``Instruction.sharding``
=============  ==========================  ===============================================

Ops along one dim (sort, topk, cumsum, cumprod) are registered from ``spmd.ir.custom_calls_sort``;
``random`` (counter-based random values; operands index, key0, key1) from ``spmd.ir.random``;
``conv1d`` (rule ``"convolution"``, see ``spmd.passes.rules_conv``) from ``spmd.ir.custom_calls_conv``;
``attention-forward`` / ``attention-backward`` (fused training attention, rule ``"attention"``) from
``spmd.ir.custom_calls_attention``.

Sharding-rule kinds (``CustomCallSpec.rule``):

- ``"elementwise"``: one operand, result of the same shape; any sharding passes through.
- ``"reduction-last-dims"``: operand 0 and the result share their shape; the dims returned by
  ``spec.unsharded_dims(config, rank)`` (softmax's ``dim``, layer-norm's last
  ``normalized_ndim`` dims) must be unsharded, the others may be sharded freely.
  ``spec.num_trailing_dims(config, rank)`` gives the same as a count of trailing dims. Other
  operands (layer-norm weight and bias) are replicated.
- ``"attention"``: q ``[..., Sq, D]``, k ``[..., Sk, D]``, v ``[..., Sk, Dv]`` and the optional
  mask (broadcastable to ``[..., Sq, Sk]``); the leading (batch, head) dims may be sharded and
  must agree across operands; the last two dims (sequence, head dim) must be unsharded. Operands after
  q, k, v (mask; the training calls' output gradient) and the result share the leading dims'
  shardings where their sizes match q's; the training calls' packed results (``attention-forward``'s
  result, ``attention-backward``'s result and its operand 3, slabs ``[n, *lead[:-1], S, lead[-1], E]``)
  hold them at their slab dims (``spmd.ir.custom_calls_attention.slab_dim``).
- ``"convolution"``: ``conv1d`` (``spmd.ir.custom_calls_conv``).
- ``"scan"``: cumsum / cumprod; any dim may be sharded, the scanned one through a parallel
  prefix (``spmd.passes.partition_scan``).
- ``"sharding-constraint"``: identity; the partitioner reshards its operand to
  ``Instruction.sharding`` and drops the instruction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from spmd.runtime import kernels_attention

Config = dict[str, Any]

RULE_KINDS = frozenset({"elementwise", "reduction-last-dims", "attention", "sharding-constraint", "convolution",
                        "scan"})


@dataclass(frozen=True)
class CustomCallSpec:
    """One custom-call target.

    Fields:
      target: the ``custom_call_target`` string.
      fn: ``fn(operands: list[Tensor], config: dict) -> Tensor``, the torch kernel.
      rule: sharding-rule kind, one of ``RULE_KINDS``.
      reduced_dims: for ``"reduction-last-dims"``, ``(config, rank) -> tuple[int, ...]`` giving
        the non-negative dims of operand 0 that must stay unsharded; None for other kinds.
      doc: one line on what it computes.
      writes_out: ``fn`` takes a third argument ``out`` (the result's buffer, or None) and writes
        its result there itself (saves the runtime's copy of a fresh result into the buffer).
    """

    target: str
    fn: Callable[..., torch.Tensor]
    rule: str
    reduced_dims: Callable[[Config, int], tuple[int, ...]] | None = None
    doc: str = ""
    writes_out: bool = False

    def __post_init__(self) -> None:
        assert self.rule in RULE_KINDS, self.rule
        assert (self.reduced_dims is not None) == (self.rule == "reduction-last-dims"), self.target

    def unsharded_dims(self, config: Config, rank: int) -> tuple[int, ...]:
        """Dims of operand 0 (rank ``rank``) that must be unsharded under this rule."""
        if self.rule == "reduction-last-dims":
            return self.reduced_dims(config, rank)
        if self.rule == "attention":
            return (rank - 2, rank - 1)
        return ()

    def num_trailing_dims(self, config: Config, rank: int) -> int:
        """How many trailing dims of operand 0 must be unsharded (covers ``unsharded_dims``)."""
        dims = self.unsharded_dims(config, rank)
        return rank - min(dims) if dims else 0


# --------------------------------------------------------------------------- kernels
def _softmax(operands: list[torch.Tensor], config: Config) -> torch.Tensor:
    """Softmax of x ``[...]`` along ``config["dim"]`` (default -1); same dtype as x."""
    return torch.softmax(operands[0], dim=int(config.get("dim", -1)))


def _softmax_dims(config: Config, rank: int) -> tuple[int, ...]:
    return (int(config.get("dim", -1)) % rank,)


def _layer_norm(operands: list[torch.Tensor], config: Config) -> torch.Tensor:
    """Layer norm of x ``[..., *N]`` over its last ``normalized_ndim`` dims ``N``.

    Operands: x, then optionally weight ``N`` and bias ``N`` (config ``has_weight`` /
    ``has_bias``, default True when the operand is present). eps defaults to 1e-5.
    """
    x = operands[0]
    n = int(config.get("normalized_ndim", 1))
    weight = operands[1] if len(operands) > 1 else None
    bias = operands[2] if len(operands) > 2 else None
    return F.layer_norm(x, tuple(x.shape[x.dim() - n:]), weight, bias, float(config.get("eps", 1e-5)))


def _layer_norm_dims(config: Config, rank: int) -> tuple[int, ...]:
    n = int(config.get("normalized_ndim", 1))
    return tuple(range(rank - n, rank))


def _attention(operands: list[torch.Tensor], config: Config) -> torch.Tensor:
    """Scaled dot-product attention ``softmax(q k^T * scale + mask) v``.

    q ``[..., Sq, D]``, k ``[..., Sk, D]``, v ``[..., Sk, Dv]``, optional mask (bool: True =
    attend; float: added) -> ``[..., Sq, Dv]``. Config: is_causal, scale (None = 1/sqrt(D)),
    has_mask. Uses ``torch.nn.functional.scaled_dot_product_attention`` through
    ``spmd.runtime.kernels_attention.sdpa``: on CUDA, with the backend chosen per shape and dtype
    by timing; elsewhere PyTorch's own choice.
    """
    q, k, v = operands[:3]
    mask = operands[3] if config.get("has_mask", len(operands) > 3) else None
    scale = config.get("scale")
    lead = q.shape[:-2]
    if q.dim() != 4:  # PyTorch's fused (flash / memory-efficient) kernels take [B, H, S, D] only
        q, k, v = (t.reshape(-1, 1, *t.shape[-2:]) if t.dim() < 4 else t.flatten(0, -4) for t in (q, k, v))
        if mask is not None and mask.dim() > 2:
            mask = mask.expand(*lead, *mask.shape[-2:]).reshape(*q.shape[:-2], *mask.shape[-2:])
    out = kernels_attention.sdpa(q, k, v, mask, bool(config.get("is_causal", False)),
                                 None if scale is None else float(scale))
    return out.reshape(*lead, *out.shape[-2:])


def _gelu(operands: list[torch.Tensor], config: Config) -> torch.Tensor:
    """GELU of x; config approximate "none" (erf form, default) or "tanh"."""
    return F.gelu(operands[0], approximate=str(config.get("approximate", "none")))


def _silu(operands: list[torch.Tensor], config: Config) -> torch.Tensor:
    """SiLU ``x * sigmoid(x)`` of x."""
    return F.silu(operands[0])


def _identity(operands: list[torch.Tensor], config: Config) -> torch.Tensor:
    """The operand itself (a sharding constraint computes nothing)."""
    return operands[0]


CUSTOM_CALLS: dict[str, CustomCallSpec] = {
    spec.target: spec
    for spec in (
        CustomCallSpec("softmax", _softmax, "reduction-last-dims", _softmax_dims,
                       "softmax along config['dim']"),
        CustomCallSpec("layer-norm", _layer_norm, "reduction-last-dims", _layer_norm_dims,
                       "layer norm over the last normalized_ndim dims, with weight and bias"),
        CustomCallSpec("attention", _attention, "attention", None,
                       "scaled dot-product attention of q, k, v with optional mask"),
        CustomCallSpec("gelu", _gelu, "elementwise", None, "GELU (erf or tanh form)"),
        CustomCallSpec("silu", _silu, "elementwise", None, "SiLU x * sigmoid(x)"),
        CustomCallSpec("Sharding", _identity, "sharding-constraint", None,
                       "identity carrying a sharding constraint in Instruction.sharding"),
    )
}


def _register_more() -> None:
    from spmd.ir.custom_calls_attention import ATTENTION_GRAD_CALLS
    from spmd.ir.custom_calls_conv import CONV_CALLS
    from spmd.ir.custom_calls_sort import SORT_CALLS
    from spmd.ir.random import RANDOM_CALLS

    for target, fn, rule, reduced_dims, doc in (*SORT_CALLS, *RANDOM_CALLS, *CONV_CALLS):
        CUSTOM_CALLS[target] = CustomCallSpec(target, fn, rule, reduced_dims, doc)
    for target, fn, rule, reduced_dims, doc in ATTENTION_GRAD_CALLS:
        CUSTOM_CALLS[target] = CustomCallSpec(target, fn, rule, reduced_dims, doc, writes_out=True)


_register_more()


def get_custom_call(target: str) -> CustomCallSpec:
    """The spec of ``target``. Raises ValueError naming the known targets if it is unknown."""
    try:
        return CUSTOM_CALLS[target]
    except KeyError:
        raise ValueError(
            f"unknown custom_call_target {target!r}; expected one of {sorted(CUSTOM_CALLS)}"
        ) from None
