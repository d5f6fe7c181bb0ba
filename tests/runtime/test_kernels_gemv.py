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


@gpu
@needs_cuda
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("k, n", [(4096, 4096), (11008, 4096)])
def test_the_generated_matrix_vector_product_rounds_once(monkeypatch, accumulate, k, n):
    """Timing made to pick the generated kernel: its value (plus ``out`` when accumulating) is within
    a bf16 rounding of the exact product; the choice is timed once and cached."""
    monkeypatch.setattr(kg, "_choices", {})
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    monkeypatch.setattr(kg, "_median_us", lambda kernels, *a: (1.0, 2.0))
    g = torch.Generator(device="cuda").manual_seed(k + n)
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16() / k ** 0.5
    c = torch.randn(1, n, device="cuda", generator=g).bfloat16()
    exact = x.double() @ w.double().T + (c.double() if accumulate else 0)
    before = len(kg.DECISIONS)
    for _ in range(2):
        out = c.clone()
        with kf.graph_warmup():
            assert kg.gemv(x, w, out, accumulate)
        err = (out.double() - exact).abs().max().item()
        assert err <= exact.abs().max().item() * 2 ** -7, err
    assert len(kg.DECISIONS) == before + 1 and kg.DECISIONS[-1].weight_shape == (n, k)


@gpu
@needs_cuda
def test_cublas_keeps_the_product_where_it_is_timed_faster(monkeypatch):
    monkeypatch.setattr(kg, "_choices", {})
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    monkeypatch.setattr(kg, "_median_us", lambda kernels, *a: (2.0, 1.0))
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    out = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)
    with kf.graph_warmup():
        assert not kg.gemv(x, w, out, False)


@gpu
@needs_cuda
def test_real_timing_picks_a_kernel_whose_result_is_right(monkeypatch):
    monkeypatch.setattr(kg, "_choices", {})
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    w = torch.randn(12288, 4096, device="cuda").bfloat16() / 64
    out = torch.empty(1, 12288, device="cuda", dtype=torch.bfloat16)
    with kf.graph_warmup():
        used = kg.gemv(x, w, out, False)
    if not used:
        torch.mm(x, w.t(), out=out)
    exact = x.double() @ w.double().T
    assert (out.double() - exact).abs().max().item() <= exact.abs().max().item() * 2 ** -7
    d = kg.DECISIONS[-1]
    assert d.generated_us > 0 and d.cublas_us > 0 and used == (d.generated_us < d.cublas_us)


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
