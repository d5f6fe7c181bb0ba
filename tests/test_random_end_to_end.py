"""Random ops through spmd.jit: the same seed gives the same numbers on every mesh and sharding
(cpu:1/2/4, 2-d, uneven dims), torch.manual_seed reproduces a run, calls draw fresh numbers, and
an exponential-race sampler over a vocab-sharded dim samples the softmax distribution."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P


def _program(x, p):
    return (torch.rand_like(x), torch.randn(x.shape[0], 3, dtype=torch.float64), F.dropout(x, 0.25, training=True),
            torch.bernoulli(p), torch.argmax(p / torch.empty_like(p).exponential_(1), dim=-1))


LAYOUTS = [
    ("cpu:1", {"t": 1}, P()),
    ("cpu:2", {"t": 2}, P("t", None)),
    ("cpu:4", {"t": 4}, P(None, "t")),
    ("cpu:4", {"a": 2, "b": 2}, P("b", "a")),
    ("cpu:4", {"a": 2, "b": 2}, P(None, ("a", "b"))),
]


def _run(devices, axes, spec, seed, x, p):
    mesh = Mesh.create(axes, devices=devices)
    f = spmd.jit(_program, mesh=mesh, in_shardings=(spec, spec))
    torch.manual_seed(seed)
    return [o.to_torch() for o in f(x, p)], [o.to_torch() for o in f(x, p)]


def test_same_seed_same_numbers_on_every_mesh_and_fresh_numbers_per_call():
    x = torch.randn(5, 7, dtype=torch.float64)
    p = torch.rand(5, 7, dtype=torch.float64)
    ref_first, ref_second = _run(*LAYOUTS[0], 1, x, p)
    for k in range(4):
        assert not torch.equal(ref_first[k], ref_second[k])
    for layout in LAYOUTS[1:]:
        first, second = _run(*layout, 1, x, p)
        for a, b in zip(first + second, ref_first + ref_second, strict=True):
            assert torch.equal(a, b), layout
    other, _ = _run(*LAYOUTS[2], 2, x, p)
    assert not torch.equal(other[0], ref_first[0])


def test_dropout_statistics_on_a_sharded_activation():
    mesh = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")
    f = spmd.jit(lambda h: F.dropout(h, 0.4, training=True), mesh=mesh, in_shardings=P("dp", None, "tp"))
    h = torch.randn(6, 33, 50, dtype=torch.float64) + 5
    y = f(h).to_torch()
    kept = y != 0
    assert abs(kept.double().mean().item() - 0.6) < 0.02
    torch.testing.assert_close(y[kept], h[kept] / 0.6, rtol=1e-15, atol=0)


@pytest.mark.parametrize("devices,spec", [("cpu:1", P()), ("cpu:4", P(None, "tp"))])
def test_exponential_race_samples_the_softmax_distribution(devices, spec):
    """gpt-fast: argmax(probs / q), q ~ Exp(1), picks token i with probability probs[i]."""
    mesh = Mesh.create(("tp",), devices=devices)

    def sample(logits):
        probs = torch.softmax(logits, dim=-1)
        return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)

    vocab, rows = 10, 4000
    logits = torch.linspace(-2, 1, vocab, dtype=torch.float64).expand(rows, vocab).contiguous()
    torch.manual_seed(0)
    tokens = spmd.jit(sample, mesh=mesh, in_shardings=spec)(logits).to_torch()
    freq = torch.bincount(tokens, minlength=vocab).double() / rows
    probs = torch.softmax(logits[0], -1)
    se = (probs * (1 - probs) / rows).sqrt()
    assert ((freq - probs).abs() < 5 * se + 1e-3).all(), (freq, probs)


def test_scalar_and_empty_random_values():
    mesh = Mesh.create(("t",), devices="cpu:2")
    f = spmd.jit(lambda x: (torch.rand(()) + x.sum(), torch.randn(0, 3), torch.rand_like(x)), mesh=mesh,
                 in_shardings=P("t"))
    x = torch.randn(3, 2)
    s, e, r = (o.to_torch() for o in f(x))
    assert s.shape == () and e.shape == (0, 3) and r.shape == (3, 2) and 0 <= (s - x.sum()).item() < 1
