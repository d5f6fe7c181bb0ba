"""spmd.Generator through the graph runner on CPU (``HostReplayBackend``): the donated KV cache is
the decode graph's static buffer, so decode steps stage no cache bytes, and tokens equal eager."""

import torch

import spmd
from spmd.generation import Generator
from spmd.generation.reference import reference_generate
from spmd.models.llama_lm import llama_lm
from spmd.runtime import graphs
from spmd.runtime.graphs import GraphOptions, GraphRunner, HostReplayBackend


def test_decode_steps_stage_no_cache_bytes(monkeypatch):
    def host_graph(executable, options=None, graph_options=None):
        return GraphRunner(executable, GraphOptions(), backend=HostReplayBackend(executable))

    monkeypatch.setattr(graphs, "maybe_graph", host_graph)
    model = llama_lm(small=True, seed=3)
    prefill_len, new, max_seq = 5, 12, 17
    gen = Generator(model, spmd.Mesh.create(("tp",), devices="cpu:2"), max_batch=2, max_seq=max_seq,
                    prefill_len=prefill_len)
    prompts = [[5, 17, 3], [11, 2, 9, 4, 1]]
    gen.generate(prompts, 4)  # the first call of each program runs eagerly, the second captures
    staged = spmd.metrics.counter("cuda_graphs.staged.bytes")
    seen = []
    res = gen.generate(prompts, new, progress=lambda _: seen.append(staged.value))
    tokens, start = gen.pad_prompts(prompts)
    ref, ref_kv = reference_generate(model, tokens, start, new, max_seq)
    assert torch.equal(res.tokens, ref)
    for (k, v), (rk, rv) in zip(gen.kv_cache(), ref_kv, strict=True):
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)
    layer_shard_bytes = min(t.nbytes for k, _ in gen.kv for t in k._buffers)
    steps = [b - a for a, b in zip(seen, seen[1:])]
    assert len(steps) == new - 2
    # the first decode call copies the prefill's cache in once; later steps stage a few small arrays
    assert all(0 < s < layer_shard_bytes for s in steps[1:]), (steps, layer_shard_bytes)
    assert spmd.metrics.counter("cuda_graphs.replay").value >= new - 1
