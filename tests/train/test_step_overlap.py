"""Communication hidden in a training step's backward, on CPU meshes: windowed einsum on the joint
graph of a tensor + sequence parallel MLP, gradient all-reduces / reduce-scatters bucketed, independent
collectives async under GEMMs (start before the dot, done after), race-free GPU lowering, and every
variant equal to PyTorch eager + torch.optim step by step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd.runtime.lower as lower_mod
from spmd import Mesh, NamedSharding, device_put
from spmd import PartitionSpec as P
from spmd.ir.hlo import ASYNC_START_OPCODES
from spmd.parallelize import summarize_collectives
from spmd.passes.assign_buffers import assign_buffers
from spmd.passes.async_collectives import is_gemm
from spmd.passes.pipeline import CompileOptions
from spmd.passes.windowed_einsum import MARK
from spmd.runtime.hazards import find_hazards
from spmd.runtime.thunks import CollectiveThunk, RecordEventThunk, WaitEventThunk
from spmd.train import SGD, AdamW, make_train_step

STEPS = 5
SYNC = CompileOptions(bucket_size_bytes=0, async_collectives=False)


def _megatron_mlp(seed: int = 0) -> nn.Module:
    """LayerNorm -> column-parallel Linear -> GELU -> row-parallel Linear (tokens x hidden)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


MEGATRON_PLAN = {"0.weight": P(), "0.bias": P(), "1.weight": P("tp", None), "1.bias": P("tp"),
                 "3.weight": P(None, "tp"), "3.bias": P()}


def _two_layer(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16))


def _loss(apply, b):
    return F.mse_loss(apply(b["x"]), b["y"])


def _batches(tokens: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(tokens, 16, generator=g), "y": torch.randn(tokens, 16, generator=g)}
            for _ in range(STEPS)]


def _run(model_fn, mesh, plan, optimizer, reference_opt, *, dp_axis="dp", fsdp=False, options=None, tokens=16,
         loss_rtol=1e-5):
    """Train ``STEPS`` steps both ways; per-step loss within ``loss_rtol`` relative, parameters within 1e-4."""
    batches = _batches(tokens)
    ref = model_fn()
    opt = reference_opt(ref.parameters())
    ts = make_train_step(model_fn(), mesh, plan, _loss, optimizer=optimizer, dp_axis=dp_axis, fsdp=fsdp,
                         options=options)
    for k, b in enumerate(batches):
        opt.zero_grad()
        loss = _loss(ref, b)
        loss.backward()
        opt.step()
        got, want = float(ts.step(b)["loss"]), loss.item()
        assert abs(got - want) <= loss_rtol * abs(want), (k, got, want)
    sd = ts.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd[f"param.{name}"], p.detach(), rtol=0, atol=1e-4, msg=name)
    return ts


def _sgd():
    return SGD(lr=0.05, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def _adamw():
    return (AdamW(lr=1e-2, weight_decay=0.1, eps=1e-4),
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-4, foreach=False))


def _windowed_sites(module) -> list[str]:
    """One line per windowed-einsum site of the module: the collective it replaced and its step-0 dot."""
    out = []
    for i in module.entry.instructions:
        calls = i.attrs.get("calls")
        dots = [b for b in calls.instructions if b.opcode == "dot"] if calls is not None else [i]
        for d in dots:
            if d.opcode == "dot" and d.attrs.get("backend_config", {}).get(MARK) == 0:
                out.append(d)
    return [d.name for d in out]


@pytest.mark.parametrize("n, optimizer", [(2, _sgd), (4, _adamw)])
def test_windowed_einsum_on_the_backward_dots_of_a_sequence_parallel_mlp(n, optimizer):
    """Tokens sharded on tp (sequence parallel), weights Megatron-split: the forward all-gather and
    reduce-scatter, the all-gather of dY for the row-parallel layer's dgrad, and both weight
    gradients' reduce-scatters become windowed einsums; numerics equal eager."""
    ts = _run(_megatron_mlp, Mesh.create(("tp",), devices=f"cpu:{n}"), MEGATRON_PLAN, *optimizer(), dp_axis="tp",
              options=CompileOptions(windowed_einsum="on"))
    # addmm: forward x all-gather -> fc1; addmm_1: fc2 -> reduce-scatter to the token shards (the
    # partitioner's all-reduce + slice, made a reduce-scatter by reduce-scatter-creator); mm: all-gather
    # of dY -> row-parallel dgrad (dY @ W2); mm_3 / mm_1: the fc1 / fc2 weight gradients ->
    # reduce-scatter (SGD: once sink-scale moves lr past them; AdamW: the partitioner also all-reduces
    # each weight gradient for grad**2, which all-reduce-reuse makes an all-gather of the reduce-scatter)
    sites = [s.split(".")[0] for s in _windowed_sites(ts.lowered.result.module)]
    assert sites == ["addmm", "addmm_1", "mm", "mm_3", "mm_1"]
    assert "reduce-scatter" not in {s.opcode for s in summarize_collectives(ts.lowered.as_text("windowed-einsum"))}


