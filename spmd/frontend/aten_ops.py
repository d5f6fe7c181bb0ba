"""ATen -> HLO-lite converters for compute ops: elementwise, reductions, matmuls (nn ops:
``spmd.frontend.aten_nn_ops``).

Elementwise ops broadcast NumPy-style and promote dtypes as PyTorch does: operands are
converted to the result dtype PyTorch computed (``val.dtype``; for comparisons, the promoted
operand dtype) and Python scalars become broadcast constants.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from spmd.frontend.aten_common import (
    Missing,
    norm_dims,
    operand,
    out_dims,
    out_dtype,
    promote,
    register,
)
from spmd.frontend.emitter import Emitter
from spmd.ir.hlo import Instruction, Shape

aten = torch.ops.aten


def _tracing_platform() -> str | None:
    """The platform (``"cpu"`` / ``"cuda"``) of the mesh being traced for, or None outside ``spmd.jit``."""
    from spmd.frontend.constraint import TRACING_MESH

    mesh = TRACING_MESH.get(None)
    return getattr(mesh, "platform", None)


# --------------------------------------------------------------------------- elementwise
#: Ops whose PyTorch kernels (CPU and CUDA) read a Python-scalar operand unrounded, as float32.
#: Additions and subtractions are left alone: PyTorch's CPU kernels round that scalar to the
#: tensor's 16-bit dtype first (its CUDA kernels do not), and spmd matches the CPU there.
_OPMATH_OPCODES = frozenset({"multiply", "divide"})
_HALF_DTYPES = frozenset({"f16", "bf16"})


def _ew(em: Emitter, opcode: str, xs: list[Any], val) -> Instruction:
    dtype, dims = out_dtype(val), out_dims(val)
    if dtype in _HALF_DTYPES and opcode in _OPMATH_OPCODES and any(_rounds(x, dtype) for x in xs):
        # PyTorch keeps the Python scalar in float32 and multiplies there ("opmath"), rounding
        # once at the end: rounding the scalar to 16 bits first would change the result.
        ops = [operand(em, x, "f32", dims) for x in xs]
        return em.convert(em.emit(opcode, Shape("f32", dims), ops), dtype)
    ops = [operand(em, x, dtype, dims) for x in xs]
    return em.emit(opcode, Shape(dtype, dims), ops)


def _rounds(x: Any, dtype: str) -> bool:
    """``x`` is a Python float that ``dtype`` cannot hold exactly."""
    if not isinstance(x, float) or not math.isfinite(x):
        return False
    return float(torch.tensor(x, dtype=Shape(dtype, ()).torch_dtype)) != x


def _scaled(em: Emitter, x: Any, alpha: Any) -> Any:
    if alpha == 1:
        return x
    if isinstance(x, Instruction):
        return em.binary("multiply", x, em.scalar(alpha, x.shape.dtype, x.shape.dims))
    return x * alpha


def _alpha_opmath(em: Emitter, opcode: str, x: Instruction, y: Instruction, alpha: Any, val) -> Instruction:
    """``x ± alpha·y`` of a 16-bit ``add`` / ``sub`` with ``alpha``, computed in float32 ("opmath") and
    rounded once, as ATen's kernels do; a 16-bit multiply then add rounded twice (1 ulp off in about
    one element of ten). ATen's CPU kernel rounds ``alpha`` to the 16-bit type first, the CUDA
    kernel (``AddFunctor<opmath_t>``) keeps it in float32."""
    dtype, dims = out_dtype(val), out_dims(val)
    alpha16 = float(torch.tensor(alpha, dtype=Shape(dtype, ()).torch_dtype)) if _tracing_platform() == "cpu" else alpha
    x32, y32 = (em.convert(operand(em, t, dtype, dims), "f32") for t in (x, y))  # operands cast to the result first
    scaled = em.binary("multiply", y32, em.scalar(alpha16, "f32", dims))
    return em.convert(em.emit(opcode, Shape("f32", dims), [x32, scaled]), dtype)


_RIGHT_IDENTITY = {"add": 0, "subtract": 0, "multiply": 1, "divide": 1}


def _binary(opcode: str):
    def convert(em: Emitter, a: dict, val) -> Instruction:
        x, y = list(a.values())[:2]
        if ("alpha" in a and a["alpha"] != 1 and opcode in ("add", "subtract") and isinstance(x, Instruction)
                and isinstance(y, Instruction) and out_dtype(val) in _HALF_DTYPES):
            return _alpha_opmath(em, opcode, x, y, a["alpha"], val)
        if "alpha" in a:
            y = _scaled(em, y, a["alpha"])
        if (isinstance(x, Instruction) and not isinstance(y, Instruction) and opcode in _RIGHT_IDENTITY
                and y == _RIGHT_IDENTITY[opcode] and x.shape == Shape(out_dtype(val), out_dims(val))):
            return x  # x + 0, x * 1: nothing to compute
        return _ew(em, opcode, [x, y], val)
    return convert


for _op, _code in [
    ("add", "add"), ("sub", "subtract"), ("mul", "multiply"), ("maximum", "maximum"),
    ("minimum", "minimum"), ("logical_and", "and"), ("logical_or", "or"),
    ("bitwise_and", "and"), ("bitwise_or", "or"),
]:
    _packet = getattr(aten, _op)
    register(*[getattr(_packet, o) for o in ("Tensor", "Scalar", "default") if hasattr(_packet, o)])(_binary(_code))


@register(aten.div.Tensor, aten.div.Scalar)
def _div(em: Emitter, a: dict, val) -> Instruction:
    return _ew(em, "divide", [a["self"], a["other"]], val)


@register(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(em: Emitter, a: dict, val) -> Instruction:
    mode = a["rounding_mode"]
    if mode == "floor" and not val.dtype.is_floating_point:
        from spmd.frontend.aten_sort_ops import div_floor_int
        return div_floor_int(em, a, val)
    q = _ew(em, "divide", [a["self"], a["other"]], val)
    if mode is None or not val.dtype.is_floating_point:
        return q
    if mode == "floor":
        return em.unary("floor", q)
    return em.binary("multiply", em.unary("sign", q), em.unary("floor", em.unary("abs", q)))


@register(aten.fmod.Tensor, aten.fmod.Scalar)
def _fmod(em: Emitter, a: dict, val) -> Instruction:
    return _ew(em, "remainder", [a["self"], a["other"]], val)


@register(aten.remainder.Tensor, aten.remainder.Scalar)
def _remainder(em: Emitter, a: dict, val) -> Instruction:
    """Python-style modulo (sign of the divisor) from XLA's remainder (sign of the dividend)."""
    dtype, dims = out_dtype(val), out_dims(val)
    x, y = operand(em, a["self"], dtype, dims), operand(em, a["other"], dtype, dims)
    r = em.binary("remainder", x, y)
    zero = em.scalar(0, dtype, dims)
    differ = em.compare(em.compare(r, zero, "LT"), em.compare(y, zero, "LT"), "NE")
    fix = em.binary("and", em.compare(r, zero, "NE"), differ)
    return em.select(fix, em.binary("add", r, y), r)


