"""Pieces shared by the benchmark block models: seeded random init and FLOP counts."""

from __future__ import annotations

import torch
from torch import nn


def init_random_(module: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Fill every parameter of ``module`` in place from a seeded normal distribution.

    Weights and biases get N(0, std^2) (biases too, so no value is an exact zero); norm
    weights (1-d parameters whose name ends in ``norm.weight`` / ``ln_*.weight``) get
    1 + N(0, std^2). Values are drawn on the parameter's device in its dtype, from one
    ``torch.Generator`` per parameter seeded by ``seed`` and the parameter's position: the same
    seed, architecture, device type and dtype give the same weights. Returns ``module``.
    """
    with torch.no_grad():
        for k, (name, p) in enumerate(module.named_parameters()):
            gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + k)
            torch.randn(p.shape, generator=gen, dtype=p.dtype, device=p.device, out=p.data).mul_(std)
            if p.ndim == 1 and _is_norm_weight(name):
                p.add_(1.0)
    return module


def _is_norm_weight(name: str) -> bool:
    leaf_module = name.rsplit(".", 2)[-2] if "." in name else ""
    return name.endswith(".weight") and ("norm" in leaf_module.lower() or leaf_module.startswith("ln"))


def attention_flops(batch: int, seq: int, hidden: int) -> int:
    """FLOPs of the two attention matmuls (QK^T and PV) of one layer, causal mask not discounted.

    2 matmuls x 2 FLOPs per multiply-add x B x S x S x hidden, as in Narayanan et al.,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (2021).
    """
    return 4 * batch * seq * seq * hidden


def linear_flops(module: nn.Module, tokens: int) -> int:
    """2 x tokens x (in x out) summed over every ``nn.Linear`` inside ``module``."""
    return sum(2 * tokens * m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


class LayerStack(nn.Module):
    """``cfg.num_layers`` decoder layers ``layer_cls(cfg)`` applied in turn.

    forward(x: float [B, S, hidden]) -> [B, S, hidden]; ``flops(batch, seq)`` counts the
    matmul FLOPs of one forward (linears plus attention, see ``attention_flops``).
    """

    def __init__(self, cfg, layer_cls: type[nn.Module]) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(layer_cls(cfg) for _ in range(cfg.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def flops(self, batch: int, seq: int) -> int:
        """Forward FLOPs for a [batch, seq, hidden] input (matmuls only)."""
        per_layer_attn = attention_flops(batch, seq, self.config.hidden_size)
        return linear_flops(self, batch * seq) + self.config.num_layers * per_layer_attn
