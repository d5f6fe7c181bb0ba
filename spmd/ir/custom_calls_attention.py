"""Custom-call targets for training attention: a fused forward that keeps its softmax statistics and
a fused backward that reads them (FlashAttention's recipe: Dao et al., "FlashAttention", 2022, and
"FlashAttention-2", 2023; the backward recomputes the probabilities from q, k and the saved
log-sum-exp instead of keeping the ``[..., Sq, Sk]`` scores).

=====================  ==================================  ==========================================
target                 operands                            result
=====================  ==================================  ==========================================
attention-forward      q, k, v[, mask]                     packed ``[2, *seq_major(lead, Sq, E)]``
attention-backward     q, k, v, packed, dout[, mask]       grads ``[3, *seq_major(lead, Smax, Dmax)]``
=====================  ==================================  ==========================================

q ``[*lead, Sq, D]``, k ``[*lead, Sk, D]``, v ``[*lead, Sk, Dv]``; mask broadcast to ``[*lead, Sq, Sk]``
(bool: True = attend; float: added to the scores). backend_config: ``is_causal`` (False),
``scale`` (None = 1/sqrt(D)), ``has_mask`` (False), ``backend`` ("auto" | "math").

A custom call has one array result, so each call packs its results into one array of *slabs*
along a new leading dim, each slab in the sequence-major order ``seq_major(lead, S, E) =
(*lead[:-1], S, lead[-1], E)`` (``(S, E)`` for rank-2 q): for the usual ``[B, H, S, D]`` operands
a slab is ``[B, S, H, E]``, the memory order of the projections ``[B*S, H*E]`` that feed q, k, v
and read the output and the gradients. So the importer's slice of one slab, transposed back to
``[B, H, S, E]`` and by the model to ``[B, S, H, E]``, reshapes to ``[B*S, H*E]`` as a view
(no copy kernel), and the kernels' own ``[B, S, H, D]`` results (flash / memory-efficient /
cuDNN, for q, k, v that are transposed views of projections) go into their slabs by plain
memory copies rather than transposing ones.

- Forward: ``E = max(Dv, w)`` with ``w = stat_width(dtype)`` (2 for 16-bit types, else 1).
  Slab 0 holds the attention output in columns ``[0, Dv)``; slab 1 holds each row's
  log-sum-exp of the scaled scores (float32, float64 for float64 inputs) bit-packed into
  columns ``[0, w)``; slab 0's columns past ``Dv`` are zero, slab 1's past ``w`` unspecified
  (never read: writing them would cost a pass over a whole slab). The importer slices the output off slab 0
  and hands the packed value itself to the backward, so the statistics are an ordinary value
  that buffer assignment keeps alive from forward to backward (and that reshards with q: every
  row's statistics sit at that row's position).
- Backward: ``Smax = max(Sq, Sk)``, ``Dmax = max(D, Dv)``; slab 0 holds dq in ``[:Sq, :D]``,
  slab 1 dk in ``[:Sk, :D]``, slab 2 dv in ``[:Sk, :Dv]`` (per slab's sequence and last dims);
  the rest (only where the sizes differ) zero.

Kernels (``backend="auto"``): the fused kernel ``torch._fused_sdp_choice`` picks for these
inputs, the one ``F.scaled_dot_product_attention`` itself would use (CPU: ATen's flash kernel
for CPU; CUDA: flash, memory-efficient or cuDNN attention), else the math definition below.
The choice is made with q, k, v marked as needing gradients, so the backward kernel's limits
count too. Forward and backward make the same choice (it depends on shapes, dtypes, strides and
the mask only, and both calls read the same q, k, v values). ``backend="math"`` always uses the
math definition (float32 arithmetic for 16-bit inputs); an unknown backend is a ValueError.
Only dropout_p = 0: the importer rejects SDPA with dropout (a clear error).

Sharding rule ``"attention"`` (``spmd.passes.sharding_rules``): the leading (batch, head) dims of
every operand and of the result may be sharded alike (in a packed result, at its dims
``slab_dim``); the sequence and last dims are unsharded.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn.attention import SDPBackend

Config = dict[str, Any]

__all__ = ["ATTENTION_GRAD_CALLS", "attention_backward", "attention_forward", "backward_dims", "check_result_shape",
           "forward_dims", "seq_major", "slab_dim", "stat_width"]


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the saved log-sum-exp: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def stat_width(dtype: torch.dtype) -> int:
    """Columns of ``dtype`` that one log-sum-exp value (``stat_dtype``) occupies: 2 for 16-bit
    types, else 1."""
    return max(1, stat_dtype(dtype).itemsize // dtype.itemsize)


def seq_major(lead, s, e) -> tuple:
    """A slab's dims for leading dims ``lead``, sequence ``s`` and last dim ``e``: the sequence
    before the last leading (head) dim, ``(*lead[:-1], s, lead[-1], e)``; ``(s, e)`` without
    leading dims. Also maps per-dim values other than sizes (shardings)."""
    lead = tuple(lead)
    return (*lead[:-1], s, lead[-1], e) if lead else (s, e)


def slab_dim(lead_rank: int, i: int) -> int:
    """Dim of the packed result (slab dim first) that holds leading dim ``i`` of q."""
    return 1 + i if i < lead_rank - 1 else 2 + i


def forward_dims(q, k, v, dtype: torch.dtype) -> tuple[int, ...]:
    """Dims of ``attention-forward``'s result for q, k, v dims: ``[2, *seq_major(lead, Sq, E)]``,
    ``E = max(Dv, stat_width(dtype))``."""
    return (2, *seq_major(q[:-2], q[-2], max(v[-1], stat_width(dtype))))


def backward_dims(q, k, v) -> tuple[int, ...]:
    """Dims of ``attention-backward``'s result: ``[3, *seq_major(lead, max(Sq, Sk), max(D, Dv))]``."""
    return (3, *seq_major(q[:-2], max(q[-2], k[-2]), max(q[-1], v[-1])))


