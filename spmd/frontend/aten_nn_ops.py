"""ATen -> HLO-lite converters for nn ops, as custom calls (``spmd.ir.custom_calls``): softmax,
log-softmax, layer norm, scaled-dot-product attention, gelu, silu; and embedding (a row gather).

16-bit inputs are computed as PyTorch's kernels compute them (float32 opmath, rounded once).
"""

from __future__ import annotations

import torch

from spmd.frontend.aten_common import check_index, norm_dim, operand, out_dims, out_dtype, register
from spmd.frontend.aten_ops import _opmath, _tracing_platform, _var_mean
from spmd.frontend.emitter import Emitter
from spmd.ir.hlo import Instruction, Shape

aten = torch.ops.aten


def _require_floating(val, what: str) -> None:
    """TypeError (reported as an unsupported operation at the user's line) unless ``val`` is floating.

    PyTorch has no integer / bool kernel for these ops (eager raises NotImplementedError); the
    fake tensors of tracing do not check, so the error would otherwise come from the runtime.
    """
    if not val.dtype.is_floating_point:
        raise TypeError(f"{what}: expected a floating-point input (PyTorch has no {val.dtype} kernel), got "
                        f"{val.dtype}; cast it first (e.g. x.float())")


@register(aten.softmax.int, aten._softmax.default, aten._safe_softmax.default)
def _softmax(em: Emitter, a: dict, val) -> Instruction:
    _require_floating(val, "softmax")
    x = em.convert(a["self"], out_dtype(val))
    if x.shape.rank == 0:  # a 0-d tensor's softmax is over itself: computed as [1]
        return em.reshape(_softmax(em, {**a, "self": em.reshape(x, (1,)), "dim": 0}, val), ())
    config = {"dim": norm_dim(a["dim"], x.shape.rank)}
    return em.custom_call("softmax", [x], x.shape, config)


@register(aten.log_softmax.int, aten._log_softmax.default)
def _log_softmax(em: Emitter, a: dict, val) -> Instruction:
    """x - max - log(sum(exp(x - max))) along dim, in that order, as PyTorch's kernels compute it.

    16-bit floats are computed in float32 and rounded once; PyTorch's CPU kernel for the last
    dim (``serial_vec_log_softmax_lastdim_range`` in ATen's ``LogSoftmaxKernelImpl.h``) also
    rounds the sum and its log to the 16-bit type, so on a CPU mesh that dim does too.
    """
    _require_floating(val, "log_softmax")
    if a["self"].shape.rank == 0:  # over the 0-d tensor itself: computed as [1]
        return em.reshape(_log_softmax(em, {**a, "self": em.reshape(a["self"], (1,)), "dim": 0}, val), ())
    out = em.convert(a["self"], out_dtype(val))
    x = _opmath(em, out)
    d = norm_dim(a["dim"], x.shape.rank)
    keep = tuple(i for i in range(x.shape.rank) if i != d)
    shifted = em.binary("subtract", x, em.broadcast(em.reduce(x, (d,), "maximum"), x.shape.dims, keep))
    total = em.reduce(em.unary("exponential", shifted), (d,), "add")
    rounded = x is not out and d == x.shape.rank - 1 and _tracing_platform() == "cpu"
    if rounded:
        total = em.convert(em.convert(total, out.shape.dtype), x.shape.dtype)
    lse = em.unary("log", total)
    if rounded:
        lse = em.convert(em.convert(lse, out.shape.dtype), x.shape.dtype)
    return em.convert(em.binary("subtract", shifted, em.broadcast(lse, x.shape.dims, keep)), out.shape.dtype)


def _layer_norm_call(em: Emitter, a: dict) -> Instruction:
    x = a["input"]
    n = len(a["normalized_shape"])
    norm_shape = x.shape.dims[x.shape.rank - n:]
    ops = [x]
    if a["weight"] is not None or a["bias"] is not None:
        ops.append(em.convert(a["weight"], x.shape.dtype) if a["weight"] is not None
                   else em.scalar(1, x.shape.dtype, norm_shape))
    if a["bias"] is not None:
        ops.append(em.convert(a["bias"], x.shape.dtype))
    return em.custom_call("layer-norm", ops, x.shape, {"normalized_ndim": n, "eps": float(a["eps"])})


@register(aten.layer_norm.default)
def _layer_norm(em: Emitter, a: dict, val) -> Instruction:
    return _layer_norm_call(em, a)


