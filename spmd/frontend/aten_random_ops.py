"""ATen -> HLO-lite converters for random ops: rand/randn/randint(_like), uniform_, normal(_),
exponential_, bernoulli, and dropout (also feature dropout) in training mode.

Every random value is ``random(index, key0, key1)`` (``spmd.ir.random``): a pure function of the
program's random key and the element's global row-major index, computed from iotas, so the
values are the same under any mesh and sharding and the op partitions as an elementwise op.
The key is one extra entry parameter ``rng_key`` (``s64[2]``), created at the first random op
and numbered after all other parameters (``ImportedProgram.rng_key_parameter``); ``spmd.jit``
passes a fresh key drawn from PyTorch's default generator at every call
(``spmd.ir.random.draw_key``). Each random op of a program gets its own stream number.

The numbers differ from PyTorch eager's (see ``spmd.ir.random`` for why); their distributions
are the same. A dropout mask is an ordinary value of the program: the output and any user of the
mask (``native_dropout``'s second result, read by a backward) see the same mask.
An explicit ``generator=`` argument is refused (UnsupportedOpError).
"""

from __future__ import annotations

import torch

from spmd.frontend.aten_common import operand, out_dims, out_dtype, register
from spmd.frontend.emitter import Emitter
from spmd.ir.hlo import Instruction, Shape

aten = torch.ops.aten

RNG_KEY_NAME = "rng_key"


def _key(em: Emitter) -> tuple[Instruction, Instruction]:
    """The program's two s64[] key words, from the ``rng_key`` parameter (created once)."""
    state = em.__dict__.setdefault("_rng", {})
    if "key" not in state:
        number = sum(1 for i in em.instructions if i.opcode == "parameter")
        param = em.parameter(number, Shape("s64", (2,)), RNG_KEY_NAME)
        state["param"] = param
        state["key"] = tuple(em.reshape(em.slice(param, [(k, k + 1, 1)]), ()) for k in (0, 1))
    return state["key"]


def rng_key_parameter(em: Emitter) -> Instruction | None:
    """The ``rng_key`` parameter the conversion created, or None when the program draws nothing."""
    return em.__dict__.get("_rng", {}).get("param")


def _next_stream(em: Emitter) -> int:
    state = em.__dict__.setdefault("_rng", {})
    state["stream"] = state.get("stream", -1) + 1
    return state["stream"]


def global_index(em: Emitter, dims: tuple[int, ...]) -> Instruction:
    """s64[dims]: each element's row-major linear index (a sum of iotas times strides)."""
    if not dims:
        return em.scalar(0, "s64")
    total = None
    stride = 1
    for d in reversed(range(len(dims))):
        term = em.iota(dims, d, "s64")
        if stride != 1:
            term = em.binary("multiply", term, em.scalar(stride, "s64", dims))
        total = term if total is None else em.binary("add", total, term)
        stride *= dims[d]
    return total


def random_values(em: Emitter, dims: tuple[int, ...], dtype: str, distribution: str) -> Instruction:
    """``dtype[dims]`` random values (uniform [0,1), standard normal, or exponential with rate 1)."""
    if dtype not in ("f64", "f32", "f16", "bf16"):
        raise TypeError(f"random values of dtype {dtype}: expected a floating dtype")
    key0, key1 = _key(em)
    config = {"distribution": distribution, "dtype": dtype, "stream": _next_stream(em)}
    return em.custom_call("random", [global_index(em, dims), key0, key1], Shape(dtype, tuple(dims)), config)


def _no_generator(a: dict) -> None:
    if a.get("generator") is not None:
        raise TypeError("random ops with an explicit generator= (spmd draws a fresh key from the default "
                        "generator at every call; seed it with torch.manual_seed)")


def _draw(distribution: str):
    def convert(em: Emitter, a: dict, val) -> Instruction:
        _no_generator(a)
        return random_values(em, out_dims(val), out_dtype(val), distribution)
    return convert


register(aten.rand.default, aten.rand_like.default, aten.rand.generator)(_draw("uniform"))
register(aten.randn.default, aten.randn_like.default, aten.randn.generator)(_draw("normal"))


@register(aten.randint.default, aten.randint.low, aten.randint_like.default, aten.randint_like.low_dtype)
def _randint(em: Emitter, a: dict, val) -> Instruction:
    """Integers uniform in ``[low, high)``: ``low + floor(u * (high - low))``, u uniform float64.

    The bias is below ``(high - low) / 2**53`` per value. The result has the dtype torch chose
    (int64 by default, floating for a floating ``randint_like``).
    """
    _no_generator(a)
    low, high = int(a.get("low") or 0), int(a["high"])
    if high <= low:
        raise ValueError(f"randint: expected low < high, got low={low}, high={high}")
    dims, dtype = out_dims(val), out_dtype(val)
    u = random_values(em, dims, "f64", "uniform")
    r = em.unary("floor", _affine(em, u, float(high - low), 0.0))
    return em.convert(_affine(em, r, 1.0, float(low)), dtype)


