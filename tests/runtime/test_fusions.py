"""Fusions of the windowed-einsum hot path, checked on the lowered program and by running it."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P
from spmd.passes.assign_buffers import assign_buffers
from spmd.runtime.fusions import make_dot_into_slice
from spmd.runtime.hazards import find_hazards
from spmd.runtime.lower import lower
from spmd.runtime.thunks import KernelThunk

SPECS = {"ag": ((P("tp", None), P(None, "tp")), P(None, "tp")),
         "rs": ((P(None, "tp"), P("tp", None)), P("tp", None))}


def _compile(side: str, shape, bidir: bool, n: int = 2):
    """(lowered GPU-style program, callable result, reference) for ``x @ w`` with fresh inputs."""
    mesh = Mesh.create(("tp",), devices=f"cpu:{n}")
    ins, out = SPECS[side]
    f = spmd.jit(lambda x, w: x @ w, mesh=mesh, in_shardings=ins, out_shardings=out,
                 options=spmd.CompileOptions(windowed_einsum="on", num_compute_streams=1,
                                             bidirectional=bidir, cuda_graphs=False))
    m, k, nn = shape
    x, w = torch.randn(m, k, dtype=torch.float64), torch.randn(k, nn, dtype=torch.float64)
    args = [spmd.device_put(t, spmd.NamedSharding(mesh, s)) for t, s in zip((x, w), ins, strict=True)]
    module = f.lower(*args).result.module
    program = lower(module, [torch.device("cpu")] * n, list(range(n)), assign_buffers(module), gpu=True)
    return program, f(*args).to_torch(), x @ w


def _kernels(program) -> list[KernelThunk]:
    return [t for t in program.thunks if isinstance(t, KernelThunk)]


@pytest.mark.parametrize("n", [2, 4])
def test_covered_accumulator_starts_from_new_memory(n):
    program, got, ref = _compile("ag", (64, 32, 256), False, n)
    names = [t.name for t in _kernels(program)]
    assert not any(name.endswith(".init") for name in names), names
    assert len(names) == n  # one fused dot-into-rows per ring step, nothing else
    torch.testing.assert_close(got, ref)


def test_weight_gather_writes_column_blocks_directly():
    program, got, ref = _compile("ag", (64, 32, 64), False)
    assert not [t.name for t in _kernels(program) if t.name.endswith((".0.op", ".1.op"))]
    torch.testing.assert_close(got, ref)


def test_bidirectional_reduce_scatter_accumulates_into_result_rows():
    program, got, ref = _compile("rs", (64, 32, 256), True)
    names = [t.name for t in _kernels(program)]
    assert not any("acc" in name or name.endswith(".init") for name in names), names
    lhs = [t for t in _kernels(program) if "lhs" in t.name]
    assert lhs and all(t.buffer == -1 for t in lhs)  # operand slices stay views of x
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("fresh", [False, True])
def test_make_dot_into_slice_addmm_into_columns(fresh):
    def addmm(ops, out):
        c, a, b = ops
        return torch.addmm(c, a, b, out=out)

    buf = torch.randn(6, 8)
    c, a, b = torch.randn(6, 3), torch.randn(6, 5), torch.randn(5, 3)
    fn = make_dot_into_slice(addmm, (6, 8), (6, 3), inplace=False, num_ins=3, fresh=fresh)
    start = torch.tensor(4)
    ops = [c, a, b, torch.tensor(0), start] if fresh else [buf, c, a, b, torch.tensor(0), start]
    got = fn(ops, None)
    torch.testing.assert_close(got[:, 4:7], c + a @ b)
    if not fresh:
        torch.testing.assert_close(got[:, :4], buf[:, :4])
        torch.testing.assert_close(got[:, 7:], buf[:, 7:])


def test_linear_on_rank4_activations_into_a_sharded_result():
    """A linear layer on 4-d activations whose product a windowed-einsum ring writes into its
    accumulator (dot -> dynamic-update-slice): the fused write runs the generic dot kernel, as
    torch.mm needs a 2-d ``a`` (found by the random tester)."""
    mesh = Mesh.create({"x": 3}, devices="cpu:3")

    def f(x0, x1, x2):
        v0 = torch.linalg.vector_norm(x0, dim=(0, 2), keepdim=True)
        v1 = spmd.with_sharding_constraint(v0, P(None, "x"))
        v2 = torch.nn.functional.linear(v1, x1, x2)
        return (1 + 0.25 * v2.tanh()).prod(dim=0, keepdim=True), v2.to(torch.bfloat16)

    xs = [torch.randn(2, 12, 4, 2, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64),
          torch.randn(16, dtype=torch.float64)]
    g = spmd.jit(f, mesh=mesh, in_shardings=(P("x", None, None, None), P("x"), P("x")),
                 out_shardings=(P("x"), P("x", None)),
                 options=spmd.CompileOptions(windowed_einsum="on", num_compute_streams=3, merge_dots=False))
    for got, want in zip(g(*xs), f(*xs), strict=True):
        tol = 1e-12 if want.dtype == torch.float64 else 1e-2
        torch.testing.assert_close(got.to_torch(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("in_place", [True, False])
def test_residual_add_after_a_row_splitting_view_runs_as_one_addmm(in_place):
    """``x + (h.view(B*S, D) @ w).view(B, S, D)`` (a projection's residual add): the dot reaches the
    add through a reshape view, and the lowering runs one addmm (no dot thunk, no add kernel). With
    the residual used again after the add the addmm cannot accumulate into it in place."""
    mesh = Mesh.create(("tp",), devices="cpu:1")

    def f(x, h, w):
        y = x + (h.reshape(-1, h.shape[-1]) @ w).reshape(x.shape)
        return y if in_place else (y, x * 2)

    f_jit = spmd.jit(f, mesh=mesh, in_shardings=(P(), P(), P()), out_shardings=P() if in_place else (P(), P()),
                     options=spmd.CompileOptions(cuda_graphs=False))
    g = torch.Generator().manual_seed(0)
    x, h, w = (torch.randn(*s, generator=g) for s in ((2, 8, 16), (2, 8, 32), (32, 16)))
    module = f_jit.lower(x, h, w).result.module
    program = lower(module, [torch.device("cpu")], [0], assign_buffers(module), gpu=True)
    kinds = [module.entry.instructions[[i.name for i in module.entry.instructions].index(t.name)].opcode
             for t in _kernels(program) if t.out not in program.view_slots]
    assert "dot" not in kinds and kinds.count("add") == 1
    assert find_hazards(program) == []
    got = f_jit(x, h, w)
    want = f(x.double(), h.double(), w.double())
    got, want = (got, want) if in_place else (got[0], want[0])
    torch.testing.assert_close(got.to_torch().double(), want, rtol=1e-5, atol=1e-5)


def _linear_gelu(x, w, b, w2, b2):
    """A BERT feed-forward block: gelu(x @ w.T + b) @ w2.T + b2 + x."""
    return torch.nn.functional.gelu(x @ w.t() + b) @ w2.t() + b2 + x


def _ffn_inputs(dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = ((4, 64, 32), (128, 32), (128,), (32, 128), (32,))
    return tuple((torch.randn(s, generator=g) / 4).to(device=device, dtype=dtype) for s in shapes)


def _cuda_kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_feed_forward_kernels_on_one_gpu(dtype, monkeypatch):
    """bf16: both linear layers are cuBLASLt GEMMs with the bias in the epilogue (addmm with the 1-d
    bias), then the GELU and the residual add; float32: plain GEMMs, the biases inside the GELU and
    residual fusions (Inductor's choice). Either way two kernels besides the GEMMs (cuBLAS may add
    split-K reductions), no bias add of its own; results equal float64 eager on the same inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from spmd.runtime import kernels_fusion as kf

    monkeypatch.setenv(kf.COMPILER_ENV, "inductor")  # generated fusion kernels without CUDA graphs (profiled)
    mesh = Mesh.create(("tp",), devices="cuda:1")
    f = spmd.jit(_linear_gelu, mesh=mesh, in_shardings=(P(),) * 5, out_shardings=P(),
                 options=spmd.CompileOptions(cuda_graphs=False))
    xs = _ffn_inputs(dtype, "cuda", 1)
    placed = [spmd.device_put(t, spmd.NamedSharding(mesh, P())) for t in xs]  # no input copies in the profile
    f(*placed)  # compile; fusions are generated at the first call
    names = _cuda_kernels(lambda: f(*placed))
    if not names:
        pytest.skip("the profiler recorded no CUDA kernels here (no CUPTI)")
    gemm = ("gemm", "nvjet", "xmma", "cutlass", "splitk", "cublas")
    others = [n for n in names if not any(g in n.lower() for g in gemm)]
    assert len(others) == 2, names
    want = _linear_gelu(*[t.double().cpu() for t in xs])
    got = f(*placed).to_torch().double().cpu()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
