"""Hoisted weight values shared between programs: a ``Generator``'s prefill and decode hold one copy.

The prefill and decode programs hoist the same merged Q/K/V and gate/up weights from the same
placed weights: one prologue run, one set of values on the devices, and an in-place weight update
seen by both (eagerly and through CUDA-graph runners on the host replay backend). Programs given
other weights keep their own values.
"""

from __future__ import annotations

import gc
import sys
import threading
import weakref

import pytest
import torch

import spmd
from spmd.generation import Generator
from spmd.generation.reference import reference_generate
from spmd.models.llama_lm import llama_lm
from spmd.runtime import graphs
from spmd.runtime.graphs import GraphOptions, GraphRunner, HostReplayBackend
from tests.runtime.test_weight_cache import _jit_mlp, _mlp_args, _mlp_ref, _rel_err

P = spmd.PartitionSpec

Q = "layers.1.self_attn.q_proj.weight"
UP = "layers.0.mlp.up_proj.weight"
PROMPTS = [[5, 17, 3], [11, 2, 9, 4, 1]]
NEW, MAX_SEQ, PREFILL = 5, 12, 5


@pytest.fixture(autouse=True)
def _fresh_compile_cache(monkeypatch):
    """Each test compiles its own executables (the process-wide cache would keep them alive)."""
    gc.collect()  # programs of earlier tests release their shared prologues
    monkeypatch.setattr(sys.modules["spmd.jit"], "_GLOBAL_CACHE", {})


def _host_graphs(monkeypatch):
    def host_graph(executable, options=None, graph_options=None):
        return GraphRunner(executable, GraphOptions(), backend=HostReplayBackend(executable))

    monkeypatch.setattr(graphs, "maybe_graph", host_graph)


def _compiled(gen: Generator) -> list:
    """The prefill and decode ``Compiled`` of ``gen`` (one sampling, one layout each)."""
    pre, dec = next(iter(gen._programs.values()))
    return [c for j in (pre, dec) for c in j._cache.values()]


def _check_tokens(gen: Generator, model) -> None:
    tokens, start = gen.pad_prompts(PROMPTS)
    ref = reference_generate(model, tokens, start, NEW, MAX_SEQ)[0][:len(PROMPTS)]
    assert torch.equal(gen.generate(PROMPTS, NEW).tokens, ref)


def _update_in_place(model, gen: Generator, name: str, scale: float) -> None:
    """Scale a weight in place, in the model (the reference) and in its placed shards (what the programs read)."""
    with torch.no_grad():
        model.get_parameter(name).mul_(scale)
        for buf in gen.params[name]._buffers:
            buf.mul_(scale)


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:2"])
def test_prefill_and_decode_hold_one_copy_of_the_hoisted_weights(devices):
    model = llama_lm(small=True, seed=5)
    gen = Generator(model, spmd.Mesh.create(("tp",), devices=devices), max_batch=2, max_seq=MAX_SEQ,
                    prefill_len=PREFILL)
    _check_tokens(gen, model)
    prefill, decode = (c.weight_cache for c in _compiled(gen))
    assert prefill.shared is decode.shared and prefill.entry is decode.entry
    assert prefill.runs == 1 and decode.runs == 0  # the prefill ran the prologue, the decode shares it
    pre_values = prefill.entry.values
    assert len(pre_values) == 4  # Q/K/V and gate/up of two layers
    bytes_once = sum(t.nbytes for per in pre_values for t in per)
    assert prefill.size_bytes == decode.size_bytes == bytes_once > 0
    assert prefill.inputs == decode.inputs  # the weights come first in both programs

    _update_in_place(model, gen, Q, -1.5)
    _update_in_place(model, gen, UP, 0.5)
    _check_tokens(gen, model)  # both programs read the new merged weights
    assert prefill.runs + decode.runs == 2 and prefill.entry is decode.entry
    _check_tokens(gen, model)
    assert prefill.runs + decode.runs == 2


