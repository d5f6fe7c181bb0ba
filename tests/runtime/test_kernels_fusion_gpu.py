"""``fusion`` kernels on CUDA: Inductor's generated kernels against the op-by-op interpreter, the
Triton kernel they launch, and fused programs through ``spmd.jit`` with and without CUDA graphs.
Skipped without CUDA."""

from __future__ import annotations

import sys

import pytest
import torch
from hlo_helpers import FakeMesh

import spmd
from spmd import metrics
from spmd.ir.text import parse_module
from spmd.passes.fuse_elementwise import FuseElementwise
from spmd.runtime import kernels_fusion as kf
from spmd.runtime.kernels import compile_kernel
from tests.passes.fuse_elementwise_programs import AFTER_ALL_REDUCE, CASES

pytestmark = pytest.mark.gpu
P = spmd.PartitionSpec
DTYPES = {torch.float32: ("f32", 1e-5), torch.bfloat16: ("bf16", 2e-2)}


@pytest.fixture(autouse=True)
def _auto_compiler(monkeypatch):
    """The default compiler choice (Inductor on CUDA), an empty compile cache, exact float32 GEMMs."""
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    monkeypatch.setattr(kf, "_cache", {})
    monkeypatch.setattr(kf, "_logged", set())
    monkeypatch.setattr(sys.modules["spmd.jit"], "_GLOBAL_CACHE", {})
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _fallbacks() -> dict[str, int]:
    return {k: v for k, v in metrics.snapshot()["counters"].items() if k.startswith("fusion.fallback.")}


def _fusion(dtype: torch.dtype):
    """The bias + residual + LayerNorm fusion of ``AFTER_ALL_REDUCE`` in ``dtype``."""
    text = AFTER_ALL_REDUCE if dtype == torch.float32 else AFTER_ALL_REDUCE.replace("f32[", DTYPES[dtype][0] + "[")
    mod = parse_module(text)
    FuseElementwise().run(mod)
    (inst,) = [i for i in mod.entry.instructions if i.opcode == "fusion"]
    return inst


def _operands(inst, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(o.shape.dims, generator=gen) + 0.1).to(device=device, dtype=dtype) for o in inst.operands]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_inductor_kernel_matches_the_interpreter(dtype):
    dev = torch.device("cuda", 0)
    assert kf.fusion_compiler(dev) == "graphs"
    inst = _fusion(dtype)
    ops = _operands(inst, dev, dtype)
    before = _fallbacks()
    with kf.graph_warmup():
        got = compile_kernel(inst, dev)(ops, None)
    want = kf.interpreter(inst.attrs["calls"], dev)(*ops)
    assert _fallbacks() == before and len(kf._cache) == 1
    assert got.device == dev and got.dtype == dtype and got.is_contiguous()
    tol = DTYPES[dtype][1]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    out = torch.empty_like(want)
    with kf.graph_warmup():  # with a buffer: a writer that stores into it is generated once
        assert compile_kernel(inst, dev)(ops, out) is out
    assert len(kf._cache) == 2 and any(k[0] == "into" for k in kf._cache)
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    hits = metrics.counter("fusion.compile_cache.hit").value
    out2 = torch.full_like(want, float("nan"))
    with kf.graph_warmup():  # a new kernel of the same structure and layout reuses the code
        assert compile_kernel(inst, dev)(ops, out2) is out2
    assert metrics.counter("fusion.compile_cache.hit").value == hits + 1
    torch.testing.assert_close(out2.float(), want.float(), rtol=tol, atol=tol)


def test_inductor_launches_a_triton_kernel():
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda", 0)
    inst = _fusion(torch.float32)
    ops = _operands(inst, dev, torch.float32)
    kernel = compile_kernel(inst, dev)
    with kf.graph_warmup():
        kernel(ops, None)  # compile outside the profile
        torch.cuda.synchronize(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            kernel(ops, None)
            torch.cuda.synchronize(dev)
    names = [e.key for e in prof.key_averages()]
    if not names:
        pytest.skip("the profiler recorded no CUDA kernels here (no CUPTI)")
    assert any("triton" in n for n in names), names


@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_programs_through_jit_on_all_local_gpus(case, cuda_graphs):
    """Each function of the pass tests on every local GPU: Inductor fusions inside the program (and
    inside the CUDA graph) agree with float64 PyTorch on fresh inputs every call."""
    n = torch.cuda.device_count()
    fn, make, in_specs, out_spec = CASES[case]
    mesh = spmd.Mesh.create({"tp": n}, "cuda")
    jitted = spmd.jit(fn, mesh=mesh, in_shardings=tuple(in_specs), out_shardings=out_spec,
                      options=spmd.CompileOptions(cuda_graphs=cuda_graphs))
    before = _fallbacks()
    for k in range(4):
        args = make(torch.Generator().manual_seed(100 + k))
        want = fn(*[a.double() if a.is_floating_point() else a for a in args])
        got = jitted(*args).to_torch().double()
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    lowered = jitted.lower(*args)
    assert "fusion(" in lowered.as_text(lowered.stages[-1])
    assert _fallbacks() == before


def test_eager_and_inductor_fusions_agree_on_the_block_workload(monkeypatch):
    from benchmarks.workloads import WORKLOADS, make_inputs

    wl = WORKLOADS["block"]
    mesh = spmd.Mesh.create({"tp": 1}, "cuda:1")
    xs = make_inputs(wl, "cpu", 9)
    outs = {}
    for mode in ("eager", "inductor"):
        monkeypatch.setenv(kf.COMPILER_ENV, mode)
        monkeypatch.setattr(sys.modules["spmd.jit"], "_GLOBAL_CACHE", {})
        f = spmd.jit(wl.fn, mesh=mesh, in_shardings=tuple(P(*s) for s in wl.specs), out_shardings=P())
        outs[mode] = f(*xs).to_torch()
    want = wl.fn(*[x.double() for x in xs])
    for got in outs.values():
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-4
    torch.testing.assert_close(outs["inductor"], outs["eager"], rtol=1e-4, atol=1e-4)


def test_executor_runs_fusions_on_two_gpus_like_the_cpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from spmd.ir.evaluate import evaluate_spmd
    from spmd.runtime.executor import Executable

    mod = parse_module(AFTER_ALL_REDUCE)
    FuseElementwise().run(mod)
    ex = Executable(mod, FakeMesh(mod.mesh, platform="cuda"))
    gen = torch.Generator().manual_seed(1)
    host = [[torch.randn(p.shape.dims, generator=gen) for _ in range(2)] for p in mod.entry.parameters]
    outs, ready = ex.run([[t.to(f"cuda:{d}") for d, t in enumerate(per)] for per in host])
    for ev in ready:
        ev.synchronize()
    ref = evaluate_spmd(mod, [[a[d] for a in host] for d in range(2)])
    for d in range(2):
        torch.testing.assert_close(outs[0][d].cpu(), ref[0][d], rtol=1e-5, atol=1e-5)
