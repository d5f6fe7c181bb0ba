"""The weight cache of hoisted values: numerics after weight updates, prologue runs, per-call kernels."""

from __future__ import annotations

import sys

import pytest
import torch

import spmd
from spmd.models.llama import llama_layers
from spmd.models.plans import Plan, Replicate, llama_plan
from spmd.parallelize import parallelize
from spmd.passes.pipeline import CompileOptions
from spmd.runtime.graphs import GraphOptions, GraphRunner, HostReplayBackend
from spmd.runtime.thunks import KernelThunk

P = spmd.PartitionSpec
QKV = ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight")
UP = "layers.1.mlp.up_proj.weight"


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return ((got - ref).abs().max() / ref.abs().max()).item()


def _model_and_mesh(mesh_spec):
    axes, devices = mesh_spec
    model = llama_layers(small=True, layers=2, seed=3, num_kv_heads=4).double()
    return model, spmd.Mesh.create(axes, devices=devices)


def _kernels(compiled, opcode: str) -> int:
    """Kernel thunks of ``opcode`` in the per-call program (names come from the instructions)."""
    module_ops = {i.name: i.opcode for i in compiled.module.entry.instructions}
    return sum(isinstance(t, KernelThunk) and module_ops.get(t.name) == opcode
               for t in compiled.executable.program.thunks)


@pytest.fixture(autouse=True)
def _fresh_compile_cache(monkeypatch):
    """Each test compiles its own executables (they hold the weight caches the tests count)."""
    monkeypatch.setattr(sys.modules["spmd.jit"], "_GLOBAL_CACHE", {})


MESHES = [(("tp",), "cpu:1"), (("tp",), "cpu:2"), (("tp",), "cpu:4"), ({"dp": 2, "tp": 2}, "cpu:4")]


@pytest.mark.parametrize("mesh_spec", MESHES, ids=["cpu1", "cpu2", "cpu4", "2x2"])
def test_parallelize_results_follow_weight_updates(mesh_spec):
    model, mesh = _model_and_mesh(mesh_spec)
    pm = parallelize(model, mesh, llama_plan())
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    assert _rel_err(pm(x).to_torch(), model(x)) < 1e-12
    cache = pm.compiled.weight_cache
    assert cache is not None and cache.runs == 1 and cache.size_bytes > 0
    for _ in range(3):
        pm(torch.randn(2, 5, 64, dtype=torch.float64))
    assert cache.runs == 1  # new inputs, same weights: the prologue does not run again
    # replace a parameter (a new ShardedArray)
    new = torch.randn_like(model.get_parameter(QKV[1]))
    with torch.no_grad():
        model.get_parameter(QKV[1]).copy_(new)
    pm.params[QKV[1]] = spmd.device_put(new, pm.params[QKV[1]].sharding)
    assert _rel_err(pm(x).to_torch(), model(x)) < 1e-12 and cache.runs == 2
    # in-place update of a parameter's buffers, through the public shards (views of the buffers)
    with torch.no_grad():
        model.get_parameter(UP).mul_(-2.0)
        for shard in pm.params[UP].shards:
            shard.data.mul_(-2.0)
    assert _rel_err(pm(x).to_torch(), model(x)) < 1e-12 and cache.runs == 3
    pm(x)
    assert cache.runs == 3


def test_no_per_call_concatenation_of_merged_weights():
    model, mesh = _model_and_mesh((("tp",), "cpu:2"))
    x = torch.randn(1, 1, 64, dtype=torch.float64)
    hoisted = parallelize(model, mesh, llama_plan())
    hoisted(x)
    plain = parallelize(model, mesh, llama_plan(), options=CompileOptions(hoist_weights=False))
    plain(x)
    assert _kernels(plain.compiled, "concatenate") >= 4  # Q/K/V and gate/up of both layers
    assert _kernels(hoisted.compiled, "concatenate") == _kernels(plain.compiled, "concatenate") - 4
    assert plain.compiled.weight_cache is None
    assert "concatenate" in hoisted.lowered.result.prologue_text
    assert _rel_err(hoisted(x).to_torch(), plain(x).to_torch()) < 1e-12


def _jit_mlp(mesh, **kwargs):
    def mlp(w, x):
        h = torch.cat([w["a"], w["b"]], dim=1)
        return torch.relu(x @ h.to(x.dtype)) @ w["c"].to(x.dtype)

    return spmd.jit(mlp, mesh=mesh, in_shardings=({"a": P("tp", None), "b": P("tp", None), "c": P("tp", None)},
                                                   P()), **kwargs)


