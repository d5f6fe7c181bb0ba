"""Skinny products that compute their input's RMS norm or SwiGLU (``spmd.runtime.kernels_prologue``):
the op-by-op path on any machine; on CUDA, every Triton configuration with each prologue against a
float64 reference, the timed and cached choice, and a decode-shaped norm + product under CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd.runtime import kernels_fusion as kf
from spmd.runtime import kernels_gemv as kg
from spmd.runtime import kernels_prologue as kp
from spmd.runtime.prologue_match import Prologue

P = spmd.PartitionSpec
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-5


def _rms_ref(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The op-by-op RMS norm of 16-bit ``x`` (float32 statistics, the roundings of ``spmd.models.llama.RMSNorm``)."""
    x32 = x.float()
    return g * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _norm_fn(ops, out):
    return _rms_ref(ops[1], ops[0])


def _swiglu_fn(ops, out):
    k = ops[0].shape[-1] // 2
    return F.silu(ops[0][..., :k]) * ops[0][..., k:]


def _product(ops, out):  # the dot kernel's contract: [x, w [N, K]] -> x @ w.T
    r = ops[0].reshape(-1, ops[0].shape[-1]) @ ops[1].t()
    if out is None:
        return r
    out.view(r.shape).copy_(r)
    return out


def _addmm(ops, out):  # make_addmm's contract: [c, x, w] -> c + x @ w.T, in place when out is c
    c, x, w = ops
    return out.view(-1, out.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), w.t()).view(out.shape)


def _rms(k: int) -> Prologue:
    return Prologue("rms-norm", x=1, g=0, eps=EPS, divisor=float(k), width=k)


def _swiglu(k: int) -> Prologue:
    return Prologue("swiglu", x=0, g=0, x_start=0, g_start=k, width=k)


def test_without_cuda_the_fusion_then_the_product_run():
    torch.manual_seed(0)
    x, g, w = torch.randn(3, 64).bfloat16(), torch.rand(64).bfloat16() + 0.5, torch.randn(32, 64).bfloat16()
    fn = kp.make_prologue_product(_rms(64), _norm_fn, _product, 2, False, True)
    out = torch.empty(3, 32, dtype=torch.bfloat16)
    got = fn([g, x, w], out)
    assert got is out and torch.equal(out, _rms_ref(x, g) @ w.t())
    c = torch.randn(3, 32).bfloat16()
    acc = kp.make_prologue_product(_swiglu(32), _swiglu_fn, _addmm, 1, True, True)
    gu = torch.randn(3, 64).bfloat16()
    want = c.clone().addmm_(F.silu(gu[:, :32]) * gu[:, 32:], w[:, :32].t())
    got = c.clone()
    assert torch.equal(acc([got, gu, w[:, :32].contiguous()], got), want)


