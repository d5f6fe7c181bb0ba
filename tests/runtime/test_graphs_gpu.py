"""CUDA-graph runner on 2 GPUs: replays equal eager execution bit for bit on fresh inputs.

Every check compares ``GraphRunner.run`` with ``Executable.run`` (eager issue) on the same
arguments; failures print the program's thunks, the runner's state and the metrics.
``test_host_time_per_call`` prints per-call host time (no timing assertion). Skipped
without 2 GPUs.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from graph_programs import compile_mlp, compile_windowed, global_out, matmul, mlp, shards, unwrap
from hlo_helpers import FakeMesh
from programs import collective, windowed_all_gather_dot

import spmd
from spmd import metrics
from spmd.runtime.executor import Executable, RuntimeOptions
from spmd.runtime.graphs import GraphOptions, GraphRunner
from spmd.runtime.graphs_cuda import CudaGraphBackend

pytestmark = pytest.mark.gpu(count=2)
ITERS = int(os.environ.get("SPMD_GRAPH_TEST_ITERS", "1000"))  # calls per long replay-vs-eager check
N = 2


@pytest.fixture(autouse=True)
def _fresh_metrics():
    metrics.reset()
    torch.backends.cuda.matmul.allow_tf32 = False
    yield


def _diag(ex, runner=None) -> str:
    """Program, runner and environment facts for a failure message."""
    lines = [f"torch {torch.__version__}, cuda {torch.version.cuda}, "
             f"nccl {getattr(torch.cuda.nccl, 'version', lambda: '?')()}, devices "
             f"{[torch.cuda.get_device_name(d) for d in range(torch.cuda.device_count())]}",
             f"streams {ex.program.stream_ids}, events {ex.program.num_events}, "
             f"nccl {getattr(ex._comm, 'use_nccl', '?')}, thunks:"]
    for t in ex.program.thunks:
        extra = getattr(getattr(t, "spec", None), "kind", "") or getattr(t, "event_id", "")
        lines.append(f"  {type(t).__name__:<18} stream={t.stream_id} {t.name} {extra}")
    if runner is not None:
        lines.append(f"runner: captures={runner.num_captures} disabled={runner.disabled_reason} "
                     f"({runner.disabled_detail}) "
                     f"staged={[b is not None for b in runner.input_buffers()]} options={runner.options}")
    lines.append(f"counters: {metrics.snapshot()['counters']}")
    return "\n".join(lines)


def _wait(ready) -> None:
    for ev in ready:
        if ev is not None:
            ev.synchronize()


def _assert_bitwise(graph_out, eager_out, what: str, ex, runner) -> None:
    for j, (gs, es) in enumerate(zip(graph_out, eager_out, strict=True)):
        for k, (g, e) in enumerate(zip(gs, es, strict=True)):
            assert g.device == e.device == torch.device("cuda", k), f"{what}: output {j} device {g.device}"
            if not torch.equal(g, e):
                diff = (g.double() - e.double()).abs()
                idx = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
                pytest.fail(f"{what}: output {j} on device {k} differs from eager: max |diff| "
                            f"{diff.max().item():.3e} at {idx} (graph {g[idx].item()}, eager {e[idx].item()}), "
                            f"{int((diff > 0).sum())} of {diff.numel()} elements differ\n{_diag(ex, runner)}")


def _check_replays(compiled, make_inputs, reference, iters: int, options: GraphOptions | None = None, atol=1e-4):
    """Run ``iters`` calls on fresh inputs; graph == eager bitwise, and close to ``reference``."""
    ex = unwrap(compiled.executable)
    runner = GraphRunner(ex, options or GraphOptions())
    for it in range(iters):
        tensors, args = make_inputs()
        g_out, g_ready = runner.run(args)
        e_out, e_ready = ex.run(args)
        _wait(g_ready)
        _wait(e_ready)
        _assert_bitwise(g_out, e_out, f"call {it}", ex, runner)
        if it < 3 or it % 250 == 0:
            got = global_out(compiled, g_out[0], reference(*tensors))
            torch.testing.assert_close(got, reference(*tensors), rtol=atol, atol=atol,
                                       msg=lambda m, it=it: f"call {it}: {m}\n{_diag(ex, runner)}")
        del g_out, e_out
    counters = metrics.snapshot()["counters"]
    assert runner.disabled_reason is None, _diag(ex, runner)
    assert counters.get("cuda_graphs.replay", 0) == iters - 1, _diag(ex, runner)  # all but the warm-up
    return runner


def test_windowed_einsum_two_streams_1000_calls():
    compiled, (xs, ws) = compile_windowed("cuda:2", m=64, k=128, f=32)
    ex = unwrap(compiled.executable)
    assert len(ex.program.stream_ids) >= 3, _diag(ex)
    w = torch.randn(ws)
    wb = shards(compiled, [torch.randn(xs), w])[1]

    def inputs():
        x = torch.randn(xs)
        return (x, w), [shards(compiled, [x, w])[0], wb]

    runner = _check_replays(compiled, inputs, matmul, ITERS)
    assert runner.input_buffers()[1] is None, "the weight passed every call should be adopted (no copy)"
    assert all(not c.device_graphs for c in _captures(runner)), "peer copies need one graph over all devices"
    assert metrics.snapshot()["counters"].get("cuda_graphs.capture") == 1, _diag(ex, runner)


def _captures(runner) -> list:
    return [s.captured for s in runner._sets] + ([runner._private.captured] if runner._private else [])


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("outputs", ["clone", "rotate"])
def test_mlp_1000_calls(outputs, split):
    """The MLP's devices meet only in NCCL all-reduces: with ``split_devices``, one graph per device."""
    compiled, (xs, w1s, w2s) = compile_mlp("cuda:2", m=32, d=64, h=128)
    w1, w2 = torch.randn(w1s) / 8, torch.randn(w2s) / 8
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])

    def inputs():
        x = torch.randn(xs)
        return (x, w1, w2), [shards(compiled, [x, w1, w2])[0], w1b, w2b]

    runner = _check_replays(compiled, inputs, mlp, ITERS, GraphOptions(outputs=outputs, split_devices=split))
    per_device = [len(c.device_graphs) for c in _captures(runner)]
    assert per_device and all(n == (2 if split else 0) for n in per_device), per_device


