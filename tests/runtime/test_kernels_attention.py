"""Attention backend chosen per key by timing (``spmd.runtime.kernels_attention``).

On CPU: the selection logic with fake candidates and an injected timer (fastest kept, raising,
disagreeing and untimeable candidates skipped, PyTorch's pick kept within the margin), the
cache per key, no timing inside a capture, the ``SPMD_ATTENTION_CHOICE`` modes, the global
flags restored, and plain CPU calls unchanged. On CUDA: MiniLM-shaped attention with a padding
mask (bf16, float32) and a causal case through ``spmd.jit`` against float64, with real timing.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import metrics
from spmd.ir.custom_calls import CUSTOM_CALLS
from spmd.runtime import kernels_attention as ka

P = spmd.PartitionSpec
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(b=2, h=3, sq=5, sk=7, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=dtype) for s in (sq, sk, sk))
    mask = torch.rand(b, 1, 1, sk, generator=g) > 0.3
    mask[..., 0] = True  # every row attends somewhere
    return q, k, v, mask


def _flags() -> tuple[bool, ...]:
    return tuple(on() for on in ka._ENABLED.values())


def _count(name: str) -> int:
    return metrics.snapshot()["counters"].get(name, 0)


# --------------------------------------------------------------------------- selection logic
def _fake(outputs: dict, ref: torch.Tensor, times: dict):
    ran, timed = [], []

    def run(name):
        ran.append(name)
        out = outputs[name]
        if isinstance(out, Exception):
            raise out
        return out

    def time_us(calls):
        names = [c.args[0] for c in calls]
        timed.append(names)
        return [times[n] for n in names]

    return run, (lambda: ref), time_us, ran, timed


def test_the_fastest_agreeing_candidate_is_chosen():
    ref = torch.randn(2, 3, 4, 5)
    outputs = {"cudnn": ref.clone(), "flash": ref + 1e-4, "efficient": ref.clone(), "math": ref.clone()}
    run, reference, time_us, _, timed = _fake(outputs, ref, {"cudnn": 9.0, "flash": 4.0, "efficient": 6.0,
                                                             "math": 30.0})
    chosen, times, skipped = ka.choose(list(outputs), run, reference, time_us, 1e-2, default="cudnn")
    assert chosen == "flash" and skipped == ()
    assert dict(times) == {"cudnn": 9.0, "flash": 4.0, "efficient": 6.0, "math": 30.0}
    assert timed == [["cudnn", "flash", "efficient", "math"]]  # one interleaved timing of all


def test_raising_disagreeing_and_untimeable_candidates_are_skipped():
    ref = torch.randn(2, 3, 4, 5)
    bad = ref.clone()
    bad[0, 0, 0, 0] += 1.0
    nan = ref.clone()
    nan[1, 2, 3, 4] = math.nan
    outputs = {"cudnn": RuntimeError("No available kernel"), "flash": bad, "efficient": nan, "math": ref.clone(),
               "other": ref.clone()}
    run, reference, time_us, _, timed = _fake(outputs, ref, {"math": 5.0, "other": None})
    chosen, times, skipped = ka.choose(list(outputs), run, reference, time_us, 1e-2)
    assert chosen == "math" and times == (("math", 5.0),)
    reasons = dict(skipped)
    assert reasons["cudnn"] == "raises RuntimeError" and reasons["other"] == "not timed"
    assert reasons["flash"].startswith("disagrees by 0.9") and reasons["efficient"] == "disagrees by inf"
    assert timed == [["math", "other"]]  # the skipped ones are never timed


def test_nothing_timed_leaves_no_choice():
    ref = torch.randn(3, 4)
    run, reference, time_us, _, timed = _fake({"flash": RuntimeError("no")}, ref, {})
    assert ka.choose(["flash"], run, reference, time_us, 1e-2) == (None, (), (("flash", "raises RuntimeError"),))
    assert timed == []


def test_the_default_is_kept_unless_clearly_beaten():
    ref = torch.randn(3, 4)
    outputs = {"cudnn": ref, "efficient": ref}
    close = {"cudnn": 10.0, "efficient": 10.0 * (1 - ka.KEEP_DEFAULT_MARGIN) + 0.01}
    run, reference, time_us, _, _ = _fake(outputs, ref, close)
    assert ka.choose(list(outputs), run, reference, time_us, 1e-2, default="cudnn")[0] == "cudnn"
    run, reference, time_us, _, _ = _fake(outputs, ref, {"cudnn": 10.0, "efficient": 9.0})
    assert ka.choose(list(outputs), run, reference, time_us, 1e-2, default="cudnn")[0] == "efficient"


def test_a_float32_kernel_computing_in_tf32_is_never_chosen():
    """float32 attention through TF32 products (10-bit mantissas: ~1e-3 relative) disagrees with
    the float32 reference beyond ``TOLERANCE[float32]``; 3xTF32 (~1e-6) agrees."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 3, 16, 8, generator=g, dtype=torch.float64)
    tf32 = ref * (1 + 2.0 ** -11 * torch.randn(ref.shape, generator=g, dtype=torch.float64).sign())
    x3 = ref * (1 + 2.0 ** -21 * torch.randn(ref.shape, generator=g, dtype=torch.float64).sign())
    outputs = {"short-seq:64x4": tf32.float(), "short-seq:32x4": x3.float(), "efficient": ref.float()}
    run, reference, time_us, _, _ = _fake(outputs, ref.float(), {"short-seq:64x4": 1.0, "short-seq:32x4": 2.0,
                                                                   "efficient": 3.0})
    chosen, _, skipped = ka.choose(list(outputs), run, reference, time_us, ka.TOLERANCE[torch.float32],
                                   default="efficient")
    assert chosen == "short-seq:32x4" and [n for n, _ in skipped] == ["short-seq:64x4"]


