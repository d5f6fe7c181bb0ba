"""Split-KV decode attention (``spmd.runtime.triton_decode_attention``): which inputs it takes, its
result against float64 SDPA on CUDA (GQA, key counts that are no multiple of the block, bool and
additive masks, broadcast masks, fully masked rows), and its place in the timed attention choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spmd.runtime import kernels_attention as ka

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(b, hq, hkv, s, d, dtype, mask_kind, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, 1, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(dtype)
    if mask_kind == "none":
        mask = None
    elif mask_kind == "bool":  # per-sequence key padding, broadcast over heads; sequence 0 fully masked
        mask = torch.rand(b, 1, 1, s, device="cuda", generator=g) > 0.3
        mask[0] = False
    else:  # the decode position mask: keys up to each sequence's position, additive, in q's dtype
        pos = torch.randint(1, s + 1, (b,), device="cuda", generator=g)
        keep = torch.arange(s, device="cuda")[None, :] < pos[:, None]
        mask = torch.where(keep, 0.0, float("-inf")).to(dtype)[:, None, None, :].expand(b, hq, 1, s)
    return q, k, v, mask


def _reference(q, k, v, mask):
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=m)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("b", "hq", "hkv", "s", "d", "mask_kind"), [
    (1, 32, 32, 383, 128, "float"), (8, 32, 32, 383, 128, "float"), (2, 8, 2, 130, 64, "bool"),
    (3, 4, 4, 7, 16, "none"), (1, 4, 1, 1000, 256, "float"), (2, 6, 3, 65, 32, "bool")])
def test_split_kv_equals_float64_sdpa(dtype, b, hq, hkv, s, d, mask_kind):
    from spmd.runtime import triton_decode_attention as tda

    q, k, v, mask = _inputs(b, hq, hkv, s, d, dtype, mask_kind, b * s + d)
    assert tda.eligible(q, k, v, mask, False)
    got = tda.attention(q, k, v, mask, None)
    ref = _reference(q, k, v, mask)
    assert got.shape == ref.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=ka.TOLERANCE[dtype] * (1 + ref.abs().max().item()))
    if mask_kind == "bool":
        assert torch.equal(got[0], torch.zeros_like(got[0]))  # every key masked: 0, as math SDPA


@gpu
@needs_cuda
def test_prefill_causal_and_float32_inputs_are_not_split_kv():
    from spmd.runtime import triton_decode_attention as tda

    q, k, v, _ = _inputs(1, 4, 4, 64, 32, torch.bfloat16, "none", 0)
    assert not tda.eligible(q, k, v, None, True)
    assert not tda.eligible(q.float(), k.float(), v.float(), None, False)
    assert not tda.eligible(q.expand(1, 4, 2, 32), k, v, None, False)
    assert not tda.eligible(q, k[:, :3], v[:, :3], None, False)  # 3 KV heads do not divide 4


@gpu
@needs_cuda
def test_a_decode_step_times_split_kv_among_the_backends():
    q, k, v, mask = _inputs(1, 32, 32, 383, 128, torch.bfloat16, "float", 1)
    key = ka._key(q, k, v, mask, False, None)
    assert ka.SPLIT_KV in key[-1]
    d = ka.decide(q, k, v, mask, False, None, candidates=key[-1])
    names = [n for n, _ in d.times_us]
    assert ka.SPLIT_KV in names, d.line()  # it ran, agreed with the float32 reference and was timed