def test_mlp_new_weights_every_call_are_staged():
    compiled, (xs, w1s, w2s) = compile_mlp("cuda:2", m=32, d=64, h=128)

    def inputs():
        x, w1, w2 = torch.randn(xs), torch.randn(w1s) / 8, torch.randn(w2s) / 8
        return (x, w1, w2), shards(compiled, [x, w1, w2])

    runner = _check_replays(compiled, inputs, mlp, 100)
    assert all(b is not None for b in runner.input_buffers())


@pytest.mark.parametrize("use_nccl", [True, False])
def test_collectives_1000_calls(use_nccl):
    opts = RuntimeOptions(use_nccl=use_nccl)
    mods = [
        collective("all-gather", f"x={N}", N, (4, 6), (4, 12), dim=1, stream_id=3),
        collective("reduce-scatter", f"x={N}", N, (8, 6), (4, 6), dim=0),
        collective("all-reduce", f"x={N}", N, (5, 7), (5, 7), stream_id=3),
        collective("all-to-all", f"x={N}", N, (4, 6), (8, 3), split=1, concat=0),
        collective("collective-permute", f"x={N}", N, (64, 32), (64, 32), pairs=[(0, 1), (1, 0)], stream_id=2),
        collective("collective-permute", f"x={N}", N, (8, 4), (8, 4), pairs=[(0, 1)]),
    ]
    for mod in mods:
        ex = Executable(mod, FakeMesh(mod.mesh, platform="cuda"), options=opts)
        runner = GraphRunner(ex)
        dims = tuple(mod.entry.parameters[0].shape.dims)
        for it in range(ITERS // 5):
            args = [[torch.randn(dims, device=f"cuda:{d}") for d in range(N)]]
            g_out, g_ready = runner.run(args)
            e_out, e_ready = ex.run(args)
            _wait(g_ready)
            _wait(e_ready)
            _assert_bitwise(g_out, e_out, f"{mod.entry.instructions[2].opcode} call {it}", ex, runner)
        assert runner.disabled_reason is None, _diag(ex, runner)


@pytest.mark.parametrize("async_dot", [False, True])
def test_hand_written_windowed_all_gather_dot(async_dot):
    mod = windowed_all_gather_dot(N, m=64, k=128, f=96, async_dot=async_dot)
    ex = Executable(mod, FakeMesh(mod.mesh, platform="cuda"))
    runner = GraphRunner(ex)
    w = [torch.randn(128, 96).to(f"cuda:{d}") for d in range(N)]
    for it in range(200):
        args = [[torch.randn(64, 128, device=f"cuda:{d}") for d in range(N)], w]
        g_out, g_ready = runner.run(args)
        e_out, e_ready = ex.run(args)
        _wait(g_ready)
        _wait(e_ready)
        _assert_bitwise(g_out, e_out, f"call {it}", ex, runner)
    assert runner.disabled_reason is None, _diag(ex, runner)


def test_rotate_outputs_not_overwritten_while_held():
    compiled, (xs, w1s, w2s) = compile_mlp("cuda:2", m=32, d=64, h=128)
    ex = unwrap(compiled.executable)
    runner = GraphRunner(ex, GraphOptions(outputs="rotate", max_output_sets=2))
    w1, w2 = torch.randn(w1s) / 8, torch.randn(w2s) / 8
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])
    held = []
    for _ in range(6):
        args = [shards(compiled, [torch.randn(xs), w1, w2])[0], w1b, w2b]
        out, ready = runner.run(args)
        _wait(ready)
        held.append((out, [[t.clone() for t in per] for per in out]))
    for i, (out, snapshot) in enumerate(held):
        _assert_bitwise(out, snapshot, f"held output of call {i}", ex, runner)
    counters = metrics.snapshot()["counters"]
    assert counters.get("cuda_graphs.clone_call.outputs_held") == 3, _diag(ex, runner)
    assert counters.get("cuda_graphs.replay") == 5 and runner.num_captures == 3, _diag(ex, runner)


