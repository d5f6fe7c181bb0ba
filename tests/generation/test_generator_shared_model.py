"""Two ``spmd.Generator``s of one model and mesh, through the graph runner on CPU (``HostReplayBackend``).

Interleaved ``generate`` calls of both give the reference tokens, every weight is placed on the
mesh once, decode steps stage (copy into graph inputs) no weight bytes -- each Generator's graphs
keep reading the shared weights in place -- and replay: no step runs eagerly because the other
Generator holds a donated static buffer (both used to share one graph runner and its buffers).
"""

import sys

import pytest
import torch

import spmd
from spmd.generation import Generator
from spmd.generation.reference import reference_generate
from spmd.models.llama_lm import llama_lm
from spmd.runtime import graphs
from spmd.runtime.graphs import GraphOptions, GraphRunner, HostReplayBackend

_HELD = spmd.metrics.counter("cuda_graphs.eager_call.donated_buffer_held")


@pytest.fixture(autouse=True)
def _host_graphs(monkeypatch):
    """Fresh executables (no process-wide cache hits from other tests), run by host-replay graph runners."""
    def host_graph(executable, options=None, graph_options=None):
        return GraphRunner(executable, GraphOptions(), backend=HostReplayBackend(executable))

    monkeypatch.setattr(graphs, "maybe_graph", host_graph)
    monkeypatch.setattr(sys.modules["spmd.jit"], "_GLOBAL_CACHE", {})


def _generate_counting(gen, prompts, new):
    """``(tokens, per decode step after the first: bytes staged into graph inputs)``."""
    staged = spmd.metrics.counter("cuda_graphs.staged.bytes")
    seen = []
    res = gen.generate(prompts, new, progress=lambda _: seen.append(staged.value))
    return res.tokens, [y - x for x, y in zip(seen, seen[1:])]


def test_two_generators_of_one_model_interleave_without_restaging_weights():
    model = llama_lm(small=True, seed=5)
    mesh = spmd.Mesh.create(("tp",), devices="cpu:1")
    prefill_len, new, max_seq = 5, 6, 12
    a = Generator(model, mesh, max_batch=2, max_seq=max_seq, prefill_len=prefill_len)
    b = Generator(model, mesh, max_batch=2, max_seq=max_seq, prefill_len=prefill_len)
    small = Generator(model, mesh, max_batch=1, max_seq=max_seq, prefill_len=prefill_len)
    for name, arr in a.params.items():  # the weights are on the mesh once
        assert b.params[name] is arr and small.params[name] is arr
    prompts = {a: [[5, 17, 3], [11, 2, 9, 4, 1]], b: [[7, 1], [3, 30, 8, 2]], small: [[9, 4, 6]]}
    refs = {}
    for g, p in prompts.items():
        tokens, start = g.pad_prompts(p)
        refs[g] = reference_generate(model, tokens, start, new, max_seq)[0][:len(p)]
    weight_bytes = min(t.nbytes for arr in a.params.values() for t in arr._buffers)
    prologue_runs = spmd.metrics.counter("hoist.prologue_runs")
    # each program's first call runs eagerly, the second captures: warm both up, then interleave
    for g in (a, b, small, a, b, small):
        assert torch.equal(g.generate(prompts[g], new).tokens, refs[g])
    runs, held = prologue_runs.value, _HELD.value
    for g in (a, b, a, small, b, a):
        tokens, steps = _generate_counting(g, prompts[g], new)
        assert torch.equal(tokens, refs[g])
        # later decode steps stage a few token-sized arrays, never a weight
        assert steps and all(s < weight_bytes for s in steps), (steps, weight_bytes)
    assert prologue_runs.value == runs  # the hoisted weight values are not recomputed either
    assert _HELD.value == held


def test_generators_of_two_models_of_one_shape_keep_their_own_weights_adopted():
    """Equal programs share one executable; each Generator's graphs still read its own weights in place."""
    mesh = spmd.Mesh.create(("tp",), devices="cpu:1")
    prefill_len, new, max_seq = 4, 5, 8
    models = [llama_lm(small=True, seed=6), llama_lm(small=True, seed=7)]
    gens = [Generator(m, mesh, max_batch=1, max_seq=max_seq, prefill_len=prefill_len) for m in models]
    prompt = [[3, 8, 1]]
    tokens, start = gens[0].pad_prompts(prompt)
    refs = [reference_generate(m, tokens, start, new, max_seq)[0][:1] for m in models]
    weight_bytes = min(t.nbytes for arr in gens[0].params.values() for t in arr._buffers)
    for g, ref in [*zip(gens, refs)] * 2:  # warm-up and capture
        assert torch.equal(g.generate(prompt, new).tokens, ref)
    held = _HELD.value
    for g, ref in [*zip(gens, refs)] * 2:
        tokens, steps = _generate_counting(g, prompt, new)
        assert torch.equal(tokens, ref)
        assert steps and all(s < weight_bytes for s in steps), (steps, weight_bytes)
    assert _HELD.value == held


def _reference_tokens(model, gen, prompts, new):
    tokens, start = gen.pad_prompts(prompts)
    return reference_generate(model, tokens, start, new, gen.max_seq)[0][:len(prompts), :new]


def test_a_generator_keeps_its_weights_and_one_built_after_an_update_reads_the_new_ones():
    """The documented contract: an update (in place under no_grad, or load_state_dict) is seen by
    Generators built after it; earlier ones, interleaved with them, go on with their own copy."""
    model = llama_lm(small=True, seed=6)
    prompts, new = [[3, 1, 4], [1, 5]], 5
    old = Generator(model, spmd.Mesh.create(("tp",), devices="cpu:2"), max_batch=2, max_seq=10, prefill_len=4)
    want_old = _reference_tokens(model, old, prompts, new)
    assert torch.equal(old.generate(prompts, new).tokens, want_old)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.lm_head.weight.mul_(-2.0)
    scaled = Generator(model, spmd.Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4"), max_batch=2, max_seq=12,
                       prefill_len=4)
    want_scaled = _reference_tokens(model, scaled, prompts, new)
    assert not torch.equal(want_scaled, want_old)  # the update changes the tokens
    assert torch.equal(scaled.generate(prompts, new).tokens, want_scaled)
    assert torch.equal(old.generate(prompts, new).tokens, want_old)
    model.load_state_dict(state)
    restored = Generator(model, spmd.Mesh.create(("tp",), devices="cpu:2"), max_batch=2, max_seq=10, prefill_len=4)
    assert restored.params["lm_head.weight"] is not old.params["lm_head.weight"]
    assert torch.equal(restored.generate(prompts, new).tokens, want_old)
    assert torch.equal(scaled.generate(prompts, new).tokens, want_scaled)