def _mlp_args(mesh, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = {"a": torch.randn(8, 6, generator=g), "b": torch.randn(8, 6, generator=g), "c": torch.randn(12, 5, generator=g)}
    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    return w, x


def _mlp_ref(w, x):
    h = torch.cat([w["a"], w["b"]], dim=1).double()
    return torch.relu(x @ h) @ w["c"].double()


def test_jit_hoists_only_weight_arguments_and_never_donated_ones():
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    w, x = _mlp_args(mesh, 0)
    assert _jit_mlp(mesh).lower(w, x).result.prologue is None  # no weight_argnums: nothing is a weight
    f = _jit_mlp(mesh, weight_argnums=0)
    assert f.lower(w, x).result.prologue is not None
    donating = _jit_mlp(mesh, weight_argnums=0, donate_argnums=0)
    assert donating.lower(w, x).result.prologue is None
    arrays = {k: spmd.device_put(v, s) for (k, v), s in zip(w.items(), [
        spmd.NamedSharding(mesh, P("tp", None)), spmd.NamedSharding(mesh, P("tp", None)),
        spmd.NamedSharding(mesh, P("tp", None))])}
    assert _rel_err(donating(arrays, x).to_torch(), _mlp_ref(w, x)) < 1e-6
    assert arrays["a"].is_deleted


def test_execute_sharded_uses_the_cache():
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    f = _jit_mlp(mesh, weight_argnums=0)
    w, x = _mlp_args(mesh, 1)
    compiled = f.lower(w, x).compile()
    specs = compiled.input_specs
    arrays = [spmd.device_put(t, s.sharding) for t, s in zip([w["a"], w["b"], w["c"], x], specs, strict=True)]
    for _ in range(3):
        out = compiled.execute_sharded(arrays)[0]
    assert _rel_err(out.to_torch(), _mlp_ref(w, x)) < 1e-6 and compiled.weight_cache.runs == 1
    w["b"] = torch.randn(8, 6)
    arrays[1] = spmd.device_put(w["b"], specs[1].sharding)
    assert _rel_err(compiled.execute_sharded(arrays)[0].to_torch(), _mlp_ref(w, x)) < 1e-6
    assert compiled.weight_cache.runs == 2


def test_graph_runner_refreshes_the_captured_values_in_place():
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    f = _jit_mlp(mesh, weight_argnums=0)
    w, x = _mlp_args(mesh, 2)
    compiled = f.lower(w, x).compile()
    ex = compiled.executable
    runner = GraphRunner(ex, GraphOptions(outputs="clone"), backend=HostReplayBackend(ex))
    compiled.executable = runner
    specs = compiled.input_specs
    arrays = [spmd.device_put(t, s.sharding) for t, s in zip([w["a"], w["b"], w["c"], x], specs, strict=True)]
    for _ in range(3):
        out = compiled.execute_sharded(arrays)[0]
    assert _rel_err(out.to_torch(), _mlp_ref(w, x)) < 1e-6 and runner.num_captures == 1
    cached = [t for per in compiled.weight_cache.values(arrays, [a._buffers for a in arrays], None) for t in per]
    with torch.no_grad():
        w["a"].mul_(3.0)
        for shard in arrays[0].shards:
            shard.data.mul_(3.0)
    assert _rel_err(compiled.execute_sharded(arrays)[0].to_torch(), _mlp_ref(w, x)) < 1e-6
    assert compiled.weight_cache.runs == 2 and runner.num_captures == 1  # refreshed in place: no capture
    after = [t for per in compiled.weight_cache.values(arrays, [a._buffers for a in arrays], None) for t in per]
    assert all(a is b for a, b in zip(cached, after, strict=True))


def test_weights_passed_as_tensors_hit_the_cache_until_updated_in_place():
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    f = _jit_mlp(mesh, weight_argnums=0)
    w, x = _mlp_args(mesh, 3)
    assert _rel_err(f(w, x).to_torch(), _mlp_ref(w, x)) < 1e-6
    cache = f.lower(w, x).compile().weight_cache
    f(w, torch.randn(4, 8, dtype=torch.float64))
    assert cache.runs == 1  # the same CPU tensors (placed on the mesh at every call)
    with torch.no_grad():
        w["c"].add_(1.0)
    assert _rel_err(f(w, x).to_torch(), _mlp_ref(w, x)) < 1e-6 and cache.runs == 2


def test_a_weight_given_new_storage_refreshes_the_cache():
    """``w.data = other`` moves the storage without bumping ``_version``: the key's ``data_ptr``
    sees it (a result 140 off before)."""
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    f = _jit_mlp(mesh, weight_argnums=0)
    w, x = _mlp_args(mesh, 5)
    assert _rel_err(f(w, x).to_torch(), _mlp_ref(w, x)) < 1e-6
    cache = f.lower(w, x).compile().weight_cache
    w["c"].data = torch.randn_like(w["c"]) * 3
    assert _rel_err(f(w, x).to_torch(), _mlp_ref(w, x)) < 1e-6 and cache.runs == 2


def test_donating_the_activations_keeps_the_weights_hoisted():
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    f = _jit_mlp(mesh, weight_argnums=0, donate_argnums=1)
    w, _ = _mlp_args(mesh, 4)
    for seed in range(3):
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        xs = spmd.device_put(x, spmd.NamedSharding(mesh, P()))
        assert _rel_err(f(w, xs).to_torch(), _mlp_ref(w, x)) < 1e-6 and xs.is_deleted
    assert f.lower(w, x).compile().weight_cache.runs == 1


@pytest.mark.gpu
def test_cuda_graph_replays_follow_weight_updates_without_recapture():
    """Hoisted values follow replaced and in-place-updated weights; in-place updates through the
    public API replay the captured graph (no recapture)."""
    from spmd import metrics

    torch.backends.cuda.matmul.allow_tf32 = False
    model = llama_layers(small=True, layers=2, seed=5, device="cuda:0")
    mesh = spmd.Mesh.create(("tp",), devices="cuda:1")  # the first GPU
    pm = parallelize(model, mesh, llama_plan())
    x = torch.randn(2, 3, 64, device="cuda:0")
    for _ in range(4):  # eager warm-up, capture, replays
        got = pm(x).to_torch()
    assert _rel_err(got, model(x)) < 1e-5 and pm.compiled.weight_cache.runs == 1
    recaptures = metrics.counter("cuda_graphs.recapture").value
    for step, name in enumerate([QKV[2], UP, QKV[2], UP]):
        if step == 2:  # a replaced parameter is a new buffer (the graph may be captured anew)
            recaptures = metrics.counter("cuda_graphs.recapture").value
        p = model.get_parameter(name)
        with torch.no_grad():
            if step < 2:
                p.copy_(torch.randn_like(p))
                pm.params[name] = spmd.device_put(p.detach(), pm.params[name].sharding)
            else:
                p.mul_(-2.0)
                for shard in pm.params[name].shards:
                    shard.data.mul_(-2.0)
        assert _rel_err(pm(x).to_torch(), model(x)) < 1e-5
        assert pm.compiled.weight_cache.runs == 2 + step
    assert metrics.counter("cuda_graphs.recapture").value == recaptures


def test_generator_decode_steps_reuse_the_hoisted_weights():
    from spmd.generation import Generator
    from spmd.models.llama_lm import llama_lm

    gen = Generator(llama_lm(small=True, seed=1), spmd.Mesh.create(("tp",), devices="cpu:1"), max_batch=2,
                    max_seq=24, prefill_len=8)
    gen.generate([[5, 17, 3], [11, 2]], 8)
    prefill, decode = next(iter(gen._programs.values()))
    (compiled,) = decode._cache.values()
    cache = compiled.weight_cache
    # once for every decode step, and for prefill: the prefill ran it, the decode shares its values
    (pre,) = prefill._cache.values()
    assert cache is not None and pre.weight_cache.runs == 1 and cache.runs == 0
    assert "concatenate" in compiled.lowered.result.prologue_text


class _CosineTable(torch.nn.Module):
    """A linear layer times an arange-built cosine table (constant-only work of [S, F] elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[-2], dtype=x.dtype)[:, None] * torch.arange(32, dtype=x.dtype)
        return self.proj(x) * torch.cos(pos * 0.01)


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:2"])
def test_a_prologue_of_constants_only_runs_once(devices):
    """Nothing weight-only to hoist, but the cosine table: the prologue reads no argument and runs
    once; the per-call program runs no kernel for the table; results equal float64 eager."""
    torch.manual_seed(0)
    model = _CosineTable().double().eval()
    plan = Plan((("proj", Replicate()),))  # a replicated table (a sharded iota reads partition-id)
    pm = parallelize(model, spmd.Mesh.create(("tp",), devices=devices), plan)
    for _ in range(3):
        x = torch.randn(2, 64, 32, dtype=torch.float64)
        assert _rel_err(pm(x).to_torch(), model(x)) < 1e-12
    cache = pm.compiled.weight_cache
    assert cache is not None and cache.inputs == () and cache.runs == 1
    assert _kernels(pm.compiled, "cosine") == 0 and "cosine(" not in pm.lowered.as_text(pm.lowered.stages[-1])
