"""End to end through spmd.jit: a 2-layer transformer block and MiniLM on CPU meshes and GPUs.

Every check compares against the same program run unsharded on one device in float64 (or the
sentence-transformers reference for MiniLM), on fresh random inputs.
"""

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P

HEADS = 4


def block(x, params):
    """Two pre-norm transformer layers: causal MHA (softmax by hand in layer 0, SDPA in layer 1), GELU MLP."""
    b, s, h = x.shape
    for i, p in enumerate(params):
        y = F.layer_norm(x, (h,), p["ln1_w"], p["ln1_b"])
        q, k, v = (
            (y @ p[n]).view(b, s, HEADS, h // HEADS).transpose(1, 2) for n in ("wq", "wk", "wv")
        )
        if i == 0:
            scores = (q @ k.transpose(-1, -2)) * (h // HEADS) ** -0.5
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            a = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(1, 2).reshape(b, s, h) @ p["wo"]
        y = F.layer_norm(x, (h,), p["ln2_w"], p["ln2_b"])
        x = x + F.gelu(y @ p["w1"] + p["b1"]) @ p["w2"]
    return x


def make_params(h: int, layers: int = 2, dtype=torch.float32):
    def layer():
        return {
            "ln1_w": 1 + 0.1 * torch.randn(h), "ln1_b": 0.1 * torch.randn(h),
            "wq": torch.randn(h, h) / h**0.5, "wk": torch.randn(h, h) / h**0.5, "wv": torch.randn(h, h) / h**0.5,
            "wo": torch.randn(h, h) / h**0.5,
            "ln2_w": 1 + 0.1 * torch.randn(h), "ln2_b": 0.1 * torch.randn(h),
            "w1": torch.randn(h, 4 * h) / h**0.5, "b1": 0.1 * torch.randn(4 * h), "w2": torch.randn(4 * h, h) / (2 * h),
        }
    return [{k: v.to(dtype) for k, v in layer().items()} for _ in range(layers)]


def megatron_specs(layers: int = 2):
    """Column-parallel Q/K/V and FFN-in, row-parallel attention-out and FFN-out, over 'tp'."""
    col, row = P(None, "tp"), P("tp", None)
    one = {"ln1_w": P(), "ln1_b": P(), "wq": col, "wk": col, "wv": col, "wo": row,
           "ln2_w": P(), "ln2_b": P(), "w1": col, "b1": P("tp"), "w2": row}
    return [dict(one) for _ in range(layers)]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def reference(x, params):
    return block(x.double(), [{k: v.double() for k, v in p.items()} for p in params])


def run_block(mesh: Mesh, x_spec, dtype=torch.float32, batch=4, seq=8, h=32):
    x = torch.randn(batch, seq, h).to(dtype)
    params = make_params(h, dtype=dtype)
    f = spmd.jit(block, mesh=mesh, in_shardings=(x_spec, megatron_specs()), out_shardings=x_spec)
    return f, rel_err(f(x, params).to_torch(), reference(x, params))


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_transformer_block_on_1d_meshes(n):
    f, err = run_block(Mesh.create(("tp",), devices=f"cpu:{n}"), P())
    assert err < 1e-5


@pytest.mark.parametrize("axes", [{"dp": 2, "tp": 2}, {"dp": 2, "tp": 4}])
def test_transformer_block_on_dp_tp_meshes(axes):
    n = axes["dp"] * axes["tp"]
    f, err = run_block(Mesh.create(axes, devices=f"cpu:{n}"), P("dp"), batch=6)
    assert err < 1e-5


def test_transformer_block_batch_not_divisible_by_dp():
    f, err = run_block(Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4"), P("dp"), batch=3, seq=5)
    assert err < 1e-5


def test_megatron_block_needs_one_all_reduce_per_sublayer():
    mesh = Mesh.create(("tp",), devices="cpu:4")
    x, params = torch.randn(2, 8, 32), make_params(32)
    f = spmd.jit(block, mesh=mesh, in_shardings=(P(), megatron_specs()), out_shardings=P(),
                 options=spmd.CompileOptions(windowed_einsum="off"))
    ops = [c["opcode"] for c in f.lower(x, params).compile().collectives()]
    assert ops == ["all-reduce"] * 4, ops


def test_compile_cache_reuses_the_executable():
    mesh = Mesh.create(("tp",), devices="cpu:2")
    f = spmd.jit(block, mesh=mesh, in_shardings=(P(), megatron_specs()), out_shardings=P())
    x, params = torch.randn(2, 4, 16), make_params(16)
    f(x, params)
    misses = spmd.metrics.counter("compile_cache.miss").value
    f(torch.randn(2, 4, 16), make_params(16))
    assert spmd.metrics.counter("compile_cache.miss").value == misses
    f(torch.randn(2, 6, 16), make_params(16))  # a new shape compiles again
    assert spmd.metrics.counter("compile_cache.miss").value == misses + 1


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_transformer_block_on_gpus(dtype, tol):
    mesh = Mesh.create(("tp",), devices="cuda")
    f, err = run_block(mesh, P(), dtype=dtype, batch=4, seq=64, h=128)
    assert err < tol


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_minilm_on_gpus_matches_sentence_transformers(dtype, tol):
    from spmd.models import minilm, plans

    try:
        model_dir = minilm.find_model_dir()
    except ValueError as e:
        pytest.skip(str(e))
    sentences = list(minilm.DEMO_SENTENCES)
    ref = minilm.reference_embeddings(sentences, model_dir)
    if ref is None:
        pytest.skip("sentence-transformers is not installed")
    model = minilm.load_model(model_dir, dtype=dtype)
    batch = minilm.tokenize(minilm.load_tokenizer(model_dir), sentences)
    pm = spmd.parallelize(model, Mesh.create(("tp",), devices="cuda"), plans.bert_plan())
    out = pm(batch.input_ids, batch.attention_mask).to_torch().float()
    cos = F.cosine_similarity(out, ref, dim=1)
    assert (out - ref).abs().max().item() <= tol
    if dtype == torch.float32:
        assert cos.min().item() >= 0.99999
