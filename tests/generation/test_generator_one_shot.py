"""Greedy decoding of a tensor-parallel Llama with every all-reduce run one-shot (CompileOptions.small_all_reduce="on")
gives the tokens and KV cache of plain PyTorch eager."""

import pytest

import spmd
import spmd.runtime.comm.cpu as comm_cpu
from spmd.generation import Generator
from spmd.models.llama_lm import llama_lm
from tests.generation.test_generator import MAX_SEQ, PREFILL, PROMPTS4, _check_against_eager


@pytest.fixture(scope="module")
def model():
    return llama_lm(small=True, seed=1)


@pytest.mark.parametrize(("n", "batch"), [(2, 4), (4, 1)])
def test_greedy_tokens_equal_eager_with_one_shot_all_reduces(monkeypatch, model, n, batch):
    calls = []
    original = comm_cpu.one_shot_cpu

    def spy(spec, x, staging, stream_id=0):
        calls.append(spec.out_dims)
        return original(spec, x, staging, stream_id)

    monkeypatch.setattr(comm_cpu, "one_shot_cpu", spy)
    marked = spmd.metrics.counter("select-all-reduce.one_shot")
    before = marked.value
    options = spmd.CompileOptions(small_all_reduce="on")
    gen = Generator(model, spmd.Mesh.create(("tp",), devices=f"cpu:{n}"), max_batch=batch, max_seq=MAX_SEQ,
                    prefill_len=PREFILL, options=options)
    _check_against_eager(model, gen, PROMPTS4[:batch] if batch > 1 else PROMPTS4[2:3])
    assert marked.value > before  # the programs were compiled with one-shot all-reduces ...
    assert any(d[:2] == (batch, 1) for d in calls)  # ... and ran them in the decode step
    assert any(d[:2] == (batch, PREFILL) for d in calls)  # ... and in the prefill