def test_windowed_einsum_off_leaves_the_joint_graph_alone():
    ts = _run(_megatron_mlp, Mesh.create(("tp",), devices="cpu:2"), MEGATRON_PLAN, *_sgd(), dp_axis="tp",
              options=CompileOptions(windowed_einsum="off"))
    assert _windowed_sites(ts.lowered.result.module) == []
    assert "sink-scale" in ts.lowered.result.stage_text


def _counts(ts) -> dict[str, int]:
    return {s.opcode: s.count for s in summarize_collectives(ts.lowered.as_text("schedule"))}


def test_data_parallel_gradient_all_reduces_are_bucketed():
    """Six gradients + the loss: seven all-reduces, one after bucketing; numerics equal eager."""
    mesh = Mesh.create(("dp",), devices="cpu:4")
    before = _run(_two_layer, mesh, None, *_sgd(), options=SYNC)
    after = _run(_two_layer, mesh, None, *_sgd())
    assert _counts(before) == {"all-reduce": 7}
    assert _counts(after) == {"all-reduce": 1}
    program = lower_mod.lower(after.lowered.result.module, [torch.device("cpu")] * 4, list(range(4)))
    assert sum(isinstance(t, CollectiveThunk) for t in program.thunks) == 1


def test_small_buckets_overlap_with_the_backward_of_the_layer_below():
    """With 1 KiB buckets the last layer's gradient bucket is reduced asynchronously while earlier
    layers' backward GEMMs run: an all-reduce-start precedes a dot, its done follows it."""
    ts = _run(_two_layer, Mesh.create(("dp",), devices="cpu:2"), None, *_adamw(),
              options=CompileOptions(bucket_size_bytes=1024))
    insts = ts.lowered.result.module.entry.instructions
    assert 2 <= _counts(ts)["all-reduce"] < 7
    starts = [k for k, i in enumerate(insts) if i.opcode == "all-reduce-start"]
    assert starts
    for k in starts:
        done = next(j for j, i in enumerate(insts) if i.opcode == "all-reduce-done" and i.operands[0] is insts[k])
        assert any(is_gemm(i) for i in insts[k + 1:done]), insts[k].name


def test_fsdp_reduce_scatters_are_bucketed_and_gathers_prefetched():
    mesh = Mesh.create(("dp",), devices="cpu:2")
    before = _run(_two_layer, mesh, None, *_adamw(), fsdp=True, options=SYNC)
    after = _run(_two_layer, mesh, None, *_adamw(), fsdp=True)
    assert _counts(after)["reduce-scatter"] < _counts(before)["reduce-scatter"]
    insts = after.lowered.result.module.entry.instructions
    gathers = [k for k, i in enumerate(insts) if i.opcode == "all-gather-start"]
    first_gemm = next(k for k, i in enumerate(insts) if is_gemm(i))
    # prefetched a bounded distance ahead: not every parameter gathered before the first GEMM
    assert sum(k < first_gemm for k in gathers) < len(gathers)


@pytest.mark.parametrize("case", ["dp", "fsdp", "tp-sp"])
def test_async_train_step_programs_are_race_free(case):
    """The GPU lowering of each step (communication stream + events) has no unordered conflict."""
    if case == "tp-sp":
        ts = _run(_megatron_mlp, Mesh.create(("tp",), devices="cpu:2"), MEGATRON_PLAN, *_sgd(), dp_axis="tp",
                  options=CompileOptions(windowed_einsum="on", cuda_graphs=False))
    else:
        ts = _run(_two_layer, Mesh.create(("dp",), devices="cpu:2"), None, *_adamw(), fsdp=case == "fsdp",
                  options=CompileOptions(bucket_size_bytes=1024, cuda_graphs=False))
    module = ts.lowered.result.module
    assert any(i.opcode in ASYNC_START_OPCODES for i in module.entry.instructions)
    for fuse in (True, False):
        program = lower_mod.lower(module, [torch.device("cpu")] * 2, [0, 1], assign_buffers(module), gpu=True,
                                  fuse=fuse)
        assert any(isinstance(t, CollectiveThunk) and t.stream_id != 0 for t in program.thunks)
        assert find_hazards(program) == []


def test_dropping_the_wait_for_an_async_gradient_all_reduce_is_reported():
    """The checker sees the communication stream: without the wait on its event, the optimizer update
    would read the all-reduced gradient while it is still being written."""
    ts = _run(_two_layer, Mesh.create(("dp",), devices="cpu:2"), None, *_sgd(),
              options=CompileOptions(bucket_size_bytes=1024, cuda_graphs=False))
    module = ts.lowered.result.module
    program = lower_mod.lower(module, [torch.device("cpu")] * 2, [0, 1], assign_buffers(module), gpu=True)
    comm = {t.stream_id for t in program.thunks if isinstance(t, CollectiveThunk)} - {0}
    waits = [k for k, t in enumerate(program.thunks) if isinstance(t, WaitEventThunk) and t.stream_id == 0
             and any(isinstance(p, RecordEventThunk) and p.event_id == t.event_id and p.stream_id in comm
                     for p in program.thunks[:k])]
    assert waits
    for k in waits:
        racy = lower_mod.Program(**{**program.__dict__, "thunks": program.thunks[:k] + program.thunks[k + 1:]})
        assert find_hazards(racy), program.thunks[k].name