@register(aten.native_layer_norm.default)
def _native_layer_norm(em: Emitter, a: dict, val) -> tuple:
    """(y, mean, rstd): y by the layer-norm custom call; mean and 1/sqrt(biased var + eps) over the
    normalized dims, kept as size-1 dims (as ATen returns them; ``native_layer_norm_backward``
    reads them). Unused mean / rstd are removed as dead code."""
    x = a["input"]
    n = len(a["normalized_shape"])
    stat_dtype = out_dtype(val[1])
    xs = em.convert(x, stat_dtype)
    var, mean, _ = _var_mean(em, {"self": xs, "dim": list(range(x.shape.rank - n, x.shape.rank)), "correction": 0})
    # _var_mean works in float32 for 16-bit inputs; the statistics are rounded once, at the end
    rstd = em.unary("rsqrt", em.binary("add", var, em.scalar(float(a["eps"]), var.shape.dtype, var.shape.dims)))
    mean, rstd = em.convert(mean, stat_dtype), em.convert(rstd, stat_dtype)
    return (_layer_norm_call(em, a), em.reshape(mean, out_dims(val[1])), em.reshape(rstd, out_dims(val[2])))


def _repeat_heads(em: Emitter, t: Instruction, n_heads: int) -> Instruction:
    """k or v ``[..., Hkv, S, E]`` with each head repeated ``n_heads / Hkv`` times (``enable_gqa=True``:
    query head h reads kv head ``h // (n_heads / Hkv)``, PyTorch's ``repeat_interleave`` on dim -3)."""
    dims = t.shape.dims
    h, r = dims[-3], len(dims)
    if h == n_heads or h == 0 or n_heads % h:
        return t  # PyTorch has checked the head counts already
    wide = em.broadcast(t, (*dims[:-2], n_heads // h, *dims[-2:]), (*range(r - 2), r - 1, r))
    return em.reshape(wide, (*dims[:-3], n_heads, *dims[-2:]))


@register(aten.scaled_dot_product_attention.default)
def _sdpa(em: Emitter, a: dict, val) -> Instruction:
    if a["dropout_p"]:
        raise NotImplementedError("scaled_dot_product_attention with dropout_p > 0")
    q, k, v = a["query"], a["key"], a["value"]
    if k.shape.dims[-2:-1] != v.shape.dims[-2:-1]:
        raise ValueError("scaled_dot_product_attention: key and value must have the same sequence length "
                         f"(dim -2), got key {list(k.shape.dims)} and value {list(v.shape.dims)}")
    if a["enable_gqa"] and min(q.shape.rank, k.shape.rank, v.shape.rank) >= 3:
        k, v = _repeat_heads(em, k, q.shape.dims[-3]), _repeat_heads(em, v, q.shape.dims[-3])
    # leading (batch, head) dims broadcast as in PyTorch: the attention custom call takes equal ones
    lead = tuple(out_dims(val)[:-2])
    q, k, v = (em.broadcast_to(t, lead + t.shape.dims[-2:]) for t in (q, k, v))
    ops = [q, k, v]
    mask = a["attn_mask"]
    if mask is not None:
        if mask.shape.dtype == "pred":
            # the additive bias (0 where True, -inf elsewhere) PyTorch would build from a bool mask
            # inside every attention call, built once here: layers sharing a mask share it (cse)
            dt, dims = q.shape.dtype, mask.shape.dims
            mask = em.select(mask, em.scalar(0.0, dt, dims), em.scalar(float("-inf"), dt, dims))
        ops.append(operand(em, mask, q.shape.dtype, q.shape.dims[:-1] + (k.shape.dims[-2],)))
    config = {"is_causal": bool(a["is_causal"]), "has_mask": mask is not None}
    if a["scale"] is not None:
        config["scale"] = float(a["scale"])
    return em.custom_call("attention", ops, Shape(out_dtype(val), out_dims(val)), config)


@register(aten.gelu.default)
def _gelu(em: Emitter, a: dict, val) -> Instruction:
    _require_floating(val, "gelu")
    x = a["self"]
    return em.custom_call("gelu", [x], x.shape, {"approximate": a["approximate"]})


@register(aten.silu.default)
def _silu(em: Emitter, a: dict, val) -> Instruction:
    _require_floating(val, "silu")
    return em.custom_call("silu", [a["self"]], a["self"].shape)


@register(aten.embedding.default)
def _embedding(em: Emitter, a: dict, val) -> Instruction:
    check_index(a["indices"], "indices")
    return em.gather_rows(a["weight"], a["indices"])