class _SyncingBackend(CudaGraphBackend):
    """Synchronises a stream in the middle of the capture: the capture must fail cleanly."""

    def _issue(self, *args):
        outputs = super()._issue(*args)
        self.envs[1].main.synchronize()
        return outputs

    def _issue_split(self, *args):
        outputs = super()._issue_split(*args)
        self.envs[1].main.synchronize()
        return outputs


@pytest.mark.parametrize("split", [False, True])
def test_failed_capture_falls_back_and_leaves_devices_usable(split):
    """A stream synchronized mid-capture: one graph over all devices, or one graph per device."""
    compiled, (xs, w1s, w2s) = compile_mlp("cuda:2", m=32, d=64, h=128)
    ex = unwrap(compiled.executable)
    runner = GraphRunner(ex, backend=_SyncingBackend(ex, split=split))
    w1, w2 = torch.randn(w1s) / 8, torch.randn(w2s) / 8
    for _ in range(4):
        x = torch.randn(xs)
        out, ready = runner.run(shards(compiled, [x, w1, w2]))
        _wait(ready)
        torch.testing.assert_close(global_out(compiled, out[0], x), mlp(x, w1, w2), rtol=1e-4, atol=1e-4)
    assert runner.disabled_reason == "capture_error", _diag(ex, runner)
    assert metrics.snapshot()["counters"].get("cuda_graphs.fallback.capture_error") == 1
    # a later capture on the same devices still works
    _check_replays(compiled, lambda: ((x, w1, w2), shards(compiled, [x, w1, w2])), mlp, 5)