def test_the_reference_may_cover_only_the_first_rows():
    ref = torch.randn(1, 3, 4)
    good = torch.cat([ref, torch.randn(2, 3, 4)])  # rows past the reference are not compared
    assert ka._disagreement(good, ref, 1e-3) is None
    assert ka._disagreement(good[:, :2], ref, 1e-3) == math.inf  # another shape
    ref_nan = ref.clone()
    ref_nan[0, 0] = math.nan  # a fully masked row: undefined, not compared
    odd = ref.clone()
    odd[0, 0] = 0.0
    assert ka._disagreement(odd, ref_nan, 1e-3) is None


def test_the_float32_reference_slices_the_batch_and_the_mask(monkeypatch):
    q, k, v, mask = _inputs(b=4)
    monkeypatch.setattr(ka, "_REFERENCE_MAX_BYTES", ka._score_bytes(q[:2], k))
    ref = ka._reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, False, None)
    assert ref.shape == (2, 3, 5, 8) and ref.dtype == torch.float32
    want = F.scaled_dot_product_attention(*(t[:2].bfloat16().double() for t in (q, k, v)), attn_mask=mask[:2])
    torch.testing.assert_close(ref.double(), want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- sdpa on CPU
def test_cpu_calls_are_unchanged_and_decide_nothing():
    q, k, v, mask = _inputs()
    before = len(ka.DECISIONS)
    got = ka.sdpa(q, k, v, mask, False, 0.3)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3))
    assert len(ka.DECISIONS) == before


@pytest.fixture
def timed_on_cpu(monkeypatch):
    """Let CPU tensors take the timed path, with a fake timer that makes math the fastest."""
    monkeypatch.setattr(ka, "_choices", {})
    monkeypatch.delenv(ka.CHOICE_ENV, raising=False)
    monkeypatch.setattr(ka, "_on_gpu", lambda q: True)
    calls = []

    def median_us(fns, device):
        calls.append([f.args[0] for f in fns])
        return [1.0 if f.args[0] == "math" else 2.0 for f in fns]

    monkeypatch.setattr(ka, "_median_us", median_us)
    return calls


def test_a_choice_is_timed_once_per_key_and_run_under_its_flags(timed_on_cpu):
    q, k, v, mask = _inputs()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    before = len(ka.DECISIONS)
    for _ in range(3):
        torch.testing.assert_close(ka.sdpa(q, k, v, mask, False, None), want)
    assert timed_on_cpu == [["flash", "math"]]  # cudnn and efficient raise on CPU
    assert len(ka.DECISIONS) == before + 1
    d = ka.DECISIONS[-1]
    assert (d.chosen, d.default, d.mask_shape, d.dtype) == ("math", "flash", (2, 1, 1, 7), "float32")
    assert {n for n, _ in d.skipped} == {"cudnn", "efficient"} and "chosen math" in d.line()
    assert list(ka._choices.values()) == ["math"] and all(_flags())  # flags restored after every call
    ka.sdpa(q[:1], k[:1], v[:1], mask[:1], False, None)  # another shape: another key
    ka.sdpa(q, k, v, None, True, None)  # causal: another key
    assert len(timed_on_cpu) == 3 and len(ka._choices) == 3


