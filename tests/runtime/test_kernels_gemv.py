"""Matrix-vector products as generated reduction kernels chosen by timing (``spmd.runtime.kernels_gemv``):
eligibility on any machine; on CUDA, the generated kernel against a float64 reference, the in-place
accumulate form, the cached choice, and a decode-shaped linear layer through ``spmd.jit`` with CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import metrics
from spmd.runtime import kernels_fusion as kf
from spmd.runtime import kernels_gemv as kg

P = spmd.PartitionSpec
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_as_weight_accepts_only_the_transposed_view_of_a_contiguous_matrix():
    w = torch.randn(6, 4)
    assert kg.as_weight(w.t()) is not None and kg.as_weight(w.t()).data_ptr() == w.data_ptr()
    assert kg.as_weight(w.t().contiguous()) is None  # [K, N] row-major is not a [N, K] weight
    assert kg.as_weight(torch.randn(2, 3, 4)) is None


def test_cpu_tensors_keep_the_blas_kernel():
    x, w = torch.randn(1, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
    out = torch.empty(1, 2048, dtype=torch.bfloat16)
    assert not kg.gemv(x, w, out, False)


def _counts() -> dict[str, int]:
    return {k: v for k, v in metrics.snapshot()["counters"].items() if k.startswith("gemv.")}


def test_a_decision_reports_every_candidate():
    d = kg.Decision((4096, 11008), 8, "torch.bfloat16", True, (("cublas", 27.5), ("triton-16x256-w4-s4", 22.25)),
                    "triton-16x256-w4-s4")
    assert d.time_us("cublas") == 27.5 and d.time_us("inductor") != d.time_us("inductor")  # nan when not timed
    assert d.summary() == ("gemv M=8 (4096, 11008) torch.bfloat16 accumulate=True: triton-16x256-w4-s4 "
                           "(cublas 27.5, triton-16x256-w4-s4 22.2 us)")


def test_more_rows_than_a_decode_batch_keep_the_blas_kernel(monkeypatch):
    monkeypatch.setattr(kf, "fusion_compiler", lambda device: "inductor")
    x = torch.randn(kg.MAX_ROWS + 1, 2048)
    assert not kg.eligible(x, torch.randn(2048, 2048), torch.empty(kg.MAX_ROWS + 1, 2048))


def _exact_check(out, exact, label=""):
    err = (out.double() - exact).abs().max().item()
    assert err <= exact.abs().max().item() * 2 ** -7, (label, err)


@gpu
@needs_cuda
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("m, k, n", [(1, 4096, 4096), (8, 11008, 4096), (3, 1000, 1040), (16, 520, 72)])
def test_every_candidate_is_within_a_rounding_of_the_exact_product(accumulate, m, k, n):
    """Each non-cuBLAS candidate (Inductor's reduction for one row; every Triton configuration, also
    where K or N is not a multiple of its blocks and rows are padded) against a float64 reference."""
    g = torch.Generator(device="cuda").manual_seed(m * k + n)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    c = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    exact = x.double() @ w.double().T + (c.double() if accumulate else 0)
    candidates = kg._candidates(x, w, c, accumulate)
    names = [name for name, _ in candidates]
    assert any(name.startswith("triton-") for name in names), names
    for name, build in candidates:
        out = c.clone()
        build()(x, w, out)
        _exact_check(out, exact, name)


@gpu
@needs_cuda
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("m, k, n", [(1, 4096, 4096), (8, 11008, 4096)])
def test_the_fastest_candidate_is_used_and_cached(monkeypatch, accumulate, m, k, n):
    """Timing made to pick the last candidate: the product is right, one decision is recorded and
    the choice is reused by the next call."""
    monkeypatch.setattr(kg, "_choices", {})
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    last_fastest = lambda kernels, *a: tuple(float(len(kernels) - i) for i in range(len(kernels)))  # noqa: E731
    monkeypatch.setattr(kg, "_median_us", last_fastest)
    g = torch.Generator(device="cuda").manual_seed(k + n)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    c = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    exact = x.double() @ w.double().T + (c.double() if accumulate else 0)
    before = len(kg.DECISIONS)
    for _ in range(2):
        out = c.clone()
        with kf.graph_warmup():
            assert kg.gemv(x, w, out, accumulate)
        _exact_check(out, exact)
    assert len(kg.DECISIONS) == before + 1
    d = kg.DECISIONS[-1]
    assert d.weight_shape == (n, k) and d.rows == m and d.chosen == d.times_us[-1][0] != "cublas"


@gpu
@needs_cuda
def test_cublas_keeps_the_product_where_it_is_timed_faster(monkeypatch):
    monkeypatch.setattr(kg, "_choices", {})
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    monkeypatch.setattr(kg, "_median_us", lambda kernels, *a: (1.0,) + (2.0,) * (len(kernels) - 1))
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    out = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)
    with kf.graph_warmup():
        assert not kg.gemv(x, w, out, False)
    assert kg.DECISIONS[-1].chosen == "cublas"


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_real_timing_picks_a_kernel_whose_result_is_right(monkeypatch, m):
    monkeypatch.setattr(kg, "_choices", {})
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    x = torch.randn(m, 4096, device="cuda").bfloat16()
    w = torch.randn(12288, 4096, device="cuda").bfloat16() / 64
    out = torch.empty(m, 12288, device="cuda", dtype=torch.bfloat16)
    with kf.graph_warmup():
        used = kg.gemv(x, w, out, False)
    if not used:
        torch.mm(x, w.t(), out=out)
    _exact_check(out, x.double() @ w.double().T)
    d = kg.DECISIONS[-1]
    assert all(t > 0 for _, t in d.times_us) and used == (d.chosen != "cublas")
    assert d.time_us(d.chosen) == min(t for _, t in d.times_us)


@gpu
@needs_cuda
def test_a_decode_shaped_linear_layer_under_cuda_graphs_equals_eager(monkeypatch):
    monkeypatch.setattr(kg, "_choices", {})
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    mesh = spmd.Mesh.create(("tp",), devices="cuda:1")
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(4096, 4096, device="cuda", generator=g).bfloat16() / 64
    h = torch.randn(1, 4096, device="cuda", generator=g).bfloat16()
    f = spmd.jit(lambda h, x, w: h + F.linear(x, w), mesh=mesh, in_shardings=(P(), P(), P()), out_shardings=P())
    for _ in range(3):  # warm-up, capture, replay
        x = torch.randn(1, 4096, device="cuda", generator=g).bfloat16()
        got = f(h, x, w).to_torch().cpu()
        exact = (h.double() + x.double() @ w.double().T).cpu()
        assert (got.double() - exact).abs().max().item() <= exact.abs().max().item() * 2 ** -7
