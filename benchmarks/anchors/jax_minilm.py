"""all-MiniLM-L6-v2 as array code over NumPy or ``jax.numpy``, for the JAX dispatch anchor.

The math is that of ``spmd.models.bert.BertSentenceEncoder`` (itself Hugging Face's
``BertModel`` plus the sentence-transformers mean-pooling head): word + position + token-type-0
embeddings and LayerNorm; post-norm encoder layers (scaled dot-product self-attention with an
additive mask of ``finfo.min`` on padded keys, output projection, residual, LayerNorm; exact
erf GELU FFN, residual, LayerNorm); mean pooling over the attention mask; L2 normalisation.
Architecture: Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for
Language Understanding" (2019).

Parameters are a dict keyed by the Hugging Face names of ``model.named_parameters()``; Linear
weights keep PyTorch's ``[out, in]`` layout. Every function takes an :class:`ArrayOps`, so the
same code runs under NumPy (tested on CPU against the PyTorch model) and under ``jax.jit``.
This module imports neither torch nor jax at import time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

EMBED = "embeddings"
LAYER = "encoder.layer"


@dataclass(frozen=True)
class ArrayOps:
    """An array namespace (``numpy`` or ``jax.numpy``) plus the ``erf`` it may lack."""

    xp: Any
    erf: Callable[[Any], Any]


@dataclass(frozen=True)
class EncoderDims:
    """What the parameter shapes do not say: layer count, head count, LayerNorm epsilon."""

    num_layers: int
    num_heads: int
    eps: float

    @staticmethod
    def from_config(cfg: Any) -> EncoderDims:
        """From a ``spmd.models.bert.BertConfig`` (or anything with its three fields)."""
        return EncoderDims(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.layer_norm_eps)


def numpy_ops() -> ArrayOps:
    """NumPy with ``scipy.special.erf`` (or an element-wise ``math.erf`` without SciPy)."""
    import numpy as np

    try:
        from scipy.special import erf
    except ImportError:
        erf = np.vectorize(math.erf, otypes=[np.float64])
    return ArrayOps(np, lambda x: erf(x).astype(x.dtype))


def jax_ops() -> ArrayOps:
    """``jax.numpy`` with ``jax.scipy.special.erf``. Raises ImportError without JAX."""
    import jax.numpy as jnp
    from jax.scipy.special import erf

    return ArrayOps(jnp, erf)


def layer_norm(ops: ArrayOps, x: Any, w: Any, b: Any, eps: float) -> Any:
    """LayerNorm over the last dim with biased variance, as ``torch.nn.LayerNorm``; x [..., H]."""
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / ops.xp.sqrt(var + eps) * w + b


def linear(x: Any, p: Mapping[str, Any], name: str) -> Any:
    """``x @ W.T + b`` for the Linear ``name`` (weight [out, in], bias [out]); x [..., in]."""
    return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]


def gelu(ops: ArrayOps, x: Any) -> Any:
    """Exact GELU, ``x * Phi(x)`` with the normal CDF written through erf (``F.gelu`` default)."""
    return 0.5 * x * (1.0 + ops.erf(x / math.sqrt(2.0)))


def softmax(ops: ArrayOps, x: Any) -> Any:
    """Softmax over the last dim, shifted by the row max."""
    e = ops.xp.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def embeddings(ops: ArrayOps, p: Mapping[str, Any], input_ids: Any, eps: float) -> Any:
    """Word + position + token-type-0 embeddings, then LayerNorm: int ids [B, S] -> [B, S, H]."""
    seq = input_ids.shape[1]
    x = ops.xp.take(p[f"{EMBED}.word_embeddings.weight"], input_ids, axis=0)
    x = x + p[f"{EMBED}.position_embeddings.weight"][:seq] + p[f"{EMBED}.token_type_embeddings.weight"][0]
    return layer_norm(ops, x, p[f"{EMBED}.LayerNorm.weight"], p[f"{EMBED}.LayerNorm.bias"], eps)


def self_attention(ops: ArrayOps, x: Any, p: Mapping[str, Any], prefix: str, mask_bias: Any, num_heads: int) -> Any:
    """Multi-head attention of layer ``prefix``: x [B, S, H], mask_bias [B, 1, 1, S] -> [B, S, H].

    Scores are ``q k^T / sqrt(head_dim) + mask_bias``, as ``F.scaled_dot_product_attention``.
    """
    b, s, h = x.shape
    hd = h // num_heads

    def heads(t: Any) -> Any:
        return t.reshape(b, s, num_heads, hd).transpose(0, 2, 1, 3)  # [B, nh, S, hd]

    q, k, v = (heads(linear(x, p, f"{prefix}.attention.self.{n}")) for n in ("query", "key", "value"))
    scores = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hd)) + mask_bias  # [B, nh, S, S]
    o = softmax(ops, scores) @ v  # [B, nh, S, hd]
    return o.transpose(0, 2, 1, 3).reshape(b, s, h)


def encoder_layer(ops: ArrayOps, x: Any, p: Mapping[str, Any], i: int, mask_bias: Any, dims: EncoderDims) -> Any:
    """Post-norm layer ``i``: attention block then FFN block, each with residual + LayerNorm. [B, S, H]."""
    pre = f"{LAYER}.{i}"
    attn = self_attention(ops, x, p, pre, mask_bias, dims.num_heads)
    a = layer_norm(ops, linear(attn, p, f"{pre}.attention.output.dense") + x,
                   p[f"{pre}.attention.output.LayerNorm.weight"], p[f"{pre}.attention.output.LayerNorm.bias"],
                   dims.eps)
    f = gelu(ops, linear(a, p, f"{pre}.intermediate.dense"))
    return layer_norm(ops, linear(f, p, f"{pre}.output.dense") + a,
                      p[f"{pre}.output.LayerNorm.weight"], p[f"{pre}.output.LayerNorm.bias"], dims.eps)


def sentence_embeddings(ops: ArrayOps, p: Mapping[str, Any], input_ids: Any, attention_mask: Any,
                        dims: EncoderDims) -> Any:
    """The all-MiniLM-L6-v2 pipeline: unit-length sentence embeddings.

    Args:
      p: float32 parameters keyed by Hugging Face names (Linear weights [out, in]).
      input_ids: int [B, S] token ids; attention_mask: int [B, S], 1 = real token, 0 = padding.
      dims: layer count, head count, LayerNorm epsilon.
    Returns:
      float32 [B, H]. Padded keys get an additive score bias of ``finfo(float32).min``; the
      mean pool divides by the real-token count clamped at 1e-9; the L2 norm is clamped at
      1e-12 (``F.normalize``).
    Raises:
      KeyError: a parameter of the architecture is missing from ``p``.
    """
    xp = ops.xp
    x = embeddings(ops, p, input_ids, dims.eps)
    keep = attention_mask.astype(x.dtype)  # [B, S]
    mask_bias = ((1.0 - keep) * xp.finfo(x.dtype).min)[:, None, None, :]  # [B, 1, 1, S]
    for i in range(dims.num_layers):
        x = encoder_layer(ops, x, p, i, mask_bias, dims)
    summed = (x * keep[:, :, None]).sum(1)  # [B, H]
    mean = summed / xp.maximum(keep.sum(1, keepdims=True), 1e-9)
    norm = xp.maximum(xp.sqrt((mean * mean).sum(1, keepdims=True)), 1e-12)
    return mean / norm


def jax_param_specs(param_specs: Mapping[str, tuple], plan_axis: str, mesh_axis: str) -> dict[str, tuple]:
    """Per parameter, the PartitionSpec entries with ``plan_axis`` renamed to ``mesh_axis``.

    ``param_specs`` is ``spmd.models.plans.resolve_plan`` output (``bert_plan``): QKV weights
    and biases split on dim 0 (by heads), attention output / FFN output weights on dim 1 with
    replicated biases, the intermediate weight and bias on dim 0, everything else replicated.
    Raises ValueError for an entry naming another axis.
    """
    out = {}
    for name, spec in param_specs.items():
        bad = [e for e in spec if e not in (None, plan_axis)]
        if bad:
            raise ValueError(f"{name}: spec {tuple(spec)} names axes {bad}; expected only {plan_axis!r}")
        out[name] = tuple(None if e is None else mesh_axis for e in spec)
    return out


def case_arrays(case: Any) -> tuple[dict[str, Any], Any, Any]:
    """A ``benchmarks.workloads.ModelCase`` as NumPy: (float32 params, int32 ids, int32 mask)."""
    import numpy as np

    params = {k: v.detach().cpu().float().numpy() for k, v in case.params.items()}
    ids = case.input_ids.cpu().numpy().astype(np.int32)
    mask = case.attention_mask.cpu().numpy().astype(np.int32)
    return params, ids, mask


def case_dims(real_weights: bool) -> EncoderDims:
    """Layer/head count and epsilon of the model ``minilm_case`` built.

    Real weights: read from the model directory's ``config.json`` as ``minilm.load_model``
    does; random weights: ``BertConfig()`` defaults. Raises ValueError from the config reader.
    """
    from spmd.models import minilm
    from spmd.models.bert import BertConfig

    cfg = minilm.load_config(minilm.find_model_dir()) if real_weights else BertConfig()
    return EncoderDims.from_config(cfg)
