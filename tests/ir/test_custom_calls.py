"""Custom-call registry: kernels against PyTorch, sharding-rule metadata."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spmd.ir.custom_calls import CUSTOM_CALLS, RULE_KINDS, get_custom_call


def test_registry_targets_and_rules():
    assert set(CUSTOM_CALLS) == {"softmax", "layer-norm", "attention", "gelu", "silu", "Sharding",
                                 "sort", "topk", "cumsum", "cumprod", "cummax", "cummin", "random", "conv1d",
                                 "attention-forward", "attention-backward"}
    assert {s.rule for s in CUSTOM_CALLS.values()} == RULE_KINDS
    assert CUSTOM_CALLS["softmax"].unsharded_dims({"dim": -1}, 3) == (2,)
    assert CUSTOM_CALLS["softmax"].unsharded_dims({"dim": 1}, 3) == (1,)
    assert CUSTOM_CALLS["softmax"].num_trailing_dims({"dim": 1}, 3) == 2
    assert CUSTOM_CALLS["layer-norm"].unsharded_dims({"normalized_ndim": 2}, 4) == (2, 3)
    assert CUSTOM_CALLS["attention"].unsharded_dims({}, 4) == (2, 3)
    assert CUSTOM_CALLS["attention-backward"].unsharded_dims({}, 4) == (2, 3)
    assert CUSTOM_CALLS["gelu"].unsharded_dims({}, 2) == ()
    with pytest.raises(ValueError, match="unknown custom_call_target"):
        get_custom_call("fft")


def test_kernels_match_torch():
    x = torch.randn(2, 5, 8)
    w, b = torch.randn(8), torch.randn(8)
    run = lambda t, ops, cfg: CUSTOM_CALLS[t].fn(ops, cfg)  # noqa: E731
    torch.testing.assert_close(run("softmax", [x], {"dim": 1}), torch.softmax(x, 1))
    torch.testing.assert_close(run("layer-norm", [x, w, b], {"eps": 1e-6}), F.layer_norm(x, (8,), w, b, 1e-6))
    torch.testing.assert_close(run("layer-norm", [x], {"normalized_ndim": 2}), F.layer_norm(x, (5, 8)))
    torch.testing.assert_close(run("gelu", [x], {"approximate": "tanh"}), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(run("silu", [x], {}), F.silu(x))
    assert run("Sharding", [x], {}) is x
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 5)
    mask = torch.rand(2, 3, 4, 6) > 0.2
    mask[..., 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(run("attention", [q, k, v, mask], {"has_mask": True, "scale": 0.3}), want)
    q2 = torch.randn(2, 3, 6, 8)
    torch.testing.assert_close(run("attention", [q2, k, v], {"is_causal": True}),
                               F.scaled_dot_product_attention(q2, k, v, is_causal=True))


@pytest.mark.parametrize("shape", [(16, 8), (4, 16, 8), (2, 3, 4, 16, 8)])
@pytest.mark.parametrize("mask_kind", [None, "2d", "full"])
def test_attention_any_rank_goes_through_4d(shape, mask_kind):
    """Attention of rank != 4 (run as [B, H, S, D] for PyTorch's fused kernels) equals the math form."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(3))
    ops, cfg = [q, k, v], {"scale": 0.3}
    scores = (q @ k.transpose(-1, -2)) * 0.3
    if mask_kind is not None:
        mshape = shape[-2:-1] * 2 if mask_kind == "2d" else (*shape[:-1], shape[-2])
        mask = torch.randn(mshape, generator=gen, dtype=torch.float64)
        ops.append(mask)
        cfg["has_mask"] = True
        scores = scores + mask
    want = torch.softmax(scores, -1) @ v
    got = CUSTOM_CALLS["attention"].fn(ops, cfg)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    # strided (transposed-view) operands, as the runtime passes views
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    torch.testing.assert_close(CUSTOM_CALLS["attention"].fn([qt, *ops[1:]], cfg), want)