def test_close_then_capture_again():
    compiled, (xs, w1s, w2s) = compile_mlp("cuda:2", m=32, d=64, h=128)
    ex = unwrap(compiled.executable)
    w1, w2 = torch.randn(w1s) / 8, torch.randn(w2s) / 8
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])

    def inputs():
        x = torch.randn(xs)
        return (x, w1, w2), [shards(compiled, [x, w1, w2])[0], w1b, w2b]

    runner = _check_replays(compiled, inputs, mlp, 20, GraphOptions(outputs="rotate"))
    kept, ready = runner.run(inputs()[1])   # held across close: its memory must stay valid
    _wait(ready)
    snapshot = [[t.clone() for t in per] for per in kept]
    runner.close()
    assert runner.num_captures == 0
    for it in range(20):
        _, args = inputs()
        g_out, g_ready = runner.run(args)
        e_out, e_ready = ex.run(args)
        _wait(g_ready)
        _wait(e_ready)
        _assert_bitwise(g_out, e_out, f"call {it} after close", ex, runner)
    _assert_bitwise(kept, snapshot, "output held across close", ex, runner)
    assert runner.num_captures >= 1 and runner.disabled_reason is None, _diag(ex, runner)
    # new weight tensors: every graph is dropped and captured again, into a fresh pool
    w1n = shards(compiled, [torch.randn(xs), torch.randn(w1s) / 8, w2])[1]
    for it in range(5):
        x = torch.randn(xs)
        args = [shards(compiled, [x, w1, w2])[0], w1n, w2b]
        g_out, _ = runner.run(args)
        e_out, e_ready = ex.run(args)
        _wait(e_ready)
        _assert_bitwise(g_out, e_out, f"call {it} after new weights", ex, runner)
        del g_out
    assert metrics.snapshot()["counters"].get("cuda_graphs.recapture") == 1, _diag(ex, runner)
    assert runner.disabled_reason is None and runner.input_buffers()[1] is not None, _diag(ex, runner)


@pytest.mark.parametrize("outputs", ["clone", "rotate"])
def test_replays_follow_the_callers_streams(outputs):
    """Outputs carry no ready events: they are ordered on the caller's current streams, also
    when the caller switches streams between calls (replays must still not overlap)."""
    compiled, (xs, w1s, w2s) = compile_mlp("cuda:2", m=256, d=512, h=1024)
    ex = unwrap(compiled.executable)
    runner = GraphRunner(ex, GraphOptions(outputs=outputs))
    w1, w2 = torch.randn(w1s) / 8, torch.randn(w2s) / 8
    _, w1b, w2b = shards(compiled, [torch.randn(xs), w1, w2])
    sides = [[torch.cuda.Stream(d) for d in range(N)] for _ in range(2)]
    for it in range(60):
        x = torch.randn(xs)
        args = [shards(compiled, [x, w1, w2])[0], w1b, w2b]
        streams = sides[it % 3] if it % 3 < 2 else [torch.cuda.default_stream(d) for d in range(N)]
        with torch.cuda.stream(streams[0]), torch.cuda.stream(streams[1]):
            for d, s in enumerate(streams):
                s.wait_stream(torch.cuda.default_stream(d))  # the inputs were made there
            g_out, g_ready = runner.run(args)
            if it == 0:  # the warm-up call is eager: its outputs carry ready events
                for s, ev in zip(streams, g_ready, strict=True):
                    s.wait_event(ev)
            else:
                assert g_ready == [None] * N
            got = [[t.clone() for t in per] for per in g_out]  # read on the caller's streams, no wait
        del g_out
        e_out, e_ready = ex.run(args)
        _wait(e_ready)
        for d in range(N):
            torch.cuda.synchronize(d)
        _assert_bitwise(got, e_out, f"call {it} on {'side' if it % 3 < 2 else 'default'} streams", ex, runner)
    assert runner.disabled_reason is None and metrics.snapshot()["counters"].get("cuda_graphs.replay") == 59


def _host_us(fn, iters: int = 300) -> float:
    for _ in range(10):
        fn()
    for d in range(N):
        torch.cuda.synchronize(d)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    us = (time.perf_counter() - t0) / iters * 1e6
    for d in range(N):
        torch.cuda.synchronize(d)
    return us


