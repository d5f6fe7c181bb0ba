"""Train steps with fused attention: the lowered step holds one fused attention backward per layer
(no softmax over the [.., S, S] scores) and still equals PyTorch eager + torch.optim over 20 steps.

Llama layer (grouped-query attention through repeated kv heads, causal SDPA) on a dp x tp mesh,
float32, AdamW; per-step loss within 1e-5 relative, final parameters within 1e-4.
"""

import re

import pytest
import torch
import torch.nn.functional as F

from spmd import CompileOptions, Mesh
from spmd.models.llama import llama_layers
from spmd.models.plans import llama_plan
from spmd.train import SGD, AdamW, make_train_step

STEPS = 20
SEQ = 8


def _model(layers=1):
    return llama_layers("llama2-7b", layers, small=True, seed=0).train().requires_grad_()


def _loss_fn(apply, batch):
    return F.mse_loss(apply(batch["x"]), batch["y"])


def _batches(n, batch=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(batch, SEQ, 64, generator=g), "y": torch.randn(batch, SEQ, 64, generator=g)}
            for _ in range(n)]


def _score_softmaxes(text: str) -> list[str]:
    """Softmax custom calls (or exp fusions' reduce inputs) over a trailing [.., SEQ, SEQ] shape."""
    return [line for line in text.splitlines()
            if 'custom_call_target="softmax"' in line and re.search(rf"\[[0-9,]*{SEQ},{SEQ}\]", line)]


def _targets(text: str, target: str) -> int:
    return text.count(f'custom_call_target="{target}"')


def test_llama_dp_tp_step_uses_fused_attention_and_matches_eager():
    mesh = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")
    batches = _batches(STEPS)
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4, foreach=False)
    ts = make_train_step(_model(), mesh, llama_plan(), _loss_fn, optimizer=AdamW(lr=1e-2, weight_decay=0.1, eps=1e-4))
    for k, b in enumerate(batches):
        opt.zero_grad()
        want = _loss_fn(ref, b)
        want.backward()
        opt.step()
        got = float(ts.step(b)["loss"])
        assert abs(got - float(want.detach())) <= 1e-5 * float(want.detach()), (k, got, float(want))
    sd = ts.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd[f"param.{name}"], p.detach(), rtol=0, atol=1e-4, msg=name)
    text = ts.lowered.as_text("spmd-partition")
    assert _targets(text, "attention-forward") == 1 and _targets(text, "attention-backward") == 1
    assert not _score_softmaxes(text)


@pytest.mark.parametrize("fused", [True, False])
def test_lowered_program_attention_kind(fused):
    """Two layers: one fused forward and backward each; the math fallback has the score softmax."""
    mesh = Mesh.create(("dp",), devices="cpu:2")
    ts = make_train_step(_model(2), mesh, None, _loss_fn, optimizer=AdamW(lr=1e-3),
                         options=CompileOptions(fused_attention_grad=fused))
    ts.step(_batches(1)[0])
    text = ts.lowered.as_text("spmd-partition")
    assert _targets(text, "attention-backward") == (2 if fused else 0)
    assert _targets(text, "attention-forward") == (2 if fused else 0)
    assert bool(_score_softmaxes(text)) != fused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_step_with_fused_attention_tracks_the_math_step():
    """One GPU, bfloat16, seq 256: the fused step (flash / efficient / cuDNN kernels, CUDA graphs
    as default) gives the math step's losses within bfloat16 rounding over 5 steps."""
    g = torch.Generator().manual_seed(4)
    batches = [{"x": torch.randn(2, 256, 64, generator=g).to("cuda", torch.bfloat16),
                "y": torch.randn(2, 256, 64, generator=g).to("cuda", torch.bfloat16)} for _ in range(5)]
    losses = {}
    for fused in (True, False):
        model = llama_layers("llama2-7b", 2, small=True, seed=0, dtype=torch.bfloat16, device="cuda")
        ts = make_train_step(model.train().requires_grad_(), Mesh.create(("dp",), devices="cuda:1"), None, _loss_fn,
                             optimizer=AdamW(lr=1e-3), options=CompileOptions(fused_attention_grad=fused))
        losses[fused] = [float(ts.step(b)["loss"]) for b in batches]
        text = ts.lowered.as_text("spmd-partition")
        assert _targets(text, "attention-backward") == (2 if fused else 0)
    for a, b in zip(losses[True], losses[False], strict=True):
        assert abs(a - b) <= 2e-2 * abs(b), (losses[True], losses[False])


@pytest.mark.slow
def test_fused_step_peak_is_smaller_than_the_math_step():
    """Sequence 128: the math step keeps [B, H, S, S] scores (and their softmax) alive from forward to
    backward; the fused step keeps one log-sum-exp per row, so the planned peak (buffer assignment's
    arena plus the kernels' own allocations, ``memory_analysis``) shrinks."""
    g = torch.Generator().manual_seed(5)
    batch = {"x": torch.randn(2, 128, 64, generator=g), "y": torch.randn(2, 128, 64, generator=g)}
    peak = {}
    for fused in (True, False):
        ts = make_train_step(_model(), Mesh.create(("dp",), devices="cpu:1"), None, _loss_fn, optimizer=AdamW(lr=1e-3),
                             options=CompileOptions(fused_attention_grad=fused))
        ts.step(batch)
        peak[fused] = ts.memory_analysis().peak_size_bytes
    scores_bytes = 2 * 4 * 128 * 128 * 4  # one [B, H, S, S] float32 tensor
    assert peak[True] + scores_bytes <= peak[False], peak


class _MaskedAttention(torch.nn.Module):
    """Self-attention whose SDPA mask is a registered buffer (a constant of the step, not a parameter)."""

    def __init__(self, mask):
        super().__init__()
        self.num_heads = 2
        self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)
        self.register_buffer("mask", mask)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, 8).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return self.out(o.transpose(1, 2).reshape(b, s, 16))


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64])
def test_mask_buffer_step_matches_eager(mask_dtype):
    """A module buffer used as the attention mask: float64 losses and parameters equal eager + torch.optim."""
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(6, 6, generator=g) > 0.3 if mask_dtype == torch.bool else torch.randn(6, 6, generator=g).double()
    if mask_dtype == torch.bool:
        mask[:, 0] = True
    torch.manual_seed(0)
    ref = _MaskedAttention(mask).double()
    model = _MaskedAttention(mask).double()
    model.load_state_dict(ref.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ts = make_train_step(model, Mesh.create(("dp",), devices="cpu:2"), None, _loss_fn, optimizer=SGD(lr=0.1))
    for _ in range(2):
        b = {"x": torch.randn(4, 6, 16, generator=g, dtype=torch.float64),
             "y": torch.randn(4, 6, 16, generator=g, dtype=torch.float64)}
        opt.zero_grad()
        want = _loss_fn(ref, b)
        want.backward()
        opt.step()
        got = float(ts.step(b)["loss"])  # the loss metric is float32
        assert abs(got - float(want.detach())) <= 1e-6 * float(want.detach())
    sd = ts.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd[f"param.{name}"], p.detach(), rtol=1e-12, atol=1e-12, msg=name)
