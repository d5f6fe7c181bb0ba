"""Counter-based random numbers: SplitMix64 of a per-op seed and the global element index.

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

Generator: each random op (stream number ``s``) and draw ``w`` (0, or 1 for the normal
distribution's second uniform) gets a 64-bit seed ``threefry2x32(key, (s, w))`` (Threefry-2x32
with 20 rounds: Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3",
SC 2011; JAX's ``threefry_2x32``), computed once per call on a scalar. Element ``g`` (global
row-major index) then gets the 64 bits ``splitmix64(seed, g)``: output ``g + 1`` of the SplitMix64
sequence (Steele, Lea, Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014;
the generator of Java's ``SplittableRandom``), ``mix64(seed + (g + 1) * gamma)``. SplitMix64 is
itself counter-based (element ``g`` needs no other element) and passes BigCrush; it costs about
ten int64 torch ops per element, against ~170 for Threefry, which is why Threefry is used only to
derive the per-op seeds. All arithmetic is int64 with wrap-around, so it runs on any device.

Distributions (from the 64 bits): uniform in ``[0, 1)`` with as many random bits as the dtype's
significand (53 for f64, 24 f32, 11 f16, 8 bf16), so the value is exact in the dtype and never
1; normal by Box-Muller in float64, ``sqrt(-2 log(1 - u1)) * cos(2 pi u2)``; exponential
``-log1p(-u)`` (rate 1; the frontend divides by the rate).
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


_GAMMA = 0x9E3779B97F4A7C15 - 2**64  # SplitMix64's increment, as a signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """SplitMix64 output number ``index + 1`` of the sequence seeded with ``seed`` (int64 bits).

    ``seed``: 0-d int64 (any bit pattern); ``index``: int64 tensor, values >= 0. Arithmetic wraps
    modulo 2**64 as torch's int64 ops do. Equals Vigna's reference ``splitmix64.c``.
    """
    z = seed + (index + 1) * _GAMMA
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def op_seed(key0: torch.Tensor, key1: torch.Tensor, stream: int, word: int = 0) -> torch.Tensor:
    """0-d int64 seed of one op's draw ``word``: Threefry-2x32 of the key and ``(stream, word)``."""
    k0, k1 = key0.to(torch.int64) & _MASK, key1.to(torch.int64) & _MASK
    s0, s1 = threefry2x32((k0, k1), torch.full_like(k0, stream & _MASK), torch.full_like(k0, word))
    return (s0 << 32) | s1


def random_bits(index: torch.Tensor, key0: torch.Tensor, key1: torch.Tensor, stream: int,
                word: int = 0) -> torch.Tensor:
    """64 random bits per element (an int64 bit pattern), see the module docstring.

    ``index``: int64 global element indices (>= 0); ``key0``/``key1``: 0-d int64 key words;
    ``stream``: the op's stream number; ``word``: which 64-bit draw (0, or 1 for the second).
    """
    return splitmix64(op_seed(key0, key1, stream, word), index)


def uniform_from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Uniform ``[0, 1)`` values of ``dtype`` from int64 random bits (their top significand bits)."""
    m = _SIGNIFICAND_BITS.get(dtype)
    if m is None:
        raise TypeError(f"random values of dtype {dtype}: expected one of {sorted(map(str, _SIGNIFICAND_BITS))}")
    return (_shr(bits, 64 - m).to(torch.float64) * 2.0 ** -m).to(dtype)


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
    ("random", _random, "elementwise", None, "counter-based random values of global element indices (SplitMix64)"),
)
