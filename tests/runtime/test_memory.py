"""Memory analysis: golden numbers on hand-counted programs, and an upper bound of what a CPU run holds."""

from __future__ import annotations

import pytest
import torch
from hlo_helpers import FakeMesh

import spmd
import spmd.runtime.executor as executor_mod
from spmd import Mesh
from spmd import PartitionSpec as P
from spmd.ir.text import parse_module
from spmd.passes.assign_buffers import assign_buffers
from spmd.runtime.executor import Executable
from spmd.runtime.memory import MemoryAnalysis, analyze_program

# e and n overlap in time (arena: 2 x 256 B); r, an all-reduce result, is allocated by the
# runtime (a heap temporary from the all-reduce to its last reader m, not in the arena); m and t
# are outputs (heap, live to the end).
_PROGRAM = """HloModule m, num_partitions=2, mesh={x=2}, is_partitioned=true

%add.f32 (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p: f32[64], q: f32[64]) -> (f32[64], f32[64]) {
  %p = f32[64] parameter(0), sharding={devices=[2]<=[2]}
  %q = f32[64] parameter(1), sharding={devices=[2]<=[2]}
  %e = f32[64] exponential(%p), sharding={devices=[2]<=[2]}
  %n = f32[64] negate(%e), sharding={devices=[2]<=[2]}
  %r = f32[64] all-reduce(%n), to_apply=%add.f32, replica_groups={{0,1}}, sharding={devices=[2]<=[2]}
  %m = f32[64] multiply(%r, %q), sharding={devices=[2]<=[2]}
  %t = f32[64] tanh(%e), sharding={devices=[2]<=[2]}
  ROOT %out = (f32[64], f32[64]) tuple(%m, %t), sharding={{devices=[2]<=[2]}, {devices=[2]<=[2]}}
}
"""


def _executable(text: str) -> Executable:
    module = parse_module(text)
    return Executable(module, FakeMesh(module.mesh), assign_buffers(module))


def test_golden_counts():
    ex = _executable(_PROGRAM)
    got = analyze_program(ex.module, ex.program, 2)
    # args 2 x 256; arena e, n = 512; heap: r (256) + m (256) at m, then m + t = 512 at t.
    assert got == MemoryAnalysis(argument_size_bytes=512, output_size_bytes=512, alias_size_bytes=0,
                                 arena_size_bytes=512, heap_temp_peak_bytes=256, constant_size_bytes=0,
                                 peak_size_bytes=512 + 512 + 512, num_devices=2)
    assert got.temp_size_bytes == 512 + 256


def test_golden_counts_donated():
    ex = _executable(_PROGRAM)
    program, _ = ex._variant(frozenset({1}))
    got = analyze_program(ex.module, program, 2)
    # m is written into q's buffer: 256 alias bytes; heap peak: r at m (256), then t (256).
    assert got.alias_size_bytes == 256
    assert got.peak_size_bytes == 512 + 512 + 256
    assert got.heap_temp_peak_bytes == 256


def _measure(monkeypatch) -> list[int]:
    """Patch the CPU executor to record, after every thunk on local device 0, the bytes of the
    distinct storages its slots and arena views hold (the arguments' storages left out)."""
    seen: list[int] = []
    skip: set[int] = set()
    run_segment = executor_mod._run_segment
    collective = Executable._collective

    def held(vals, views) -> int:
        storages = {}
        for t in list(vals) + list(views):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s.data_ptr() not in skip:
                    storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())

    def segment(thunks, vals, views, env, k):
        if k != 0:
            return run_segment(thunks, vals, views, env, k)
        for th in thunks:
            th.run(vals, views, env)
            seen.append(held(vals, views))
            for s in th.release:
                vals[s] = None

    def coll(self, th, call):
        collective(self, th, call)
        seen.append(held(call.vals[0], call.views[0]))

    def run(self, args, *rest, **kw):
        skip.clear()
        skip.update(a[0].untyped_storage().data_ptr() for a in args)
        return original_run(self, args, *rest, **kw)

    original_run = Executable.run
    monkeypatch.setattr(executor_mod, "_run_segment", segment)
    monkeypatch.setattr(Executable, "_collective", coll)
    monkeypatch.setattr(Executable, "run", run)
    return seen