def check_result_shape(target: str, operand_shapes, shape) -> None:
    """ValueError unless ``shape`` (an ``spmd.ir.hlo.Shape``) is the result shape of ``target``
    (``attention-forward`` / ``attention-backward``) for these operand shapes; other targets pass."""
    if target not in ("attention-forward", "attention-backward"):
        return
    need = 3 if target == "attention-forward" else 5
    if len(operand_shapes) < need or any(o.is_tuple or o.rank < 2 for o in operand_shapes[:need]):
        raise ValueError(f"{target}: expected at least {need} array operands of rank >= 2, got "
                         f"{[str(o) for o in operand_shapes]}")
    q, k, v = (o.dims for o in operand_shapes[:3])
    if target == "attention-forward":
        dims = forward_dims(q, k, v, operand_shapes[0].torch_dtype)
    else:
        dims = backward_dims(q, k, v)
    if shape.dtype != operand_shapes[0].dtype or tuple(shape.dims) != dims:
        raise ValueError(f"{target}: result must be {operand_shapes[0].dtype}{list(dims)} for q {operand_shapes[0]}, "
                         f"k {operand_shapes[1]}, v {operand_shapes[2]}; got {shape}")


# --------------------------------------------------------------------------- helpers
def _as4d(t: torch.Tensor) -> torch.Tensor:
    """``[*lead, S, D]`` as ``[B, H, S, D]`` (PyTorch's fused kernels take 4-d inputs only): ``H``
    the last leading dim (1 without one), ``B`` the product of the others."""
    if t.dim() < 4:
        return t.reshape(1, -1 if t.dim() == 3 else 1, *t.shape[-2:])
    return t.flatten(0, -4) if t.dim() > 4 else t


