"""``reference_generate``: the eager reference rejects bad arguments with errors naming them."""

import pytest
import torch

from spmd.generation import Sampling
from spmd.generation.reference import reference_generate
from spmd.models.llama_lm import llama_lm

TOKENS, START = torch.tensor([[0, 1, 2], [0, 0, 7]]), torch.tensor([0, 2])


@pytest.fixture(scope="module")
def model():
    return llama_lm(small=True, seed=1, layers=1)


@pytest.mark.parametrize(("args", "exc", "match"), [
    ((TOKENS, START, 0, 8), ValueError, "max_new_tokens: expected an int >= 1, got 0"),
    ((TOKENS, START, 2.0, 8), TypeError, "max_new_tokens: expected an int >= 1, got float"),
    ((TOKENS, START, 5, 4), ValueError, "a prefill of 3 and 5 new tokens need 7 cache positions, got max_seq=4"),
    ((TOKENS, START, 1, 2), ValueError, "need 3 cache positions, got max_seq=2"),
    ((TOKENS[0], START, 2, 8), TypeError, r"tokens: expected an int64 tensor of 2 dims, got torch.int64 \[3\]"),
    ((TOKENS.float(), START, 2, 8), TypeError, "tokens: expected an int64 tensor of 2 dims, got torch.float32"),
    (([[0, 1, 2]], START, 2, 8), TypeError, "tokens: expected an int64 tensor of 2 dims, got list"),
    ((TOKENS, torch.tensor([0]), 2, 8), ValueError, r"start \[1\]"),
    ((TOKENS, torch.tensor([0, 3]), 2, 8), ValueError, r"start: expected slots in \[0, 3\)"),
    ((TOKENS + 300, START, 2, 8), ValueError, r"tokens: expected ids in \[0, 256\), got 300..307"),
])
def test_bad_arguments_name_the_argument(model, args, exc, match):
    with pytest.raises(exc, match=match):
        reference_generate(model, *args)


def test_bad_model_and_sampling(model):
    with pytest.raises(TypeError, match="model: expected a spmd.models.llama_lm.LlamaForCausalLM, got Linear"):
        reference_generate(torch.nn.Linear(2, 2), TOKENS, START, 2, 8)
    with pytest.raises(TypeError, match="sampling: expected a spmd.generation.Sampling or None, got str"):
        reference_generate(model, TOKENS, START, 2, 8, "greedy")


def test_valid_arguments_give_one_token_per_step(model):
    tokens, kv = reference_generate(model, TOKENS, START, 3, 5, Sampling(temperature=0.5, seed=1))
    assert tokens.shape == (2, 3) and tokens.dtype == torch.int64 and len(kv) == 1
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 256
