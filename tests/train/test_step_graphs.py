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
