"""An AdamW train step with multi-output fusion: one fusion kernel per parameter, equal to torch.optim.

The update of each parameter is three loop fusions after fuse-elementwise (m', v', and p' reading
them); multi-output-fusion makes it one fusion with three outputs, stored in place over the
donated parameter and moments. Losses and parameters are compared step by step with the same
model trained by PyTorch eager and ``torch.optim.AdamW`` on one device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spmd import Mesh
from spmd.passes.pipeline import CompileOptions
from spmd.runtime import kernels_fusion as kf
from spmd.runtime.thunks import KernelThunk, MultiOutputKernelThunk
from spmd.train import AdamW, make_train_step

STEPS = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _loss_fn(apply, batch):
    return F.mse_loss(apply(batch["x"]), batch["y"])


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 8, generator=g)} for _ in range(n)]


def _train_step(n: int, multi_output_fusion: bool = True):
    return make_train_step(_model(), Mesh.create(("dp",), devices=f"cpu:{n}"), None, _loss_fn,
                           optimizer=AdamW(lr=1e-2, weight_decay=0.1),
                           options=CompileOptions(multi_output_fusion=multi_output_fusion))


def _update_fusions_per_parameter(ts) -> list[int]:
    """Per parameter, the fusion kernels of the lowered step that produce its p', m' and v' outputs."""
    program = ts.compiled.executable.program
    writer = {th.out: th for th in program.thunks if isinstance(th, KernelThunk)}
    n = len(ts.params)
    outs = program.output_slots  # (params..., step, exp_avg..., exp_avg_sq..., loss)

    def fusion_of(slot):
        th = writer[slot]
        if len(th.ins) == 1 and isinstance(writer.get(th.ins[0]), MultiOutputKernelThunk):
            th = writer[th.ins[0]]  # a get-tuple-element reads its fusion's tuple
        return th.name
    return [len({fusion_of(outs[k]), fusion_of(outs[n + 1 + k]), fusion_of(outs[2 * n + 1 + k])})
            for k in range(n)]


@pytest.mark.parametrize("enabled, per_parameter", [(False, 3), (True, 1)])
def test_adamw_update_is_one_fusion_kernel_per_parameter(enabled, per_parameter):
    ts = _train_step(1, enabled)
    ts.step(_batches(1)[0])
    assert _update_fusions_per_parameter(ts) == [per_parameter] * len(ts.params)
    assert ("get-tuple-element" in ts.lowered.as_text("multi-output-fusion")) == enabled


def _reference(batches):
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = _loss_fn(ref, b)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, ref, opt


def _check(n: int) -> None:
    batches = _batches(STEPS)
    want_losses, ref, opt = _reference(batches)
    ts = _train_step(n)
    for k, (b, want) in enumerate(zip(batches, want_losses, strict=True)):
        ptrs = {name: [t.data_ptr() for t in a._buffers] for name, a in ts.params.items()}
        got = float(ts.step(b)["loss"])
        assert abs(got - want) <= 1e-5 * abs(want), (k, got, want)
        # p' written over p (the donated buffer): no fresh parameter memory per step
        assert all([t.data_ptr() for t in a._buffers] == ptrs[name] for name, a in ts.params.items())
    sd = ts.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd[f"param.{name}"], p.detach(), rtol=0, atol=1e-5, msg=name)
        state = opt.state[p]
        torch.testing.assert_close(sd[f"opt.exp_avg.{name}"], state["exp_avg"], rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(sd[f"opt.exp_avg_sq.{name}"], state["exp_avg_sq"], rtol=0, atol=1e-6, msg=name)
    assert _update_fusions_per_parameter(ts) == [1] * len(ts.params)


@pytest.mark.parametrize("n", [1, 2])
def test_train_step_equals_torch_optim_adamw_step_by_step(n):
    _check(n)


@pytest.mark.slow
def test_train_step_with_generated_kernels_on_cpu_equals_torch_optim(monkeypatch):
    """The same through Inductor's generated kernels (stores over the donated operands)."""
    monkeypatch.setenv(kf.COMPILER_ENV, "inductor")
    _check(1)


def test_mixed_precision_step_equals_the_unmerged_program_bit_for_bit():
    """bf16 compute, float32 master weights and moments: merged and unmerged update fusions agree exactly."""
    states = []
    for enabled in (False, True):
        ts = make_train_step(_model(), Mesh.create(("dp",), devices="cpu:1"), None,
                             lambda apply, b: F.mse_loss(apply(b["x"]).float(), b["y"]),
                             optimizer=AdamW(lr=1e-2, weight_decay=0.1), compute_dtype=torch.bfloat16,
                             options=CompileOptions(multi_output_fusion=enabled))
        for b in _batches(3):
            ts.step(b)
        assert _update_fusions_per_parameter(ts) == [1 if enabled else 3] * len(ts.params)
        states.append(ts.state_dict())
    assert states[0].keys() == states[1].keys()
    for name, want in states[0].items():
        assert torch.equal(states[1][name], want), name
