"""ATen -> HLO-lite converters for ATen's fused scaled-dot-product attention ops and their backwards.

``F.scaled_dot_product_attention`` is normally converted before it reaches ATen (``aten_nn_ops``'s
``attention`` call; ``spmd.frontend.joint_attention`` in programs that take gradients). These
converters cover the programs where PyTorch itself dispatches it to a fused kernel inside the
trace: a ``torch.utils.checkpoint`` region (its recomputation runs under the autograd engine,
where the trace's torch-function mode does not see it), a user ``torch.autograd.Function`` whose
forward / backward call SDPA, and graphs that name the ops directly.

=================================================  ===============================================
op                                                 results converted
=================================================  ===============================================
``_scaled_dot_product_flash_attention_for_cpu``    out ``[B, H, Sq, Dv]``, logsumexp ``[B, H, Sq]``
``_scaled_dot_product_flash_attention``            out, logsumexp ``[B, H, Sq]`` (+ rng / seq values)
``_scaled_dot_product_efficient_attention``        out, log_sumexp ``[B, H, ceil(Sq / 32) * 32]``
``_scaled_dot_product_cudnn_attention``            out, logsumexp ``[B, H, Sq, 1]`` (+ rng / seq values)
``_scaled_dot_product_fused_attention_overrideable``  out, logsumexp ``[B, H, Sq]``
their ``_backward`` ops                            grad_query, grad_key, grad_value (+ grad_attn_bias)
=================================================  ===============================================

Lowering (PyTorch's definitions; the log-sum-exp is the natural log of the sum of the exponentials
of each row's scaled, masked scores, float32 for 16-bit inputs):

- forward: the output by the ``attention-forward`` custom call (slab 0 of its packed result,
  ``spmd.ir.custom_calls_attention``); the log-sum-exp as its math definition (dot, maximum and
  sum reductions) in float32 (float64 for float64), shaped as the op returns it. A row with
  nothing to attend to gets the kernels' value: 0 (ATen's CPU flash kernel), +inf (the CUDA
  kernels, FlashAttention's convention); its output and gradients are zero.
- backward: when its out and logsumexp are a converted forward's (same q, k, v, mask, causal
  flag and scale: the usual case, also after a checkpoint's recomputation), the
  ``attention-backward`` custom call on that forward's packed result; the forward's math
  log-sum-exp is then dead code. Otherwise FlashAttention-2's backward formulas (Dao, 2023) from
  (q, k, v, out, logsumexp, grad_out): ``P = exp(S - lse)``, ``dV = Pᵀ dO``, ``dP = dO Vᵀ``,
  ``dS = P (dP - rowsum(dO * O))``, ``dQ = dS K · scale``, ``dK = dSᵀ Q · scale``.

With ``CompileOptions(fused_attention_grad=False)`` the output is the math definition too
(softmax as ``exp(S - lse)``, then a dot with v) and every backward takes the math formulas.

Rng, sequence-length and debug results are placeholders that only these backwards may read.
Dropout (``dropout_p > 0``), ``return_debug_mask=True``, sliding windows and other extra arguments
raise UnsupportedOpError (through NotImplementedError) naming the argument. Sharding: the custom
calls' ``attention`` rule and the dot / reduce rules (batch and head dims shard).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from spmd.frontend.aten_common import register
from spmd.frontend.emitter import Emitter
from spmd.frontend.joint_attention import FUSED_ATTENTION_GRAD, _config, _mask_operand, _slab_value
from spmd.ir.custom_calls_attention import backward_dims, forward_dims
from spmd.ir.hlo import Instruction, Shape

aten = torch.ops.aten

__all__ = ["FORWARD_OPS", "BACKWARD_OPS"]


class Placeholder:
    """An rng / sequence-length / debug result of a fused attention forward: read only by the
    fused backwards (which ignore it); other converters reject it as an operand."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __repr__(self) -> str:
        return f"<{self.what}: not computed by the compiled program>"


@dataclass(frozen=True)
class _Forward:
    """A converted forward: its operands (before any head repetition), config and packed result."""

    q: Instruction
    k: Instruction
    v: Instruction
    mask: Any
    config: tuple
    packed: Instruction
    out: Instruction


