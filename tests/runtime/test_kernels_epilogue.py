"""A product and its activation as cuBLAS plus the activation or one generated GEMM with the activation
in its epilogue, chosen by timing (``spmd.runtime.kernels_epilogue``): eligibility and reports on any
machine; on CUDA, the generated candidate against float64, the cached choice, and a linear layer with
GELU through ``spmd.jit`` with CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import metrics
from spmd.runtime import fusions
from spmd.runtime import kernels_epilogue as ke
from spmd.runtime import kernels_fusion as kf

P = spmd.PartitionSpec
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_addmm = fusions.make_addmm(False, True)


def _gelu_linear(ops, out):
    """The pair of a BERT intermediate layer: addmm ``b + x @ w.T`` (rounded), then the exact GELU."""
    r = F.gelu(_addmm(ops, None))
    return r if out is None else out.copy_(r)


def test_a_decision_reports_every_candidate():
    d = ke.Decision("linear+gelu", ((16384, 1536), (16384, 384), (1536, 384)), "torch.bfloat16",
                    (("cublas+act", 61.25), ("triton-epilogue", 30.5)), "triton-epilogue", 12.34)
    assert d.time_us("cublas+act") == 61.25 and d.time_us("other") != d.time_us("other")  # nan when not timed
    assert d.summary() == ("epilogue linear+gelu [16384x1536 16384x384 1536x384] torch.bfloat16: triton-epilogue "
                           "(cublas+act 61.2, triton-epilogue 30.5 us; generated candidate built in 12.3 s)")


def test_choice_variable_is_checked(monkeypatch):
    monkeypatch.setenv(ke.CHOICE_ENV, "sometimes")
    with pytest.raises(ValueError, match=ke.CHOICE_ENV):
        ke.choice_mode()
    monkeypatch.setenv(ke.CHOICE_ENV, "off")
    assert ke.choice_mode() == "off"


def test_autotune_options_name_only_config_this_torch_has():
    import torch._inductor.config as config

    opts = ke.autotune_options()
    assert opts["max_autotune_gemm"] is True and opts["max_autotune_gemm_backends"] == "TRITON"
    assert all(hasattr(config, k) for k in opts)


def _never(*args, **kwargs):
    raise AssertionError("no candidate may be built or timed here")


@pytest.mark.parametrize("flops", [ke.MIN_FLOPS - 2, 2**40])
def test_cpu_operands_and_small_products_run_the_pair(monkeypatch, flops):
    """On CPU (and for any product under ``MIN_FLOPS``) the fused op is the pair: bit-equal to the
    addmm then the GELU, nothing compiled."""
    monkeypatch.setattr(ke, "_choose", _never)
    kernel = ke.make_kernel(_gelu_linear, _gelu_linear, ("test",), flops, torch.bfloat16, "t")
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 16, generator=g).bfloat16(), torch.randn(24, 16, generator=g).bfloat16()
    b = torch.randn(24, generator=g).bfloat16().expand(5, 24)
    want = F.gelu(torch.addmm(b[0], x, w.t()))
    assert torch.equal(kernel([b, x, w], None), want)
    out = torch.empty(5, 24, dtype=torch.bfloat16)
    assert kernel([b, x, w], out) is out and torch.equal(out, want)


def _cpu_stand_ins(monkeypatch, times, broken: bool = False):
    """CPU stand-ins for the CUDA-only steps of a choice: the traced pair without Inductor as the
    generated candidate (or one that computes something else), fixed timings, no device sync."""
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(ke, "_choices", {})
    monkeypatch.setattr(ke, "_eligible", lambda ops: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(ke, "_median_us", lambda kernels, ops: times)

    def generated(traceable, ops):
        gm = make_fx(lambda *args: traceable(list(args), None))(*ops)
        return (lambda ops: gm(*ops) * 2) if broken else (lambda ops: gm(*ops))
    monkeypatch.setattr(ke, "_inductor", generated)


def _cpu_ops(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(24, generator=g).expand(5, 24), torch.randn(5, 16, generator=g),
            torch.randn(24, 16, generator=g)]


@pytest.mark.parametrize("times, chosen", [((5.0, 3.0), "triton-epilogue"), ((3.0, 5.0), "cublas+act")])
def test_a_choice_keeps_the_faster_candidate_and_is_reused(monkeypatch, times, chosen):
    _cpu_stand_ins(monkeypatch, times)
    kernel = ke.make_kernel(_gelu_linear, _gelu_linear, ("cpu", times), 2**30, torch.float32, "linear+gelu")
    ops = _cpu_ops(2)
    before, counters = len(ke.DECISIONS), dict(metrics.snapshot()["counters"])
    for _ in range(2):
        torch.testing.assert_close(kernel(ops, None), _gelu_linear(ops, None))
    assert len(ke.DECISIONS) == before + 1
    d = ke.DECISIONS[-1]
    assert d.chosen == chosen and d.times_us == (("cublas+act", times[0]), ("triton-epilogue", times[1]))
    key = "epilogue.generated" if chosen == "triton-epilogue" else "epilogue.pair"
    assert metrics.snapshot()["counters"][key] == counters.get(key, 0) + 1


def test_a_wrong_generated_candidate_is_dropped(monkeypatch):
    _cpu_stand_ins(monkeypatch, (5.0, 1.0), broken=True)
    kernel = ke.make_kernel(_gelu_linear, _gelu_linear, ("cpu-broken",), 2**30, torch.float32, "linear+gelu")
    ops = _cpu_ops(3)
    assert torch.equal(kernel(ops, None), _gelu_linear(ops, None))
    d = ke.DECISIONS[-1]
    assert d.chosen == "cublas+act" and [n for n, _ in d.times_us] == ["cublas+act"]


def _inputs(m: int, k: int, n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype)
    exact = F.gelu(x.double() @ w.double().T + b.double())
    return [b.expand(m, n), x, w], exact


def _exact_check(got, exact, dtype, label=""):
    bound = exact.abs().max().item() * (2 ** -7 if dtype != torch.float32 else 1e-4)
    err = (got.double() - exact).abs().max().item()
    assert err <= bound, (label, err, bound)


@gpu
@pytest.mark.slow  # autotunes Triton GEMM templates: 10-50 s per shape on an H200
@needs_cuda
@pytest.mark.parametrize("dtype, m, k, n", [
    (torch.bfloat16, 16384, 384, 1536), (torch.bfloat16, 1000, 384, 1030), (torch.bfloat16, 77, 520, 136),
    (torch.float16, 1000, 384, 1030), (torch.float32, 77, 520, 136)], ids=str)
def test_generated_candidate_is_within_a_rounding_of_the_exact_value(dtype, m, k, n):
    """Inductor's Triton GEMM with the bias and the GELU in its epilogue, also where no dim is a
    multiple of its blocks, against float64 (each case autotunes one GEMM: seconds each)."""
    ops, exact = _inputs(m, k, n, dtype, m + n)
    with torch.no_grad():
        fused = ke._inductor(_gelu_linear, ops)
        got = fused(ops)
    assert got.dtype == dtype and got.shape == (m, n)
    _exact_check(got, exact, dtype)
    _exact_check(_gelu_linear(ops, None), exact, dtype, "pair")


@gpu
@pytest.mark.slow  # autotunes Triton GEMM templates: 10-50 s per shape on an H200
@needs_cuda
@pytest.mark.parametrize("fused_fastest", [True, False])
def test_the_fastest_candidate_is_used_and_cached(monkeypatch, fused_fastest):
    """Timing made to pick one candidate: the result is right, one decision is recorded, the choice
    is reused by the next call, and a call inside a capture before any decision runs the pair."""
    monkeypatch.setattr(ke, "_choices", {})
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    monkeypatch.setenv(ke.CHOICE_ENV, "auto")
    monkeypatch.setattr(ke, "_median_us", lambda kernels, ops: (2.0, 1.0) if fused_fastest else (1.0, 2.0))
    built = []
    real_inductor = ke._inductor
    monkeypatch.setattr(ke, "_inductor", lambda *a: built.append(1) or real_inductor(*a))
    ops, exact = _inputs(2048, 384, 1536, torch.bfloat16, 3)
    kernel = ke.make_kernel(_gelu_linear, _gelu_linear, ("test", fused_fastest), 2 * 2048 * 384 * 1536,
                            torch.bfloat16, "linear+gelu")
    before = len(ke.DECISIONS)
    for _ in range(2):
        with kf.graph_warmup():
            got = kernel(ops, None)
        _exact_check(got, exact, torch.bfloat16)
    assert len(ke.DECISIONS) == before + 1 and len(built) == 1
    d = ke.DECISIONS[-1]
    assert d.chosen == ("triton-epilogue" if fused_fastest else "cublas+act")
    assert d.shapes == ((2048, 1536), (2048, 384), (1536, 384))
    out = torch.empty(2048, 1536, device="cuda", dtype=torch.bfloat16)
    with kf.graph_warmup():
        assert kernel(ops, out) is out
    _exact_check(out, exact, torch.bfloat16)


@gpu
@needs_cuda
def test_the_pair_runs_where_fusions_run_op_by_op(monkeypatch):
    """Outside graph warm-up and capture (``auto``), with ``SPMD_EPILOGUE_CHOICE=off`` and by default: no choice."""
    monkeypatch.setattr(ke, "_choices", {})
    monkeypatch.setenv(ke.CHOICE_ENV, "auto")
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    monkeypatch.setattr(ke, "_choose", _never)
    ops, exact = _inputs(2048, 384, 1536, torch.bfloat16, 4)
    kernel = ke.make_kernel(_gelu_linear, _gelu_linear, ("off",), 2**40, torch.bfloat16, "t")
    _exact_check(kernel(ops, None), exact, torch.bfloat16)
    for default_or_off in (None, "off"):
        if default_or_off is None:
            monkeypatch.delenv(ke.CHOICE_ENV)
        else:
            monkeypatch.setenv(ke.CHOICE_ENV, default_or_off)
        with kf.graph_warmup():
            _exact_check(kernel(ops, None), exact, torch.bfloat16)


@gpu
@pytest.mark.slow  # autotunes Triton GEMM templates: 10-50 s per shape on an H200
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_linear_layer_with_gelu_under_cuda_graphs_equals_eager(monkeypatch, dtype):
    """Real timing: a decision is recorded for the fused product, its times are positive, and the
    chosen kernel's result (warm-up, capture, replays) equals float64 eager."""
    monkeypatch.setattr(ke, "_choices", {})
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    monkeypatch.setenv(ke.CHOICE_ENV, "auto")
    mesh = spmd.Mesh.create(("tp",), devices="cuda:1")
    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(1536, 384, device="cuda", generator=g) / 20).to(dtype)
    b = torch.randn(1536, device="cuda", generator=g).to(dtype)
    f = spmd.jit(lambda x, w, b: F.gelu(F.linear(x, w, b)), mesh=mesh, in_shardings=(P(), P(), P()),
                 out_shardings=P())
    before = len(ke.DECISIONS)
    for _ in range(4):  # warm-up, capture, replays
        x = torch.randn(16, 128, 384, device="cuda", generator=g).to(dtype)
        got = f(x, w, b).to_torch()
        _exact_check(got, F.gelu(x.double() @ w.double().T + b.double()), dtype)
    assert len(ke.DECISIONS) == before + 1
    d = ke.DECISIONS[-1]
    assert (16, 128, 384) in d.shapes and (1536, 384) in d.shapes  # the product's operands
    if d.chosen == "triton-epilogue":
        assert d.time_us("triton-epilogue") <= d.time_us("cublas+act")
    assert all(t > 0 for _, t in d.times_us if t == t)