@register(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(em: Emitter, a: dict, val) -> Instruction:
    return _ew(em, "subtract", [a["other"], _scaled(em, a["self"], a["alpha"])], val)


_UNARY = {
    "neg": "negate", "exp": "exponential", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt",
    "tanh": "tanh", "sigmoid": "logistic", "abs": "abs", "erf": "erf", "sin": "sine",
    "cos": "cosine", "floor": "floor", "ceil": "ceil", "sign": "sign", "bitwise_not": "not",
}


def _unary(opcode: str):
    def convert(em: Emitter, a: dict, val) -> Instruction:
        return _ew(em, opcode, [a["self"]], val)
    return convert


for _op, _code in _UNARY.items():
    register(getattr(aten, _op).default)(_unary(_code))


@register(aten.logical_not.default)
def _logical_not(em: Emitter, a: dict, val) -> Instruction:
    x = a["self"]
    pred = x if x.shape.dtype == "pred" else em.compare(x, em.scalar(0, x.shape.dtype, x.shape.dims), "NE")
    return em.unary("not", pred)


@register(aten.relu.default)
def _relu(em: Emitter, a: dict, val) -> Instruction:
    return _ew(em, "maximum", [a["self"], 0], val)


@register(aten.reciprocal.default)
def _reciprocal(em: Emitter, a: dict, val) -> Instruction:
    return _ew(em, "divide", [1, a["self"]], val)


@register(aten.square.default)
def _square(em: Emitter, a: dict, val) -> Instruction:
    return _ew(em, "multiply", [a["self"], a["self"]], val)


@register(aten.pow.Tensor_Scalar)
def _pow_scalar(em: Emitter, a: dict, val) -> Instruction:
    """x ** e; e in {1, 2} (and 0.5, -0.5 for floats) map to copy-free ops as PyTorch computes them."""
    e = a["exponent"]
    if not val.dtype.is_floating_point and not val.dtype.is_complex and isinstance(e, int) and e < 0:
        raise ValueError(f"pow: an integer tensor to a negative integer power ({e}) is not allowed (as in "
                         f"PyTorch); convert the base to floating point first")
    x = operand(em, a["self"], out_dtype(val), out_dims(val))
    if e == 1:
        return x
    if e == 2:
        return em.binary("multiply", x, x)
    if val.dtype.is_floating_point and e in (0.5, -0.5):
        return em.unary("sqrt" if e > 0 else "rsqrt", x)
    return _ew(em, "power", [x, e], val)


@register(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow(em: Emitter, a: dict, val) -> Instruction:
    return _ew(em, "power", [a["self"], a["exponent"]], val)


def _compare(direction: str):
    def convert(em: Emitter, a: dict, val) -> Instruction:
        x, y = a["self"], a["other"]
        dtype, dims = promote(x, y), out_dims(val)
        return em.compare(operand(em, x, dtype, dims), operand(em, y, dtype, dims), direction)
    return convert


for _op, _dir in [("eq", "EQ"), ("ne", "NE"), ("lt", "LT"), ("le", "LE"), ("gt", "GT"), ("ge", "GE")]:
    register(getattr(aten, _op).Tensor, getattr(aten, _op).Scalar)(_compare(_dir))


@register(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
def _where(em: Emitter, a: dict, val) -> Instruction:
    dtype, dims = out_dtype(val), out_dims(val)
    cond = operand(em, a["condition"], "pred", dims)
    return em.select(cond, operand(em, a["self"], dtype, dims), operand(em, a["other"], dtype, dims))


@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(em: Emitter, a: dict, val) -> Instruction:
    dtype, dims = out_dtype(val), out_dims(val)
    mask = operand(em, a["mask"], "pred", dims)
    return em.select(mask, operand(em, a["value"], dtype, dims), operand(em, a["self"], dtype, dims))


@register(aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default)
def _clamp(em: Emitter, a: dict, val) -> Instruction:
    dtype, dims = out_dtype(val), out_dims(val)
    x = operand(em, a["self"], dtype, dims)
    if a.get("min") is not None:
        x = em.binary("maximum", x, operand(em, a["min"], dtype, dims))
    if a.get("max") is not None:
        x = em.binary("minimum", x, operand(em, a["max"], dtype, dims))
    return x


@register(aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default)
def _to(em: Emitter, a: dict, val) -> Instruction:
    return em.convert(a["self"], out_dtype(val))


@register(aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
          aten.lift_fresh_copy.default, aten.lift_fresh.default)
def _identity(em: Emitter, a: dict, val) -> Instruction:
    return list(a.values())[0]


# --------------------------------------------------------------------------- reductions
def _keep(em: Emitter, r: Instruction, val) -> Instruction:
    return em.reshape(r, out_dims(val))


def _kept(em: Emitter, r: Instruction, x: Instruction, dims: tuple[int, ...], keepdim: bool) -> Instruction:
    """``r`` (``x`` reduced over ``dims``, those dims removed) with size-1 dims back when ``keepdim``.

    The result shape comes from the arguments, not from the traced value: torch 2.11's meta
    function of ``linalg_vector_norm`` kept a size-1 reduced dim given as a negative index.
    """
    if not keepdim:
        return r
    return em.reshape(r, tuple(1 if i in dims else d for i, d in enumerate(x.shape.dims)))


_HALF_TYPES = frozenset({"bf16", "f16"})


def _opmath(em: Emitter, x: Instruction) -> Instruction:
    """``x`` in float32 when it is a 16-bit float: PyTorch's CPU and CUDA kernels of softmax-like
    ops, mean, var and norms compute in float32 ("opmath") and round once to the result type."""
    return em.convert(x, "f32") if x.shape.dtype in _HALF_TYPES else x


@register(aten.sum.dim_IntList, aten.sum.default)
def _sum(em: Emitter, a: dict, val) -> Instruction:
    """Sum over dims; a 16-bit float sum accumulates in float32 and rounds once, as PyTorch's does
    (so a sum over a sharded dim all-reduces float32 partial sums, rounded once after)."""
    x = em.convert(a["self"], out_dtype(val))
    dims = norm_dims(a.get("dim"), x.shape.rank)
    r = em.convert(em.reduce(_opmath(em, x), dims, "add"), x.shape.dtype)
    return _kept(em, r, x, dims, bool(a.get("keepdim", False)))


@register(aten.mean.dim, aten.mean.default)
def _mean(em: Emitter, a: dict, val) -> Instruction:
    x = em.convert(a["self"], out_dtype(val))
    dims = norm_dims(a.get("dim"), x.shape.rank)
    s = em.reduce(_opmath(em, x), dims, "add")
    count = math.prod(x.shape.dims[d] for d in dims)
    r = em.binary("divide", s, em.scalar(count, s.shape.dtype, s.shape.dims))
    return _kept(em, em.convert(r, x.shape.dtype), x, dims, bool(a.get("keepdim", False)))


def _minmax(kind: str, with_indices: bool):
    def convert(em: Emitter, a: dict, val) -> Any:
        x = a["self"]
        dims = norm_dims(a.get("dim"), x.shape.rank)
        if any(x.shape.dims[d] == 0 for d in dims):  # torch raises too: no elements, no extreme value
            name = {"maximum": "max", "minimum": "min"}[kind]
            raise ValueError(f"{name}: expected non-empty reduced dims {list(dims)}, got shape {list(x.shape.dims)}")
        r = em.reduce(x, dims, kind)
        if with_indices:
            return _keep(em, r, val[0]), Missing(f"aten.{'max' if kind == 'maximum' else 'min'}.dim indices")
        return _keep(em, r, val)
    return convert


register(aten.amax.default, aten.max.default)(_minmax("maximum", False))
register(aten.amin.default, aten.min.default)(_minmax("minimum", False))


@register(aten.linalg_vector_norm.default)
def _vector_norm(em: Emitter, a: dict, val) -> Instruction:
    """p-norm over dims for ord 2, 1 and +inf (F.normalize, gradient clipping)."""
    out = em.convert(a["self"], out_dtype(val))
    x = _opmath(em, out)
    dims = norm_dims(a.get("dim"), x.shape.rank)
    order = a["ord"]
    if order == 2:
        r = em.unary("sqrt", em.reduce(em.binary("multiply", x, x), dims, "add"))
    elif order == 1:
        r = em.reduce(em.unary("abs", x), dims, "add")
    elif order == math.inf:
        r = em.reduce(em.unary("abs", x), dims, "maximum")
    else:
        raise NotImplementedError(f"vector norm of order {order}")
    return _kept(em, em.convert(r, out.shape.dtype), x, dims, bool(a.get("keepdim", False)))


def _var_mean(em: Emitter, a: dict) -> tuple[Instruction, Instruction, tuple[int, ...]]:
    """Biased-or-corrected variance and mean over dims, both with reduced dims removed (in float32
    for a 16-bit float input, see ``_opmath``; the callers round to the input type).

    Two-pass, the mean taken on data shifted by their maximum, ``m = s + sum(x - s) / n`` (shifting
    by a data value: Chan, Golub & LeVeque, "Algorithms for computing the sample variance", 1983):
    a row of equal values has mean exactly that value and variance exactly 0, as eager's Welford
    kernel gives, even where a sum split over devices would round ``n * c`` (so ``var(x) > 0``
    cannot flip). The shift is a max (exact in any order), so no partial sum is refined per device.
    """
    x = _opmath(em, a["self"])
    dims = norm_dims(a.get("dim"), x.shape.rank)
    count = math.prod(x.shape.dims[d] for d in dims)
    correction = a.get("correction")
    if correction is None:
        correction = 1 if a.get("unbiased", True) else 0
    keep = tuple(i for i in range(x.shape.rank) if i not in dims)
    kept_dims = [x.shape.dims[i] for i in keep]
    n = em.scalar(count, x.shape.dtype, kept_dims)
    shift = em.reduce(x, dims, "maximum")  # a value of the data, the same on every device
    offset = em.reduce(em.binary("subtract", x, em.broadcast(shift, x.shape.dims, keep)), dims, "add")
    mean = em.binary("add", shift, em.binary("divide", offset, n))
    centered = em.binary("subtract", x, em.broadcast(mean, x.shape.dims, keep))
    sq = em.reduce(em.binary("multiply", centered, centered), dims, "add")
    var = em.binary("divide", sq, em.scalar(max(count - correction, 0), x.shape.dtype, sq.shape.dims))
    return var, mean, dims


@register(aten.var_mean.correction, aten.var_mean.dim)
def _var_mean_op(em: Emitter, a: dict, val) -> tuple:
    var, mean, _ = _var_mean(em, a)
    t = a["self"].shape.dtype
    return em.reshape(em.convert(var, t), out_dims(val[0])), em.reshape(em.convert(mean, t), out_dims(val[1]))


@register(aten.var.correction, aten.var.dim)
def _var(em: Emitter, a: dict, val) -> Instruction:
    return em.reshape(em.convert(_var_mean(em, a)[0], a["self"].shape.dtype), out_dims(val))


# --------------------------------------------------------------------------- matmuls
def _matmul(em: Emitter, x: Instruction, y: Instruction) -> Instruction:
    """torch.matmul semantics as one dot (after broadcasting batch dims if they differ)."""
    rx, ry = x.shape.rank, y.shape.rank
    if rx == 1:
        return em.dot(x, y, (), (), (0,), (max(ry - 2, 0),))
    if ry <= 2:
        return em.dot(x, y, (), (), (rx - 1,), (0,))
    if rx == 2:  # [m, k] @ [..., k, n]: the dot gives [m, ..., n]
        d = em.dot(x, y, (), (), (1,), (ry - 2,))
        nb = ry - 2
        return em.transpose(d, (*range(1, nb + 1), 0, nb + 1))
    batch = tuple(torch.broadcast_shapes(x.shape.dims[:-2], y.shape.dims[:-2]))
    x = em.broadcast_to(x, batch + x.shape.dims[-2:])
    y = em.broadcast_to(y, batch + y.shape.dims[-2:])
    nb = len(batch)
    return em.dot(x, y, range(nb), range(nb), (nb + 1,), (nb,))


def _common_dtype(em: Emitter, val, *xs: Instruction) -> list[Instruction]:
    """The operands of a matrix product, which PyTorch requires to share one dtype.

    Raises TypeError (reported as an unsupported operation at the user's line) for mixed dtypes:
    PyTorch eager raises there too, and a silent convert would change the numbers.
    """
    dtypes = [x.shape.dtype for x in xs]
    if len(set(dtypes)) > 1:
        raise TypeError(f"expected the operands of a matrix product to have one dtype (as PyTorch "
                        f"requires), got {' and '.join(dtypes)}")
    return [em.convert(x, out_dtype(val)) for x in xs]


@register(aten.matmul.default, aten.mm.default, aten.bmm.default)
def _matmul_op(em: Emitter, a: dict, val) -> Instruction:
    x, y = _common_dtype(em, val, a["self"], list(a.values())[1])
    return em.reshape(_matmul(em, x, y), out_dims(val))


@register(aten.linear.default)
def _linear(em: Emitter, a: dict, val) -> Instruction:
    x, w = _common_dtype(em, val, a["input"], a["weight"])
    y = em.dot(x, w, (), (), (x.shape.rank - 1,), (w.shape.rank - 1,))
    if a["bias"] is not None:
        y = em.binary("add", y, operand(em, a["bias"], y.shape.dtype, y.shape.dims))
    return y


def _add_scaled_input(em: Emitter, prod: Instruction, a: dict) -> Instruction:
    prod = _scaled(em, prod, a["alpha"])
    bias = _scaled(em, operand(em, a["self"], prod.shape.dtype, prod.shape.dims), a["beta"])
    return em.binary("add", prod, bias)


@register(aten.addmm.default)
def _addmm(em: Emitter, a: dict, val) -> Instruction:
    x, y = _common_dtype(em, val, a["mat1"], a["mat2"])
    return _add_scaled_input(em, em.dot(x, y, (), (), (1,), (0,)), a)


@register(aten.baddbmm.default)
def _baddbmm(em: Emitter, a: dict, val) -> Instruction:
    x, y = _common_dtype(em, val, a["batch1"], a["batch2"])
    return _add_scaled_input(em, em.dot(x, y, (0,), (0,), (2,), (1,)), a)