def _inputs(kind: str, m: int, k: int, n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    c = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    if kind == "rms-norm":
        x = (torch.randn(m, k, device="cuda", generator=g) * 3).bfloat16()
        gamma = (torch.rand(k, device="cuda", generator=g) + 0.5).bfloat16()
        return [gamma, x], _rms_ref(x, gamma), w, c, _rms(k), _norm_fn
    gu = torch.randn(m, 2 * k, device="cuda", generator=g).bfloat16()
    return [gu], _swiglu_fn([gu], None), w, c, _swiglu(k), _swiglu_fn


def _close(out: torch.Tensor, exact: torch.Tensor, label: str = "") -> None:
    """Within two bf16 roundings of the largest value (the fused kernel rounds x * g, the op-by-op
    program rounds x * r, then g times it: both a few roundings from the float64 product)."""
    out, exact = out.double().cpu(), exact.cpu()
    err = (out - exact).abs().max().item()
    assert err <= exact.abs().max().item() * 2 ** -6, (label, err)


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["rms-norm", "swiglu"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("m, k, n", [(1, 4096, 4096), (8, 1000, 1040), (16, 520, 72)])
def test_every_configuration_is_within_a_rounding_of_the_exact_product(kind, accumulate, m, k, n):
    f_ops, x_in, w, c, pro, _ = _inputs(kind, m, k, n, m * k + n)
    exact = x_in.double() @ w.double().T + (c.double() if accumulate else 0)
    configs = [(c, False) for c in kg.SKINNY_CONFIGS] + [(c, True) for c in kg.ROW_CONFIGS if m == 1]
    for config, row in configs:
        out = c.clone()
        kp._triton(pro, accumulate, config, row)(f_ops, w, out)
        _close(out, exact, str((config, row)))


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["rms-norm", "swiglu"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_the_fastest_candidate_is_used_and_cached(monkeypatch, kind, accumulate):
    """Timing made to pick the last candidate: the result is right, one decision with the prologue
    is recorded, and the next call reuses it."""
    monkeypatch.setattr(kp, "_choices", {})
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    last_fastest = lambda kernels, *a: tuple(float(len(kernels) - i) for i in range(len(kernels)))  # noqa: E731
    monkeypatch.setattr(kg, "_median_us", last_fastest)
    f_ops, x_in, w, c, pro, fusion_fn = _inputs(kind, 1, 4096, 4096, 7)
    fn = kp.make_prologue_product(pro, fusion_fn, _addmm if accumulate else _product, len(f_ops), accumulate, True)
    exact = x_in.double() @ w.double().T + (c.double() if accumulate else 0)
    before = len(kg.DECISIONS)
    for _ in range(2):
        out = c.clone()
        with kf.graph_warmup():
            fn([out, *f_ops, w] if accumulate else [*f_ops, w], out)
        _close(out, exact)
    assert len(kg.DECISIONS) == before + 1
    d = kg.DECISIONS[-1]
    assert d.prologue == kind and d.chosen == d.times_us[-1][0] != "unfused" and d.times_us[0][0] == "unfused"


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["rms-norm", "swiglu"])
def test_real_timing_picks_a_kernel_whose_result_is_right(monkeypatch, kind):
    monkeypatch.setattr(kp, "_choices", {})
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    f_ops, x_in, w, c, pro, fusion_fn = _inputs(kind, 1, 4096, 12288, 11)
    fn = kp.make_prologue_product(pro, fusion_fn, _product, len(f_ops), False, True)
    out = torch.empty_like(c)
    with kf.graph_warmup():
        fn([*f_ops, w], out)
    _close(out, x_in.double() @ w.double().T)
    d = kg.DECISIONS[-1]
    assert d.prologue == kind and d.time_us(d.chosen) == min(t for _, t in d.times_us)


@gpu
@needs_cuda
def test_a_decode_shaped_norm_and_product_under_cuda_graphs_equal_eager(monkeypatch):
    monkeypatch.setattr(kp, "_choices", {})
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    mesh = spmd.Mesh.create(("tp",), devices="cuda:1")
    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(4096, 4096, device="cuda", generator=g).bfloat16() / 64
    gamma = (torch.rand(4096, device="cuda", generator=g) + 0.5).bfloat16()
    # the product is read by another op, as in a decoder layer: it writes into its arena buffer
    # (a program output has none, and the op-by-op pair computes it)
    f = spmd.jit(lambda x, gamma, w: F.linear(_rms_ref(x, gamma), w) * 2, mesh=mesh, in_shardings=(P(), P(), P()),
                 out_shardings=P())
    before = len(kg.DECISIONS)
    for _ in range(3):  # warm-up, capture, replay
        x = torch.randn(1, 4096, device="cuda", generator=g).bfloat16()
        got = f(x, gamma, w).to_torch()
        _close(got, _rms_ref(x, gamma).double() @ w.double().T * 2)
    assert any(d.prologue == "rms-norm" for d in kg.DECISIONS[before:])