#: per emitter: id(logsumexp instruction) -> the forward that produced it
_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _overload(name: str, overload: str = "default"):
    packet = getattr(aten, name, None)
    return None if packet is None or overload not in packet.overloads() else getattr(packet, overload)


def _ops(*names: str) -> tuple:
    return tuple(op for op in (_overload(n) for n in names) if op is not None)


FORWARD_OPS = _ops("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                   "_scaled_dot_product_fused_attention_overrideable")
BACKWARD_OPS = _ops(*(f"{op._schema.name.split('::')[1]}_backward" for op in FORWARD_OPS))

#: arguments the converters read or ignore (rng / sequence bookkeeping); any other argument that is
#: not at its neutral value is rejected
_KNOWN = frozenset({
    "query", "key", "value", "attn_mask", "attn_bias", "dropout_p", "is_causal", "scale", "return_debug_mask",
    "compute_log_sumexp", "grad_out", "grad_out_", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
    "philox_seed", "philox_offset", "grad_input_mask",
})


def _check_args(op, a: dict) -> str:
    """The op's name; NotImplementedError for dropout, a debug mask, an argument this module does
    not know at other than its schema default (None / False without one), or non-float q, k, v."""
    name = op._schema.name.split("::")[-1]
    defaults = {arg.name: arg.default_value for arg in op._schema.arguments if arg.has_default_value()}
    if a.get("dropout_p"):
        raise NotImplementedError(f"{name}: dropout_p={a['dropout_p']} (only dropout_p=0 is supported inside "
                                  "ATen's fused attention; apply dropout outside it)")
    if a.get("return_debug_mask"):
        raise NotImplementedError(f"{name}: return_debug_mask=True is not supported")
    for key, value in a.items():
        neutral = value is None or value is False or (key in defaults and value == defaults[key])
        if key not in _KNOWN and not neutral:
            raise NotImplementedError(f"{name}: argument {key}={value!r} is not supported")
    for key in ("query", "key", "value"):
        t = a.get(key)
        if not isinstance(t, Instruction) or t.shape.rank < 2 or not t.shape.torch_dtype.is_floating_point:
            raise NotImplementedError(f"{name}: expected a floating-point {key} of rank >= 2, got {t!r}")
    k, v = a["key"].shape.dims, a["value"].shape.dims
    if k[-2] != v[-2]:  # ATen's CPU kernel does not check this and reads past value's end
        raise ValueError(f"{name}: key and value must have the same sequence length (dim -2), got key {list(k)} "
                         f"and value {list(v)}")
    return name


def _wide(dtype: str) -> str:
    return "f64" if dtype == "f64" else "f32"


def _repeat_kv(em: Emitter, q: Instruction, t: Instruction, name: str) -> Instruction:
    """k or v with the leading dims of q: equal, or (GQA) heads repeated per query-head group."""
    lead, own = q.shape.dims[:-2], t.shape.dims[:-2]
    if own == lead:
        return t
    if len(own) == len(lead) >= 1 and own[:-1] == lead[:-1] and own[-1] and lead[-1] % own[-1] == 0:
        dims, r = t.shape.dims, t.shape.rank
        wide = em.broadcast(t, (*dims[:-2], lead[-1] // own[-1], *dims[-2:]), (*range(r - 2), r - 1, r))
        return em.reshape(wide, (*lead, *dims[-2:]))
    raise NotImplementedError(f"{name}: key / value leading dims {own} do not match the query's {lead}")


def _sum_groups(em: Emitter, g: Instruction, dims: tuple) -> Instruction:
    """A gradient of repeated k / v ``[*lead, S, E]`` summed back over each group to ``dims``."""
    if g.shape.dims == tuple(dims):
        return g
    r = g.shape.rank
    groups = g.shape.dims[r - 3] // dims[-3]
    split = em.reshape(g, (*dims[:-2], groups, *dims[-2:]))
    return em.reduce(split, (r - 2,), "add")


def _bias(em: Emitter, mask, dtype: str, dims: tuple) -> Instruction | None:
    """The mask as an additive bias of ``dims`` in ``dtype`` (bool False -> -inf)."""
    if mask is None:
        return None
    if mask.shape.dtype == "pred":
        m = em.broadcast_to(mask, dims)
        return em.select(m, em.scalar(0.0, dtype, dims), em.scalar(-math.inf, dtype, dims))
    return em.broadcast_to(em.convert(mask, dtype), dims)


def _scores(em: Emitter, q, k, mask, causal: bool, scale: float) -> Instruction:
    """Scaled, masked scores ``[*lead, Sq, Sk]`` in the wide dtype (float32 / float64)."""
    w = _wide(q.shape.dtype)
    r = q.shape.rank
    lead = tuple(range(r - 2))
    s = em.dot(em.convert(q, w), em.convert(k, w), lead, lead, (r - 1,), (r - 1,))
    s = em.binary("multiply", s, em.scalar(scale, w, s.shape.dims))
    bias = _bias(em, mask, w, s.shape.dims)
    if bias is not None:
        s = em.binary("add", s, bias)
    if causal:
        rows, cols = em.iota(s.shape.dims, r - 2, "s64"), em.iota(s.shape.dims, r - 1, "s64")
        s = em.select(em.compare(cols, rows, "LE"), s, em.scalar(-math.inf, w, s.shape.dims))
    return s


def _finite_or_zero(em: Emitter, x: Instruction) -> Instruction:
    """``x`` with -inf (a row with nothing to attend to) replaced by 0."""
    ninf = em.scalar(-math.inf, x.shape.dtype, x.shape.dims)
    return em.select(em.compare(x, ninf, "EQ"), em.scalar(0.0, x.shape.dtype, x.shape.dims), x)


def _row_bcast(em: Emitter, x: Instruction, dims: tuple) -> Instruction:
    return em.broadcast(x, dims, tuple(range(len(dims) - 1)))


def _logsumexp(em: Emitter, s: Instruction, empty: float) -> Instruction:
    """log(sum(exp(s))) over the last dim, stabilised by the row maximum; ``empty`` for a row with
    nothing to attend to (all scores -inf), as the op's kernel writes it."""
    last = s.shape.rank - 1
    m = em.reduce(s, (last,), "maximum")
    is_empty = em.compare(m, em.scalar(-math.inf, m.shape.dtype, m.shape.dims), "EQ")
    m = em.select(is_empty, em.scalar(0.0, m.shape.dtype, m.shape.dims), m)
    total = em.reduce(em.unary("exponential", em.binary("subtract", s, _row_bcast(em, m, s.shape.dims))),
                      (last,), "add")
    lse = em.binary("add", m, em.unary("log", total))
    return em.select(is_empty, em.scalar(empty, m.shape.dtype, m.shape.dims), lse)


def _as_stat(em: Emitter, lse: Instruction, val) -> Instruction:
    """``lse [*lead, Sq]`` shaped and typed as the op's logsumexp result ``val``."""
    dims, dtype = tuple(int(d) for d in val.shape), Shape.of(val).dtype
    lse = em.convert(lse, dtype)
    if math.prod(dims) == lse.shape.numel:
        return em.reshape(lse, dims)
    n, want = lse.shape.dims[-1], dims[-1]
    if dims[:-1] != lse.shape.dims[:-1]:
        raise NotImplementedError(f"logsumexp of shape {dims} for scores rows {lse.shape.dims}")
    if want < n:
        return em.slice(lse, [(0, d, 1) for d in dims])
    pad = em.scalar(0.0, dtype, (*dims[:-1], want - n))
    return em.concatenate([lse, pad], len(dims) - 1)


def _stat_rows(em: Emitter, lse: Instruction, q: Instruction) -> Instruction:
    """A logsumexp operand (``[*lead, Sq]``, ``[*lead, Sq, 1]`` or ``[*lead, n >= Sq]``, as the ops
    return it) as ``[*lead, Sq]`` in the wide dtype (undoing ``_as_stat``); NotImplementedError for
    any other shape (e.g. the probabilities that torch's inference decomposition of the CPU op
    returns in its place)."""
    lead, sq = q.shape.dims[:-2], q.shape.dims[-2]
    dims, n = lse.shape.dims, len(lead)
    rest = dims[n:] if dims[:n] == lead else None
    if rest not in ((sq,), (sq, 1)) and not (rest is not None and len(rest) == 1 and rest[0] >= sq):
        raise NotImplementedError(f"logsumexp of shape {list(dims)} for a query of shape {list(q.shape.dims)}: "
                                  f"expected [{', '.join(map(str, (*lead, sq)))}] (or a [..., 1] / padded form)")
    lse = em.convert(lse, _wide(q.shape.dtype))
    if rest == (sq, 1):
        return em.reshape(lse, (*lead, sq))
    return em.slice(lse, [(0, d, 1) for d in (*lead, sq)])


def _scale_of(a: dict, q: Instruction) -> float:
    return 1.0 / math.sqrt(q.shape.dims[-1]) if a.get("scale") is None else float(a["scale"])


def _mask_of(a: dict):
    mask = a.get("attn_mask", a.get("attn_bias"))
    if mask is not None and not isinstance(mask, Instruction):
        raise NotImplementedError(f"attention mask {mask!r} is not a tensor")
    return mask


def _placeholders(name: str, val, first: int) -> tuple:
    """Results ``first..`` of a forward: SymInt sizes as ints, tensors as Placeholders."""
    rest = []
    for i, v in enumerate(val[first:], start=first):
        rest.append(int(v) if isinstance(v, (int, torch.SymInt)) else Placeholder(f"result {i} of {name}"))
    return tuple(rest)


def _probs(em: Emitter, s: Instruction, lse_rows: Instruction) -> Instruction:
    """``exp(s - lse)`` per row (0 where a row's scores are all -inf, whatever its lse)."""
    return em.unary("exponential", em.binary("subtract", s, _row_bcast(em, _finite_or_zero(em, lse_rows),
                                                                       s.shape.dims)))


def _forward(op, em: Emitter, a: dict, val) -> tuple:
    """(out, logsumexp, placeholders...) of one fused forward op; see the module docstring."""
    name = _check_args(op, a)
    q, k0, v0, mask = a["query"], a["key"], a["value"], _mask_of(a)
    k, v = _repeat_kv(em, q, k0, name), _repeat_kv(em, q, v0, name)
    causal, scale = bool(a.get("is_causal")), a.get("scale")
    s = _scores(em, q, k, mask, causal, _scale_of(a, q))
    rows = _logsumexp(em, s, 0.0 if name.endswith("_for_cpu") else math.inf)
    lse = _as_stat(em, rows, val[1])
    if not FUSED_ATTENTION_GRAD.get():  # CompileOptions(fused_attention_grad=False): the math definition
        r = q.shape.rank
        lead = tuple(range(r - 2))
        out = em.dot(_probs(em, s, rows), em.convert(v, s.shape.dtype), lead, lead, (r - 1,), (r - 2,))
        return (em.convert(out, Shape.of(val[0]).dtype), lse, *_placeholders(name, val, 2))
    masks = _mask_operand(em, mask, q, k)
    config = _config(causal, scale, bool(masks))
    dims = forward_dims(q.shape.dims, k.shape.dims, v.shape.dims, q.shape.torch_dtype)
    packed = em.custom_call("attention-forward", [q, k, v, *masks], Shape(q.shape.dtype, dims), config)
    out = _slab_value(em, packed, 0, q.shape.dims[:-2], q.shape.dims[-2], v.shape.dims[-1])
    out = em.convert(out, Shape.of(val[0]).dtype)
    _FORWARDS.setdefault(em, {})[id(lse)] = _Forward(q, k0, v0, mask, tuple(sorted(config.items())), packed, out)
    return (out, lse, *_placeholders(name, val, 2))


def _fused_backward(em: Emitter, fwd: _Forward, q, k, v, dout) -> tuple:
    """(dq, dk, dv) by ``attention-backward`` on the forward's packed result."""
    config = dict(fwd.config)
    masks = _mask_operand(em, fwd.mask, q, k)
    shape = Shape(q.shape.dtype, backward_dims(q.shape.dims, k.shape.dims, v.shape.dims))
    grads = em.custom_call("attention-backward", [q, k, v, fwd.packed, em.convert(dout, q.shape.dtype), *masks],
                           shape, config)
    return tuple(_slab_value(em, grads, i, t.shape.dims[:-2], *t.shape.dims[-2:]) for i, t in enumerate((q, k, v)))


def _math_backward(em: Emitter, q, k, v, out, lse, dout, mask, causal: bool, scale: float) -> tuple:
    """(dq, dk, dv, dS) in the wide dtype from the saved log-sum-exp (FlashAttention-2's backward);
    dS is the gradient of the scaled, masked scores (that of an additive mask)."""
    w = _wide(q.shape.dtype)
    r = q.shape.rank
    lead = tuple(range(r - 2))
    s = _scores(em, q, k, mask, causal, scale)
    p = _probs(em, s, _stat_rows(em, lse, q))
    do, vw = em.convert(dout, w), em.convert(v, w)
    dv = em.dot(p, do, lead, lead, (r - 2,), (r - 2,))
    dp = em.dot(do, vw, lead, lead, (r - 1,), (r - 1,))
    delta = em.reduce(em.binary("multiply", do, em.convert(out, w)), (r - 1,), "add")
    ds = em.binary("multiply", p, em.binary("subtract", dp, _row_bcast(em, delta, dp.shape.dims)))
    dss = em.binary("multiply", ds, em.scalar(scale, w, ds.shape.dims))
    dq = em.dot(dss, em.convert(k, w), lead, lead, (r - 1,), (r - 2,))
    dk = em.dot(dss, em.convert(q, w), lead, lead, (r - 2,), (r - 2,))
    return dq, dk, dv, ds


def _same_forward(fwd: _Forward | None, a: dict, q, k, v, mask, config: dict) -> bool:
    return (fwd is not None and fwd.q is q and fwd.k is k and fwd.v is v and fwd.mask is mask
            and fwd.out is a["out"] and fwd.config == tuple(sorted(config.items())))


def _backward(op, em: Emitter, a: dict, val) -> tuple:
    """(grad_query, grad_key, grad_value[, grad_attn_bias]) of one fused backward op."""
    name = _check_args(op, a)
    q, k0, v0, mask = a["query"], a["key"], a["value"], _mask_of(a)
    dout = a.get("grad_out", a.get("grad_out_"))
    out, lse = a["out"], a["logsumexp"]
    if not all(isinstance(t, Instruction) for t in (dout, out, lse)):
        raise NotImplementedError(f"{name}: grad_out, out and logsumexp must be tensors")
    k, v = _repeat_kv(em, q, k0, name), _repeat_kv(em, q, v0, name)
    causal, scale = bool(a.get("is_causal")), a.get("scale")
    config = _config(causal, scale, mask is not None)
    want_bias = len(val) > 3 and bool((a.get("grad_input_mask") or [False] * 4)[3]) and mask is not None
    fwd = _FORWARDS.get(em, {}).get(id(lse))
    ds = None
    if _same_forward(fwd, a, q, k0, v0, mask, config) and not want_bias:
        dq, dk, dv = _fused_backward(em, fwd, q, k, v, dout)
    else:
        dq, dk, dv, ds = _math_backward(em, q, k, v, out, lse, dout, mask, causal, _scale_of(a, q))
    grads = [em.convert(dq, Shape.of(val[0]).dtype)]
    for g, t, gv in ((dk, k0, val[1]), (dv, v0, val[2])):
        grads.append(em.convert(_sum_groups(em, g, t.shape.dims), Shape.of(gv).dtype))
    if len(val) > 3:
        grads.append(_bias_grad(em, ds, mask, val[3]) if want_bias else None)
    return tuple(grads)


def _bias_grad(em: Emitter, ds: Instruction, mask: Instruction, val) -> Instruction:
    """The additive mask's gradient (dS summed over the dims the mask broadcast along)."""
    dims = tuple(int(d) for d in val.shape)
    if mask.shape.dtype == "pred":
        raise NotImplementedError("gradient of a boolean attention mask")
    offset = ds.shape.rank - len(dims)
    summed = [i for i in range(ds.shape.rank) if i < offset or dims[i - offset] != ds.shape.dims[i]]
    g = em.reshape(em.reduce(ds, summed, "add"), dims)
    return em.convert(g, Shape.of(val).dtype)


def _register_all() -> None:
    for op in FORWARD_OPS:
        register(op)(lambda em, a, val, _op=op: _forward(_op, em, a, val))
    for op in BACKWARD_OPS:
        register(op)(lambda em, a, val, _op=op: _backward(_op, em, a, val))


_register_all()
