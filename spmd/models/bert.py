"""A compact BERT encoder with mean pooling: the sentence-embedding model of all-MiniLM-L6-v2.

The module mirrors Hugging Face's ``BertModel`` parameter names
(``embeddings.word_embeddings.weight``, ``encoder.layer.3.attention.self.query.weight``, ...)
so that a ``model.safetensors`` checkpoint loads with ``load_state_dict`` and sharding plans
read like the checkpoint. On top of the encoder it applies the sentence-transformers head
of all-MiniLM-L6-v2: mean pooling over the attention mask, then L2 normalisation.

The forward has no data-dependent Python control flow: every shape is static for a given
input shape, so ``torch.export`` traces it into one graph.

Architecture: Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for
Language Understanding" (2019); post-norm residual blocks, exact (erf) GELU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    """Shape of a BERT encoder (the fields of a Hugging Face ``config.json`` we use).

    Sizes are element counts; ``layer_norm_eps`` is the LayerNorm epsilon.
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )

    @staticmethod
    def from_dict(d: dict) -> BertConfig:
        """Read the known keys of a Hugging Face BERT ``config.json`` dict; others are ignored.

        Raises ValueError if ``hidden_act`` is present and not ``"gelu"``.
        """
        act = d.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"config hidden_act: expected 'gelu', got {act!r}")
        names = BertConfig.__dataclass_fields__
        return BertConfig(**{k: d[k] for k in names if k in d})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class BertEmbeddings(nn.Module):
    """Word + position + token-type (type 0) embeddings, then LayerNorm.

    input_ids: int64 [B, S] -> [B, S, hidden].
    """

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        x = self.word_embeddings(input_ids)  # [B, S, H]
        x = x + self.position_embeddings.weight[:seq]  # [S, H] broadcast over B
        x = x + self.token_type_embeddings.weight[0]  # [H]: every token has type 0
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    """Multi-head self-attention projections and scaled dot-product attention.

    x: [B, S, H], mask_bias: [B, 1, 1, S] additive (0 keep, very negative drop) -> [B, S, H].
    """

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, S, hd]

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_bias)  # [B, nh, S, hd]
        return o.transpose(1, 2).reshape(b, s, h)


class BertSelfOutput(nn.Module):
    """Attention output projection, residual add, LayerNorm. [B, S, H] x2 -> [B, S, H]."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(attn) + residual)


class BertAttention(nn.Module):
    """Self-attention plus its output block."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim  # read by sharding plans
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask_bias), x)


class BertIntermediate(nn.Module):
    """FFN up-projection with exact GELU. [B, S, H] -> [B, S, F]."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class BertOutput(nn.Module):
    """FFN down-projection, residual add, LayerNorm. [B, S, F], [B, S, H] -> [B, S, H]."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertLayer(nn.Module):
    """One post-norm encoder layer: attention block, then FFN block."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        a = self.attention(x, mask_bias)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    """``num_hidden_layers`` encoder layers in sequence."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, mask_bias)
        return x


class BertSentenceEncoder(nn.Module):
    """BERT encoder + mean pooling + L2 normalisation (the all-MiniLM-L6-v2 pipeline).

    forward(input_ids, attention_mask):
      input_ids: int64 [B, S] token ids; attention_mask: int64 (or bool) [B, S], 1 = real token.
      Returns float [B, hidden]: unit-length sentence embeddings in the parameters' dtype.
    """

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids)  # [B, S, H]
        keep = attention_mask.to(x.dtype)  # [B, S]
        mask_bias = ((1.0 - keep) * torch.finfo(x.dtype).min)[:, None, None, :]  # [B, 1, 1, S]
        x = self.encoder(x, mask_bias)
        summed = (x * keep[:, :, None]).sum(dim=1)  # [B, H]
        count = keep.sum(dim=1, keepdim=True).clamp(min=1e-9)  # [B, 1]
        mean = summed / count
        norm = (mean * mean).sum(dim=1, keepdim=True).sqrt().clamp(min=1e-12)  # as F.normalize(p=2, eps=1e-12)
        return mean / norm
