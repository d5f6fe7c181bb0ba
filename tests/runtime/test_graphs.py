"""CUDA-graph runner: entry point, fallback reasons, and the binding / output rules on CPU meshes.

The binding and aliasing logic runs on virtual CPU devices through ``HostReplayBackend``
(re-issue into static buffers: a graph's semantics without a GPU). GPU tests live in
``test_graphs_gpu.py``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from graph_programs import compile_mlp, compile_windowed, global_out, matmul, mlp, shards, unwrap

import spmd
from spmd import metrics
from spmd.runtime import graphs
from spmd.runtime.executor import RuntimeOptions
from spmd.runtime.graphs import GraphOptions, GraphRunner, HostReplayBackend, fallback_reason, maybe_graph


@pytest.fixture(autouse=True)
def _fresh_metrics():
    metrics.reset()
    graphs._logged.clear()
    yield
    metrics.reset()


def _counter(name: str) -> int:
    return metrics.snapshot()["counters"].get(name, 0)


def _runner(compiled, **opts) -> GraphRunner:
    ex = unwrap(compiled.executable)
    return GraphRunner(ex, GraphOptions(**opts), backend=HostReplayBackend(ex))


_ALIVE: list = []


@pytest.fixture(autouse=True)
def _inputs_stay_allocated(monkeypatch):
    """Every input made by ``shards`` lives until the test ends.

    A freed input buffer can come back at the same address in the next call; the runner then
    adopts it (reads the caller's buffer in place) and rebinds when a later call passes another
    address, which would make capture counts depend on the allocator.
    """
    real = shards

    def keeping(compiled, tensors):
        out = real(compiled, tensors)
        _ALIVE.append(out)
        return out

    monkeypatch.setitem(globals(), "shards", keeping)
    yield
    _ALIVE.clear()


@pytest.fixture(scope="module")
def mlp_prog():
    return compile_mlp("cpu:2")


@pytest.fixture(scope="module")
def windowed_prog():
    return compile_windowed("cpu:2")


# ---------------------------------------------------------------------------- entry point
def test_maybe_graph_off_and_cpu_fallback(mlp_prog, caplog):
    compiled, _ = mlp_prog
    ex = unwrap(compiled.executable)
    assert maybe_graph(ex, False) is ex
    assert maybe_graph(ex, spmd.CompileOptions(cuda_graphs=False)) is ex
    assert maybe_graph(ex, None) is ex          # default: on only for GPU meshes, nothing recorded
    assert _counter("cuda_graphs.fallback.cpu_mesh") == 0
    with caplog.at_level(logging.WARNING, logger="spmd"):
        assert maybe_graph(ex, spmd.CompileOptions(cuda_graphs=True)) is ex
        assert maybe_graph(ex, True) is ex
    assert _counter("cuda_graphs.fallback.cpu_mesh") == 2
    logged = [r for r in caplog.records if "cpu_mesh" in r.getMessage()]
    assert len(logged) == 1 and logged[0].name == "spmd"


def test_maybe_graph_rejects_bad_options(mlp_prog):
    ex = unwrap(mlp_prog[0].executable)
    with pytest.raises(TypeError, match="options"):
        maybe_graph(ex, "yes")
    with pytest.raises(TypeError, match="cuda_graphs"):
        maybe_graph(ex, SimpleNamespace(cuda_graphs="on"))


def test_fallback_reasons():
    cuda = SimpleNamespace(platform="cuda")
    cpu = SimpleNamespace(mesh=SimpleNamespace(platform="cpu"), options=RuntimeOptions())
    assert fallback_reason(cpu) == "cpu_mesh"
    dist = SimpleNamespace(mesh=cuda, options=RuntimeOptions(distributed=True), devices=(0,))
    assert fallback_reason(dist) == "distributed"
    local = SimpleNamespace(mesh=cuda, options=RuntimeOptions(), devices=(0, 1))
    expected = None if torch.cuda.is_available() else "no_cuda"
    assert fallback_reason(local) == expected


def test_graph_helps_threshold():
    assert not graphs.graph_helps(SimpleNamespace(thunks=[object()] * (graphs.MIN_THUNKS - 1)))
    assert graphs.graph_helps(SimpleNamespace(thunks=[object()] * graphs.MIN_THUNKS))


def test_graph_options_validation():
    with pytest.raises(ValueError, match="outputs"):
        GraphOptions(outputs="share")
    with pytest.raises(ValueError, match="max_output_sets"):
        GraphOptions(max_output_sets=0)
    with pytest.raises(ValueError, match="capture_error_mode"):
        GraphOptions(capture_error_mode="loose")
    with pytest.raises(TypeError, match="split_devices"):
        GraphOptions(split_devices="yes")
    for bad in (True, 2.0, "3"):
        with pytest.raises(TypeError, match="max_output_sets"):
            GraphOptions(max_output_sets=bad)
    with pytest.raises(TypeError, match="GraphOptions"):
        GraphRunner(object(), options={"outputs": "clone"}, backend=object())


def test_ready_per_device_skips_missing_events():
    a, b = object(), object()
    assert graphs._ready_per_device(None, 2) == [[], []]
    assert graphs._ready_per_device([None, [a, None], [None, b]], 2) == [[a], [b]]


# ---------------------------------------------------------------------------- replay == eager
@pytest.mark.parametrize("outputs", ["clone", "rotate"])
def test_replay_matches_eager_windowed_einsum(windowed_prog, outputs):
    compiled, (xs, ws) = windowed_prog
    ex = unwrap(compiled.executable)
    assert len(ex.program.stream_ids) > 1
    r = _runner(compiled, outputs=outputs)
    w = torch.randn(ws)
    wb = shards(compiled, [torch.randn(xs), w])[1]
    for _ in range(6):
        x = torch.randn(xs)
        args = [shards(compiled, [x, w])[0], wb]
        out, ready = r.run(args)
        ref, _ = ex.run(args)
        assert ready == [None, None]
        for a, b in zip(out[0], ref[0], strict=True):
            assert torch.equal(a, b)
        torch.testing.assert_close(global_out(compiled, out[0], x @ w), matmul(x, w), rtol=1e-5, atol=1e-5)
        del out, a, b  # loop variables would keep a "rotate" set held
    assert _counter("cuda_graphs.eager_call.warmup") == 1
    assert _counter("cuda_graphs.capture") == 1
    assert _counter("cuda_graphs.replay") == 5
    assert r.backend.num_launches == 5


def test_weights_adopted_activations_staged(mlp_prog):
    compiled, (xs, w1s, w2s) = mlp_prog
    r = _runner(compiled)
    w1, w2 = torch.randn(w1s), torch.randn(w2s)
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])
    for _ in range(3):
        x = torch.randn(xs)
        out, _ = r.run([shards(compiled, [x, w1, w2])[0], w1b, w2b])
        torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    bufs = r.input_buffers()
    assert bufs[0] is not None and bufs[1] is None and bufs[2] is None
    # the graph reads the adopted weights by reference: in-place updates are seen
    for t in w1b:
        t.mul_(-1.5)
    x = torch.randn(xs)
    out, _ = r.run([shards(compiled, [x, w1, w2])[0], w1b, w2b])
    torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, -1.5 * w1, w2), rtol=1e-5, atol=1e-5)
    assert _counter("cuda_graphs.recapture") == 0


def test_new_weight_tensors_recapture_once(mlp_prog):
    compiled, (xs, w1s, w2s) = mlp_prog
    r = _runner(compiled, outputs="clone")
    w1, w2 = torch.randn(w1s), torch.randn(w2s)
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])
    for _ in range(2):
        r.run([shards(compiled, [torch.randn(xs), w1, w2])[0], w1b, w2b])
    for _ in range(4):  # a fresh w1 every call: staged after the first mismatch
        w1 = torch.randn(w1s)
        x = torch.randn(xs)
        xb, w1n, _ = shards(compiled, [x, w1, w2])
        out, _ = r.run([xb, w1n, w2b])
        torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    assert _counter("cuda_graphs.recapture") == 1
    assert _counter("cuda_graphs.capture") == 2
    assert r.input_buffers()[1] is not None and r.input_buffers()[2] is None


def test_passing_static_buffer_skips_copy(mlp_prog):
    compiled, (xs, w1s, w2s) = mlp_prog
    r = _runner(compiled)
    w1, w2 = torch.randn(w1s), torch.randn(w2s)
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])
    for _ in range(2):
        r.run([shards(compiled, [torch.randn(xs), w1, w2])[0], w1b, w2b])
    static_x = r.input_buffers()[0]
    x = torch.randn(xs)
    for buf, src in zip(static_x, shards(compiled, [x, w1, w2])[0], strict=True):
        buf.copy_(src)
    assert r._copies([static_x, w1b, w2b]) == [[], []]
    out, _ = r.run([static_x, w1b, w2b])
    torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)


def test_donated_parameters_are_staged(mlp_prog):
    compiled, (xs, w1s, w2s) = mlp_prog
    r = _runner(compiled)
    w1, w2 = torch.randn(w1s), torch.randn(w2s)
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])
    for _ in range(3):
        x = torch.randn(xs)
        out, _ = r.run([shards(compiled, [x, w1, w2])[0], w1b, w2b], donated=frozenset({1}))
        torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    assert r.input_buffers()[1] is not None
    assert all(torch.equal(a, b) for a, b in zip(w1b, shards(compiled, [torch.randn(xs), w1, w2])[1], strict=True))


# ---------------------------------------------------------------------------- outputs
def test_clone_outputs_survive_later_calls(mlp_prog):
    compiled, (xs, w1s, w2s) = mlp_prog
    r = _runner(compiled, outputs="clone")
    w1, w2 = torch.randn(w1s), torch.randn(w2s)
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])
    held = []
    for _ in range(5):
        x = torch.randn(xs)
        out, _ = r.run([shards(compiled, [x, w1, w2])[0], w1b, w2b])
        held.append((x, out))
    for x, out in held:
        torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    assert r.num_captures == 1


def test_rotate_outputs_never_overwritten_while_held(mlp_prog, caplog):
    compiled, (xs, w1s, w2s) = mlp_prog
    r = _runner(compiled, outputs="rotate", max_output_sets=2)
    w1, w2 = torch.randn(w1s), torch.randn(w2s)
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])

    def call():
        x = torch.randn(xs)
        out, _ = r.run([shards(compiled, [x, w1, w2])[0], w1b, w2b])
        return x, out

    call()                       # warm-up (eager)
    held = [call(), call()]      # two sets captured, both held
    assert r.num_captures == 2
    replays = _counter("cuda_graphs.replay")
    with caplog.at_level(logging.WARNING, logger="spmd"):
        held.append(call())      # no free set: the private set is replayed, its outputs cloned
        held.append(call())
    assert _counter("cuda_graphs.clone_call.outputs_held") == 2
    assert _counter("cuda_graphs.replay") == replays + 2 and r.num_captures == 3
    assert sum("still held" in rec.getMessage() for rec in caplog.records) == 1
    for x, out in held:
        torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    # a view keeps its set held; dropping everything frees both sets
    view = held[0][1][0][1][1:]
    held = held[1:]
    x, out = call()
    assert _counter("cuda_graphs.clone_call.outputs_held") == 3
    del view, held, out
    replays = _counter("cuda_graphs.replay")
    for _ in range(4):
        x, out = call()
        torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    assert _counter("cuda_graphs.replay") == replays + 4
    assert _counter("cuda_graphs.clone_call.outputs_held") == 3
    assert r.num_captures == 3


# ---------------------------------------------------------------------------- fallbacks
class _FailingBackend(HostReplayBackend):
    def capture(self, static_args):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_capture_failure_falls_back_to_eager(mlp_prog, caplog):
    compiled, (xs, w1s, w2s) = mlp_prog
    ex = unwrap(compiled.executable)
    r = GraphRunner(ex, backend=_FailingBackend(ex))
    w1, w2 = torch.randn(w1s), torch.randn(w2s)
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])
    with caplog.at_level(logging.WARNING, logger="spmd"):
        for _ in range(4):
            x = torch.randn(xs)
            out, _ = r.run([shards(compiled, [x, w1, w2])[0], w1b, w2b])
            torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    assert r.disabled_reason == "capture_error"
    assert _counter("cuda_graphs.fallback.capture_error") == 1
    msgs = [rec.getMessage() for rec in caplog.records if "capture_error" in rec.getMessage()]
    assert len(msgs) == 1 and "not permitted" in msgs[0]


def test_fork_binds_its_own_weights_and_keeps_a_disabled_runner_disabled(mlp_prog):
    compiled, (xs, w1s, w2s) = mlp_prog
    first = _runner(compiled)
    second = first.fork()
    assert second.executable is first.executable and second.backend is not first.backend
    assert second._lock is first._lock  # the executable's streams are shared: calls stay serialised
    ws = [(torch.randn(w1s), torch.randn(w2s)) for _ in range(2)]
    bound = [shards(compiled, [torch.randn(xs), w1, w2])[1:] for w1, w2 in ws]
    for _ in range(4):  # eager, capture, then replays: the callers alternate, each with its own weights
        for r, (w1, w2), (w1b, w2b) in zip((first, second), ws, bound, strict=True):
            x = torch.randn(xs)
            out, _ = r.run([shards(compiled, [x, w1, w2])[0], w1b, w2b])
            torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    for r in (first, second):  # only x is staged; each runner reads its weights in place
        assert [b is None for b in r.input_buffers()] == [False, True, True]
    assert _counter("cuda_graphs.recapture") == 0
    ex = unwrap(compiled.executable)
    failed = GraphRunner(ex, backend=_FailingBackend(ex))
    failed.disabled_reason = "capture_error"
    assert failed.fork().disabled_reason == "capture_error"


def test_trace_runs_eagerly_and_bad_args_raise(mlp_prog):
    from spmd.runtime.trace_events import TraceRecorder

    compiled, (xs, w1s, w2s) = mlp_prog
    r = _runner(compiled)
    args = shards(compiled, [torch.randn(xs), torch.randn(w1s), torch.randn(w2s)])
    r.run(args, trace=TraceRecorder())
    assert _counter("cuda_graphs.eager_call.trace") == 1
    with pytest.raises(ValueError, match=r"args\[0\]"):
        r.run([[a[:1] for a in args[0]], args[1], args[2]])
    with pytest.raises(ValueError, match="parameters"):
        r.run(args[:2])
    assert _counter("cuda_graphs.eager_call.warmup") == 0


def test_runner_forwards_and_close_recaptures(mlp_prog):
    compiled, (xs, w1s, w2s) = mlp_prog
    ex = unwrap(compiled.executable)
    r = _runner(compiled)
    assert r.program is ex.program and r.devices == ex.devices
    w1, w2 = torch.randn(w1s), torch.randn(w2s)
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])
    x = torch.randn(xs)
    xb = shards(compiled, [x, w1, w2])[0]
    r.run([xb, w1b, w2b])
    r.run([shards(compiled, [torch.randn(xs), w1, w2])[0], w1b, w2b])
    r.close()
    assert r.num_captures == 0 and r.input_buffers() == []
    # x was staged before: it stays staged, even at the warm-up call's addresses
    out, _ = r.run([xb, w1b, w2b])
    torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    assert r.num_captures == 1
    bufs = r.input_buffers()
    assert bufs[0] is not None and bufs[1] is None and bufs[2] is None


def test_foreign_storages_cover_args_and_arena():
    from spmd.runtime.graphs_cuda import _foreign_storages

    arg = torch.randn(4, 4)
    arena = torch.empty(64, dtype=torch.uint8)
    view = arena[16:32].view(torch.float32)
    got = _foreign_storages([[arg[1:]]], [[None, torch.tensor(1.0)]], [[view]])
    assert got == {arg.untyped_storage().data_ptr(), arena.untyped_storage().data_ptr()}


def test_capture_in_another_thread_warms_it_up(mlp_prog):
    import threading

    compiled, (xs, w1s, w2s) = mlp_prog
    r = _runner(compiled)
    w1, w2 = torch.randn(w1s), torch.randn(w2s)
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])
    r.run([shards(compiled, [torch.randn(xs), w1, w2])[0], w1b, w2b])
    x = torch.randn(xs)
    got = {}
    t = threading.Thread(target=lambda: got.update(out=r.run([shards(compiled, [x, w1, w2])[0], w1b, w2b])[0]))
    t.start()
    t.join()
    torch.testing.assert_close(global_out(compiled, got["out"][0], x), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    assert _counter("cuda_graphs.eager_call.thread_warmup") == 1
    assert _counter("cuda_graphs.replay") == 1
    r.run([shards(compiled, [x, w1, w2])[0], w1b, w2b])
    assert _counter("cuda_graphs.eager_call.thread_warmup") == 1


# ---------------------------------------------------------------------------- per-call fast paths
class _CountingBackend(HostReplayBackend):
    """Counts ``close`` (the CUDA backend takes a fresh memory pool there)."""

    def __init__(self, executable):
        super().__init__(executable)
        self.closes = 0

    def close(self):
        self.closes += 1


def test_dropping_every_graph_renews_the_backend_pool(mlp_prog):
    compiled, (xs, w1s, w2s) = mlp_prog
    ex = unwrap(compiled.executable)
    backend = _CountingBackend(ex)
    r = GraphRunner(ex, GraphOptions(outputs="clone"), backend=backend)
    w1, w2 = torch.randn(w1s), torch.randn(w2s)
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])
    for _ in range(3):
        r.run([shards(compiled, [torch.randn(xs), w1, w2])[0], w1b, w2b])
    assert backend.closes == 0 and _counter("cuda_graphs.capture") == 1
    w1 = torch.randn(w1s)  # new weight tensors: every graph is dropped, then captured again
    x = torch.randn(xs)
    xb, w1n, _ = shards(compiled, [x, w1, w2])
    out, _ = r.run([xb, w1n, w2b])
    torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    assert backend.closes == 1 and _counter("cuda_graphs.capture") == 2
    r.close()
    assert backend.closes == 2


def test_cuda_backend_close_releases_every_pool_even_when_release_fails(monkeypatch):
    from spmd.runtime import graphs_cuda

    b = object.__new__(graphs_cuda.CudaGraphBackend)
    b.pool, b._views, b.ex = "old", None, None
    b._pool_refs = [(0, "old"), (1, "old"), (0, "older")]
    b._key, b._streams = ("stream",), ["stream"]
    calls = []

    def release(device, pool):
        calls.append((device, pool))
        raise RuntimeError("INTERNAL ASSERT FAILED: use_count")

    monkeypatch.setattr(torch._C, "_cuda_releasePool", release, raising=False)
    b.close()
    assert calls == [(0, "old"), (1, "old"), (0, "older")]
    assert b._pool_refs == [] and b._streams is None and b._key is None


def test_every_capture_takes_a_pool_of_its_own(monkeypatch):
    """Regression (8 threads on one H200, rotate output sets): sets captured into one shared pool
    placed a later set's static outputs in blocks an earlier set frees during its capture and
    writes on every replay, so the earlier set's replay overwrote outputs a caller still held."""
    from spmd.runtime import graphs_cuda

    b = object.__new__(graphs_cuda.CudaGraphBackend)
    b._pool_refs = []
    b.envs = [type("Env", (), {"device": torch.device("cuda", k)})() for k in range(2)]
    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", next(handles)))
    began = []
    monkeypatch.setattr(graphs_cuda, "_pool_begin_fn", lambda: lambda d, p: began.append((d, p)))
    monkeypatch.setattr(graphs_cuda, "_pool_end_fn", lambda: lambda d, p: None)
    first, second = b._new_pool(), b._new_pool()
    assert first != second and b.pool == second
    assert b._pool_refs == [(0, first), (1, first), (0, second), (1, second)] == began


def test_adopted_list_changed_in_place_is_noticed(mlp_prog):
    compiled, (xs, w1s, w2s) = mlp_prog
    r = _runner(compiled, outputs="clone")
    w1, w2 = torch.randn(w1s), torch.randn(w2s)
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])
    for _ in range(3):
        r.run([shards(compiled, [torch.randn(xs), w1, w2])[0], w1b, w2b])
    assert r.input_buffers()[1] is None
    w1 = torch.randn(w1s)
    w1b[:] = shards(compiled, [torch.randn(xs), w1, w2])[1]  # the same list object, other tensors
    x = torch.randn(xs)
    out, _ = r.run([shards(compiled, [x, w1, w2])[0], w1b, w2b])
    torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    assert _counter("cuda_graphs.recapture") == 1 and r.input_buffers()[1] is not None


