"""spmd.trace: the Chrome trace-event JSON of one execution on virtual CPU devices."""

import copy
import json

import pytest
import torch

import spmd
from spmd.models import gpt, plans
from spmd.parallelize import parallelize
from spmd.runtime.trace_events import TraceEvent
from spmd.sharding import PartitionSpec as P
from spmd.trace import TracedCalls, build_chrome_trace, stream_kinds, trace, tracing, write_chrome_trace

MESH4 = spmd.Mesh.create(("tp",), devices="cpu:4")
WINDOWED = spmd.CompileOptions(windowed_einsum="on", num_compute_streams=2)


def _matmul(x, w):
    return x @ w


def _mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def _load(path):
    with open(path) as f:
        return json.load(f)


def _tracks(obj):
    """(process names by pid, thread names by (pid, tid), complete events)."""
    procs = {e["pid"]: e["args"]["name"] for e in obj["traceEvents"] if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in obj["traceEvents"] if e["name"] == "thread_name"}
    events = [e for e in obj["traceEvents"] if e["ph"] == "X"]
    return procs, threads, events


def _dots(compiled):
    return {i.name for c in compiled.module.all_computations() for i in c.instructions if i.opcode == "dot"}


def _check_every_dot_on_every_device(compiled, events, n):
    ran = {(e["pid"], e["name"]) for e in events}
    fused = {(e["pid"], d) for e in events for d in e["args"].get("fused", ())}
    dots = _dots(compiled)
    assert dots
    for pid in range(n):
        for d in dots:
            assert (pid, d) in ran or (pid, d) in fused, f"no event for dot %{d} on device {pid}"


def test_windowed_einsum_events_sit_on_their_streams(tmp_path):
    f = spmd.jit(_matmul, mesh=MESH4, in_shardings=(P("tp", None), P(None, "tp")), out_shardings=P(None, "tp"),
                 options=WINDOWED)
    x, w = torch.randn(16, 24) + 0.1, torch.randn(24, 12) + 0.1
    path = trace(f, x, w, path=tmp_path / "sub" / "mm.json")
    assert path == str(tmp_path / "sub" / "mm.json")
    procs, threads, events = _tracks(_load(path))
    assert procs == {k: f"device cpu:{k}" for k in range(4)}
    assert {threads[(k, s)] for k in range(4) for s in range(4)} == {
        "stream 0 (main)", "stream 1 (compute)", "stream 2 (compute)", "stream 3 (communication)"}
    compiled = f.lower(x, w).compile()
    _check_every_dot_on_every_device(compiled, events, 4)
    permutes = [e for e in events if e["args"]["opcode"] == "collective-permute-start"]
    dots = [e for e in events if e["args"]["opcode"] == "dot" or e["args"].get("fused")]  # partial dots
    assert len(permutes) == 4 * 3 and len(dots) == 4 * 4  # a ring of 4: 3 hops, 4 partial dots per device
    assert all(threads[(e["pid"], e["tid"])] == "stream 3 (communication)" for e in permutes)
    assert all(e["cat"] == "communication" for e in permutes)
    assert {e["tid"] for e in dots} == {1, 2}  # the partial dots alternate over both compute streams
    assert all(threads[(e["pid"], e["tid"])].endswith("(compute)") for e in dots)
    for e in events:
        assert e["dur"] >= 0 and e["ts"] >= 0
        assert e["args"]["partition"] == e["pid"] and e["args"]["stream"] == e["tid"]
    compiled_dots = {i.name: i for c in compiled.module.all_computations() for i in c.instructions}
    first = compiled_dots[dots[0]["name"] if dots[0]["args"]["opcode"] == "dot" else dots[0]["args"]["fused"][0]]
    assert str(first.shape) == "f32[4,3]" and str(first.operands[0].shape) == "f32[4,24]"
    assert all(e["args"]["operands"] and e["args"]["shape"].startswith("f32[") for e in dots)