@pytest.mark.parametrize("n", [1, 2, 4])
def test_peak_bounds_what_a_cpu_run_holds(monkeypatch, n):
    mesh = Mesh.create(("x",), devices=f"cpu:{n}")

    def f(a, w1, w2):
        h = torch.nn.functional.gelu(a @ w1)
        return torch.softmax(h @ w2, dim=-1).sum(0), h.mean()

    jitted = spmd.jit(f, mesh=mesh, in_shardings=(P("x"), P(), P()))
    args = (torch.randn(32, 48), torch.randn(48, 64), torch.randn(64, 16))
    compiled = jitted.lower(*args).compile()
    report = compiled.memory_analysis()
    seen = _measure(monkeypatch)
    compiled(*args)
    assert seen, "no thunk ran"
    assert report.argument_size_bytes == sum(a.numel() * 4 for a in args) - args[0].numel() * 4 * (n - 1) // n
    assert max(seen) + report.argument_size_bytes <= report.peak_size_bytes  # equal here: the replay is exact
    assert report.peak_size_bytes >= report.argument_size_bytes + report.arena_size_bytes + report.output_size_bytes


def test_report_is_cached_and_summarised():
    mesh = Mesh.create(("x",), devices="cpu:2")
    compiled = spmd.jit(lambda a: a * 2.0, mesh=mesh, in_shardings=(P("x"),)).lower(torch.randn(8, 4)).compile()
    report = compiled.memory_analysis()
    assert compiled.memory_analysis() is report
    assert report.num_devices == 2 and report.argument_size_bytes == 4 * 4 * 4
    assert report.summary().startswith(f"peak {report.peak_size_bytes} B/device (args 64, ")


@pytest.mark.parametrize(("peak", "text"), [(5 * 2**20 + 2**19, "peak 5.50 MiB/device"),
                                            (3 * 2**10, "peak 3.00 KiB/device"), (100, "peak 100 B/device")])
def test_summary_unit_follows_the_peak(peak, text):
    report = MemoryAnalysis(argument_size_bytes=peak // 4, output_size_bytes=0, alias_size_bytes=0,
                            arena_size_bytes=0, heap_temp_peak_bytes=0, constant_size_bytes=0,
                            peak_size_bytes=peak, num_devices=1)
    assert report.summary().startswith(text + " (args ")


@pytest.mark.parametrize("remat", ["none", pytest.param("full", marks=pytest.mark.slow)])
def test_peak_bounds_what_a_train_step_holds(monkeypatch, remat):
    """A 2-layer GPT train step (joint forward + backward, AdamW, donated params and state) on cpu:2."""
    import torch.nn.functional as F

    from spmd.models.gpt import gpt3_layers
    from spmd.passes.pipeline import CompileOptions
    from spmd.train import AdamW, make_train_step

    torch.manual_seed(0)
    model = gpt3_layers(2, small=True, hidden_size=16, num_heads=4, ffn_size=32, seed=0).train().requires_grad_()
    ts = make_train_step(model, Mesh.create(("dp",), devices="cpu:2"), None,
                         lambda apply, b: F.mse_loss(apply(b["x"]), b["y"]), optimizer=AdamW(lr=1e-2),
                         options=CompileOptions(remat=remat))
    batch = {"x": torch.randn(4, 32, 16), "y": torch.randn(4, 32, 16)}
    report = ts.memory_analysis(batch)
    assert report.alias_size_bytes >= report.argument_size_bytes - 4 * 32 * 16 * 4  # params and state updated in place
    seen = _measure(monkeypatch)
    ts.step(batch)
    assert seen and max(seen) + report.argument_size_bytes <= report.peak_size_bytes