def test_a_prefill_with_its_own_constant_tables_shares_its_weight_values():
    """A longer prefill also hoists its mask tables (constant-only, of its shapes): they go to a
    prologue of their own, and the merged weights are still held once for prefill and decode."""
    model = llama_lm(small=True, seed=10)
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    gen = Generator(model, mesh, max_batch=2, max_seq=40, prefill_len=32)
    tokens, start = gen.pad_prompts(PROMPTS)
    ref = reference_generate(model, tokens, start, NEW, 40)[0][:len(PROMPTS)]
    assert torch.equal(gen.generate(PROMPTS, NEW).tokens, ref)
    prefill, decode = (c.weight_cache for c in _compiled(gen))
    assert prefill.constants is not None and decode.constants is None
    assert prefill.entry is decode.entry and prefill.runs == 1 and decode.runs == 0
    assert prefill.size_bytes == decode.size_bytes + prefill.constants.size_bytes > decode.size_bytes
    table_runs = prefill.constants.runs
    _update_in_place(model, gen, UP, -0.5)
    ref = reference_generate(model, tokens, start, NEW, 40)[0][:len(PROMPTS)]
    assert torch.equal(gen.generate(PROMPTS, NEW).tokens, ref)
    assert prefill.runs + decode.runs == 2 and prefill.constants.runs == table_runs  # tables not recomputed


def test_graph_runners_of_both_programs_see_a_refresh_in_place(monkeypatch):
    """Both programs' graphs captured the shared values: an update refreshes them in place, no recapture."""
    _host_graphs(monkeypatch)
    model = llama_lm(small=True, seed=8)
    gen = Generator(model, spmd.Mesh.create(("tp",), devices="cpu:2"), max_batch=2, max_seq=MAX_SEQ,
                    prefill_len=PREFILL)
    for _ in range(2):  # eager warm-up, then capture
        _check_tokens(gen, model)
    compiled = _compiled(gen)
    caches = [c.weight_cache for c in compiled]
    assert all(c.copy_into for c in caches) and caches[0].entry is caches[1].entry
    held = [t for per in caches[0].entry.values for t in per]
    captures = [c.executable.num_captures for c in compiled]
    assert min(captures) >= 1

    _update_in_place(model, gen, Q, -2.0)
    _check_tokens(gen, model)
    assert sum(c.runs for c in caches) == 2
    assert all(a is b for a, b in zip(held, (t for per in caches[1].entry.values for t in per), strict=True))
    assert [c.executable.num_captures for c in compiled] == captures


def test_generators_of_other_weights_keep_their_own_values():
    """Equal prologues, other weights: one shared prologue, a set of values per model, none recomputed."""
    mesh = spmd.Mesh.create(("tp",), devices="cpu:1")
    models = [llama_lm(small=True, seed=6), llama_lm(small=True, seed=7)]
    gens = [Generator(m, mesh, max_batch=2, max_seq=MAX_SEQ, prefill_len=PREFILL) for m in models]
    for g, m in [*zip(gens, models)] * 2:
        _check_tokens(g, m)
    a, b = ([c.weight_cache for c in _compiled(g)] for g in gens)
    assert a[0].shared is b[0].shared and a[0].entry is a[1].entry and b[0].entry is b[1].entry
    assert a[0].entry is not b[0].entry
    assert sum(c.runs for c in (*a, *b)) == 2  # once per model, not on every switch
    assert not {id(t) for per in a[0].entry.values for t in per} & {id(t) for per in b[0].entry.values for t in per}


def test_the_values_and_graphs_are_freed_with_the_last_program(monkeypatch):
    """The process-wide compile cache keeps only a never-called template: a Generator's hoisted
    values, graph runners and their static buffers go with it (the cache is left as it is)."""
    _host_graphs(monkeypatch)
    model = llama_lm(small=True, seed=9)
    gen = Generator(model, spmd.Mesh.create(("tp",), devices="cpu:1"), max_batch=1, max_seq=MAX_SEQ,
                    prefill_len=PREFILL)
    gen.generate([[3, 4]], 2)
    gen.generate([[3, 4]], 3)  # replays
    compiled = _compiled(gen)
    entry = weakref.ref(compiled[0].weight_cache.entry)
    runners = [weakref.ref(c.executable) for c in compiled]
    assert all(isinstance(r(), GraphRunner) for r in runners)
    assert len(sys.modules["spmd.jit"]._GLOBAL_CACHE) == 2
    del gen, compiled
    gc.collect()
    # (the shared prologue itself lives on while programs of other tests hold it: test_prologue_registry)
    assert entry() is None
    assert all(r() is None for r in runners)


