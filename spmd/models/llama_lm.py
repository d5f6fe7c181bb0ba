"""A Llama causal language model with a preallocated (static) KV cache, written gpt-fast style.

The same ``nn.Module`` runs in plain PyTorch eager (the reference) and under ``spmd.jit``: the
KV cache is an explicit argument and result of ``forward`` (one ``(k, v)`` pair per layer, each
``[B, num_kv_heads, max_seq, head_dim]``), so a compiled step can donate it and write it in
place (PyTorch-Labs gpt-fast, "Accelerating Generative AI with PyTorch II", 2023: a static cache
updated at the position, attention over the whole cache with a mask by position).

Batches of prompts of different lengths are **left-padded** to one static length: sequence
``b`` starts at cache slot ``start[b]``, and every sequence writes the same slot at each step, so
the decode step writes one cache column (a dynamic-update-slice at a device position) and the
prefill writes a static slice. Rotary positions are per sequence (``slot - start[b]``), so each
sequence computes exactly what it would alone; the attention mask hides the padding slots.

Parameter names follow Hugging Face (``embed_tokens``, ``layers.N.self_attn.q_proj``, ``norm``,
``lm_head``); ``spmd.models.plans.llama_lm_plan`` shards them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spmd.models.common import init_random_
from spmd.models.gpt import _replace
from spmd.models.llama import LlamaAttention, LlamaConfig, LlamaLayer, RMSNorm

CACHE_UPDATES = ("mask", "index", "inplace")


@dataclass(frozen=True)
class LlamaLMConfig(LlamaConfig):
    """A Llama decoder stack plus token embedding, final RMS norm and LM head (sizes in elements)."""

    vocab_size: int = 32000

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size: expected >= 1, got {self.vocab_size}")


LM_PRESETS = {
    # Touvron et al., "Llama 2" (2023), 7B: 4096 hidden, 32 heads (MHA), FFN 11008, vocab 32000.
    "llama2-7b": LlamaLMConfig(num_layers=32),
    # Meta's Llama 3 model card, 8B: 4096 hidden, 32 heads, 8 KV heads (GQA), FFN 14336, vocab 128256.
    "llama3-8b": LlamaLMConfig(num_layers=32, num_kv_heads=8, ffn_size=14336, vocab_size=128256,
                               rope_theta=500000.0),
}
LM_SMALL = LlamaLMConfig(hidden_size=64, num_heads=4, num_kv_heads=2, ffn_size=160, num_layers=2, vocab_size=256)


def _int_arg(name: str, value, minimum: int | None = None) -> int:
    """``value`` as an int; TypeError naming ``name`` for a bool or a non-integer, ValueError below ``minimum``."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def _real_arg(name: str, value) -> float:
    """``value`` as a float; TypeError naming ``name`` for a bool or a non-number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def rotary_at(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin for integer positions ``pos`` [B, S] -> each [B, 1, S, 2, head_dim / 2].

    The head dim is split in its two rotary halves (``_rotate``); ``sin[..., 0, :]`` is negated,
    so the rotate-half product needs no concatenation (only elementwise ops, slices and
    broadcasts, which fuse into one kernel), with the same values as the textbook form.
    """
    half = head_dim // 2
    inv_freq = torch.exp(torch.arange(0, head_dim, 2, device=pos.device).float() * (-math.log(theta) / head_dim))
    angles = pos.float()[:, :, None] * inv_freq  # [B, S, hd/2]
    angles = angles[:, None, :, None, :].expand(pos.shape[0], 1, pos.shape[1], 2, half)
    sign = torch.arange(2, device=pos.device).float()[:, None] * 2 - 1  # [[-1], [1]]
    return angles.cos().to(dtype), (angles.sin() * sign).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding (Su et al., "RoFormer", 2021; Hugging Face's Llama form).

    x [B, nh, S, hd]; cos, sin from ``rotary_at``. Equals ``x * cos + cat(-x2, x1) * sin`` of
    the full-width tables: the halves are swapped with a select over a broadcast instead of a
    concatenation.
    """
    xv = x.unflatten(-1, (2, x.shape[-1] // 2))  # [B, nh, S, 2, hd/2]
    first_half = torch.arange(2, device=x.device)[:, None] == 0
    swapped = torch.where(first_half, xv[..., 1:, :], xv[..., :1, :])
    return (xv * cos + swapped * sin).flatten(-2)


def write_cache(cache: torch.Tensor, new: torch.Tensor, slot, mode: str) -> torch.Tensor:
    """``cache`` [B, nkv, max_seq, hd] with ``new`` [B, nkv, S, hd] written at slots ``slot .. slot+S-1``.

    ``slot`` is a Python int (a static slice, ``slice_scatter``: the prefill) or an int64 tensor [] (the decode
    step's device position). ``mode`` "index" writes with ``index_copy`` (a dynamic-update-slice
    in the compiled program); "mask" selects with ``torch.where`` over the slot dim (needs S == 1).
    Functional: returns the new cache (a compiled step donating the cache writes it in place).
    "inplace" writes ``cache`` itself and returns it (gpt-fast's eager / ``torch.compile`` form, for
    caches held as module buffers; not for ``spmd.jit``).
    """
    s, max_seq = new.shape[2], cache.shape[2]
    if mode == "inplace":
        if isinstance(slot, int):
            cache[:, :, slot:slot + s] = new
        else:
            cache.index_copy_(2, slot.reshape(1) + torch.arange(s, device=cache.device), new)
        return cache
    if isinstance(slot, int):  # a dynamic-update-slice at a constant start (in place when donated)
        return torch.slice_scatter(cache, new, dim=2, start=slot, end=slot + s)
    if mode == "index":
        return cache.index_copy(2, slot.reshape(1) + torch.arange(s, device=cache.device), new)
    assert s == 1, "the mask cache update writes one slot"
    hit = torch.arange(max_seq, device=cache.device)[:, None] == slot
    return torch.where(hit, new, cache)


def _repeat_kv(cache: torch.Tensor, c: LlamaConfig) -> torch.Tensor:
    """[B, nkv, n, hd] -> [B, nh, n, hd], each KV head repeated for its query heads (GQA); as is for MHA."""
    rep = c.num_heads // c.num_kv_heads
    if rep == 1:
        return cache
    b, _, n, hd = cache.shape
    return cache[:, :, None].expand(b, c.num_kv_heads, rep, n, hd).reshape(b, c.num_heads, n, hd)


class CachedLlamaAttention(LlamaAttention):
    """GQA self-attention over a static KV cache. x [B, S, H] -> ([B, S, H], new k cache, new v cache)."""

    def __init__(self, cfg: LlamaConfig, cache_update: str) -> None:
        super().__init__(cfg)
        self.cache_update = cache_update

    def forward(self, x, cos, sin, mask, slot, k_cache, v_cache):  # noqa: D102 (see the class docstring)
        c = self.cfg
        b, s, h = x.shape
        q = self.q_proj(x).view(b, s, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k_cache = write_cache(k_cache, k, slot, self.cache_update)
        v_cache = write_cache(v_cache, v, slot, self.cache_update)
        keys, vals = _repeat_kv(k_cache, c), _repeat_kv(v_cache, c)
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, h)), k_cache, v_cache


class CachedLlamaLayer(LlamaLayer):
    """A pre-norm Llama layer whose attention reads and writes a KV cache."""

    def __init__(self, cfg: LlamaConfig, cache_update: str) -> None:
        super().__init__(cfg)
        self.self_attn = CachedLlamaAttention(cfg, cache_update)

    def forward(self, x, cos, sin, mask, slot, k_cache, v_cache):  # noqa: D102
        a, k_cache, v_cache = self.self_attn(self.input_layernorm(x), cos, sin, mask, slot, k_cache, v_cache)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), k_cache, v_cache


def attention_mask(q_slots: torch.Tensor, start: torch.Tensor, max_seq: int) -> torch.Tensor:
    """Boolean [B, 1, S, max_seq]: query at slot ``q_slots[i]`` of sequence b sees key slot j iff
    ``start[b] <= j <= q_slots[i]`` (causal, padding hidden), or ``j == q_slots[i]`` (so a padding
    query attends to itself and its softmax is finite; its output is never used)."""
    j = torch.arange(max_seq, device=start.device)
    causal = j[None, None, :] <= q_slots[None, :, None]
    valid = j[None, None, :] >= start[:, None, None]
    diag = j[None, None, :] == q_slots[None, :, None]
    return ((causal & valid) | diag)[:, None]


class LlamaForCausalLM(nn.Module):
    """Llama LM: embedding, ``num_layers`` cached decoder layers, final RMS norm, LM head.

    ``forward(tokens, slot, start, kv) -> (logits, kv)``:
      tokens: int64 [B, S], left-padded; written to cache slots ``slot .. slot + S - 1``.
      slot: a Python int (static; the prefill passes 0) or an int64 tensor [] (the decode position).
      start: int64 [B], the first cache slot of each sequence (its left-padding length).
      kv: tuple of ``(k, v)`` per layer, each [B, num_kv_heads, max_seq, head_dim] in the model dtype.
      logits: float32 [B, vocab] of the last token; kv: the updated cache (same structure).
    ``cache_update`` ("index", "mask" or "inplace", see ``write_cache``) picks how the cache is written.
    """

    def __init__(self, cfg: LlamaLMConfig, cache_update: str = "index") -> None:
        super().__init__()
        if cache_update not in CACHE_UPDATES:
            raise ValueError(f"cache_update: expected one of {CACHE_UPDATES}, got {cache_update!r}")
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(CachedLlamaLayer(cfg, cache_update) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens, slot, start, kv):  # noqa: D102 (see the class docstring)
        c = self.config
        b, s = tokens.shape
        max_seq = kv[0][0].shape[2]
        q_slots = slot + torch.arange(s, device=tokens.device)  # [S]
        pos = (q_slots[None, :] - start[:, None]).clamp_min(0)  # [B, S] rotary positions
        x = self.embed_tokens(tokens)
        cos, sin = rotary_at(pos, c.head_dim, c.rope_theta, x.dtype)
        mask = attention_mask(q_slots, start, max_seq)
        out = []
        for layer, (k_cache, v_cache) in zip(self.layers, kv, strict=True):
            x, k_cache, v_cache = layer(x, cos, sin, mask, slot, k_cache, v_cache)
            out.append((k_cache, v_cache))
        logits = self.lm_head(self.norm(x[:, -1])).float()
        return logits, tuple(out)

    def kv_shape(self, batch: int, max_seq: int) -> tuple[int, int, int, int]:
        """Shape of one layer's k (or v) cache: [batch, num_kv_heads, max_seq, head_dim]."""
        return (batch, self.config.num_kv_heads, max_seq, self.config.head_dim)

    def empty_kv(self, batch: int, max_seq: int, device=None) -> tuple:
        """A zeroed cache for ``batch`` sequences of ``max_seq`` slots, in the parameters' dtype and device."""
        p = self.lm_head.weight
        shape = self.kv_shape(batch, max_seq)
        return tuple((torch.zeros(shape, dtype=p.dtype, device=device or p.device),
                      torch.zeros(shape, dtype=p.dtype, device=device or p.device)) for _ in self.layers)


def llama_lm(
    preset: str = "llama2-7b",
    layers: int | None = None,
    *,
    small: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    cache_update: str = "index",
    **overrides,
) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` with seeded random weights at a published shape, in eval mode.

    Args:
      preset: ``"llama2-7b"`` (multi-head attention) or ``"llama3-8b"`` (GQA, 8 KV heads).
      layers: number of decoder layers (default: the preset's 32).
      small: a tiny shape (hidden 64, 4 heads, 2 KV heads, FFN 160, vocab 256) that runs on CPU.
      dtype, device: of the parameters (``device="meta"``: shapes only). seed: of the weights.
      cache_update: "index" (default), "mask" or "inplace" (see ``write_cache``).
      overrides: any ``LlamaLMConfig`` field.
    Raises:
      ValueError: unknown preset, invalid sizes (``layers`` or an int override < 1).
      TypeError: unknown override name; ``layers``, ``seed`` or an int override that is not an
        int (numpy integers are ints), a float override that is not a real number, ``dtype``
        not a ``torch.dtype``.
    """
    if preset not in LM_PRESETS:
        raise ValueError(f"preset: expected one of {sorted(LM_PRESETS)}, got {preset!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    seed = _int_arg("seed", seed)
    base = LM_SMALL if small else LM_PRESETS[preset]
    if layers is not None:
        overrides["num_layers"] = _int_arg("layers", layers, 1)
    for f in dataclasses.fields(base):  # numbers of the right type, before the config compares them
        if f.name in overrides and isinstance(f.default, int):
            overrides[f.name] = _int_arg(f.name, overrides[f.name], 1)
        elif f.name in overrides and isinstance(f.default, float):
            overrides[f.name] = _real_arg(f.name, overrides[f.name])
    cfg = _replace(base, **overrides)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, cache_update)
    model = model.to(dtype).eval().requires_grad_(False)
    if torch.device(device).type == "meta":
        return model
    return init_random_(model.to_empty(device=device), seed)
