"""Fused attention in programs that take gradients: ``F.scaled_dot_product_attention`` as a forward
op that keeps its softmax statistics and a backward op that reads them.

The joint importer (``spmd.frontend.joint``) traces the autograd engine itself, so the backward of
whatever the forward calls lands in the graph. Two torch custom ops (``torch.library``) make that
backward one node:

- ``spmd::attention_fwd(q, k, v, mask, is_causal, scale) -> (out, packed)``: ``out`` is the
  attention output ``[..., Sq, Dv]``; ``packed`` (``forward_dims``: two sequence-major slabs) holds
  the output and the log-sum-exp of every row's scores (``spmd.ir.custom_calls_attention``);
  not differentiable.
- ``spmd::attention_bwd(dout, q, k, v, mask, packed, is_causal, scale) -> (dq, dk, dv)``: its
  autograd formula.

They convert to the custom calls ``attention-forward`` (plus a slice, reshape and transpose of
slab 0 for ``out``) and ``attention-backward`` (the same per slab for dq, dk, dv); the transposes
undo the slabs' sequence-major order, and cancel against the model's own transposes back to it.
Their eager kernels are the custom calls' kernels, so a program traced here computes what it computes compiled.

``use_fused(...)`` says when SDPA takes this path: ``FUSED_ATTENTION_GRAD`` is on (the
``CompileOptions.fused_attention_grad`` of the compilation, set by ``spmd.lowering``), dropout_p
is 0, q, k and v share their leading dims (or ``enable_gqa=True`` with kv heads dividing the query
heads: k and v are repeated per group first), and the mask needs no gradient and is not combined
with ``is_causal``; otherwise the importer traces SDPA's math definition (dots and softmax).
"""

import contextvars

import torch

from spmd.frontend.aten_common import operand, register
from spmd.frontend.emitter import Emitter
from spmd.ir.custom_calls_attention import attention_backward, attention_forward, backward_dims, forward_dims, seq_major
from spmd.ir.hlo import Instruction, Shape

__all__ = ["FUSED_ATTENTION_GRAD", "check_sdpa_args", "fused_sdpa", "repeat_heads", "use_fused"]

FUSED_ATTENTION_GRAD: contextvars.ContextVar = contextvars.ContextVar("spmd_fused_attention_grad", default=True)


def _config(is_causal: bool, scale, has_mask: bool) -> dict:
    config = {"is_causal": bool(is_causal), "has_mask": has_mask}
    if scale is not None:
        config["scale"] = float(scale)
    return config


def _full_mask(mask, q, k):
    return None if mask is None else mask.expand(*q.shape[:-1], k.shape[-2])


@torch.library.custom_op("spmd::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                  scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[..., Sq, Dv]``, packed ``[..., Sq, Dv + c]``): see ``spmd.ir.custom_calls_attention``."""
    mask = _full_mask(mask, q, k)
    ops = [q, k, v] + ([] if mask is None else [mask])
    packed = attention_forward(ops, _config(is_causal, scale, mask is not None))
    return _unslab(packed[0], q.shape[:-2], q.shape[-2], v.shape[-1]).clone(), packed


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, mask, is_causal, scale):
    return (q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(forward_dims(q.shape, k.shape, v.shape, q.dtype)))


