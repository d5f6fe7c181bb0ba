"""GPT-3 style decoder layers at published shapes, with seeded random weights, for benchmarks.

A layer is pre-norm: ``x + attn(LN(x))`` then ``x + mlp(LN(x))``; causal multi-head
attention through ``scaled_dot_product_attention``; the MLP is Linear -> GELU (tanh
approximation, as GPT-2/3) -> Linear. Shapes of GPT-3 175B from Brown et al., "Language
Models are Few-Shot Learners" (2020), Table 2.1: d_model 12288, 96 heads, d_ff = 4 d_model.

Parameter names (``layers.0.attn.q_proj.weight``, ``layers.0.mlp.fc_in.bias``, ...) are what
``spmd.models.plans.gpt_plan`` matches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spmd.models.common import LayerStack, init_random_


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a stack of GPT decoder layers (sizes in elements)."""

    hidden_size: int = 12288
    num_heads: int = 96
    ffn_size: int = 49152
    num_layers: int = 1
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_layers < 1:
            raise ValueError(f"num_layers: expected >= 1, got {self.num_layers}")


GPT3_175B = GPTConfig()
GPT3_SMALL_TEST = GPTConfig(hidden_size=64, num_heads=4, ffn_size=256)


class GPTAttention(nn.Module):
    """Causal multi-head self-attention. x: [B, S, H] -> [B, S, H]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, h // cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        split = lambda t: t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, S, hd]
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(o.transpose(1, 2).reshape(b, s, h))


class GPTMLP(nn.Module):
    """Linear -> GELU(tanh) -> Linear. [B, S, H] -> [B, S, H]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.fc_out = nn.Linear(cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


class GPTLayer(nn.Module):
    """One pre-norm decoder layer. [B, S, H] -> [B, S, H]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = GPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTBlocks(LayerStack):
    """``cfg.num_layers`` GPT layers. forward(x: float [B, S, hidden]) -> [B, S, hidden]."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg, GPTLayer)


def gpt3_layers(
    layers: int = 1,
    *,
    small: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **overrides,
) -> GPTBlocks:
    """GPT-3 175B decoder layers with seeded random weights, in eval mode.

    Args:
      layers: number of layers (>= 1).
      small: use a tiny shape (hidden 64, 4 heads, FFN 256) for tests on CPU.
      dtype, device: of the parameters (``device="meta"``: shapes only, no values).
      seed: random seed of the weights (see ``common.init_random_``).
      overrides: any ``GPTConfig`` field (hidden_size, num_heads, ffn_size, layer_norm_eps).
    Raises:
      ValueError/TypeError: invalid sizes or an unknown override name.
    """
    base = GPT3_SMALL_TEST if small else GPT3_175B
    cfg = _replace(base, num_layers=layers, **overrides)
    with torch.device("meta"):
        model = GPTBlocks(cfg)
    model = model.to(dtype).eval().requires_grad_(False)
    if torch.device(device).type == "meta":  # shapes only, e.g. to check a sharding plan
        return model
    return init_random_(model.to_empty(device=device), seed)


def _replace(cfg, **fields):
    known = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"unknown config field(s) {unknown}; expected some of {sorted(known)}")
    return dataclasses.replace(cfg, **fields)
