"""make_train_step through the graph runner on CPU (``HostReplayBackend``): donated parameters and
optimizer state are the step graph's static buffers, updated in place; nothing but the batch is
staged in the steady state, and the losses and parameters still equal PyTorch eager."""

import importlib

import pytest
from test_step import _adamw, _check

from spmd import Mesh, metrics
from spmd.runtime import graphs
from spmd.runtime.graphs import GraphOptions, GraphRunner, HostReplayBackend
from spmd.train.step import TrainStep


@pytest.mark.parametrize("n", [1, 2])
def test_train_step_updates_params_and_state_in_place(monkeypatch, n):
    runners = []

    def host_graph(executable, options=None, graph_options=None):
        runners.append(GraphRunner(executable, GraphOptions(), backend=HostReplayBackend(executable)))
        return runners[-1]

    monkeypatch.setattr(graphs, "maybe_graph", host_graph)
    # an equal step compiled by an earlier test would come from the process-wide cache, built
    # without this backend: start from an empty cache
    monkeypatch.setattr(importlib.import_module("spmd.jit"), "_GLOBAL_CACHE", {})
    staged, seen, real_step = metrics.counter("cuda_graphs.staged.copies"), [], TrainStep.step

    def counting(self, batch):
        out = real_step(self, batch)
        seen.append(staged.value)
        return out

    monkeypatch.setattr(TrainStep, "step", counting)
    ts = _check(Mesh.create(("dp",), devices=f"cpu:{n}"), *_adamw(), batch=8)  # losses, params == eager
    (runner,) = [r for r in runners if r.num_captures]
    donated = len(ts.params) + 1 + sum(len(ts.opt_state[s]) for s in ts.optimizer.slots())
    assert runner._donors is not None and len(runner._donors.params) == donated  # every one aliased
    per_step = [b - a for a, b in zip(seen, seen[1:])]
    # first replay: every parameter and state buffer copied in once, then only the batch's x and y
    # (a fresh batch tensor the allocator happens to place at its static buffer's address needs no copy)
    assert donated * n <= per_step[0] <= (donated + 2) * n, per_step
    assert all(0 <= s <= 2 * n for s in per_step[1:]) and sum(per_step[1:]) > 0, per_step


COUNTERS = ("replay", "capture", "recapture", "staged.copies", "donated_output_copied", "clone_call.outputs_held",
            "eager_call.warmup", "eager_call.thread_warmup", "eager_call.donated_buffer_held", "eager_call.trace")


def test_benchmark_loop_replays_once_per_step_and_nothing_else(monkeypatch):
    """The loop ``benchmarks/train.py`` times: the Llama step with donated params and state, the same
    placed batch every step, ``fetch=False`` and the metrics dropped. Step 1 runs eagerly (warm-up),
    step 2 captures and stages every donated buffer once; from step 3 on each step is one replay:
    no capture or recapture, no staged copy (params and state are the graph's own static buffers,
    the batch is adopted), no donated output copied, no clone of held outputs, no eager call."""
    import torch
    import torch.nn.functional as F

    from spmd import CompileOptions
    from spmd.models.llama import llama_layers
    from spmd.train import AdamW, make_train_step

    monkeypatch.setattr(graphs, "maybe_graph", lambda executable, options=None, graph_options=None: GraphRunner(
        executable, GraphOptions(), backend=HostReplayBackend(executable)))
    monkeypatch.setattr(importlib.import_module("spmd.jit"), "_GLOBAL_CACHE", {})
    model = llama_layers("llama2-7b", 2, small=True, num_kv_heads=4, seed=0).train().requires_grad_()
    ts = make_train_step(model, Mesh.create(("dp",), devices="cpu:1"), None,
                         lambda apply, b: F.mse_loss(apply(b["x"]), b["y"]),
                         optimizer=AdamW(lr=1e-3, weight_decay=0.1), options=CompileOptions(merge_dots=False))
    g = torch.Generator().manual_seed(0)
    batch = ts.place_batch({"x": torch.randn(2, 8, 64, generator=g), "y": torch.randn(2, 8, 64, generator=g)})
    names = [f"cuda_graphs.{c}" for c in COUNTERS]
    per_step = []
    for _ in range(5):
        before = [metrics.counter(n).value for n in names]
        ts.step(batch, fetch=False)
        per_step.append({c: metrics.counter(n).value - b for c, n, b in zip(COUNTERS, names, before)
                         if metrics.counter(n).value != b})
    donated = len(ts.params) + 1 + sum(len(ts.opt_state[s]) for s in ts.optimizer.slots())
    assert per_step[0] == {"eager_call.warmup": 1}
    assert per_step[1] == {"capture": 1, "replay": 1, "staged.copies": donated}
    assert per_step[2:] == [{"replay": 1}] * 3
