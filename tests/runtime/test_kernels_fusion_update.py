"""In-place update fusions through ``spmd.jit``: a decode step's rotary embedding and KV-cache
writes (one fusion: q's rotary value, the k and v cache updates) against single-device PyTorch
in float64, on fresh random inputs and positions, with the cache's kv heads sharded over ``tp``
(cpu:1, 2 and 4: one, two and four devices over 4 heads); the donated caches are updated in place."""

import pytest
import torch

import spmd
from spmd.sharding import NamedSharding
from spmd.sharding import PartitionSpec as P

B, HEADS, SEQ, HD = 2, 4, 8, 8


def _rotate(x, cos, sin):
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def step(kc, vc, qkv, cos, sin, pos):
    """qkv [B, 1, 3, HEADS, HD] (heads sharded: a column-parallel projection) -> (rotated q
    [B, HEADS, 1, HD], new k cache, new v cache)."""
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    slot = pos.reshape(1)
    return q, kc.index_copy(2, slot, k), vc.index_copy(2, slot, v)


def _inputs(seed: int, pos: int):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) + 0.1  # noqa: E731
    return (r(B, HEADS, SEQ, HD), r(B, HEADS, SEQ, HD), r(B, 1, 3, HEADS, HD), r(B, 1, 1, HD), r(B, 1, 1, HD),
            torch.tensor(pos))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_fused_cache_writes_equal_pytorch_and_stay_in_place(n):
    mesh = spmd.Mesh.create(("tp",), devices=f"cpu:{n}")
    heads = P(None, "tp")
    jitted = spmd.jit(step, mesh=mesh, in_shardings=(heads, heads, P(None, None, None, "tp"), P(), P(), P()),
                      out_shardings=(heads, heads, heads), donate_argnums=(0, 1))
    compiled = None
    for seed, pos in ((0, 3), (1, 0), (2, SEQ - 1), (3, 5)):
        args = _inputs(seed, pos)
        want = step(*args)
        f32 = [a.float() if a.is_floating_point() else a for a in args]
        kc = spmd.device_put(f32[0], NamedSharding(mesh, heads))
        vc = spmd.device_put(f32[1], NamedSharding(mesh, heads))
        before = [t.data_ptr() for t in (*kc._buffers, *vc._buffers)]
        if compiled is None:
            compiled = jitted.lower(kc, vc, *f32[2:]).compile()
            text = jitted.lower(kc, vc, *f32[2:]).as_text("multi-output-fusion")
            fused = [ln for ln in text.splitlines() if " fusion(" in ln and "ENTRY" not in ln]
            # one fusion stores q's rotary value and both cache updates
            assert any(ln.count("f32[") >= 3 and "(f32" in ln.split("=")[1] for ln in fused), text
        got = jitted(kc, vc, *f32[2:])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.to_torch().double(), w, rtol=1e-5, atol=1e-5)
        assert [t.data_ptr() for t in (*got[1]._buffers, *got[2]._buffers)] == before  # updated in place


def _fallbacks() -> int:
    return sum(v for k, v in spmd.metrics.snapshot()["counters"].items() if k.startswith("fusion.fallback."))


def _generated_decode_matches_eager(device: str, kv_heads: int, max_seq: int,
                                    prefill_len: int = 4, **model: object) -> tuple[int, int]:
    """Greedy tokens and caches of generated update kernels equal eager PyTorch; returns (update
    fusions compiled, kernels Inductor generated for them). ``max_seq``: a cache length no other
    test uses, so that the kernels are compiled here; ``model``: ``llama_lm`` arguments (default:
    the small shape)."""
    from spmd.generation import Generator
    from spmd.generation.reference import reference_generate
    from spmd.models.llama_lm import llama_lm

    model = llama_lm(**({"small": True} | model), seed=4, device=f"{device}:0", num_kv_heads=kv_heads)
    gen = Generator(model, spmd.Mesh.create(("tp",), devices=f"{device}:1"), max_batch=2, max_seq=max_seq,
                    prefill_len=prefill_len)
    prompts = [[5, 17, 3], [11]] if prefill_len >= 3 else [[5], [11]]
    compiled, kernels = (spmd.metrics.counter(f"fusion.update.{k}") for k in ("compiled", "kernels"))
    before, fallbacks = (compiled.value, kernels.value), _fallbacks()
    gen.generate(prompts, 3)  # on CUDA the first calls run eagerly, the next capture the graphs
    res = gen.generate(prompts, 8)
    tokens, start = gen.pad_prompts(prompts)
    ref, ref_kv = reference_generate(model, tokens, start, 8, max_seq)
    assert torch.equal(res.tokens, ref.cpu())
    for (k, v), (rk, rv) in zip(gen.kv_cache(), ref_kv, strict=True):
        torch.testing.assert_close(k, rk.cpu(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, rv.cpu(), rtol=1e-4, atol=1e-4)
    assert _fallbacks() == fallbacks
    return compiled.value - before[0], kernels.value - before[1]


@pytest.mark.slow
def test_generated_kernel_on_cpu_equals_eager(monkeypatch):
    """The Inductor path on CPU (``SPMD_FUSION_COMPILER=inductor``: C++ kernels), multi-head attention:
    q's rotary, k and v cache writes traced and compiled into one kernel, tokens and caches as eager."""
    monkeypatch.setenv("SPMD_FUSION_COMPILER", "inductor")
    compiled, _ = _generated_decode_matches_eager("cpu", kv_heads=4, max_seq=17)
    assert compiled >= 2  # prefill and decode


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_generated_kernel_on_gpu_is_one_triton_kernel_and_equals_eager(monkeypatch, kv_heads):
    """Each update fusion (the k / v cache writes with k's rotary, and q's rotary under multi-head
    attention) compiles to one Triton kernel: Inductor would split the two cache writes, which
    share no read but the position, without ``_options``' fusion settings."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)  # count kernels generated here
    # one-token prompts: the prefill writes one row as the decode step does (a longer prefill may
    # take a second kernel for q's transposed rows)
    compiled, kernels = _generated_decode_matches_eager("cuda", kv_heads, max_seq=18 + kv_heads, prefill_len=1)
    assert compiled >= 2 and kernels == compiled, (compiled, kernels)


@pytest.mark.gpu
def test_generated_kernel_at_llama2_7b_layer_shapes_is_one_triton_kernel(monkeypatch):
    """At Llama-2-7B's layer shapes (32 heads of 128; one layer, a small vocabulary) q's rotary is
    stored by the kernel that writes the caches: as a copy into fresh memory Inductor made it a
    kernel of its own (two kernels per layer and step on an H200)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    compiled, kernels = _generated_decode_matches_eager("cuda", 32, max_seq=25, prefill_len=1, small=False,
                                                        layers=1, vocab_size=512)
    assert compiled >= 2 and kernels == compiled, (compiled, kernels)


def test_generated_update_kernel_options_ask_inductor_for_pdl_only_when_spmd_uses_it():
    import torch._inductor.config as inductor_config

    from spmd.runtime import kernels_fusion_update as kfu

    assert "triton.enable_pdl" not in kfu._options(False)
    assert kfu._options(True).get("triton.enable_pdl") is (True if hasattr(inductor_config.triton, "enable_pdl")
                                                         else None)
    assert kfu._options(True)["score_fusion_memory_threshold"] == 0
    assert not kfu._pdl(torch.device("cpu"))
