"""spmd.compiled: the executable bound on first run is safe to call from several threads at once; a
process-wide cache hit shares the executable but not a CUDA-graph runner's bindings."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P
from spmd.runtime import graphs
from spmd.runtime.graphs import GraphOptions, GraphRunner, HostReplayBackend


class _SlowToBind:
    """An executable whose ``run`` attribute takes a while to look up, the first time only."""

    def __init__(self, real, entered: threading.Event, release: threading.Event) -> None:
        self._real, self._entered, self._release = real, entered, release

    def __getattr__(self, name):
        if name == "run" and not self._entered.is_set():
            self._entered.set()
            self._release.wait(10)
        return getattr(self._real, name)


def test_first_runs_from_two_threads_both_bind_the_executable():
    """The first run binds the executable's run method; a second thread arriving meanwhile used to
    find the binding half made and call None ("'NoneType' object is not callable" in
    ``_execute_claimed``: random tester seed 3101 #1801, a reshard program's first call from 3 threads)."""
    mesh = Mesh.create(("tp",), devices="cpu:2")
    x = torch.randn(8, 6)
    compiled = spmd.jit(lambda t: t * 2 + 1, mesh=mesh, in_shardings=(P("tp"),), out_shardings=P()).lower(x).compile()
    entered, release = threading.Event(), threading.Event()
    compiled.executable = _SlowToBind(compiled.executable, entered, release)
    arg = lambda: spmd.device_put(x, spmd.NamedSharding(mesh, P("tp")))  # noqa: E731
    first: list = []
    worker = threading.Thread(target=lambda: first.append(compiled.execute_sharded([arg()])[0]))
    worker.start()
    try:
        assert entered.wait(30)
        second = compiled.execute_sharded([arg()])[0]
    finally:
        release.set()
        worker.join(60)
    torch.testing.assert_close(second.to_torch(), x * 2 + 1)
    torch.testing.assert_close(first[0].to_torch(), x * 2 + 1)


def test_equal_programs_of_two_jit_functions_keep_their_own_weights_adopted(monkeypatch):
    """Two ``jit`` functions compiling one program share its executable (process-wide cache); each
    calling with its own weight used to make the one shared graph runner stage (copy) the weight
    on every call once the callers alternated. ``CompiledTemplate.rebind`` forks the runner instead."""
    monkeypatch.setattr(graphs, "maybe_graph", lambda executable, options=None, graph_options=None: GraphRunner(
        executable, GraphOptions(), backend=HostReplayBackend(executable)))
    monkeypatch.setattr(sys.modules["spmd.jit"], "_GLOBAL_CACHE", {})
    mesh = Mesh.create(("tp",), devices="cpu:2")
    fns = [spmd.jit(lambda x, w: x @ w, mesh=mesh, in_shardings=(P(), P(None, "tp")), out_shardings=P())
           for _ in range(2)]
    weights = [spmd.device_put(torch.randn(16, 64), spmd.NamedSharding(mesh, P(None, "tp"))) for _ in fns]
    x = spmd.device_put(torch.randn(3, 16), spmd.NamedSharding(mesh, P()))
    staged = spmd.metrics.counter("cuda_graphs.staged.bytes")
    for _ in range(2):  # first call eager, second captures
        for f, w in zip(fns, weights, strict=True):
            f(x, w)
    runners = [next(iter(f._cache.values())).executable for f in fns]
    assert runners[0] is not runners[1] and runners[0].executable is runners[1].executable
    before = staged.value
    for _ in range(3):
        for f, w in zip(fns, weights, strict=True):
            torch.testing.assert_close(f(x, w).to_torch(), x.to_torch() @ w.to_torch())
    assert staged.value == before  # x and each function's weight stay adopted: nothing is copied


def test_a_call_compares_static_arguments_by_their_cache_key():
    # nan != nan made a Compiled reject the very nan it was compiled for; 0.0 == -0.0 let it run
    # the program of 0.0 for -0.0 (1 / (x * k) is +inf instead of -inf)
    mesh = Mesh.create(("tp",), devices="cpu:2")
    f = spmd.jit(lambda x, k: 1 / (x * k), mesh=mesh)
    x = torch.ones(4)
    c = f.lower(x, float("nan")).compile()
    assert torch.isnan(c(x, float("nan")).to_torch()).all()
    c = f.lower(x, 0.0).compile()
    assert torch.equal(c(x, 0.0).to_torch(), torch.full((4,), float("inf")))
    with pytest.raises(ValueError, match=r"static argument leaf 1 is -0.0, compiled for 0.0"):
        c(x, -0.0)
