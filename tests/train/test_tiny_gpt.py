"""Batches of the small-GPT training task: deterministic windows of the corpus, user errors for bad sizes."""

import pytest
import torch

from spmd.train.tiny_gpt import batch_at


def test_batch_is_shifted_windows_and_a_function_of_seed_and_step():
    tokens = torch.randperm(500)
    b = batch_at(tokens, step=3, batch=4, seq=16, seed=7)
    assert b["ids"].shape == (4, 16) and b["targets"].shape == (4, 16)
    assert torch.equal(b["ids"][:, 1:], b["targets"][:, :-1])
    for row in b["ids"]:  # each row is a contiguous window of the corpus
        start = int((tokens == row[0]).nonzero())
        assert torch.equal(tokens[start:start + 16], row)
    again = batch_at(tokens, step=3, batch=4, seq=16, seed=7)
    assert all(torch.equal(b[k], again[k]) for k in b)


@pytest.mark.parametrize("seq", [99, 100, 5000])
def test_window_longer_than_the_corpus_is_a_value_error(seq):
    with pytest.raises(ValueError, match=rf"seq: a window of seq \+ 1 tokens must be shorter than the corpus "
                                         rf"\(100 tokens\), got seq={seq}"):
        batch_at(torch.arange(100), step=0, batch=2, seq=seq, seed=0)


def test_longest_window_that_fits():
    b = batch_at(torch.arange(100), step=0, batch=2, seq=98, seed=0)
    assert b["ids"].shape == (2, 98)