def test_host_time_per_call(capsys):
    rows = []
    for name, (compiled, shapes) in (("windowed x@w (2 streams)", compile_windowed("cuda:2", m=64, k=128, f=32)),
                                     ("2-layer MLP", compile_mlp("cuda:2", m=32, d=64, h=128))):
        ex = unwrap(compiled.executable)
        args = shards(compiled, [torch.randn(s) for s in shapes])
        kernels = sum(type(t).__name__ == "KernelThunk" for t in ex.program.thunks)
        eager = _host_us(lambda ex=ex, args=args: ex.run(args))
        row = [name, len(ex.program.thunks), kernels, eager]
        for mode in ("clone", "rotate"):
            runner = GraphRunner(ex, GraphOptions(outputs=mode))

            def call(runner=runner, args=args):
                out, _ = runner.run(args)
                del out
            row.append(_host_us(call))
            assert runner.disabled_reason is None, _diag(ex, runner)
        rows.append(row)
    with capsys.disabled():
        print("\nper-call host time (us), 2 GPUs, no synchronisation:")
        print(f"{'program':<28}{'thunks':>8}{'kernels':>9}{'eager':>10}{'graph clone':>13}{'graph rotate':>14}")
        for name, th, kn, e, c, r in rows:
            print(f"{name:<28}{th:>8}{kn:>9}{e:>10.1f}{c:>13.1f}{r:>14.1f}")


def test_jit_cuda_graphs_option_is_wired():
    import inspect

    from spmd import compiled as compiled_module

    if "maybe_graph" not in inspect.getsource(compiled_module):
        pytest.skip("spmd/compiled.py does not route CompileOptions.cuda_graphs to maybe_graph yet")
    mesh = spmd.Mesh.create(("tp",), devices="cuda:2")
    opts = spmd.CompileOptions(windowed_einsum="on", num_compute_streams=2, cuda_graphs=True)
    f = spmd.jit(matmul, mesh=mesh, in_shardings=(spmd.PartitionSpec("tp", None), spmd.PartitionSpec(None, "tp")),
                 out_shardings=spmd.PartitionSpec(None, "tp"), options=opts)
    w = torch.randn(128, 32)
    for _ in range(5):
        x = torch.randn(64, 128)
        torch.testing.assert_close(f(x, w).to_torch(), x @ w, rtol=1e-4, atol=1e-4)
    counters = metrics.snapshot()["counters"]
    assert counters.get("cuda_graphs.replay", 0) >= 3, counters


def test_jit_dispatch_host_and_device_time(capsys):
    """Per call of ``spmd.jit`` with CUDA graphs on the dispatch workloads: host µs for bursts of
    8 and of 200 calls (a long burst is bounded by the devices once their queues fill), and
    device µs (CUDA events around 100 calls on the caller's stream). Prints; asserts results."""
    from benchmarks.workloads import WORKLOADS, make_inputs

    mesh = spmd.Mesh.create(("tp",), devices="cuda:2")
    P = spmd.PartitionSpec
    rows = []
    for name in ("add", "mlp", "block"):
        wl = WORKLOADS[name]
        xs = make_inputs(wl, "cpu", 1234)
        f = spmd.jit(wl.fn, mesh=mesh, in_shardings=tuple(P(*s) for s in wl.specs), out_shardings=P(*wl.out_spec),
                     options=spmd.CompileOptions(cuda_graphs=True))
        placed = [spmd.device_put(x, spmd.NamedSharding(mesh, P(*s))) for x, s in zip(xs, wl.specs, strict=True)]
        for _ in range(5):
            out = f(*placed)
        torch.testing.assert_close(out.to_torch(), wl.fn(*xs), rtol=2e-3, atol=2e-3)
        del out
        row = [name]
        for calls in (8, 200):
            best = float("inf")
            for _ in range(10):
                for d in range(N):
                    torch.cuda.synchronize(d)
                t0 = time.perf_counter()
                for _ in range(calls):
                    f(*placed)
                best = min(best, (time.perf_counter() - t0) / calls * 1e6)
            row.append(best)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for d in range(N):
            torch.cuda.synchronize(d)
        start.record()
        for _ in range(100):
            f(*placed)
        stop.record()
        stop.synchronize()
        row.append(start.elapsed_time(stop) * 1e3 / 100)
        rows.append(row)
    with capsys.disabled():
        print("\nspmd.jit + CUDA graphs, 2 GPUs: host us/call (bursts of 8 / 200), device us/call")
        for name, b8, b200, dev in rows:
            print(f"{name:<8}{b8:>10.1f}{b200:>10.1f}{dev:>10.1f}")