def _slabs(packed: torch.Tensor, b: int, h: int) -> torch.Tensor:
    """A packed result ``[n, *seq_major(lead, S, E)]`` as ``[n, B, H, S, E]``, the leading dims as
    ``_as4d`` folds them (a view of a contiguous one, which the results written here are)."""
    n, s, e = packed.shape[0], packed.shape[-3 if packed.dim() > 3 else -2], packed.shape[-1]
    return packed.reshape(n, b, s, h, e).transpose(2, 3)


def _dense_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` as is when its last dim is dense and its rows are 16-byte aligned (stride 1 and every
    other stride and the start a multiple of 16 bytes: what the fused kernels read directly; the
    other strides are free, so transposed views of a projection's output go in without a copy),
    else a contiguous copy (the backward reads the output slab of the packed forward result in place)."""
    size = t.element_size()
    aligned = t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for n, st in zip(t.shape[:-1], t.stride()[:-1],
                                                                                strict=True) if n > 1)
    return t if aligned and (t.shape[-1] <= 1 or t.stride(-1) == 1) else t.contiguous()


def _bias(mask: torch.Tensor | None, q4: torch.Tensor, k4: torch.Tensor, lead) -> torch.Tensor | None:
    """The mask as an additive bias ``[B, H, Sq, Sk]`` in q's dtype (bool False -> -inf)."""
    if mask is None:
        return None
    full = mask.expand(*lead, q4.shape[-2], k4.shape[-2]).reshape(*q4.shape[:-1], k4.shape[-2])
    if full.dtype == torch.bool:
        zero = torch.zeros((), dtype=q4.dtype, device=q4.device)
        full = torch.where(full, zero, torch.full((), -math.inf, dtype=q4.dtype, device=q4.device))
    return full.to(q4.dtype)


def _scale(config: Config, d: int) -> float:
    s = config.get("scale")
    return 1.0 / math.sqrt(d) if s is None else float(s)


def _choose(q, k, v, bias, causal: bool, scale: float, config: Config) -> str:
    """The kernel for these 4-d inputs: "flash-cpu", "flash", "efficient", "cudnn" or "math"."""
    backend = config.get("backend", "auto")
    if backend not in ("auto", "math"):
        raise ValueError(f"attention backend_config backend: expected 'auto' or 'math', got {backend!r}")
    if backend == "math" or q.shape[-1] != v.shape[-1] or q.numel() == 0 or k.shape[-2] == 0:
        return "math"
    try:  # inputs marked as needing gradients: the choice then also checks the backward's limits
        probe = tuple(t.detach().requires_grad_() for t in (q, k, v))
    except RuntimeError:  # inference-mode tensors
        probe = (q, k, v)
    try:
        choice = int(torch._fused_sdp_choice(*probe, bias, 0.0, causal, scale=scale))
    except RuntimeError:
        return "math"
    if q.device.type == "cpu":
        return "flash-cpu" if choice == SDPBackend.FLASH_ATTENTION.value else "math"
    if choice == SDPBackend.FLASH_ATTENTION.value and bias is None:
        return "flash"
    if choice == SDPBackend.CUDNN_ATTENTION.value:
        return "cudnn"
    if choice == SDPBackend.EFFICIENT_ATTENTION.value:
        return "efficient"
    return "math"


def _causal_keep(sq: int, sk: int, device) -> torch.Tensor:
    """PyTorch's causal mask: row i attends to columns j <= i (top-left aligned)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def _math_probs(q, k, bias, causal, scale, lse=None):
    """Scores' softmax in float32 (float64 for float64) and the log-sum-exp; rows with nothing to
    attend to get probability 0 (as PyTorch's math kernel)."""
    wide = stat_dtype(q.dtype)
    s = torch.matmul(q.to(wide), k.to(wide).transpose(-2, -1)) * scale
    if bias is not None:
        s = s + bias.to(wide)
    if causal:
        s = s.masked_fill(~_causal_keep(q.shape[-2], k.shape[-2], q.device), -math.inf)
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    finite = torch.isfinite(lse)[..., None]
    p = torch.where(finite, torch.exp(s - torch.where(finite, lse[..., None], 0)), 0)
    return p, lse


def _dummy_rng(q: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Philox seed / offset placeholders for dropout_p = 0 (the kernels do not read them), shaped as
    the forward kernels return them (ATen's meta functions)."""
    if kind == "flash":
        return torch.empty(2, dtype=torch.uint64, device=q.device), torch.empty((), dtype=torch.uint64, device=q.device)
    return torch.empty((), dtype=torch.long, device=q.device), torch.empty((), dtype=torch.long, device=q.device)


def _aligned(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias with its last dim's storage padded to a multiple of 16 elements (what
    ``F.scaled_dot_product_attention`` does for the memory-efficient kernel); same values."""
    if bias is None or bias.shape[-1] % 16 == 0:
        return bias
    return torch.nn.functional.pad(bias, (0, -bias.shape[-1] % 16))[..., :bias.shape[-1]]


def _target(out: torch.Tensor | None, q: torch.Tensor, shape) -> torch.Tensor:
    """Where a kernel writes its packed result: ``out`` when it is contiguous, else a new tensor."""
    return out if out is not None and out.is_contiguous() else q.new_empty(shape)


def _written(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None or out is result:
        return result
    return out.copy_(result)


# --------------------------------------------------------------------------- forward
def _forward4(q, k, v, bias, causal, scale, kind):
    """(out ``[B, H, Sq, Dv]``, lse ``[B, H, Sq]`` in ``stat_dtype``) by kernel ``kind``."""
    aten = torch.ops.aten
    sq = q.shape[-2]
    if kind == "flash-cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    elif kind == "flash":
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
    elif kind == "cudnn":
        res = aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1].reshape(*q.shape[:2], sq)
    elif kind == "efficient":
        res = aten._scaled_dot_product_efficient_attention(q, k, v, _aligned(bias), True, 0.0, causal, scale=scale)
        out, lse = res[0], res[1][..., :sq]
    else:
        p, lse = _math_probs(q, k, bias, causal, scale)
        out = torch.matmul(p, v.to(p.dtype)).to(q.dtype)
    return out, lse.to(stat_dtype(q.dtype))


def attention_forward(operands: list[torch.Tensor], config: Config, out: torch.Tensor | None = None) -> torch.Tensor:
    """``attention-forward``: q, k, v[, mask] -> packed ``forward_dims(q, k, v)`` (q's dtype).

    Slab 0: softmax(q kᵀ·scale + mask) v in columns ``[0, Dv)``; slab 1: the float32 (float64)
    log-sum-exp of each row's scaled, masked scores, bit-packed into columns ``[0, stat_width)``;
    slab 0's columns past Dv zero, slab 1's past stat_width unspecified. Written into ``out`` when given.
    """
    q, k, v = operands[:3]
    mask = operands[3] if config.get("has_mask", len(operands) > 3) else None
    lead = q.shape[:-2]
    q4, k4, v4 = (_dense_last(_as4d(t)) for t in (q, k, v))
    bias = _bias(mask, q4, k4, lead)
    causal = bool(config.get("is_causal", False))
    scale = _scale(config, q.shape[-1])
    attn, lse = _forward4(q4, k4, v4, bias, causal, scale, _choose(q4, k4, v4, bias, causal, scale, config))
    b, h, sq, dv = attn.shape
    result = _target(out, q, forward_dims(q.shape, k.shape, v.shape, q.dtype))
    slabs = _slabs(result, b, h)
    width, cols = stat_width(q.dtype), result.shape[-1]
    if cols > dv:
        slabs[0, ..., dv:].zero_()
    slabs[0, ..., :dv].copy_(attn)  # a plain memory copy when the kernel wrote [B, S, H, Dv]
    stats = lse.contiguous().unsqueeze(-1).view(q.dtype).transpose(1, 2)  # [B, Sq, H, width]
    stat_slab = result[1].view(b, sq, h, cols)
    stat_slab[..., :width].copy_(stats)  # only the statistics: the rest of the slab is never read
    return _written(out, result)


# --------------------------------------------------------------------------- backward
def _backward4(do, q, k, v, bias, out, lse, causal, scale, kind):
    """(dq, dk, dv) of 4-d inputs by kernel ``kind``; ``lse`` ``[B, H, Sq]`` as the forward saved it."""
    aten = torch.ops.aten
    sq, sk = q.shape[-2], k.shape[-2]
    if kind == "flash-cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    seed, offset = _dummy_rng(q, kind)
    if kind == "flash":
        return aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, lse.float().contiguous(), None, None, sq, sk, 0.0, causal, seed, offset, scale=scale)
    if kind == "cudnn":
        return aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, out, lse.float().unsqueeze(-1).contiguous(), seed, offset, bias, None, None, sq, sk, 0.0,
            causal, scale=scale)
    if kind == "efficient":
        padded = torch.nn.functional.pad(lse.float(), (0, -sq % 32)).contiguous()
        res = aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, _aligned(bias), out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
        return res[0], res[1], res[2]
    p, _ = _math_probs(q, k, bias, causal, scale, lse)
    wide = p.dtype
    do_w, v_w = do.to(wide), v.to(wide)
    dv = torch.matmul(p.transpose(-2, -1), do_w)
    dp = torch.matmul(do_w, v_w.transpose(-2, -1))
    delta = (do_w * out.to(wide)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    return torch.matmul(ds, k.to(wide)), torch.matmul(ds.transpose(-2, -1), q.to(wide)), dv


def attention_backward(operands: list[torch.Tensor], config: Config, out: torch.Tensor | None = None) -> torch.Tensor:
    """``attention-backward``: q, k, v, packed, dout[, mask] -> grads ``backward_dims(q, k, v)``.

    ``packed`` is ``attention-forward``'s result for the same q, k, v, mask and config; dout
    ``[..., Sq, Dv]``. The result's slabs hold dq, dk, dv (q's dtype, zeros past their sizes);
    written into ``out`` when given.
    """
    q, k, v, packed, do = operands[:5]
    mask = operands[5] if config.get("has_mask", len(operands) > 5) else None
    lead, dv_size = q.shape[:-2], v.shape[-1]
    q4, k4, v4 = (_dense_last(_as4d(t)) for t in (q, k, v))
    b, h = q4.shape[:2]
    p5 = _slabs(packed, b, h)
    attn = _dense_last(p5[0, ..., :dv_size])  # the output slab in place
    width = stat_width(q.dtype)
    lse = p5[1, ..., :width].contiguous().view(stat_dtype(q.dtype)).squeeze(-1)
    do4 = _dense_last(_as4d(do)).to(q.dtype)
    bias = _bias(mask, q4, k4, lead)
    causal = bool(config.get("is_causal", False))
    scale = _scale(config, q.shape[-1])
    kind = _choose(q4, k4, v4, bias, causal, scale, config)
    grads = _backward4(do4, q4, k4, v4, bias, attn, lse, causal, scale, kind)
    result = _target(out, q, backward_dims(q.shape, k.shape, v.shape))
    slabs = _slabs(result, b, h)
    if any(g.shape[-2:] != slabs.shape[-2:] for g in grads):
        result.zero_()
    for slab, g in zip(slabs, grads, strict=True):
        slab[..., :g.shape[-2], :g.shape[-1]].copy_(g)  # plain memory copies for [B, S, H, D] grads
    return _written(out, result)


ATTENTION_GRAD_CALLS = (
    ("attention-forward", attention_forward, "attention", None,
     "fused attention forward: output and bit-packed log-sum-exp in one array"),
    ("attention-backward", attention_backward, "attention", None,
     "fused attention backward from the packed forward result: dq, dk, dv in one array"),
)