def test_compiled_runs_a_graph_runner_without_rechecking(mlp_prog):
    from spmd.compiled import Compiled

    compiled, (xs, w1s, w2s) = mlp_prog
    ex = unwrap(compiled.executable)
    runner = GraphRunner(ex, backend=HostReplayBackend(ex))  # default: "rotate"
    c = Compiled(compiled.lowered, runner, compiled.output_shardings, [s for _, s, _ in compiled._outputs],
                 [d for _, _, d in compiled._outputs], compiled.buffers)
    w1, w2 = torch.randn(w1s), torch.randn(w2s)
    w1a, w2a = (spmd.device_put(t, s) for t, s in zip((w1, w2), compiled.input_shardings[1:], strict=True))
    held = []
    for _ in range(5):
        x = torch.randn(xs)
        y = c(spmd.device_put(x, compiled.input_shardings[0]), w1a, w2a)
        assert y._ready_events is None
        held.append((x, y))  # every output held: rotating sets, then clones of the private set
    assert c._run == runner.run_checked
    for x, y in held:
        torch.testing.assert_close(y.to_torch(), mlp(x, w1, w2), rtol=1e-5, atol=1e-5)
    assert _counter("cuda_graphs.replay") == 4 and _counter("cuda_graphs.clone_call.outputs_held") == 1