def test_no_timing_inside_a_capture(timed_on_cpu, monkeypatch):
    q, k, v, mask = _inputs()
    monkeypatch.setattr(ka, "_capturing", lambda: True)
    before = _count("attention.capture_default")
    got = ka.sdpa(q, k, v, mask, False, None)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert timed_on_cpu == [] and ka._choices == {} and _count("attention.capture_default") == before + 1
    monkeypatch.setattr(ka, "_capturing", lambda: False)
    ka.sdpa(q, k, v, mask, False, None)  # the next call outside a capture decides
    assert len(timed_on_cpu) == 1 and len(ka._choices) == 1


def test_the_default_pick_winning_runs_without_flags(timed_on_cpu, monkeypatch):
    monkeypatch.setattr(ka, "_median_us", lambda fns, device: [1.0 if f.args[0] == "flash" else 2.0 for f in fns])
    q, k, v, mask = _inputs()
    ka.sdpa(q, k, v, mask, False, None)
    assert list(ka._choices.values()) == [None] and ka.DECISIONS[-1].chosen == "flash"
    forced, run_backend = [], ka.run_backend
    monkeypatch.setattr(ka, "run_backend", lambda *a: forced.append(a[0]) or run_backend(*a))
    got = ka.sdpa(q, k, v, mask, False, None)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask)) and forced == []


def test_inputs_needing_gradients_traces_and_other_ranks_are_not_timed(timed_on_cpu):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, mask = _inputs()
    out = ka.sdpa(q.requires_grad_(), k, v, mask, False, None)
    assert out.requires_grad
    ka.sdpa(q[0].detach(), k[0], v[0], mask[0], False, None)  # 3-d
    plain = [t.detach() for t in (q, k, v)]
    with FakeTensorMode() as fake:
        fq, fk, fv = (fake.from_tensor(t) for t in plain)
        assert ka.sdpa(fq, fk, fv, None, True, None).shape == (2, 3, 5, 8)
    assert timed_on_cpu == [] and ka._choices == {}


def test_a_user_disabled_backend_is_no_candidate(timed_on_cpu):
    q, k, v, mask = _inputs()
    torch.backends.cuda.enable_math_sdp(False)
    try:
        ka.sdpa(q, k, v, mask, False, None)
    finally:
        torch.backends.cuda.enable_math_sdp(True)
    assert timed_on_cpu == [["flash"]]


def test_the_attention_custom_call_goes_through_the_choice(timed_on_cpu):
    q, k, v, mask = _inputs(b=6)
    q3, k3, v3 = (t.reshape(2, 3, 3, *t.shape[2:]) for t in (q, k, v))
    bias = torch.where(mask, 0.0, -math.inf).reshape(2, 3, 1, 1, 7)
    got = CUSTOM_CALLS["attention"].fn([q3, k3, v3, bias], {"has_mask": True, "scale": 0.25})
    want = F.scaled_dot_product_attention(q3, k3, v3, attn_mask=bias, scale=0.25)
    torch.testing.assert_close(got, want)
    assert len(timed_on_cpu) == 1 and ka.DECISIONS[-1].q_shape == (6, 3, 5, 8)