def test_two_jits_called_from_threads_run_the_shared_prologue_once():
    """Two functions hoisting the same casts of the same placed weights, called concurrently."""
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    w, x = _mlp_args(mesh, 11)
    placed = {k: spmd.device_put(v, spmd.NamedSharding(mesh, P("tp", None))) for k, v in w.items()}

    def tanh_mlp(w, x):
        h = torch.cat([w["a"], w["b"]], dim=1)
        return torch.tanh(x @ h.to(x.dtype)) @ w["c"].to(x.dtype)

    f = _jit_mlp(mesh, weight_argnums=0)
    g = spmd.jit(tanh_mlp, mesh=mesh, in_shardings=({k: P("tp", None) for k in w}, P()), weight_argnums=0)
    x2 = x[:2] * 0.5
    h = torch.cat([w["a"], w["b"]], dim=1).double()
    want = [_mlp_ref(w, x), torch.tanh(x2 @ h) @ w["c"].double()]
    errors = []

    def work() -> None:
        for _ in range(5):
            for fn, arg, ref in ((f, x, want[0]), (g, x2, want[1])):
                errors.append(_rel_err(fn(placed, arg).to_torch(), ref))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 40 and max(errors) < 1e-6
    caches = [c.weight_cache for fn in (f, g) for c in fn._cache.values()]
    assert len(caches) == 2 and caches[0].entry is caches[1].entry and sum(c.runs for c in caches) == 1


@pytest.mark.gpu
def test_cuda_graphs_of_prefill_and_decode_follow_a_shared_refresh():
    """On a GPU: both programs' graphs read the one shared copy; an in-place weight update refreshes
    it in place (ordered after both programs' last replays), no recapture, tokens equal eager."""
    model = llama_lm(small=True, seed=4, device="cuda:0")
    gen = Generator(model, spmd.Mesh.create(("tp",), devices="cuda:1"), max_batch=2, max_seq=MAX_SEQ,
                    prefill_len=PREFILL)
    tokens, start = gen.pad_prompts(PROMPTS)

    def check() -> None:
        ref = reference_generate(model, tokens, start, NEW, MAX_SEQ)[0][:len(PROMPTS)]
        assert torch.equal(gen.generate(PROMPTS, NEW).tokens, ref.cpu())

    for _ in range(3):  # eager, capture, replay
        check()
    compiled = _compiled(gen)
    caches = [c.weight_cache for c in compiled]
    assert caches[0].entry is caches[1].entry and sum(c.runs for c in caches) == 1
    held = [t for per in caches[0].entry.values for t in per]
    captures = [getattr(c.executable, "num_captures", None) for c in compiled]
    _update_in_place(model, gen, Q, -1.5)
    check()
    assert sum(c.runs for c in caches) == 2 and caches[0].entry is caches[1].entry
    assert all(a is b for a, b in zip(held, (t for per in caches[1].entry.values for t in per), strict=True))
    assert [getattr(c.executable, "num_captures", None) for c in compiled] == captures


def test_a_program_moving_to_values_another_computed_orders_after_them(monkeypatch):
    """f moves from its own values to those g computed for other weights: its streams wait for g's
    refresh events (GPU; recorded here), although both refreshes were each entry's first."""
    from spmd.runtime.weight_cache import WeightCache

    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    sharding = spmd.NamedSharding(mesh, P("tp", None))
    (w1, x), (w2, _) = _mlp_args(mesh, 12), _mlp_args(mesh, 13)
    p1, p2 = ({k: spmd.device_put(v, sharding) for k, v in w.items()} for w in (w1, w2))
    f, g = _jit_mlp(mesh, weight_argnums=0), _jit_mlp(mesh, weight_argnums=0)
    waited = []
    real_wait = WeightCache._wait
    monkeypatch.setattr(WeightCache, "_wait", lambda self, events: (waited.append((self, events)),
                                                                      real_wait(self, events)))
    f(p1, x)
    g(p2, x)
    (fc,), (gc_,) = f._cache.values(), g._cache.values()
    assert fc.weight_cache.entry is not gc_.weight_cache.entry
    waited.clear()
    assert _rel_err(f(p2, x).to_torch(), _mlp_ref(w2, x)) < 1e-6
    assert fc.weight_cache.entry is gc_.weight_cache.entry
    assert (fc.weight_cache.runs, gc_.weight_cache.runs) == (1, 1)  # f found g's values
    assert (fc.weight_cache, gc_.weight_cache.entry.ready) in [(s, e) for s, e in waited]