def test_tracing_does_not_change_results(tmp_path):
    f = spmd.jit(_matmul, mesh=MESH4, in_shardings=(P("tp", None), P(None, "tp")), out_shardings=P(None, "tp"),
                 options=WINDOWED)
    x, w = torch.randn(16, 24) + 0.1, torch.randn(24, 12) + 0.1
    plain = f(x, w).to_torch()
    with tracing(f, path=tmp_path / "t.json") as run:
        traced = run(x, w).to_torch()
    assert torch.equal(plain, traced)
    ref = (x.double() @ w.double()).float()
    assert ((traced - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_megatron_mlp_on_a_compiled_object(tmp_path):
    f = spmd.jit(_mlp, mesh=MESH4, in_shardings=(P(), P(None, "tp"), P("tp", None)), out_shardings=P())
    x, w1, w2 = torch.randn(8, 16) + 0.1, torch.randn(16, 32) + 0.1, torch.randn(32, 16) + 0.1
    compiled = f.lower(x, w1, w2).compile()
    runner = TracedCalls(compiled)
    out = runner(x, w1, w2).to_torch()
    ref = torch.relu(x.double() @ w1.double()) @ w2.double()
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    obj = runner.chrome_trace()
    procs, threads, events = _tracks(obj)
    assert len(procs) == 4 and set(threads.values()) == {"stream 0 (main)"}
    _check_every_dot_on_every_device(compiled, events, 4)
    reduces = [e for e in events if e["args"]["opcode"] == "all-reduce"]
    assert len(reduces) == 4 and all(e["cat"] == "communication" for e in reduces)
    assert obj["otherData"]["num_partitions"] == 4
    json.dumps(obj)  # serialisable as is


def test_context_manager_puts_calls_one_after_the_other(tmp_path):
    f = spmd.jit(_mlp, mesh=MESH4, in_shardings=(P(), P(None, "tp"), P("tp", None)), out_shardings=P())
    x, w1, w2 = torch.randn(4, 8) + 0.1, torch.randn(8, 16) + 0.1, torch.randn(16, 8) + 0.1
    path = tmp_path / "two.json"
    with tracing(f, path=path) as run:
        y = run(x, w1, w2)
        first = run.events()
        run(y, w1, w2)
        both = run.events()
    assert len(both) == 2 * len(first)
    end_first = max(e.end_us for e in first)
    second = [e for e in both if e not in first]
    assert min(e.start_us for e in second) >= end_first
    _, _, events = _tracks(_load(path))
    assert len(events) == len(both)


def test_parallel_module_trace(tmp_path):
    m = gpt.gpt3_layers(1, small=True, seed=3)
    pm = parallelize(m, spmd.Mesh.create(("tp",), devices="cpu:2"), plans.gpt_plan())
    x = torch.randn(2, 4, 64)
    _, _, events = _tracks(_load(trace(pm, x, path=tmp_path / "gpt.json")))
    _check_every_dot_on_every_device(pm.compiled, events, 2)
    assert {e["args"]["opcode"] for e in events} >= {"dot", "all-reduce", "custom-call"}


def test_graph_runner_calls_run_eagerly_when_traced(tmp_path):
    from spmd.runtime.graphs import GraphRunner, HostReplayBackend

    f = spmd.jit(_matmul, mesh=MESH4, in_shardings=(P("tp", None), P(None, "tp")), out_shardings=P(None, "tp"),
                 options=WINDOWED)
    x, w = torch.randn(16, 24) + 0.1, torch.randn(24, 12) + 0.1
    compiled = copy.copy(f.lower(x, w).compile())
    compiled.executable = GraphRunner(compiled.executable, backend=HostReplayBackend(compiled.executable))
    want = compiled(x, w).to_torch()
    with tracing(compiled, path=tmp_path / "g.json") as run:
        got = run(x, w).to_torch()
    assert torch.equal(got, want)
    threads = _tracks(_load(tmp_path / "g.json"))[1]
    assert threads[(2, 3)] == "stream 3 (communication)"
    assert sum(e.name.endswith(".op") for e in run.events()) in (4 * 4, 4 * 8)  # 4 partial dots (+ updates)


def test_stream_kinds_and_build_from_events():
    f = spmd.jit(_matmul, mesh=MESH4, in_shardings=(P("tp", None), P(None, "tp")), out_shardings=P(None, "tp"),
                 options=WINDOWED)
    compiled = f.lower(torch.randn(16, 24), torch.randn(24, 12)).compile()
    assert stream_kinds(compiled) == {0: "main", 1: "compute", 2: "compute", 3: "communication"}
    obj = build_chrome_trace([], compiled)
    assert not [e for e in obj["traceEvents"] if e["ph"] == "X"]
    assert len([e for e in obj["traceEvents"] if e["name"] == "thread_name"]) == 16
    # a dot fused into its accumulator update has no thunk of its own: the update names it
    events = [TraceEvent(2, 1, "matmul.acc0.op", 5.0, 7.5), TraceEvent(2, 0, "wait.matmul.acc0.op", 8.0, 8.0)]
    slices = [e for e in build_chrome_trace(events, compiled)["traceEvents"] if e["ph"] == "X"]
    assert slices[0]["args"]["fused"] == ["matmul.0.op"] and slices[0]["dur"] == 2.5
    assert slices[0]["args"]["opcode"] == "dynamic-update-slice" and slices[0]["cat"] == "compute"
    assert slices[1]["args"]["opcode"] == "wait-event" and slices[1]["cat"] == "sync"


def test_errors(tmp_path):
    with pytest.raises(TypeError, match="fn_or_compiled: expected an spmd.jit object"):
        trace(_matmul, torch.randn(2, 2), path=tmp_path / "x.json")
    f = spmd.jit(_matmul, mesh=MESH4, in_shardings=(P("tp", None), P()))
    with pytest.raises(TypeError, match="path: expected a str or os.PathLike, got int"):
        trace(f, torch.randn(4, 2), torch.randn(2, 2), path=3)
    with pytest.raises(ValueError, match="no call"):
        TracedCalls(f).chrome_trace()
    with pytest.raises(ValueError, match=r"in_shardings has 2 entries \(one per argument\)"):
        trace(f, torch.randn(4, 2), path=tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


def test_unwritable_path_is_a_value_error_before_the_call_consumes_donated_arguments(tmp_path):
    f = spmd.jit(lambda a: a * 2, mesh=MESH4, in_shardings=P("tp"), out_shardings=P("tp"), donate_argnums=0)
    x = spmd.device_put(torch.randn(8), spmd.NamedSharding(MESH4, P("tp")))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="path: cannot create the folder .*file/sub"):
        trace(f, x, path=tmp_path / "file" / "sub" / "t.json")
    assert x.to_torch().shape == (8,)  # not donated: nothing ran
    out = trace(f, x, path=tmp_path / "new" / "t.json")  # missing folders are created
    assert _load(out)["traceEvents"]


def test_directory_path_is_a_value_error_before_the_call(tmp_path):
    f = spmd.jit(lambda a: a * 2, mesh=MESH4, in_shardings=P("tp"), out_shardings=P("tp"), donate_argnums=0)
    x = spmd.device_put(torch.randn(8), spmd.NamedSharding(MESH4, P("tp")))
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="path: expected a file path for the trace, got the existing folder .*d'"):
        trace(f, x, path=tmp_path / "d")
    assert x.to_torch().shape == (8,)  # not donated: nothing ran
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temp file next to the folder
    assert not any((tmp_path / "d").iterdir())


def test_failed_write_removes_the_temp_file(tmp_path, monkeypatch):
    def fail(self, target):
        raise OSError("disk full")

    monkeypatch.setattr(type(tmp_path), "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_chrome_trace({"traceEvents": []}, tmp_path / "t.json")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu(count=2)
def test_gpu_windowed_einsum_trace(tmp_path):
    mesh = spmd.Mesh.create(("tp",), devices="cuda:2")
    f = spmd.jit(_matmul, mesh=mesh, in_shardings=(P("tp", None), P(None, "tp")), out_shardings=P(None, "tp"),
                 options=WINDOWED)
    x, w = torch.randn(1024, 512) + 0.1, torch.randn(512, 1024) + 0.1
    want = f(x, w).to_torch()
    with tracing(f, path=tmp_path / "gpu.json") as run:
        got = run(x, w).to_torch()
    assert torch.equal(got, want)
    procs, threads, events = _tracks(_load(tmp_path / "gpu.json"))
    assert procs == {0: "device cuda:0", 1: "device cuda:1"}
    _check_every_dot_on_every_device(f.lower(x, w).compile(), events, 2)
    permutes = [e for e in events if e["args"]["opcode"] == "collective-permute-start"]
    assert permutes and all(threads[(e["pid"], e["tid"])].endswith("(communication)") for e in permutes)
    assert all(e["dur"] > 0 for e in events if e["cat"] != "sync")
