"""spmd.Generator on one GPU: the decode step replays one CUDA graph, output sets rotate, tokens equal eager."""

import contextlib

import pytest
import torch

import spmd
from spmd.generation import Generator
from spmd.generation.reference import reference_generate
from spmd.models.llama_lm import llama_lm


@pytest.mark.gpu
def test_decode_steps_replay_cuda_graphs_and_equal_eager():
    model = llama_lm(small=True, seed=1, device="cuda:0")
    mesh = spmd.Mesh.create(("tp",), devices="cuda:1")
    gen = Generator(model, mesh, max_batch=4, max_seq=48, prefill_len=8)
    prompts = [[5, 17, 3], [11, 2, 9, 4, 1, 1, 7, 8], [7], [1, 2]]
    gen.generate(prompts, 4)  # compiles; the first call of each program runs eagerly, the second captures
    count = spmd.metrics.counter
    before = {k: count(k).value for k in ("cuda_graphs.replay", "cuda_graphs.clone_call.outputs_held")}
    res = gen.generate(prompts, 40)
    tokens, start = gen.pad_prompts(prompts)
    ref, ref_kv = reference_generate(model, tokens, start, 40, 48)
    assert torch.equal(res.tokens, ref.cpu())
    for (k, v), (rk, rv) in zip(gen.kv_cache(), ref_kv, strict=True):
        torch.testing.assert_close(k, rk.cpu(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, rv.cpu(), rtol=1e-4, atol=1e-4)
    assert count("cuda_graphs.replay").value - before["cuda_graphs.replay"] >= 39  # every decode step
    # the host holds no step's outputs (tokens accumulate in a donated device buffer): no cloned output sets
    assert count("cuda_graphs.clone_call.outputs_held").value == before["cuda_graphs.clone_call.outputs_held"]


@pytest.mark.gpu
def test_decode_steps_stage_no_cache_bytes():
    """The donated KV cache is the decode graph's static buffer: steady decode steps copy none of it."""
    model = llama_lm(small=True, seed=2, device="cuda:0")
    gen = Generator(model, spmd.Mesh.create(("tp",), devices="cuda:1"), max_batch=2, max_seq=40, prefill_len=8)
    prompts = [[5, 17, 3], [11, 2, 9, 4, 1, 1, 7, 8]]
    gen.generate(prompts, 4)  # compiles; the first call of each program runs eagerly, the second captures
    staged = spmd.metrics.counter("cuda_graphs.staged.bytes")
    seen = []
    res = gen.generate(prompts, 30, progress=lambda _: seen.append(staged.value))
    tokens, start = gen.pad_prompts(prompts)
    ref, _ = reference_generate(model, tokens, start, 30, 40)
    assert torch.equal(res.tokens, ref.cpu())
    layer_shard_bytes = min(t.nbytes for k, _ in gen.kv for t in k._buffers)
    steps = [b - a for a, b in zip(seen, seen[1:])]
    assert steps and all(s < layer_shard_bytes for s in steps[1:]), (steps, layer_shard_bytes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs compute capability 9.0")
def test_programmatic_dependent_launch_changes_no_token(monkeypatch):
    """bf16 decode through spmd's Triton kernels launched with PDL gives the tokens of the same
    programs launched without it (PDL reorders no write before a read)."""
    pytest.importorskip("triton")
    from spmd.runtime import triton_pdl

    monkeypatch.setenv("SPMD_PDL", "1")
    model = llama_lm(small=True, seed=3, device="cuda:0", dtype=torch.bfloat16)
    mesh = spmd.Mesh.create(("tp",), devices="cuda:1")
    prompts = [[5, 17, 3, 9]]
    results = []
    for pdl in (True, False):
        with contextlib.nullcontext() if pdl else triton_pdl.disabled():
            gen = Generator(model, mesh, max_batch=1, max_seq=48, prefill_len=8)
            gen.generate(prompts, 4)  # compiles and captures
            results.append(gen.generate(prompts, 40).tokens)
            del gen
    assert torch.equal(results[0], results[1])


@pytest.mark.gpu
def test_two_generators_of_one_model_keep_their_graphs_and_share_the_weights():
    """A second Generator of one model (same mesh) used to make the first one copy every weight into
    its graph inputs on every decode step (one graph runner shared through the compile cache, fed
    two device copies of the weights, and the second ran its steps eagerly: the first held the
    shared donated KV buffers); now both replay without staging weights, on one copy."""
    model = llama_lm(small=True, seed=4, device="cuda:0")
    mesh = spmd.Mesh.create(("tp",), devices="cuda:1")
    a = Generator(model, mesh, max_batch=2, max_seq=24, prefill_len=8)
    allocated = torch.cuda.memory_allocated()
    b = Generator(model, mesh, max_batch=2, max_seq=24, prefill_len=8)
    one = Generator(model, mesh, max_batch=1, max_seq=24, prefill_len=8)
    weight_bytes = sum(t.nbytes for arr in a.params.values() for t in arr._buffers)
    assert torch.cuda.memory_allocated() - allocated < weight_bytes  # only the KV caches are new
    prompts = {a: [[5, 17, 3], [11, 2, 9, 4, 1, 1, 7, 8]], b: [[7, 1], [3, 30, 8, 2]], one: [[9, 4, 6]]}
    refs = {}
    for g, p in prompts.items():
        tokens, start = g.pad_prompts(p)
        refs[g] = reference_generate(model, tokens, start, 12, 24)[0][:len(p)].cpu()
    for g in (a, b, one, a, b, one):  # compile, then capture
        g.generate(prompts[g], 4)
    staged = spmd.metrics.counter("cuda_graphs.staged.bytes")
    held = spmd.metrics.counter("cuda_graphs.eager_call.donated_buffer_held")
    held_before = held.value
    smallest_matrix = min(t.nbytes for arr in a.params.values() for t in arr._buffers if t.dim() == 2)
    for g in (a, b, a, one, b, a):
        seen = []
        res = g.generate(prompts[g], 12, progress=lambda _, seen=seen: seen.append(staged.value))
        assert torch.equal(res.tokens, refs[g])
        steps = [y - x for x, y in zip(seen, seen[1:])]
        assert steps and all(s < smallest_matrix for s in steps), (steps, smallest_matrix)
    assert held.value == held_before  # no decode step ran eagerly for a static buffer the other one holds
