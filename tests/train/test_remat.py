"""Activation recomputation (``CompileOptions(remat=...)``) in train steps.

The steps with remat equal the steps without it and PyTorch eager + torch.optim (2-layer tiny GPT,
float32, same init and batches) on 1-d and 2-d CPU meshes; dropout masks are recomputed bit for
bit; and the memory report of a longer sequence shows a lower peak with recomputation.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spmd import Mesh
from spmd.ir.text import parse_module
from spmd.models.gpt import gpt3_layers
from spmd.models.plans import gpt_plan
from spmd.passes.pipeline import CompileOptions
from spmd.train import SGD, AdamW, make_train_step

STEPS = 6


def _model(layers=2):
    torch.manual_seed(0)
    return gpt3_layers(layers, small=True, hidden_size=16, num_heads=4, ffn_size=32, seed=0).train().requires_grad_()


def _loss_fn(apply, batch):
    return F.mse_loss(apply(batch["x"]), batch["y"])


def _batches(n, batch, seq):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(batch, seq, 16, generator=g), "y": torch.randn(batch, seq, 16, generator=g)}
            for _ in range(n)]


def _reference(batches):
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4, foreach=False)
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = _loss_fn(ref, b)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: p.detach() for k, p in ref.named_parameters()}


def _train(mesh, remat, batches, plan=None):
    ts = make_train_step(_model(), mesh, plan, _loss_fn, optimizer=AdamW(lr=1e-2, weight_decay=0.1, eps=1e-4),
                         options=CompileOptions(remat=remat))
    losses = [float(ts.step(b)["loss"]) for b in batches]
    return ts, losses


@pytest.mark.parametrize("mesh_axes, devices, plan, modes, batch, seq", [
    pytest.param(("dp",), "cpu:1", None, ("selective", "full"), 4, 16, marks=pytest.mark.slow),  # both modes: below
    (("dp",), "cpu:2", None, ("selective",), 8, 32),
    (("dp",), "cpu:4", None, ("full",), 8, 32),
    ({"dp": 2, "tp": 2}, "cpu:4", "gpt", ("full",), 4, 16),
])
def test_remat_steps_equal_eager_and_no_remat(mesh_axes, devices, plan, modes, batch, seq):
    """Against eager + torch.optim everywhere; against the same step without remat on cpu:1 (tighter).

    (Small per-device batches, e.g. one or two sequences of 16 on cpu:4 / cpu:2, have their peak in
    the optimizer update, where nothing can be recomputed: the pass then leaves the program as it is.)"""
    mesh = Mesh.create(mesh_axes, devices=devices)
    plan = gpt_plan() if plan else None
    batches = _batches(STEPS, batch, seq)
    want_losses, want_params = _reference(batches)
    plain = _train(mesh, "none", batches, plan) if devices == "cpu:1" else None
    for mode in modes:
        ts, losses = _train(mesh, mode, batches, plan)
        assert ".remat" in ts.lowered.as_text("rematerialize"), mode
        for k, (got, want) in enumerate(zip(losses, want_losses)):
            assert abs(got - want) <= 1e-5 * abs(want), (mode, k, got, want)
        sd = ts.state_dict()
        for name, want in want_params.items():
            torch.testing.assert_close(sd[f"param.{name}"], want, rtol=0, atol=1e-4, msg=name)
        if plain is not None:
            for k, (got, ref) in enumerate(zip(losses, plain[1])):
                assert abs(got - ref) <= 1e-6 * abs(ref), (mode, k, got, ref)
            plain_sd = plain[0].state_dict()
            for name in want_params:
                torch.testing.assert_close(sd[f"param.{name}"], plain_sd[f"param.{name}"], rtol=0, atol=1e-5, msg=name)


class _DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = F.dropout(F.gelu(self.fc1(x)), 0.3, self.training)
        h = F.dropout(torch.tanh(self.fc2(h)), 0.3, self.training)
        return self.fc3(h)


def _draws(inst) -> bool:
    """Whether ``inst`` is a ``random`` custom call or a fusion containing one."""
    if inst.opcode == "custom-call":
        return inst.attrs.get("custom_call_target") == "random"
    body = inst.attrs.get("calls") if inst.opcode == "fusion" else None
    return body is not None and any(_draws(b) for b in body.instructions)


@pytest.mark.parametrize("n", [1, 2])
def test_dropout_masks_are_recomputed_bit_for_bit(n):
    mesh = Mesh.create(("dp",), devices=f"cpu:{n}")
    batches = _batches(4, 8, 16)
    runs = {}
    for mode in ("none", "full"):
        torch.manual_seed(0)
        ts = make_train_step(_DropoutMLP(), mesh, None, _loss_fn, optimizer=SGD(lr=0.1, momentum=0.9),
                             options=CompileOptions(remat=mode))
        torch.manual_seed(5)  # the per-call random keys
        runs[mode] = ([float(ts.step(b)["loss"]) for b in batches], ts.state_dict(), ts)
    # at the rematerialize stage (multi-output-fusion may then fuse the copy into its consumer)
    remat = parse_module(runs["full"][2].lowered.as_text("rematerialize"))
    copies = [i for i in remat.entry.instructions if ".remat" in i.name]
    assert any(_draws(i) for i in copies)  # a dropout mask was recomputed
    # Equal masks: a different mask changes the gradients (and every later loss) by far more than rounding.
    for got, want in zip(runs["full"][0], runs["none"][0]):
        assert abs(got - want) <= 1e-6 * abs(want), (runs["full"][0], runs["none"][0])
    for k, v in runs["none"][1].items():
        torch.testing.assert_close(runs["full"][1][k], v, rtol=0, atol=1e-6, msg=k)


@pytest.mark.slow  # test_cli_train checks the lower peak and the same losses through the CLI in CI
def test_peak_memory_is_lower_with_remat_on_a_longer_sequence():
    mesh = Mesh.create(("dp",), devices="cpu:1")
    batch = _batches(1, 2, 128)[0]
    peaks = {}
    for mode in ("none", "selective", "full"):
        ts = make_train_step(_model(), mesh, None, _loss_fn, optimizer=AdamW(lr=1e-2),
                             options=CompileOptions(remat=mode))
        report = ts.memory_analysis(batch)
        peaks[mode] = report.peak_size_bytes
        assert report.alias_size_bytes > 0  # new params and state written into the donated buffers
    assert peaks["full"] < 0.85 * peaks["none"], peaks
    assert peaks["selective"] <= peaks["none"], peaks
