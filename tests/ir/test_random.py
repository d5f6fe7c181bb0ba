"""Counter-based random numbers (Threefry-2x32-20 seeds, SplitMix64 values): known answers,
distributions, streams."""

from __future__ import annotations

import math

import pytest
import torch

from spmd.ir.custom_calls import CUSTOM_CALLS
from spmd.ir.random import draw_key, random_bits, splitmix64, threefry2x32, uniform_from_bits

# Known-answer vectors of Threefry-2x32-20 (Random123's kat_vectors; JAX's threefry tests).
KAT = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("key,ctr,want", KAT)
def test_threefry_known_answers(key, ctr, want):
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    got = threefry2x32((t(key[0]), t(key[1])), t(ctr[0]), t(ctr[1]))
    assert (got[0].item(), got[1].item()) == want


def _draw(dist, dtype, n=50_000, stream=0, key=(12345, 678)):
    index = torch.arange(n, dtype=torch.int64)
    cfg = {"distribution": dist, "dtype": dtype, "stream": stream}
    return CUSTOM_CALLS["random"].fn([index, torch.tensor(key[0]), torch.tensor(key[1])], cfg)


@pytest.mark.parametrize("dtype,torch_dtype", [("f64", torch.float64), ("f32", torch.float32),
                                               ("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_uniform_is_in_unit_interval_with_moments_of_uniform(dtype, torch_dtype):
    u = _draw("uniform", dtype)
    assert u.dtype == torch_dtype
    assert u.min() >= 0 and u.max() < 1
    u = u.double()
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    # Kolmogorov-Smirnov distance against U[0, 1) (resolution of the dtype's significand added).
    s = u.sort().values
    ecdf = torch.arange(1, len(s) + 1, dtype=torch.float64) / len(s)
    resolution = {"f64": 0, "f32": 0, "f16": 2**-11, "bf16": 2**-8}[dtype]
    assert (ecdf - s).abs().max() < 0.009 + resolution


def test_normal_and_exponential_moments():
    z = _draw("normal", "f64")
    assert abs(z.mean()) < 0.02 and abs(z.var() - 1) < 0.03
    assert abs((z.abs() < 1).double().mean() - math.erf(1 / math.sqrt(2))) < 0.01
    e = _draw("exponential", "f64")
    assert e.min() >= 0 and abs(e.mean() - 1) < 0.02 and abs(e.var() - 1) < 0.06
    assert abs((e > 1).double().mean() - math.exp(-1)) < 0.01


def test_streams_and_keys_are_independent():
    a, b, c = _draw("uniform", "f64", stream=0), _draw("uniform", "f64", stream=1), _draw("uniform", "f64", key=(1, 2))
    for x, y in ((a, b), (a, c), (b, c)):
        assert abs(torch.corrcoef(torch.stack([x, y]))[0, 1]) < 0.02
    assert torch.equal(a, _draw("uniform", "f64", stream=0))  # deterministic


def test_values_depend_on_the_global_index_only():
    """Any subset of indices (a shard) gives the same values as the full draw at those indices."""
    full = _draw("normal", "f32", n=1000)
    idx = torch.tensor([[999, 3], [500, 0]], dtype=torch.int64)
    cfg = {"distribution": "normal", "dtype": "f32", "stream": 0}
    part = CUSTOM_CALLS["random"].fn([idx, torch.tensor(12345), torch.tensor(678)], cfg)
    assert torch.equal(part, full[idx])


def test_splitmix64_equals_the_reference_sequence():
    """Vigna's splitmix64.c seeded with 1234567 (outputs as unsigned 64-bit ints)."""
    want = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
            16408922859458223821]
    got = splitmix64(torch.tensor(1234567), torch.arange(5, dtype=torch.int64))
    assert [v % 2**64 for v in got.tolist()] == want


def test_second_word_and_uniform_bits():
    index = torch.arange(10, dtype=torch.int64)
    k = torch.tensor(1), torch.tensor(2)
    assert not torch.equal(random_bits(index, *k, stream=0, word=0), random_bits(index, *k, stream=0, word=1))
    top = torch.tensor([-1], dtype=torch.int64)  # all 64 bits set
    assert uniform_from_bits(top, torch.float64).item() == 1 - 2**-53
    assert uniform_from_bits(top, torch.bfloat16).item() == 1 - 2**-8
    assert uniform_from_bits(torch.tensor([2**62]), torch.float32).item() == 0.25
    with pytest.raises(TypeError, match="dtype"):
        uniform_from_bits(top, torch.int32)


def test_draw_key_follows_manual_seed():
    torch.manual_seed(5)
    a = draw_key()
    torch.manual_seed(5)
    assert torch.equal(a, draw_key()) and a.dtype == torch.int64 and a.shape == (2,)
    assert not torch.equal(draw_key(), draw_key())
