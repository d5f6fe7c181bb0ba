"""One-pass short-sequence attention (``spmd.runtime.triton_short_attention``): which inputs it
takes, its result against float64 SDPA on CUDA (float32 / bf16 / fp16, GQA, causal, bool and
additive masks, broadcast masks, fully masked rows, head dims and key counts that are no power of
two), and its place in the timed attention choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spmd.runtime import kernels_attention as ka

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(b, hq, hkv, sq, sk, d, dv, dtype, mask_kind, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, sq, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, hkv, sk, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, hkv, sk, dv, device="cuda", generator=g).to(dtype)
    if mask_kind in ("none", "causal"):
        mask = None
    elif mask_kind == "bool":  # per-sequence key padding, broadcast over heads and queries; sequence 0 fully masked
        mask = torch.rand(b, 1, 1, sk, device="cuda", generator=g) > 0.3
        mask[0] = False
    else:  # an additive mask per query, broadcast over heads, in q's dtype (BERT's extended mask)
        mask = torch.randn(b, 1, sq, sk, device="cuda", generator=g).to(dtype)
    return q, k, v, mask


def _reference(q, k, v, mask, causal):
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=m, is_causal=causal)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("b", "hq", "hkv", "sq", "sk", "d", "dv", "mask_kind"), [
    (8, 12, 12, 128, 128, 32, 32, "float"), (4, 12, 12, 128, 128, 32, 32, "bool"),
    (2, 8, 2, 130, 130, 64, 64, "causal"),
    (3, 4, 4, 7, 200, 16, 16, "none"), (1, 4, 1, 1, 256, 128, 128, "float"), (2, 6, 3, 65, 33, 24, 40, "bool"),
    (2, 2, 2, 20, 10, 8, 8, "causal")])
def test_short_seq_equals_float64_sdpa(dtype, b, hq, hkv, sq, sk, d, dv, mask_kind):
    from spmd.runtime import triton_short_attention as tsa

    q, k, v, mask = _inputs(b, hq, hkv, sq, sk, d, dv, dtype, mask_kind, b * sk + d)
    causal = mask_kind == "causal"
    over_smem = dtype == torch.float32 and sk == 256 and d == 128  # float32 keys + values: 256 KiB
    assert tsa.eligible(q, k, v, mask, causal) is not over_smem
    if over_smem:
        return
    got = tsa.attention(q, k, v, mask, causal, None)
    ref = _reference(q, k, v, mask, causal)
    assert got.shape == ref.shape and got.dtype == dtype
    assert got.transpose(1, 2).is_contiguous()  # laid out [B, Sq, H, Dv], as SDPA's flash and cuDNN outputs
    tol = 1e-5 if dtype == torch.float32 else ka.TOLERANCE[dtype]  # float32: 3xTF32, about float32 accuracy
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=tol * (1 + ref.abs().max().item()))
    if mask_kind == "bool":
        assert torch.equal(got[0], torch.zeros_like(got[0]))  # every key masked: 0, as math SDPA


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sk", [128, 100])  # a full block of keys (no key masking in the kernel) and a padded one
def test_a_padding_mask_of_finfo_min_equals_sdpa(dtype, sk):
    """BERT's extended mask: finfo.min on padded keys, one sequence padded everywhere (the
    softmax of equal scores: the mean of the values, as eager SDPA gives), at full and partial
    key blocks."""
    from spmd.runtime import triton_short_attention as tsa

    q, k, v, _ = _inputs(3, 4, 4, 64, sk, 32, 32, dtype, "none", sk)
    keep = torch.ones(3, sk, device="cuda")
    keep[0] = 0
    keep[1, sk // 2:] = 0
    mask = ((1.0 - keep) * torch.finfo(dtype).min).to(dtype)[:, None, None, :]
    ref = _reference(q, k, v, mask, False)
    tol = 1e-5 if dtype == torch.float32 else ka.TOLERANCE[dtype]
    for config in tsa.configs(q, k, v):
        got = tsa.attention(q, k, v, mask, False, None, config)
        assert not got.isnan().any(), config
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=tol * (1 + ref.abs().max().item()), msg=str(config))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_configuration_gives_the_same_result(dtype):
    from spmd.runtime import triton_short_attention as tsa

    q, k, v, mask = _inputs(3, 4, 2, 100, 77, 32, 32, dtype, "float", 5)
    usable = tsa.configs(q, k, v)
    assert len(usable) == len(tsa.CONFIGS)  # 100 queries of 32 dims: every configuration fits
    ref = _reference(q, k, v, mask, False)
    tol = 1e-5 if dtype == torch.float32 else ka.TOLERANCE[dtype]
    for config in usable:
        got = tsa.attention(q, k, v, mask, False, None, config)
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=tol * (1 + ref.abs().max().item()), msg=str(config))
    big = torch.randn(1, 2, 4, 128, device="cuda")
    keys = torch.randn(1, 2, 256, 128, device="cuda")
    assert not tsa.configs(big, keys, keys) and not tsa.eligible(big, keys, keys, None, False)  # over shared memory
    assert max(tsa.configs(q[:, :, :9], k, v)) == (16, 4)  # no more queries per program than needed


@gpu
@needs_cuda
def test_inputs_it_does_not_take():
    from spmd.runtime import triton_short_attention as tsa

    q, k, v, _ = _inputs(1, 4, 4, 8, 300, 32, 32, torch.bfloat16, "none", 0)
    assert not tsa.eligible(q, k, v, None, False)  # more keys than one block
    q, k, v, mask = _inputs(1, 4, 4, 8, 64, 32, 32, torch.bfloat16, "bool", 0)
    assert not tsa.eligible(q, k, v, mask, True)  # a mask and is_causal: PyTorch rejects it
    assert not tsa.eligible(q, k[:, :3], v[:, :3], None, False)  # 3 KV heads do not divide 4
    assert not tsa.eligible(q.double(), k.double(), v.double(), None, False)
    assert not tsa.eligible(q, k, v, mask.int(), False)  # integer masks
    assert not tsa.eligible(q.transpose(2, 3), k, v, None, False)
    big = torch.randn(1, 4, 8, 256, device="cuda", dtype=torch.bfloat16)
    assert not tsa.eligible(big, big, big, None, False)  # head dim over 128


@gpu
@needs_cuda
def test_an_encoder_attention_times_short_seq_among_the_backends():
    q, k, v, mask = _inputs(8, 12, 12, 128, 128, 32, 32, torch.float32, "bool", 1)
    key = ka._key(q, k, v, mask, False, None)
    short = [n for n in key[-1] if n.startswith(ka.SHORT_SEQ + ":")]
    assert len(short) > 1 and ka.SPLIT_KV not in key[-1]  # one candidate per usable configuration
    d = ka.decide(q, k, v, mask, False, None, candidates=key[-1])
    timed = [n for n, _ in d.times_us]
    assert set(short) <= set(timed), d.line()  # each ran, agreed with the reference and was timed
    if d.chosen in short:
        assert torch.equal(ka.run_backend(d.chosen, q, k, v, mask, False, None),
                           ka.run_backend(d.chosen, q, k, v, mask, False, None))
