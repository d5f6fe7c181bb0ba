"""Random ops imported from torch.export: the key parameter, distributions, dropout masks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from spmd.frontend.aten_common import UnsupportedOpError
from spmd.frontend.torch_export import import_program

from .helpers import run_entry


def _run(fn, args, key=(11, 22)):
    """Import ``fn`` and run it with the random key ``key``; returns (program, outputs)."""
    prog = import_program(fn, args)
    leaves = pytree.tree_leaves(tuple(args))
    inputs = [leaves[i] for i in prog.user_leaf_indices] + list(prog.param_values)
    if prog.rng_key_parameter is not None:
        assert prog.rng_key_parameter == len(prog.module.entry.parameters) - 1 == len(inputs)
        inputs.append(torch.tensor(key, dtype=torch.int64))
    out = run_entry(prog, inputs)
    return prog, out


def test_creation_ops_shapes_dtypes_ranges_and_distinct_streams():
    def f(x):
        return (torch.rand(3, 4), torch.rand_like(x), torch.randn(2, 5, dtype=torch.float64), torch.randn_like(x),
                torch.empty_like(x).exponential_(2.0), x.clone().uniform_(-1, 3), torch.normal(2.0, 3.0, (4,)))

    x = torch.randn(64, 32)
    _, out = _run(f, (x,))
    want = f(x)
    for g, w in zip(out, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
    assert out[1].min() >= 0 and out[1].max() < 1 and abs(out[1].mean() - 0.5) < 0.02
    assert abs(out[3].mean()) < 0.05 and abs(out[3].std() - 1) < 0.05
    assert out[4].min() >= 0 and abs(out[4].mean() - 0.5) < 0.03
    assert out[5].min() >= -1 and out[5].max() < 3 and abs(out[5].mean() - 1) < 0.05
    assert not torch.equal(out[1], out[5])  # every random op draws from its own stream


def test_same_key_same_numbers_other_key_other_numbers():
    f = lambda x: torch.rand_like(x) + x  # noqa: E731
    x = torch.randn(8, 8)
    a, b, c = _run(f, (x,))[1][0], _run(f, (x,))[1][0], _run(f, (x,), key=(11, 23))[1][0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_dropout_scales_kept_values_and_drops_p():
    x = torch.randn(128, 64, dtype=torch.float64) + 3
    _, (y,) = _run(lambda t: F.dropout(t, 0.3, training=True), (x,))
    kept = y != 0
    assert abs(kept.double().mean() - 0.7) < 0.02
    torch.testing.assert_close(y[kept], x[kept] / 0.7, rtol=1e-15, atol=0)
    _, (same,) = _run(lambda t: F.dropout(t, 0.3, training=False), (x,))
    assert torch.equal(same, x)
    _, (zeros,) = _run(lambda t: F.dropout(t, 1.0, training=True) + torch.rand_like(t) * 0, (x,))
    assert torch.equal(zeros, torch.zeros_like(x))


def test_native_dropout_mask_is_the_mask_of_the_output():
    x = torch.randn(64, 48) + 2
    _, (y, mask) = _run(lambda t: torch.ops.aten.native_dropout(t, 0.4, True), (x,))
    assert mask.dtype == torch.bool and abs(mask.float().mean() - 0.6) < 0.03
    assert torch.equal(y, torch.where(mask, x * (1 / 0.6), torch.zeros_like(x)))


def test_feature_dropout_drops_whole_channels():
    x = torch.randn(8, 16, 5, 5) + 2
    _, (y,) = _run(lambda t: F.dropout2d(t, 0.5, training=True), (x,))
    per_channel = (y != 0).flatten(2)
    assert torch.equal(per_channel.all(-1), per_channel.any(-1))
    assert 0.25 < per_channel.all(-1).float().mean() < 0.75


def test_bernoulli_of_tensor_and_scalar_probability():
    p = torch.rand(256, 64, dtype=torch.float64)
    _, (b, c) = _run(lambda t: (torch.bernoulli(t), torch.bernoulli(t, 0.25)), (p,))
    assert b.dtype == torch.float64 and set(b.unique().tolist()) <= {0.0, 1.0}
    assert abs((b - p).mean()) < 0.01 and abs(c.mean() - 0.25) < 0.01


def test_explicit_generator_is_refused():
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(UnsupportedOpError, match="explicit generator= are not supported.*torch.manual_seed"):
        import_program(lambda x: x + torch.rand(3, generator=gen), (torch.randn(3),))


def test_bf16_dropout_decides_in_float32():
    x = torch.randn(64, 64).bfloat16() + 2
    _, (y,) = _run(lambda t: F.dropout(t, 0.1, training=True), (x,))
    assert y.dtype == torch.bfloat16 and abs((y != 0).float().mean() - 0.9) < 0.02


def test_randint_ranges_dtypes_and_uniformity():
    def f(x):
        return (torch.randint(0, 10, (100, 50)), torch.randint(5, (7,)), torch.randint_like(x, 3, 7),
                torch.randint(-4, 4, (20, 30), dtype=torch.int32))

    x = torch.randn(40, 30)
    _, out = _run(f, (x,))
    for g, w in zip(out, f(x), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
    counts = torch.bincount(out[0].flatten(), minlength=10).double()
    chi2 = ((counts - counts.mean()) ** 2 / counts.mean()).sum()
    assert out[0].min() >= 0 and out[0].max() <= 9 and chi2 < 27.9  # 99.9th percentile of chi2(9)
    assert set(out[2].unique().tolist()) == {3.0, 4.0, 5.0, 6.0}
    assert out[3].min() >= -4 and out[3].max() <= 3 and set(out[1].tolist()) <= set(range(5))
