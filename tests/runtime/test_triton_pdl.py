"""Programmatic dependent launch of spmd's Triton kernels (``spmd.runtime.triton_pdl``): when it is
used, how much each program prefetches, and, on a Hopper GPU, that a chain of PDL kernels in
which every kernel reads what the one before wrote gives bit-equal results with and without PDL,
eagerly and as CUDA-graph replays."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from spmd.runtime import triton_pdl  # noqa: E402

gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                  reason="needs a CUDA GPU of compute capability 9.0 or later")


def test_no_prefetch_by_default():
    assert triton_pdl.prefetch_lines(1, 1, 8192) == 0


def test_prefetch_lines_share_the_budget_and_stay_inside_the_row(monkeypatch):
    monkeypatch.setattr(triton_pdl, "PREFETCH_BUDGET_BYTES", 8 * 2**20)
    budget_lines = triton_pdl.PREFETCH_BUDGET_BYTES // triton_pdl.LINE_BYTES
    assert triton_pdl.prefetch_lines(1, 1, 8192) == 64  # the whole 8 KiB row
    assert triton_pdl.prefetch_lines(1, 1, 200) == 1  # only whole lines inside the row
    assert triton_pdl.prefetch_lines(768, 16, 8192) == 4  # 8 MiB over 12288 rows: 5.3 -> 4 lines
    assert triton_pdl.prefetch_lines(budget_lines, 2, 8192) == 0
    for programs, rows in [(1, 1), (3, 5), (256, 16), (4096, 64)]:
        lines = triton_pdl.prefetch_lines(programs, rows, 1 << 20)
        assert lines == 0 or (lines & (lines - 1) == 0 and programs * rows * lines <= budget_lines)


def test_pdl_by_default_only_over_one_row_and_never_on_cpu(monkeypatch):
    monkeypatch.delenv("SPMD_PDL", raising=False)
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (9, 0)
    assert triton_pdl.enabled(torch.device("cuda", 0), 1) is (hopper and triton_pdl.gdc_wait is not None)
    assert not triton_pdl.enabled(torch.device("cuda", 0), 8)
    assert not triton_pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("SPMD_PDL", "0")
    assert not triton_pdl.enabled(torch.device("cuda", 0), 1)
    monkeypatch.setenv("SPMD_PDL", "1")
    assert triton_pdl.enabled(torch.device("cuda", 0), 8) is (hopper and triton_pdl.gdc_wait is not None)
    assert not triton_pdl.enabled(torch.device("cpu"), 1)
    with triton_pdl.disabled():
        assert not triton_pdl.enabled(torch.device("cuda", 0), 1)


def test_a_bad_spmd_pdl_names_the_variable(monkeypatch):
    monkeypatch.setenv("SPMD_PDL", "yes")
    with pytest.raises(ValueError, match=r"SPMD_PDL: expected one of \('auto', '0', '1'\), got 'yes'"):
        triton_pdl.enabled(torch.device("cpu"))


def _chain(x, weights, norm_weight, up, q, k, v, mask):
    """Kernels that each read the previous one's result: a norm-prologue product, products that
    accumulate into their input, a SwiGLU product and split-KV attention on top."""
    from spmd.runtime import triton_decode_attention, triton_skinny

    rows, hidden = x.shape
    launch = triton_skinny.launch_row if rows == 1 else triton_skinny.launch
    h = torch.empty(rows, weights[0].shape[0], dtype=x.dtype, device=x.device)
    launch(x, weights[0], h, accumulate=False, block_n=32, block_k=128, num_warps=4, num_stages=3,
           prologue=triton_skinny.PROLOGUE_RMS_NORM, g=norm_weight, eps=1e-5, divisor=float(hidden))
    other = torch.ones_like(h)
    for w in weights[1:]:  # other += h @ w.T, then the roles swap (a kernel never reads what it writes)
        launch(h, w, other, accumulate=True, block_n=16, block_k=256, num_warps=4, num_stages=3)
        h, other = other, h
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    launch(h, weights[0].t().contiguous()[:, : h.shape[1]].contiguous(), out, accumulate=False, block_n=64,
           block_k=64, num_warps=4, num_stages=3, prologue=triton_skinny.PROLOGUE_SWIGLU, g=up)
    attn = triton_decode_attention.attention(q + out[:1, : q.shape[-1]].view(1, 1, 1, -1), k, v, mask, None)
    return out, attn


@gpu
@needs_hopper
@pytest.mark.parametrize("rows", [1, 8])
def test_a_chain_of_pdl_kernels_equals_the_same_chain_without_pdl(rows, monkeypatch):
    monkeypatch.setenv("SPMD_PDL", "1")
    g = torch.Generator(device="cuda").manual_seed(rows)
    dt = torch.bfloat16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dt)

    hidden, inner = 1024, 1536
    x, norm_weight, up = rand(rows, hidden), rand(hidden), rand(rows, inner)
    weights = [rand(inner, hidden, scale=0.03)] + [rand(inner, inner, scale=0.02) for _ in range(3)]
    q, k, v = rand(rows, 8, 1, 128), rand(rows, 2, 300, 128), rand(rows, 2, 300, 128)
    mask = torch.arange(300, device="cuda").view(1, 1, 1, -1) < 250
    args = (x, weights, norm_weight, up, q, k, v, mask)
    assert triton_pdl.enabled(x.device)
    with triton_pdl.disabled():
        want = _chain(*args)
    got = _chain(*args)  # eager, with PDL
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    _chain(*args)  # compile outside the capture
    with torch.cuda.graph(graph):
        captured = _chain(*args)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