@pytest.mark.parametrize("devices, batch, seq_sharded", [("cpu:2", 2, False), ("cpu:4", 1, False), ("cpu:2", 2, True)])
def test_windowed_einsum_through_reshapes_in_a_sequence_parallel_gpt_layer(devices, batch, seq_sharded):
    """gpt_plan(sequence_parallel=True): the gathered [B, S, H] activations reach the Q/K/V GEMMs
    through a [B*S, H] reshape (and attention's through [B*heads, ...]); they become windowed
    einsums (the weight-gradient dots keep the all-gather). With the batch's sequence dim on tp
    (the residual stream sequence-sharded), the row-parallel outputs [B*S, H] -> [B, S/P, H] are
    reduce-scattered (reduce-scatter-creator) and windowed too. Numerics equal eager."""
    from spmd.models.gpt import gpt3_layers
    from spmd.models.plans import gpt_plan

    def model():
        return gpt3_layers(1, small=True, hidden_size=16, num_heads=4, ffn_size=32, seed=0).train().requires_grad_()

    g = torch.Generator().manual_seed(3)
    batches = [{"x": torch.randn(batch, 8, 16, generator=g), "y": torch.randn(batch, 8, 16, generator=g)}
               for _ in range(STEPS)]
    ref = model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    mesh = Mesh.create(("tp",), devices=devices)
    ts = make_train_step(model(), mesh, gpt_plan(sequence_parallel=True), _loss,
                         optimizer=SGD(lr=0.05, momentum=0.9), options=CompileOptions(windowed_einsum="on"))
    place = NamedSharding(mesh, P(None, "tp"))
    for k, b in enumerate(batches):
        opt.zero_grad()
        loss = _loss(ref, b)
        loss.backward()
        opt.step()
        placed = {key: device_put(v, place) for key, v in b.items()} if seq_sharded else b
        got, want = float(ts.step(placed)["loss"]), loss.item()
        assert abs(got - want) <= 1e-5 * abs(want), (k, got, want)
    sd = ts.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd[f"param.{name}"], p.detach(), rtol=0, atol=1e-4, msg=name)
    sites = {s.split(".")[0] for s in _windowed_sites(ts.lowered.result.module)}
    assert {"addmm", "addmm_1", "addmm_2"} <= sites, sites  # Q, K, V projections of the gathered input
    if seq_sharded:  # attention out_proj and fc_out: dot -> [B, S/P, H] reduce-scatter
        assert {"addmm_3", "addmm_5"} <= sites, sites
    module, n = ts.lowered.result.module, int(devices[4:])
    program = lower_mod.lower(module, [torch.device("cpu")] * n, list(range(n)), assign_buffers(module), gpu=True)
    assert find_hazards(program) == []


def test_dp_times_tp_with_fsdp_and_sequence_parallel_on_a_2d_mesh():
    """dp=2 x tp=2: windowed einsum on the tp groups ({{0,1},{2,3}}), FSDP gathers / reduce-scatters
    and bucketed gradient reductions on the dp groups, all async where a GEMM hides them."""
    from spmd.models.gpt import gpt3_layers
    from spmd.models.plans import gpt_plan

    def model():
        return gpt3_layers(1, small=True, hidden_size=16, num_heads=4, ffn_size=32, seed=0).train().requires_grad_()

    g = torch.Generator().manual_seed(4)
    batches = [{"x": torch.randn(4, 8, 16, generator=g), "y": torch.randn(4, 8, 16, generator=g)}
               for _ in range(STEPS)]
    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4, foreach=False)
    ts = make_train_step(model(), Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4"), gpt_plan(sequence_parallel=True),
                         _loss, optimizer=AdamW(lr=1e-2, weight_decay=0.1, eps=1e-4), fsdp=True,
                         options=CompileOptions(windowed_einsum="on", bucket_size_bytes=4096))
    for k, b in enumerate(batches):
        opt.zero_grad()
        loss = _loss(ref, b)
        loss.backward()
        opt.step()
        got, want = float(ts.step(b)["loss"]), loss.item()
        assert abs(got - want) <= 1e-5 * abs(want), (k, got, want)
    sd = ts.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd[f"param.{name}"], p.detach(), rtol=0, atol=1e-4, msg=name)
    module = ts.lowered.result.module
    assert _windowed_sites(module)
    starts = [i for i in module.entry.instructions if i.opcode in ASYNC_START_OPCODES and "calls" not in i.attrs]
    assert {i.opcode for i in starts} >= {"all-gather-start", "collective-permute-start"}
    program = lower_mod.lower(module, [torch.device("cpu")] * 4, list(range(4)), assign_buffers(module), gpu=True)
    assert find_hazards(program) == []