def _affine(em: Emitter, x: Instruction, scale: float, shift: float) -> Instruction:
    dims, dtype = x.shape.dims, x.shape.dtype
    if scale != 1:
        x = em.binary("multiply", x, em.scalar(scale, dtype, dims))
    if shift != 0:
        x = em.binary("add", x, em.scalar(shift, dtype, dims))
    return x


@register(aten.uniform_.default, aten.uniform.default)
def _uniform(em: Emitter, a: dict, val) -> Instruction:
    _no_generator(a)
    lo, hi = float(a["from"]), float(a["to"])
    return _affine(em, random_values(em, out_dims(val), out_dtype(val), "uniform"), hi - lo, lo)


@register(aten.normal_.default, aten.normal.float_float)
def _normal(em: Emitter, a: dict, val) -> Instruction:
    _no_generator(a)
    return _affine(em, random_values(em, out_dims(val), out_dtype(val), "normal"), float(a["std"]),
                   float(a["mean"]))


@register(aten.exponential_.default, aten.exponential.default)
def _exponential(em: Emitter, a: dict, val) -> Instruction:
    _no_generator(a)
    rate = float(a["lambd"])
    if not rate > 0:
        raise ValueError(f"exponential_: expected lambd > 0, got {rate}")
    return _affine(em, random_values(em, out_dims(val), out_dtype(val), "exponential"), 1.0 / rate, 0.0)


def _mask_dtype(dtype: str) -> str:
    """The dtype uniforms for a keep/draw decision are drawn in (float32 for 16-bit inputs)."""
    return "f64" if dtype == "f64" else "f32"


@register(aten.bernoulli.default, aten.bernoulli.p)
def _bernoulli(em: Emitter, a: dict, val) -> Instruction:
    """1 where a uniform draw is below the probability (``self``, or the scalar ``p``), else 0."""
    _no_generator(a)
    dims, dtype = out_dims(val), out_dtype(val)
    if dtype not in ("f64", "f32", "f16", "bf16"):
        raise TypeError(f"bernoulli of dtype {dtype}: expected a floating tensor")
    u = random_values(em, dims, _mask_dtype(dtype), "uniform")
    p = a.get("p")
    prob = operand(em, a["self"] if p is None else float(p), u.shape.dtype, dims)
    return em.convert(em.compare(u, prob, "LT"), dtype)


def dropout_mask(em: Emitter, x: Instruction, p: float, mask_dims: tuple[int, ...]) -> Instruction:
    """pred[x dims]: True for kept elements, each kept with probability 1 - p (drawn over mask_dims)."""
    u = random_values(em, mask_dims, _mask_dtype(x.shape.dtype), "uniform")
    keep = em.compare(u, em.scalar(1.0 - p, u.shape.dtype, mask_dims), "LT")
    return em.broadcast_to(keep, x.shape.dims)


def _apply_dropout(em: Emitter, x: Instruction, keep: Instruction, p: float) -> Instruction:
    dims, dtype = x.shape.dims, x.shape.dtype
    if p >= 1:
        return em.scalar(0, dtype, dims)
    scaled = em.binary("multiply", x, em.scalar(1.0 / (1.0 - p), dtype, dims))
    return em.select(keep, scaled, em.scalar(0, dtype, dims))


def _check_p(p: float) -> float:
    p = float(p)
    if not 0 <= p <= 1:
        raise ValueError(f"dropout probability p: expected a value in [0, 1], got {p}")
    return p


def _dropout(feature: bool):
    def convert(em: Emitter, a: dict, val) -> Instruction:
        x, p = a["input"], _check_p(a["p"])
        if not a["train"] or p == 0:
            return x
        dims = x.shape.dims
        if feature and len(dims) < 3:
            raise ValueError(f"feature dropout: expected an input of rank >= 3 ([N, C, ...]), got shape {list(dims)}")
        mask_dims = tuple(dims[:2]) + (1,) * (len(dims) - 2) if feature else dims
        return _apply_dropout(em, x, dropout_mask(em, x, p, mask_dims), p)
    return convert


register(aten.dropout.default)(_dropout(False))
register(aten.feature_dropout.default)(_dropout(True))


@register(aten.native_dropout.default)
def _native_dropout(em: Emitter, a: dict, val) -> tuple[Instruction, Instruction]:
    x, p = a["input"], _check_p(a["p"])
    dims = x.shape.dims
    if a["train"] is False or p == 0:
        return x, em.scalar(True, "pred", dims)
    keep = dropout_mask(em, x, p, dims)
    return _apply_dropout(em, x, keep, p), keep