@pytest.mark.parametrize("mode", ["default", "math"])
def test_the_environment_variable_turns_timing_off(timed_on_cpu, monkeypatch, mode):
    monkeypatch.setenv(ka.CHOICE_ENV, mode)
    q, k, v, mask = _inputs()
    torch.testing.assert_close(ka.sdpa(q, k, v, mask, False, None),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert timed_on_cpu == [] and ka._choices == {}


def test_an_override_holds_for_its_thread_only(timed_on_cpu, monkeypatch):
    monkeypatch.setenv(ka.CHOICE_ENV, "fastest")  # the override wins over the variable
    q, k, v, mask = _inputs()
    with ka.override_mode("default"):
        ka.sdpa(q, k, v, mask, False, None)
        assert ka.choice_mode() == "default"
    assert timed_on_cpu == [] and ka._choices == {}
    monkeypatch.delenv(ka.CHOICE_ENV)
    assert ka.choice_mode() == "auto"
    with pytest.raises(ValueError, match="'fast'"), ka.override_mode("fast"):
        pass


def test_a_forced_backend_without_a_kernel_falls_back_to_the_default(timed_on_cpu, monkeypatch):
    monkeypatch.setenv(ka.CHOICE_ENV, "efficient")  # no memory-efficient kernel on CPU
    q, k, v, mask = _inputs()
    before = _count("attention.forced_unavailable")
    got = ka.sdpa(q, k, v, mask, False, None)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert _count("attention.forced_unavailable") == before + 1 and all(_flags())


def test_an_unknown_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv(ka.CHOICE_ENV, "fastest")
    ka.sdpa(*_inputs(), False, None)  # CPU calls never read it
    monkeypatch.setattr(ka, "_on_gpu", lambda q: True)
    with pytest.raises(ValueError, match="SPMD_ATTENTION_CHOICE.*'fastest'"):
        ka.sdpa(*_inputs(), False, None)



@pytest.mark.parametrize("mode", ["short-seq", "split-kv", "default"])
def test_the_kernel_modes_are_accepted(monkeypatch, mode):
    monkeypatch.setenv(ka.CHOICE_ENV, mode)
    assert ka.choice_mode() == mode


@pytest.mark.parametrize("mode", ["short-seq:64x4", "SHORT-SEQ", " auto"])
def test_a_candidate_name_is_not_a_mode(monkeypatch, mode):
    # candidate names of the timed choice carry a configuration; the variable takes kernels only
    monkeypatch.setenv(ka.CHOICE_ENV, mode)
    expected = r"SPMD_ATTENTION_CHOICE: expected one of \(.*'short-seq'\), got "
    with pytest.raises(ValueError, match=expected + re.escape(repr(mode))):
        ka.choice_mode()


# --------------------------------------------------------------------------- CUDA
def _relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double().cpu() - exact.cpu()).abs().max() / exact.abs().max()).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype, batch, causal", [(torch.bfloat16, 8, False), (torch.float32, 8, False),
                                                  (torch.bfloat16, 4, True)])
def test_minilm_shaped_attention_through_jit_equals_float64(monkeypatch, dtype, batch, causal):
    """12 heads of 32 over 128 tokens (MiniLM), a key-padding mask or causal; real timing."""
    monkeypatch.setattr(ka, "_choices", {})
    monkeypatch.delenv(ka.CHOICE_ENV, raising=False)
    mesh = spmd.Mesh.create(("tp",), devices="cuda:1")
    g = torch.Generator(device="cuda").manual_seed(batch)
    q, k, v = (torch.randn(batch, 128, 12, 32, device="cuda", generator=g).to(dtype).transpose(1, 2).contiguous()
               for _ in range(3))
    keep = torch.arange(128, device="cuda")[None, :] < torch.tensor([128, 100, 77, 5] * 2, device="cuda")[:batch, None]
    mask = keep[:, None, None, :]
    if causal:
        f = spmd.jit(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), mesh=mesh,
                     in_shardings=(P(),) * 3, out_shardings=P())
        args, exact = (q, k, v), F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    else:
        f = spmd.jit(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), mesh=mesh,
                     in_shardings=(P(),) * 4, out_shardings=P())
        args = (q, k, v, mask)
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    before = len(ka.DECISIONS)
    for _ in range(3):  # warm-up (timed), capture, replay
        got = f(*args).to_torch()
        assert _relative_error(got, exact) <= (2e-2 if dtype == torch.bfloat16 else 1e-3)
    assert len(ka.DECISIONS) == before + 1
    d = ka.DECISIONS[-1]
    assert d.chosen is not None and d.times_us and all(t > 0 for _, t in d.times_us), d.line()
    assert d.q_shape == (batch, 12, 128, 32) and all(_flags())


@pytest.mark.parametrize("name", ka.TRITON_KERNELS)
def test_spmd_triton_kernels_are_modes_and_never_run_on_cpu(monkeypatch, name):
    monkeypatch.setenv(ka.CHOICE_ENV, name)
    assert ka.choice_mode() == name
    q, k = torch.randn(1, 4, 1, 16).half(), torch.randn(1, 4, 9, 16).half()
    assert not ka._triton_eligible(name, q, k, k, None, False)
    with pytest.raises(RuntimeError, match=name):
        ka.run_backend(name, q, k, k, None, False, None)
