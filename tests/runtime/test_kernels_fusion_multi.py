"""The multi-output fusion kernel: op by op, generated (Inductor) with stores over its operands, the executor."""

from __future__ import annotations

import shutil

import pytest
import torch
from hlo_helpers import FakeMesh

from spmd import metrics
from spmd.ir.text import parse_module
from spmd.passes.assign_buffers import assign_buffers
from spmd.passes.assign_streams import AssignStreams
from spmd.passes.multi_output_fusion import MultiOutputFusion
from spmd.passes.schedule import Schedule
from spmd.runtime import kernels_fusion as kf
from spmd.runtime import kernels_fusion_multi as kfm
from spmd.runtime.executor import Executable
from spmd.runtime.hazards import find_hazards
from spmd.runtime.kernels import compile_kernel
from spmd.runtime.lower import lower
from spmd.runtime.memory import analyze_program
from spmd.runtime.thunks import MultiOutputKernelThunk
from tests.passes.multi_output_fusion_programs import ADAMW

CPU = torch.device("cpu")


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(kf, "_cache", {})
    monkeypatch.setattr(kf, "_logged", set())


def _merged():
    mod = parse_module(ADAMW)
    MultiOutputFusion().run(mod)
    (inst,) = [i for i in mod.entry.instructions if i.opcode == "fusion"]
    return mod, inst


def _operands(inst, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape.dims, generator=gen) + 0.1 for o in inst.operands]


def _unfused_outputs(ops_by_name):
    """ADAMW's three fusions run op by op, unmerged: (m', v', p')."""
    mod = parse_module(ADAMW)
    want = {}
    env = dict(ops_by_name)
    for inst in mod.entry.instructions:
        if inst.opcode == "fusion":
            env[inst.name] = kf.interpreter(inst.attrs["calls"], CPU)(*[env[o.name] for o in inst.operands])
            want[inst.name] = env[inst.name]
    return want["fm"], want["fv"], want["fp"]


def test_op_by_op_kernel_equals_the_unmerged_fusions_and_fills_destinations():
    _, inst = _merged()
    ops = _operands(inst)
    named = {o.name: t for o, t in zip(inst.operands, ops, strict=True)}
    want = _unfused_outputs(named)
    kernel = compile_kernel(inst, CPU)
    got = kernel(ops, None)
    assert isinstance(got, tuple) and len(got) == 3
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    dests = [torch.full((8, 4), float("nan")), None, torch.full((8, 4), float("nan"))]
    got = kernel(ops, dests)
    assert got[0] is dests[0] and got[2] is dests[2]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_pointwise_parameters_of_a_tuple_root():
    _, inst = _merged()
    assert kf.pointwise_parameters(inst.attrs["calls"]) == frozenset({0, 1, 2, 3})


def _fake_writer(monkeypatch):
    calls = []

    def fake(fn, ops, outs, alias):
        calls.append(alias)
        n = len(outs)

        def run(*args):
            values = fn(*args[:-n])
            for d, v in zip(args[-n:], values, strict=True):
                d.copy_(v)
        return run
    monkeypatch.setattr(kfm, "fusion_compiler", lambda device: "inductor")
    monkeypatch.setattr(kfm, "_inductor_multi_into", fake)
    return calls


