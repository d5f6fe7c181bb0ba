"""LlamaForCausalLM in eager: left padding, cache writes, presets and the tensor-parallel plan."""

import pytest
import torch

import spmd
from spmd.generation.reference import reference_generate
from spmd.models.llama_lm import LM_PRESETS, LlamaLMConfig, llama_lm, write_cache
from spmd.models.plans import ColwiseParallel, Replicate, llama_lm_plan, resolve_plan


def _padded(prompts, p):
    tokens = torch.zeros(len(prompts), p, dtype=torch.int64)
    for b, ids in enumerate(prompts):
        tokens[b, p - len(ids):] = torch.tensor(ids)
    return tokens, torch.tensor([p - len(ids) for ids in prompts])


def test_left_padded_batch_equals_each_sequence_alone():
    model = llama_lm(small=True, seed=2)
    prompts = [[4, 9, 1, 250, 3], [17], [8, 8, 8, 2, 5, 6, 90]]
    batch, _ = reference_generate(model, *_padded(prompts, 9), 12, 24)
    for b, ids in enumerate(prompts):
        alone, _ = reference_generate(model, *_padded([ids], len(ids)), 12, 24)
        assert torch.equal(batch[b], alone[0])


@pytest.mark.parametrize("s", [1, 3])
def test_cache_writes_agree(s):
    cache, new = torch.randn(2, 3, 10, 4), torch.randn(2, 3, s, 4)
    expect = cache.clone()
    expect[:, :, 5:5 + s] = new
    assert torch.equal(write_cache(cache, new, 5, "mask"), expect)  # static slot
    assert torch.equal(write_cache(cache, new, torch.tensor(5), "index"), expect)
    if s == 1:
        assert torch.equal(write_cache(cache, new, torch.tensor(5), "mask"), expect)
    for slot in (5, torch.tensor(5)):
        inplace = cache.clone()
        assert write_cache(inplace, new, slot, "inplace") is inplace and torch.equal(inplace, expect)


def test_presets_have_published_shapes():
    m = llama_lm("llama3-8b", layers=1, device="meta")
    assert (m.config.hidden_size, m.config.num_kv_heads, m.config.vocab_size) == (4096, 8, 128256)
    assert m.layers[0].self_attn.k_proj.weight.shape == (1024, 4096)
    assert LM_PRESETS["llama2-7b"].num_kv_heads == 32 and LM_PRESETS["llama2-7b"].num_layers == 32
    with pytest.raises(ValueError, match="preset"):
        llama_lm("gpt2")
    with pytest.raises(ValueError, match="vocab_size"):
        LlamaLMConfig(vocab_size=0)
    with pytest.raises(ValueError, match="cache_update"):
        llama_lm(small=True, cache_update="scatter")


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(layers="2"), TypeError, "layers: expected an int, got str '2'"),
    (dict(layers=2.0), TypeError, "layers: expected an int, got float 2.0"),
    (dict(layers=True), TypeError, "layers: expected an int, got bool True"),
    (dict(layers=0), ValueError, "layers: expected an int >= 1, got 0"),
    (dict(seed="1"), TypeError, "seed: expected an int, got str '1'"),
    (dict(vocab_size="8"), TypeError, "vocab_size: expected an int, got str '8'"),
    (dict(hidden_size="64"), TypeError, "hidden_size: expected an int, got str '64'"),
    (dict(num_heads=0), ValueError, "num_heads: expected an int >= 1, got 0"),
    (dict(rope_theta="x"), TypeError, "rope_theta: expected a number, got str 'x'"),
    (dict(dtype="float32"), TypeError, "dtype: expected a torch.dtype, got str 'float32'"),
])
def test_arguments_of_the_wrong_type_are_named(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        llama_lm(small=True, device="meta", **kwargs)


def test_numpy_integer_sizes_are_ints():
    import numpy as np

    m = llama_lm(small=True, layers=np.int64(1), seed=np.int32(0), vocab_size=np.int16(32), device="meta")
    assert (m.config.num_layers, m.config.vocab_size) == (1, 32)
    assert type(m.config.vocab_size) is int


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_plan_replicates_kv_heads_when_tp_exceeds_them(tp):
    model = llama_lm(small=True, device="meta")  # 4 heads, 2 KV heads
    mesh = spmd.Mesh.create(("tp",), devices=f"cpu:{tp}")
    plan = llama_lm_plan(model.config.num_kv_heads, tp)
    specs = resolve_plan(model, mesh, plan)
    kv_style = dict(plan.rules)["layers.*.self_attn.{k_proj,v_proj}"]
    assert isinstance(kv_style, Replicate if tp == 4 else ColwiseParallel)
    assert specs["layers.0.self_attn.q_proj.weight"] == spmd.PartitionSpec("tp")
    assert specs["lm_head.weight"] == spmd.PartitionSpec("tp")
    assert specs["embed_tokens.weight"] == spmd.PartitionSpec()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_without_concatenation_equals_the_rotate_half_form(dtype):
    import math

    from spmd.models.llama import apply_rotary
    from spmd.models.llama_lm import _rotate, rotary_at

    pos = torch.randint(0, 300, (3, 5))
    x = torch.randn(3, 4, 5, 16).to(dtype)
    cos, sin = rotary_at(pos, 16, 10000.0, dtype)
    inv = torch.exp(torch.arange(0, 16, 2).float() * (-math.log(10000.0) / 16))
    angles = pos.float()[:, :, None] * inv
    angles = torch.cat([angles, angles], -1)[:, None]
    assert torch.equal(_rotate(x, cos, sin), apply_rotary(x, angles.cos().to(dtype), angles.sin().to(dtype)))
