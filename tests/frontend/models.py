"""Small PyTorch models used by the frontend tests."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d: int = 16, h: int = 64, approximate: str = "none") -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class Block(nn.Module):
    """Pre-norm transformer block; attention by explicit matmuls + softmax, or by SDPA."""

    def __init__(self, d: int = 32, heads: int = 4, use_sdpa: bool = False) -> None:
        super().__init__()
        self.heads, self.use_sdpa = heads, use_sdpa
        self.ln1 = nn.LayerNorm(d)
        self.ln2 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = MLP(d, 4 * d)
        self.drop = nn.Dropout(0.1)

    def attention(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.use_sdpa:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ v
        return self.proj(o.transpose(1, 2).reshape(b, s, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attention(self.ln1(x), mask))
        return x + self.drop(self.mlp(self.ln2(x)))


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class LlamaBlock(nn.Module):
    """Llama-style block: RMSNorm, causal SDPA attention, SiLU-gated MLP (no rotary)."""

    def __init__(self, d: int = 32, heads: int = 4, hidden: int = 96) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, s, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLM(nn.Module):
    """Embedding lookup, one block, tied output projection."""

    def __init__(self, vocab: int = 50, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(16, d) * 0.1)
        self.block = LlamaBlock(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        x = self.emb(ids) + self.pos[:s]
        return torch.log_softmax(self.block(x) @ self.emb.weight.t(), dim=-1)