def test_generated_kernel_stores_over_its_pointwise_operands(monkeypatch, fresh_cache):
    calls = _fake_writer(monkeypatch)
    _, inst = _merged()
    ops = _operands(inst)  # operands: g, m, v, p
    named = {o.name: t.clone() for o, t in zip(inst.operands, ops, strict=True)}
    want = _unfused_outputs(named)
    m, v, p = ops[1], ops[2], ops[3]
    got = compile_kernel(inst, CPU)(ops, [m, v, p])  # m', v', p' over m, v, p
    assert got[0] is m and got[1] is v and got[2] is p
    assert calls == [(1, 2, 3)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_destination_overlapping_another_operand_takes_the_op_by_op_path(monkeypatch, fresh_cache):
    calls = _fake_writer(monkeypatch)
    _, inst = _merged()
    ops = _operands(inst)
    named = {o.name: t.clone() for o, t in zip(inst.operands, ops, strict=True)}
    want = _unfused_outputs(named)
    big = torch.randn(64)
    ops[0] = big[:32].view(8, 4)  # g shares storage with p' 's destination, shifted by one element
    named["g"] = ops[0].clone()
    want = _unfused_outputs(named)
    dest = big[1:33].view(8, 4)
    got = compile_kernel(inst, CPU)(ops, [None, None, dest])
    assert calls == [] and got[2] is dest
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def _has_cxx() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.slow
@pytest.mark.skipif(not _has_cxx(), reason="Inductor on CPU needs a C++ compiler")
def test_inductor_on_cpu_stores_every_output_in_place(monkeypatch, fresh_cache):
    monkeypatch.setenv(kf.COMPILER_ENV, "inductor")
    _, inst = _merged()
    ops = _operands(inst)
    named = {o.name: t.clone() for o, t in zip(inst.operands, ops, strict=True)}
    want = _unfused_outputs(named)
    ptrs = [t.data_ptr() for t in ops[1:]]
    got = compile_kernel(inst, CPU)(ops, ops[1:])
    assert [t.data_ptr() for t in got] == ptrs
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert any(k[0] == "multi-into" for k in kf._cache)
    assert not any(k.startswith("fusion.fallback") for k in kf._logged)


def _scheduled():
    mod, _ = _merged()
    AssignStreams().run(mod)
    Schedule().run(mod)
    return mod


def test_executor_writes_the_three_outputs_into_the_donated_buffers():
    mod = _scheduled()
    plain = parse_module(ADAMW)
    args = [[torch.randn(8, 4) + 0.1] for _ in range(4)]
    want, _ = Executable(plain, FakeMesh(plain.mesh)).run([[t.clone() for t in a] for a in args])
    ex = Executable(mod, FakeMesh(mod.mesh), assign_buffers(mod))
    outs, _ = ex.run(args, donated=frozenset({0, 2, 3}))  # p, m, v donated; g is not
    assert [o[0].data_ptr() for o in outs] == [args[0][0].data_ptr(), args[2][0].data_ptr(), args[3][0].data_ptr()]
    for w, g in zip(want, outs, strict=True):
        assert torch.equal(w[0], g[0])


def test_lowering_hazards_and_memory_of_a_multi_output_fusion():
    mod = _scheduled()
    buffers = assign_buffers(mod)
    program = lower(mod, [CPU], buffers=buffers, gpu=True, donated=frozenset({0, 2, 3}))
    (th,) = [t for t in program.thunks if isinstance(t, MultiOutputKernelThunk)]
    assert sorted(th.buffers) == [0, 1, 2] and program.output_donors == (0, 2, 3)
    assert find_hazards(program) == []
    ma = analyze_program(mod, program)
    assert ma.alias_size_bytes == 3 * 8 * 4 * 4 and ma.heap_temp_peak_bytes == 0
    plain = lower(mod, [CPU], buffers=buffers, gpu=True)  # nothing donated: fresh outputs
    (th,) = [t for t in plain.thunks if isinstance(t, MultiOutputKernelThunk)]
    assert th.buffers == (-1, -1, -1)
    assert analyze_program(mod, plain).output_size_bytes == 3 * 8 * 4 * 4


def test_a_generated_kernel_that_reads_an_operand_after_storing_over_it_is_not_used(monkeypatch, fresh_cache):
    """A compiled schedule split into one store per output (each recomputing from the operands)
    reads m after m' was stored over it: the one-time check finds different bits and the fusion
    runs op by op (counted as a fallback), with the right values."""
    monkeypatch.setattr(kfm, "fusion_compiler", lambda device: "inductor")

    def split_compile(gm, inputs, options=None):
        def run(*args):
            ops, dests = args[:-3], args[-3:]
            for i in range(3):
                tmp = [torch.empty_like(d) for d in dests]
                tmp[i] = dests[i]
                gm(*ops, *tmp)
        return run
    monkeypatch.setattr(torch._inductor, "compile", split_compile)
    _, inst = _merged()
    ops = _operands(inst)
    named = {o.name: t.clone() for o, t in zip(inst.operands, ops, strict=True)}
    want = _unfused_outputs(named)
    before = metrics.snapshot()["counters"].get("fusion.fallback.RuntimeError", 0)
    got = compile_kernel(inst, CPU)(ops, ops[1:])
    assert metrics.snapshot()["counters"].get("fusion.fallback.RuntimeError", 0) == before + 1
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
