"""GPT-3 and Llama block models: published shapes, seeded weights, numerics against references."""

import math

import pytest
import torch
import torch.nn.functional as F

from spmd.models import gpt, llama


def test_published_shapes_on_meta():
    g = gpt.gpt3_layers(device="meta")
    assert g.config == gpt.GPTConfig(12288, 96, 49152, 1)
    assert g.layers[0].mlp.fc_in.weight.shape == (49152, 12288)
    l7 = llama.llama_layers("llama2-7b", 2, device="meta")
    assert l7.layers[1].mlp.gate_proj.weight.shape == (11008, 4096)
    assert l7.layers[0].self_attn.k_proj.weight.shape == (4096, 4096)
    l70 = llama.llama_layers("llama3-70b", device="meta")
    assert l70.layers[0].self_attn.k_proj.weight.shape == (8 * 128, 8192)  # GQA: 8 KV heads of 128
    assert l70.layers[0].mlp.down_proj.weight.shape == (8192, 28672)
    # 70B: 80 layers of ~856M parameters plus embeddings (~2.1B) make ~70.6B.
    per_layer = sum(p.numel() for p in l70.parameters())
    assert 855e6 < per_layer < 857e6


def test_seeded_weights_are_deterministic_and_nonzero():
    a, b = gpt.gpt3_layers(small=True, seed=3), gpt.gpt3_layers(small=True, seed=3)
    c = gpt.gpt3_layers(small=True, seed=4)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), n
        assert not torch.equal(pa, pc), n
        assert pa.abs().min() > 0 or pa.numel() > 64, n
    assert abs(a.layers[0].ln_1.weight.mean().item() - 1.0) < 0.02


def test_overrides_and_errors():
    m = gpt.gpt3_layers(small=True, hidden_size=32, num_heads=2, ffn_size=48, device="meta")
    assert m.layers[0].mlp.fc_in.weight.shape == (48, 32)
    with pytest.raises(TypeError, match="unknown config field"):
        gpt.gpt3_layers(small=True, hiden_size=32)
    with pytest.raises(ValueError, match="divisible"):
        gpt.gpt3_layers(small=True, num_heads=5)
    with pytest.raises(ValueError, match="preset"):
        llama.llama_layers("llama9")
    with pytest.raises(ValueError, match="num_kv_heads"):
        llama.llama_layers(small=True, num_kv_heads=3)


def _naive_gpt_layer(layer, x):
    c = layer.attn
    b, s, h = x.shape
    y = F.layer_norm(x, (h,), layer.ln_1.weight, layer.ln_1.bias, layer.ln_1.eps)
    q, k, v = (p(y).view(b, s, c.num_heads, c.head_dim).permute(0, 2, 1, 3) for p in (c.q_proj, c.k_proj, c.v_proj))
    scores = q @ k.transpose(-1, -2) / math.sqrt(c.head_dim)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(b, s, h)
    x = x + c.out_proj(o)
    y = F.layer_norm(x, (h,), layer.ln_2.weight, layer.ln_2.bias, layer.ln_2.eps)
    inner = layer.mlp.fc_in(y)
    gelu = 0.5 * inner * (1 + torch.tanh(math.sqrt(2 / math.pi) * (inner + 0.044715 * inner**3)))
    return x + layer.mlp.fc_out(gelu)


def test_gpt_matches_naive_attention():
    m = gpt.gpt3_layers(2, small=True, seed=11)
    x = torch.randn(2, 9, 64)
    ref = x
    for layer in m.layers:
        ref = _naive_gpt_layer(layer, ref)
    assert torch.allclose(m(x), ref, atol=1e-5, rtol=1e-5)
    assert m.flops(2, 9) == 2 * (2 * 18 * (4 * 64 * 64 + 2 * 64 * 256) + 4 * 2 * 81 * 64)


def test_llama_matches_transformers_decoder_layer():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as hf

    ours = llama.llama_layers("llama3-70b", small=True, seed=5)  # GQA: 4 heads, 2 KV heads
    c = ours.config
    cfg = transformers.LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.ffn_size,
                                   num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                                   rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, num_hidden_layers=1,
                                   attn_implementation="eager")
    ref = hf.LlamaDecoderLayer(cfg, layer_idx=0).eval()
    missing = ref.load_state_dict({k.removeprefix("layers.0."): v for k, v in ours.state_dict().items()})
    assert not missing.missing_keys and not missing.unexpected_keys
    x = torch.randn(2, 7, c.hidden_size)
    pos = torch.arange(7)[None].expand(2, 7)
    cos_sin = hf.LlamaRotaryEmbedding(cfg)(x, pos)
    causal = torch.full((7, 7), float("-inf")).triu(1)[None, None].expand(2, 1, 7, 7)
    with torch.no_grad():
        expected = ref(x, attention_mask=causal, position_ids=pos, position_embeddings=cos_sin)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = ours(x)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()


@pytest.mark.parametrize("make", [lambda: gpt.gpt3_layers(small=True), lambda: llama.llama_layers(small=True)])
def test_blocks_export(make):
    m = make()
    x = torch.randn(2, 8, 64)
    ep = torch.export.export(m, (x,))
    assert torch.allclose(ep.module()(x), m(x), atol=1e-6)


def test_bfloat16_build():
    m = llama.llama_layers(small=True, dtype=torch.bfloat16)
    y = m(torch.randn(1, 4, 64, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