@torch.library.custom_op("spmd::attention_bwd", mutates_args=())
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  packed: torch.Tensor, is_causal: bool,
                  scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``attention_fwd`` from its packed result and the output gradient ``dout``."""
    mask = _full_mask(mask, q, k)
    ops = [q, k, v, packed, dout] + ([] if mask is None else [mask])
    grads = attention_backward(ops, _config(is_causal, scale, mask is not None))
    return tuple(_unslab(g, t.shape[:-2], *t.shape[-2:]).clone() for g, t in zip(grads, (q, k, v), strict=True))


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, mask, packed, is_causal, scale):
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape)


def _unslab(slab: torch.Tensor, lead, s: int, e: int) -> torch.Tensor:
    """One slab ``seq_major(lead, S', E')`` of a packed result as ``[*lead, s, e]`` (a view)."""
    part = slab[..., :s, :, :e] if lead else slab[:s, :e]
    return part.movedim(-3, -2) if lead else part


class _FusedAttention(torch.autograd.Function):
    """Autograd of ``attention_fwd``: the backward is ``attention_bwd`` (a ``torch.autograd.Function``
    with ``setup_context``, so ``torch.func.grad`` can differentiate it too). First derivatives
    only: differentiating the gradients it returns raises NotImplementedError."""

    @staticmethod
    def forward(q, k, v, mask, is_causal, scale):
        return attention_fwd(q, k, v, mask, is_causal, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, is_causal, scale = inputs
        ctx.save_for_backward(q, k, v, mask, output[1])
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, dout, _dpacked):
        q, k, v, mask, packed = ctx.saved_tensors
        dq, dk, dv = _FusedAttentionBackward.apply(dout.to(q.dtype), q, k, v, mask, packed, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None, None


class _FusedAttentionBackward(torch.autograd.Function):
    """``attention_bwd`` as a function whose own derivative is a clear error (second derivatives
    through the fused attention are not supported)."""

    @staticmethod
    def forward(dout, q, k, v, mask, packed, is_causal, scale):
        return attention_bwd(dout, q, k, v, mask, packed, is_causal, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "second derivatives through the fused scaled_dot_product_attention are not supported; compile with "
            "spmd.CompileOptions(fused_attention_grad=False) to differentiate its math definition")


def repeat_heads(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """k or v ``[..., Hkv, S, E]`` with each head repeated ``n_heads / Hkv`` times (GQA, as
    ``enable_gqa=True`` defines it: query head h reads kv head ``h // (n_heads / Hkv)``)."""
    h = t.shape[-3]
    if h == n_heads:
        return t
    lead = t.shape[:-3]
    return t.unsqueeze(-3).expand(*lead, h, n_heads // h, *t.shape[-2:]).reshape(*lead, n_heads, *t.shape[-2:])


def _gqa_ok(query, key, value) -> bool:
    if min(query.dim(), key.dim(), value.dim()) < 3 or query.shape[:-3] != key.shape[:-3]:
        return False
    hq, hk = query.shape[-3], key.shape[-3]
    return hk == value.shape[-3] and hk > 0 and hq % hk == 0


def check_sdpa_args(query, key, value, attn_mask=None, *args, **kwargs) -> None:
    """PyTorch's own argument checks of ``F.scaled_dot_product_attention`` that neither the fused ops
    nor the math definition would make: key and value of one sequence length (``[..., S, E]`` and
    ``[..., S, Ev]``), and a mask that is bool, float32 or of the query's dtype (eager refuses an
    integer or other 16-bit mask; the math definition would add it as a bias).

    Raises ValueError (key / value lengths) or TypeError (mask dtype) naming the argument.
    """
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (query, key, value)):
        return
    if key.shape[-2] != value.shape[-2]:
        raise ValueError("scaled_dot_product_attention: key and value must have the same sequence length "
                         f"(dim -2), got key {list(key.shape)} and value {list(value.shape)}")
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise TypeError(f"scaled_dot_product_attention: attn_mask must be bool, float32 or the query's dtype "
                        f"{query.dtype}, got {attn_mask.dtype}")


def use_fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False) -> bool:
    """Whether this SDPA call (``F.scaled_dot_product_attention``'s arguments) takes the fused ops."""
    if not FUSED_ATTENTION_GRAD.get() or dropout_p:
        return False
    ts = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.dim() >= 2 for t in ts):
        return False
    if len({t.dtype for t in ts}) != 1 or query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
        return False
    if enable_gqa:
        if not _gqa_ok(query, key, value):
            return False
    elif not query.shape[:-2] == key.shape[:-2] == value.shape[:-2]:
        return False
    if attn_mask is not None:
        if is_causal or (not isinstance(attn_mask, torch.Tensor) or attn_mask.requires_grad
                or attn_mask.dtype not in (torch.bool, query.dtype)):
            return False
        scores = (*query.shape[:-1], key.shape[-2])
        try:
            if tuple(torch.broadcast_shapes(attn_mask.shape, scores)) != scores:
                return False
        except RuntimeError:
            return False
    return scale is None or isinstance(scale, (int, float))


def fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` through ``spmd::attention_fwd`` (call when ``use_fused``).

    With ``enable_gqa`` the key / value heads are repeated to the query's head count first (their
    gradients are summed back over each group by autograd)."""
    if enable_gqa:
        key, value = repeat_heads(key, query.shape[-3]), repeat_heads(value, query.shape[-3])
    scale = None if scale is None else float(scale)
    return _FusedAttention.apply(query, key, value, attn_mask, bool(is_causal), scale)[0]


# --------------------------------------------------------------------------- converters
def _mask_operand(em: Emitter, mask, q: Instruction, k: Instruction) -> list[Instruction]:
    if mask is None:
        return []
    dtype = "pred" if mask.shape.dtype == "pred" else q.shape.dtype
    return [operand(em, mask, dtype, q.shape.dims[:-1] + (k.shape.dims[-2],))]


def _slab_value(em: Emitter, packed: Instruction, index: int, lead, s: int, e: int) -> Instruction:
    """Slab ``index`` of a packed result, cut to sequence ``s`` and last dim ``e``, as ``[*lead, s, e]``:
    slice, reshape (drop the slab dim), and a transpose back from the sequence-major order."""
    starts = [(index, index + 1, 1)] + [(0, n, 1) for n in seq_major(lead, s, e)]
    part = em.slice(packed, starts)
    part = em.reshape(part, seq_major(lead, s, e))
    if not lead:
        return part
    r = len(lead) + 2
    perm = (*range(r - 3), r - 2, r - 3, r - 1)
    return em.transpose(part, perm)


@register(torch.ops.spmd.attention_fwd.default)
def _convert_fwd(em: Emitter, a: dict, val) -> tuple[Instruction, Instruction]:
    q, k, v, mask = a["q"], a["k"], a["v"], a["mask"]
    masks = _mask_operand(em, mask, q, k)
    dims = forward_dims(q.shape.dims, k.shape.dims, v.shape.dims, q.shape.torch_dtype)
    packed = em.custom_call("attention-forward", [q, k, v, *masks], Shape(q.shape.dtype, dims),
                            _config(a["is_causal"], a["scale"], bool(masks)))
    lead = q.shape.dims[:-2]
    return _slab_value(em, packed, 0, lead, q.shape.dims[-2], v.shape.dims[-1]), packed


@register(torch.ops.spmd.attention_bwd.default)
def _convert_bwd(em: Emitter, a: dict, val) -> tuple[Instruction, Instruction, Instruction]:
    q, k, v, mask, packed = a["q"], a["k"], a["v"], a["mask"], a["packed"]
    dout = em.convert(a["dout"], q.shape.dtype)
    masks = _mask_operand(em, mask, q, k)
    shape = Shape(q.shape.dtype, backward_dims(q.shape.dims, k.shape.dims, v.shape.dims))
    grads = em.custom_call("attention-backward", [q, k, v, packed, dout, *masks], shape,
                           _config(a["is_causal"], a["scale"], bool(masks)))
    return tuple(_slab_value(em, grads, i, t.shape.dims[:-2], *t.shape.dims[-2:]) for i, t in enumerate((q, k, v)))
