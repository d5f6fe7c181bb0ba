"""Differential random-program tests: generated PyTorch programs through ``spmd.jit`` on random CPU
meshes, shardings, options, donation and argument kinds, against PyTorch eager in float64.

- ``test_ci_slice``: a few dozen hypothesis-generated programs (derandomized: the same programs on
  every run); a failure is shrunk by hypothesis and reported with a standalone reproducer script.
- ``test_sweep`` (``-m slow``): ``tests.fuzz.sweep`` over SPMD_FUZZ_EXAMPLES programs (default
  10,000; SPMD_FUZZ_JOBS processes, default 1), printing the summary table; fails on any crash,
  wrong result or timeout.
- The rest checks the tester itself (tolerance, classification, replay, shrinking, reproducers).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from spmd.frontend.aten_common import UnsupportedOpError
from tests.fuzz.case import reproducer
from tests.fuzz.draw import RandomDraw, ReplayDraw
from tests.fuzz.generate import KNOWN_OPEN, ci_features, generate_case
from tests.fuzz.oracle import NOISE_ULPS, Wrong, classify_exception, compare_float, describe, run_case

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.fuzz.draw import HypothesisDraw  # noqa: E402

CI_EXAMPLES = int(os.environ.get("SPMD_FUZZ_CI_EXAMPLES", "24"))
CI_MAX_OPS = 6


@settings(max_examples=CI_EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_ci_slice(data):
    d = HypothesisDraw(data)
    case = generate_case(d, d.integer(0, 9999), features=ci_features(), max_ops=CI_MAX_OPS)
    note(reproducer(case))
    outcome = run_case(case)
    event(f"outcome: {outcome.cls}")  # pytest --hypothesis-show-statistics
    if outcome.cls not in ("match", "unsupported"):
        raise AssertionError(f"known open (excluded from this slice): {sorted(KNOWN_OPEN)}\n"
                             + describe(case, outcome))


FUSION_KINDS = frozenset({"rms_linear", "swiglu_linear", "linear_act"})


def test_fusion_slice(monkeypatch):
    """Programs of only the ``tests.fuzz.ops_fusion`` ops (seeded: the same programs every run): each
    matches float64 eager, and together they reach fusion (d) and the epilogue fusion."""
    from spmd.runtime import kernels_epilogue, kernels_prologue
    from tests.fuzz.generate import op_kinds

    built = {"prologue": 0, "epilogue": 0}

    def counting(key, make):
        def wrapper(*args, **kwargs):
            built[key] += 1
            return make(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(kernels_prologue, "make_prologue_product",
                        counting("prologue", kernels_prologue.make_prologue_product))
    monkeypatch.setattr(kernels_epilogue, "make_kernel", counting("epilogue", kernels_epilogue.make_kernel))
    exclude = frozenset(op_kinds()) - FUSION_KINDS
    for seed in range(24):
        case = generate_case(RandomDraw(f"fusion-{seed}"), seed, features=ci_features(), max_ops=3,
                             exclude_ops=exclude)
        assert set(case.ops) <= FUSION_KINDS, case.ops
        outcome = run_case(case)
        assert outcome.cls in ("match", "unsupported"), describe(case, outcome)
    assert built["prologue"] >= 3 and built["epilogue"] >= 2, built


@pytest.mark.slow
def test_sweep(tmp_path):
    from tests.fuzz.sweep import parse_args, run_jobs, summary, sweep

    n = int(os.environ.get("SPMD_FUZZ_EXAMPLES", "10000"))
    jobs = int(os.environ.get("SPMD_FUZZ_JOBS", "1"))
    argv = ["--n", str(n), "--seed", "0", "--out", str(tmp_path / "report.json"), "--jobs", str(jobs)]
    args = parse_args(argv)
    report = run_jobs(args, argv) if jobs > 1 else sweep(args)
    print(summary(report))
    assert not any(report["counts"].get(c) for c in ("crash", "wrong", "timeout", "invalid")), summary(report)


# ---------------------------------------------------------------------------- the tester itself


def _ref(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64)


def test_tolerance_passes_errors_comparable_to_eager():
    ref = _ref()
    eager = ref.to(torch.bfloat16)
    noise = (ref - eager.double())  # eager's own error
    got = (ref + 3 * noise).to(torch.bfloat16)  # three times eager's error (after rounding)
    assert compare_float(0, got, eager, ref.float(), ref) <= 1.0


def test_tolerance_fails_27x_eager_error():
    # The shape of issue 20's bf16 defect: 27x eager's error in a bf16 output.
    ref = _ref() * 0.1
    eager = ref.to(torch.bfloat16)
    err = (eager.double() - ref).abs().max()
    bad = (ref + 27 * err * torch.sign(_ref(seed=1))).to(torch.bfloat16)
    with pytest.raises(Wrong, match="error"):
        compare_float(0, bad, eager, ref.float(), ref)


def test_tolerance_float64_uses_conditioning_of_the_float32_run():
    ref = _ref()
    e32 = (ref.float() + 1e-6).double()  # a float32 run with error 1e-6 / max|ref|
    assert compare_float(0, ref + 1e-13, ref, e32, ref) <= 1.0
    with pytest.raises(Wrong):
        compare_float(0, ref + 1e-7, ref, e32, ref)


def test_nonfinite_must_match_the_reference():
    ref = torch.tensor([1.0, float("-inf"), 2.0], dtype=torch.float64)
    eager = ref.float()
    assert compare_float(0, ref.float(), eager, eager, ref) <= 1.0
    with pytest.raises(Wrong, match="non-finite"):
        compare_float(0, torch.tensor([1.0, 0.0, 2.0]), eager, eager, ref)
    with pytest.raises(Wrong, match="non-finite"):
        compare_float(0, torch.tensor([1.0, float("-inf"), float("nan")]), eager, eager, ref)


def _case(seed=3):
    return generate_case(RandomDraw(seed), seed, features=ci_features(), max_ops=4)


def test_classification_of_exceptions():
    case = _case()
    assert classify_exception(case, UnsupportedOpError("unsupported operation aten.sort.default at x")).cls \
        == "unsupported"
    try:
        [][1]
    except IndexError as e:
        out = classify_exception(case, e)
    assert out.cls == "crash" and out.signature.startswith("[") and "IndexError" in out.signature


def test_replay_rebuilds_the_same_case():
    d = RandomDraw("replay")
    case = generate_case(d, 7)
    again = generate_case(ReplayDraw(d.choices), 7)
    assert again.source() == case.source() and again == case


def test_generated_programs_run_in_eager_and_vary():
    cases = [generate_case(RandomDraw(i), i) for i in range(40)]
    kinds = {k for c in cases for k in c.ops}
    assert {"matmul", "unary", "binary", "reduce", "reshape"} <= kinds
    assert len({c.mesh_axes for c in cases}) > 4 and any(c.donate for c in cases)
    assert any(c.packed for c in cases) and any(not c.packed for c in cases)
    for c in cases:
        c.function()(*c.structure([i.make() for i in c.inputs]))  # every program runs in eager PyTorch


def test_shrink_keeps_the_failure_and_simplifies():
    from tests.fuzz.oracle import Outcome
    from tests.fuzz.shrink import shrink

    d, seed = None, 0
    for seed in range(200):  # a case with several ops, one of them a softmax
        d = RandomDraw(seed)
        case = generate_case(d, seed, max_ops=12)
        if "softmax" in case.ops and len(case.ops) >= 5:
            break
    fails = lambda c: Outcome("wrong", "softmax") if "softmax" in c.ops else Outcome("match")  # noqa: E731
    small, out = shrink(d.choices, lambda dr: generate_case(dr, seed, max_ops=12), fails, "softmax", budget_s=60)
    assert out.signature == "softmax" and "softmax" in small.ops
    assert len(small.ops) <= 2 < len(case.ops)


def test_reproducer_is_a_standalone_script(tmp_path):
    import dataclasses

    case = _case(5)
    # Weights in a dict argument and a first call from three threads: the script rebuilds both.
    case = dataclasses.replace(case, threads=3, donate=(), packed=tuple(i.name for i in case.inputs[1:]))
    assert run_case(case).cls in ("match", "unsupported")
    path = tmp_path / "repro.py"
    path.write_text(reproducer(case, "test"))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    res = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "output 0:" in res.stdout


def test_tolerance_follows_the_least_precise_dtype_an_output_passed_through():
    from tests.fuzz.case import Case, InputSpec
    from tests.fuzz.oracle import lowest_dtype

    bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
    case = Case(inputs=(InputSpec("x0", (4, 12), bf16, 1), InputSpec("x1", (3,), f64, 2)),
                body=("v0 = x0.mean(dim=(0, 1), keepdim=True)", "v1 = v0.to(F32)", "v2 = x1.to(F32)",
                      "v3 = (x1 * 2).to(F16).to(F64)"),
                outputs=("v1", "v2", "v3"), ops=(), mesh_axes=(("tp", 4),))
    assert lowest_dtype(case, "v1", f32) == bf16  # a bf16 mean cast to float32 keeps bf16's rounding
    assert lowest_dtype(case, "v2", f32) == f32
    assert lowest_dtype(case, "v3", f64) == torch.float16
    # One bf16 ulp at the scale of a float32 output passes with the bf16 floor, not without it.
    ref = torch.tensor([0.123], dtype=f64)
    got = torch.tensor([0.123 + 2 ** -11])
    with pytest.raises(Wrong):
        compare_float(0, got, ref.float(), ref.float(), ref)
    assert compare_float(0, got, ref.float(), ref.float(), ref, floor=bf16) <= 1.0


def test_tolerance_of_a_cancelling_float64_sum_scales_with_its_terms():
    """Seed 2027 #9454: a float64 sum of 128 layer-norm outputs (terms of size 1) is ~1e-15; spmd's
    order of summation gives another ~1e-15, eager's happens to equal the reference and the float32
    run cancels to 0. The perturbed float64 runs' noise (the size of float64 rounding of those
    terms) admits it; without that noise, or with a real error on top, it is wrong."""
    g = torch.Generator().manual_seed(9454)
    x = torch.nn.functional.layer_norm(torch.randn(8, 16, generator=g, dtype=torch.float64), (16,)).view(128)
    ref = x.sum(-1, keepdim=True)
    got = x.flip(0).sum(-1, keepdim=True) + 4 * torch.finfo(torch.float64).eps  # another order, a few ulps of 1
    noise = (x * (1 + 1e-15 * torch.randn(128, generator=g, dtype=torch.float64))).sum(-1, keepdim=True) - ref
    noise = noise.abs() + torch.finfo(torch.float64).eps
    e32 = torch.zeros_like(ref, dtype=torch.float32)
    assert compare_float(0, got, ref, e32, ref, noise=noise) <= 1.0
    with pytest.raises(Wrong, match="error"):
        compare_float(0, got, ref, e32, ref)
    for wrong in (ref + 1e-9, ref + 1.0, -ref + 1e-12, x[:60].sum(-1, keepdim=True)):  # deliberate errors
        with pytest.raises(Wrong, match="error"):
            compare_float(0, wrong, ref, e32, ref, noise=noise)


def test_tolerance_of_a_cancelling_float32_sum_scales_with_float32_rounding():
    """Seed 12 #2082: relu(sum of 5 float32 layer-norm outputs) is ~1e-17 in float64; eager's float32
    sum came out negative (relu: 0, exactly the reference's size) and spmd's +5e-8, float32 rounding of
    the size-1 terms. The float64 noise scaled to float32's eps admits it; real errors stay wrong."""
    g = torch.Generator().manual_seed(2082)
    x = torch.nn.functional.layer_norm(torch.randn(5, generator=g, dtype=torch.float64), (5,))
    ref = x.sum(-1, keepdim=True).relu() + 1e-17
    eager = torch.zeros(1, dtype=torch.float32)
    got = ref.float() + 5e-8
    noise = torch.full_like(ref, 2 * torch.finfo(torch.float64).eps)  # perturbed float64 runs: ulps of 1
    assert compare_float(0, got, eager, eager, ref, noise=noise) <= 1.0
    with pytest.raises(Wrong, match="error"):
        compare_float(0, got, eager, eager, ref)  # without the noise: 5e-8 against |ref| ~1e-17
    for wrong in (ref.float() + 1e-5, ref.float() + 0.1, x[:4].sum(-1, keepdim=True).float()):
        with pytest.raises(Wrong, match="error"):
            compare_float(0, wrong, eager, eager, ref, noise=noise)


def test_float64_noise_still_fails_27x_eager_error_in_bf16():
    """The noise term does not hide issue 20's defect: a well-conditioned bf16 output whose float64
    runs move by the perturbation's few ulps gets about one bf16 ulp from it, below 27x eager's error."""
    ref = _ref() * 0.1
    eager = ref.to(torch.bfloat16)
    err = (eager.double() - ref).abs().max()
    noise = ref.abs() * NOISE_ULPS * torch.finfo(torch.float64).eps
    bad = (ref + 27 * err * torch.sign(_ref(seed=1))).to(torch.bfloat16)
    with pytest.raises(Wrong, match="error"):
        compare_float(0, bad, eager, ref.float(), ref, noise=noise)
    assert compare_float(0, (ref + 3 * (eager.double() - ref)).to(torch.bfloat16), eager, ref.float(), ref,
                         noise=noise) <= 1.0


def test_reference_noise_is_rounding_sized_and_median_reference_is_eagers_right_answer():
    """``references`` on a case: the float64 noise of a well-conditioned output is a few ulps of it
    (so it loosens nothing there), and the reference of ``median`` along an expanded dim is the
    broadcast value (eager's own CPU kernel is wrong on a stride-0 dim, seed 2027 #4646)."""
    from tests.fuzz.oracle import EagerWorkarounds, references

    case = _case()
    inputs = [i.make(0) for i in case.inputs]
    _, _, ref, noise = references(case, inputs)
    for r, nz in zip(ref, noise):
        if nz is not None:
            assert float(nz.max()) <= 1e-12 * max(float(r.abs().max()), 1.0), float(nz.max())
    x = torch.randn(4, 1, 3, dtype=torch.float64)
    with EagerWorkarounds():
        assert torch.equal(x.expand(4, 5, 3).median(dim=1).values, x[:, 0])
        assert torch.equal(x.expand(4, 5, 3).nanmedian(dim=1).values, x[:, 0])
