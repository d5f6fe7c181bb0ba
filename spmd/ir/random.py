"""Counter-based random numbers: Threefry-2x32-20 of (key, global element index).

Why not PyTorch eager's stream: eager draws from a stateful generator (mt19937 on the CPU,
Philox with a host-side offset on CUDA) in the order the elements are laid out in one tensor
on one device, and the CPU and CUDA streams already differ. A sharded program would have to
generate every global tensor in full on every device, in eager's order, to reproduce it. Instead,
as JAX (threefry) and XLA's ``rng-bit-generator`` do, every random value here is a pure function
of a key and the element's *global* linear index, so that:

- the values do not depend on the mesh or the shardings (the same seed gives the same numbers on
  ``cpu:1`` and ``cpu:4``, under any ``in_shardings``), and each device computes only its shard;
- the program stays a pure function of its inputs (the key is an entry parameter), so a dropout
  mask is one value that the forward output and the backward both read;
- ``torch.manual_seed(s)`` still makes runs reproducible: ``spmd.jit`` draws a fresh key from
  PyTorch's default CPU generator at every call (``draw_key``), so successive calls give new
  numbers and reseeding repeats them.

The generator is Threefry-2x32 with 20 rounds (Salmon, Moraes, Dror, Shaw, "Parallel random
numbers: as easy as 1, 2, 3", SC 2011; the same function as JAX's ``threefry_2x32``), computed
with int64 torch ops on values held in ``[0, 2**32)`` so that it runs on any device.

Layout of one draw: element ``g`` (global row-major index, ``g < 2**62``) of the op with stream
number ``s`` uses key ``k_s = threefry(key, (s, 0))`` and counter ``(g mod 2**32, g >> 32)``;
a second 64-bit word (the normal distribution's second uniform) uses counter
``(g mod 2**32, (g >> 32) | 2**31)``.

Distributions (from the 64 random bits ``(w0, w1)``, ``w0`` the high word): uniform in ``[0, 1)`` with as
many random bits as the dtype's significand (53 for f64, 24 f32, 11 f16, 8 bf16), so the value is
exact in the dtype and never 1; normal by Box-Muller in float64, ``sqrt(-2 log(1 - u1)) *
cos(2 pi u2)``; exponential ``-log1p(-u)`` (rate 1; the frontend divides by the rate).
"""

from __future__ import annotations

import math
from typing import Any

import torch

_MASK = 0xFFFFFFFF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA
_SIGNIFICAND_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
DISTRIBUTIONS = ("uniform", "normal", "exponential")


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK


def threefry2x32(key: tuple[Any, Any], x0: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32-20 of counters ``(x0, x1)`` under ``key`` (two words in ``[0, 2**32)``).

    ``x0``, ``x1``: int64 tensors (or ints) of one shape, values in ``[0, 2**32)``; key words may
    be ints or 0-d int64 tensors. Returns the two output words as int64 tensors in ``[0, 2**32)``.
    """
    k0, k1 = key
    ks = (k0, k1, (k0 ^ k1 ^ _PARITY) & _MASK if isinstance(k0, int) else k0 ^ k1 ^ _PARITY)
    x0 = (x0 + ks[0]) & _MASK
    x1 = (x1 + ks[1]) & _MASK
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = (x0 + x1) & _MASK
            x1 = _rotl(x1, r) ^ x0
        x0 = (x0 + ks[(i + 1) % 3]) & _MASK
        x1 = (x1 + ks[(i + 2) % 3] + i + 1) & _MASK
    return x0, x1


def draw_key(generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh int64 ``[2]`` key (two words in ``[0, 2**32)``) from ``generator``.

    None means PyTorch's default CPU generator, so ``torch.manual_seed`` controls it.
    """
    return torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=generator)


def random_bits(index: torch.Tensor, key0: torch.Tensor, key1: torch.Tensor, stream: int,
                word: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """64 random bits per element as two int64 words in ``[0, 2**32)`` (see the module docstring).

    ``index``: int64 global element indices in ``[0, 2**62)``; ``key0``/``key1``: 0-d int64 key
    words; ``stream``: the op's stream number; ``word``: 0 or 1 (which 64-bit draw).
    """
    k0, k1 = key0.to(torch.int64) & _MASK, key1.to(torch.int64) & _MASK
    s0, s1 = threefry2x32((k0, k1), torch.full_like(k0, stream & _MASK), torch.zeros_like(k0))
    hi = (index >> 32) | (word << 31)
    return threefry2x32((s0, s1), index & _MASK, hi)


def uniform_from_bits(bits: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Uniform ``[0, 1)`` values of ``dtype`` from two random words (their top significand bits)."""
    m = _SIGNIFICAND_BITS.get(dtype)
    if m is None:
        raise TypeError(f"random values of dtype {dtype}: expected one of {sorted(map(str, _SIGNIFICAND_BITS))}")
    w0, w1 = bits
    top = (w0 << (m - 32)) | (w1 >> (64 - m)) if m > 32 else w0 >> (32 - m)
    return (top.to(torch.float64) * 2.0 ** -m).to(dtype)


def _random(operands: list[torch.Tensor], config: dict[str, Any]) -> torch.Tensor:
    """Random values of ``config['dtype']`` for int64 global indices ``operands[0]``.

    Operands: index (int64, the result's shape), key0 and key1 (0-d int64). Config:
    distribution (uniform | normal | exponential), dtype (HLO name), stream (int).
    """
    from spmd.ir.hlo import DTYPES

    index, key0, key1 = operands
    dtype = DTYPES[config["dtype"]]
    dist, stream = config.get("distribution", "uniform"), int(config.get("stream", 0))
    bits = random_bits(index, key0, key1, stream)
    if dist == "uniform":
        return uniform_from_bits(bits, dtype)
    u1 = uniform_from_bits(bits, torch.float64)
    if dist == "exponential":
        return (-torch.log1p(-u1)).to(dtype)
    if dist == "normal":
        u2 = uniform_from_bits(random_bits(index, key0, key1, stream, word=1), torch.float64)
        return (torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)).to(dtype)
    raise ValueError(f"backend_config distribution: expected one of {DISTRIBUTIONS}, got {dist!r}")


#: (target, kernel, sharding-rule kind, unsharded dims, doc): ``spmd.ir.custom_calls`` builds the spec.
RANDOM_CALLS = (
    ("random", _random, "elementwise", None, "counter-based random values of global element indices"),
)
