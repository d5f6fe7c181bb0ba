"""The on-device sampler: argument checks, greedy ties, the exponential race's distribution, top-k, top-p."""

import numpy as np
import pytest
import torch

import spmd
from spmd.generation.sampling import (
    RNG_MODULUS,
    Sampling,
    argmax_first,
    initial_rng_state,
    sample,
)


@pytest.mark.parametrize(("kwargs", "exc", "match"), [
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=1e-45), ValueError, "temperature"),  # 0 in float32: the logits would be divided by 0
    (dict(temperature="hot"), TypeError, "temperature"),
    (dict(temperature=1.0, top_k=0), ValueError, "top_k"),
    (dict(temperature=1.0, top_k=2.5), TypeError, "top_k"),
    (dict(temperature=1.0, top_p=0.0), ValueError, "top_p"),
    (dict(temperature=1.0, top_p=1.5), ValueError, "top_p"),
    (dict(top_k=3), ValueError, "need a temperature"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(temperature=1.0, seed=2**70), ValueError, "seed"),
    (dict(temperature=1.0, seed=-(2**63) - 1), ValueError, "seed"),
    (dict(temperature=torch.tensor(0.5)), TypeError, "temperature: expected a float > 0 or None .* got Tensor"),
    (dict(temperature=np.float32(0.0)), ValueError, "temperature"),
    (dict(temperature=1.0, top_k=np.float64(2.0)), TypeError, "top_k"),
    (dict(temperature=1.0, top_k=np.int64(0)), ValueError, "top_k"),
])
def test_bad_sampling_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Sampling(**kwargs)


def test_numpy_scalars_are_stored_as_python_numbers():
    s = Sampling(temperature=np.float32(0.5), top_k=np.int64(5), top_p=np.float16(0.75), seed=np.uint64(2**63 + 1))
    assert s == Sampling(temperature=0.5, top_k=5, top_p=0.75, seed=2**63 + 1)
    assert [type(v) for v in (s.temperature, s.top_k, s.top_p, s.seed)] == [float, int, float, int]
    assert type(Sampling(temperature=2).temperature) is float and hash(s) == hash(Sampling(0.5, 5, 0.75, 2**63 + 1))


def test_argmax_first_takes_the_lowest_index_on_ties():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    assert argmax_first(x).tolist() == [1, 0]
    y = torch.randn(5, 33)
    assert torch.equal(argmax_first(y), y.argmax(-1))


def test_rng_state_lanes_stay_in_range():
    state = initial_rng_state(3, 50, seed=7)
    assert torch.equal(state, initial_rng_state(3, 50, seed=7))
    assert int(state.min()) >= 1 and int(state.max()) < RNG_MODULUS


def _frequencies(logits, sampling, draws=4000):
    """Token frequencies of ``draws`` samples from one row of logits (one lane per draw)."""
    rng = initial_rng_state(draws, logits.shape[-1], sampling.seed)
    tokens, _ = sample(logits.expand(draws, -1), rng, sampling)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / draws


def test_exponential_race_samples_the_softmax():
    logits = torch.tensor([[0.5, 1.5, -1.0, 0.0, 1.0]])
    freq = _frequencies(logits, Sampling(temperature=0.7, seed=0))
    probs = torch.softmax(logits[0].double() / 0.7, -1)
    assert (freq - probs).abs().max() < 0.03  # 4000 draws: the standard error is below 0.008


def test_top_k_and_top_p_keep_only_the_head():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9, 0.0, 1.0]])
    fk = _frequencies(logits, Sampling(temperature=1.0, top_k=2))
    assert fk[[1, 3]].sum() == 1 and fk[1] > 0 and fk[3] > 0
    probs = torch.softmax(logits[0], -1)  # sorted: 1 (.38), 3 (.35), 5 (.14), ...
    fp = _frequencies(logits, Sampling(temperature=1.0, top_p=0.7))
    assert fp[[1, 3]].sum() == 1 and probs[[1, 3]].sum() > 0.7
    fp2 = _frequencies(logits, Sampling(temperature=1.0, top_p=0.75))
    assert fp2[[1, 3, 5]].sum() == 1 and fp2[5] > 0


def test_greedy_leaves_the_state():
    rng = initial_rng_state(2, 8, 0)
    tokens, out = sample(torch.randn(2, 8), rng, Sampling())
    assert out is rng and tokens.dtype == torch.int64


def test_compiled_sampler_equals_eager_on_a_vocab_sharded_mesh():
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    logits, rng = torch.randn(3, 64) * 3, initial_rng_state(3, 64, 5)
    s = Sampling(temperature=0.8)
    f = spmd.jit(lambda x, r: sample(x, r, s), mesh=mesh, in_shardings=(spmd.PartitionSpec(None, "tp"),) * 2)
    tokens, state = f(logits, rng)
    ref_tokens, ref_state = sample(logits, rng, s)
    assert torch.equal(tokens.to_torch(), ref_tokens) and torch.equal(state.to_torch(), ref_state)


@pytest.mark.parametrize("kwargs", [{}, {"top_k": 2}, {"top_p": 0.5}])
@pytest.mark.parametrize("temperature", [1e-37, 1.2e-38])
def test_tiny_temperature_samples_the_largest_logit(kwargs, temperature):
    """logits / temperature overflows float32: the sample is still the argmax (no NaN row, no token id
    equal to the vocabulary size), compiled on a vocabulary-sharded mesh as in eager."""
    logits = torch.randn(3, 64) * 4
    logits[:, 5] = 60.0
    logits[1, 9] = 61.0
    rng = initial_rng_state(3, 64, 1)
    s = Sampling(temperature=temperature, **kwargs)
    tokens, _ = sample(logits, rng, s)
    assert tokens.tolist() == [5, 9, 5]
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    f = spmd.jit(lambda x, r: sample(x, r, s), mesh=mesh, in_shardings=(spmd.PartitionSpec(None, "tp"),) * 2)
    assert f(logits, rng)[0].to_torch().tolist() == [5, 9, 5]
