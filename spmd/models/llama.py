"""Llama decoder layers at published shapes, with seeded random weights, for benchmarks.

A layer is ``x + attn(RMSNorm(x))`` then ``x + mlp(RMSNorm(x))``; attention uses rotary
position embeddings (Su et al., "RoFormer", 2021; the rotate-half form of Hugging Face's
Llama) and grouped-query attention (Ainslie et al., "GQA", 2023: ``num_kv_heads`` key/value
heads, each shared by ``num_heads / num_kv_heads`` query heads); the MLP is SwiGLU
(Shazeer, "GLU Variants Improve Transformer", 2020): ``down(silu(gate(x)) * up(x))``.
Shapes from Touvron et al., "Llama 2" (2023) and Meta's Llama 3 model card (70B: 8192
hidden, 64 heads, 8 KV heads, FFN 28672, rope theta 500000).

Parameter names follow Hugging Face (``layers.0.self_attn.q_proj.weight``,
``layers.0.mlp.gate_proj.weight``, ``layers.0.input_layernorm.weight``); linears have no bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spmd.models.common import LayerStack, init_random_
from spmd.models.gpt import _replace


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a stack of Llama decoder layers (sizes in elements)."""

    hidden_size: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 32
    ffn_size: int = 11008
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head dim ({self.hidden_size // self.num_heads}) must be even for rotary embeddings")
        if self.num_layers < 1:
            raise ValueError(f"num_layers: expected >= 1, got {self.num_layers}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


LLAMA2_7B = LlamaConfig()
LLAMA3_70B = LlamaConfig(hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_size=28672, rope_theta=500000.0)
LLAMA_SMALL_TEST = LlamaConfig(hidden_size=64, num_heads=4, num_kv_heads=2, ffn_size=160)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in float32. [..., H] -> [..., H]."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_tables(seq: int, head_dim: int, theta: float, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """cos and sin tables, each [S, head_dim], built from iotas inside the traced program."""
    inv_freq = torch.exp(torch.arange(0, head_dim, 2, device=device).float() * (-math.log(theta) / head_dim))
    angles = torch.arange(seq, device=device).float()[:, None] * inv_freq[None, :]  # [S, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, hd]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding. x: [B, nh, S, hd]; cos, sin: [S, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    """Causal GQA self-attention with rotary embeddings. x: [B, S, H] -> [B, S, H]."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.head_dim  # read by sharding plans
        kv = cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        b, s, h = x.shape
        q = self.q_proj(x).view(b, s, c.num_heads, c.head_dim).transpose(1, 2)  # [B, nh, S, hd]
        k = self.k_proj(x).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, nkv, S, hd]
        v = self.v_proj(x).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(s, c.head_dim, c.rope_theta, x.dtype, x.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        rep = c.num_heads // c.num_kv_heads
        k = k[:, :, None].expand(b, c.num_kv_heads, rep, s, c.head_dim).reshape(b, c.num_heads, s, c.head_dim)
        v = v[:, :, None].expand(b, c.num_kv_heads, rep, s, c.head_dim).reshape(b, c.num_heads, s, c.head_dim)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, S, hd]
        return self.o_proj(o.transpose(1, 2).reshape(b, s, h))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). [B, S, H] -> [B, S, H]."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    """One pre-norm Llama decoder layer. [B, S, H] -> [B, S, H]."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBlocks(LayerStack):
    """``cfg.num_layers`` Llama layers. forward(x: float [B, S, hidden]) -> [B, S, hidden]."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg, LlamaLayer)


def llama_layers(
    preset: str = "llama2-7b",
    layers: int = 1,
    *,
    small: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **overrides,
) -> LlamaBlocks:
    """Llama decoder layers with seeded random weights, in eval mode.

    Args:
      preset: ``"llama2-7b"`` or ``"llama3-70b"``.
      layers: number of layers (>= 1).
      small: a tiny shape (hidden 64, 4 heads, 2 KV heads, FFN 160) for tests on CPU.
      dtype, device: of the parameters (``device="meta"``: shapes only, no values). seed: random seed of the weights.
      overrides: any ``LlamaConfig`` field.
    Raises:
      ValueError: unknown preset or invalid sizes. TypeError: unknown override name.
    """
    presets = {"llama2-7b": LLAMA2_7B, "llama3-70b": LLAMA3_70B}
    if preset not in presets:
        raise ValueError(f"preset: expected one of {sorted(presets)}, got {preset!r}")
    base = LLAMA_SMALL_TEST if small else presets[preset]
    cfg = _replace(base, num_layers=layers, **overrides)
    with torch.device("meta"):
        model = LlamaBlocks(cfg)
    model = model.to(dtype).eval().requires_grad_(False)
    if torch.device(device).type == "meta":  # shapes only, e.g. to check a sharding plan
        return model
    return init_random_(model.to_empty(device=device), seed)
