"""spmd.Generator against the same model in plain PyTorch eager (float32, one device)."""

import numpy as np
import pytest
import torch

import spmd
from spmd.generation import Generator, Sampling
from spmd.generation.reference import reference_generate
from spmd.models.llama_lm import llama_lm

PROMPTS4 = [[5, 17, 3, 99, 42, 7], [11, 2], [200, 1, 9, 31, 64, 128, 250, 4, 8, 16], [77]]
PREFILL, NEW = 12, 64
MAX_SEQ = PREFILL + NEW


@pytest.fixture(scope="module")
def model():
    return llama_lm(small=True, seed=1)


def _mesh(axes, n):
    return spmd.Mesh.create(axes, devices=f"cpu:{n}")


def _check_against_eager(model, gen, prompts, sampling=None):
    res = gen.generate(prompts, NEW, sampling)
    tokens, start = gen.pad_prompts(gen._check_prompts(prompts))
    ref, ref_kv = reference_generate(model, tokens, start, NEW, MAX_SEQ, sampling)
    assert res.tokens.shape == (len(prompts), NEW)
    assert torch.equal(res.tokens, ref[:len(prompts)])
    for (k, v), (rk, rv) in zip(gen.kv_cache(), ref_kv, strict=True):
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)
    return res


@pytest.mark.parametrize(("axes", "n", "batch"), [
    (("tp",), 1, 1), (("tp",), 2, 4), pytest.param(("tp",), 4, 4, marks=pytest.mark.slow), ({"dp": 2, "tp": 2}, 4, 4),
    pytest.param(("tp",), 1, 4, marks=pytest.mark.slow), pytest.param(("tp",), 4, 1, marks=pytest.mark.slow),
])
def test_greedy_tokens_and_cache_equal_eager(model, axes, n, batch):
    # tp=4 exceeds the 2 KV heads: the cache and K/V projections are replicated over tp
    gen = Generator(model, _mesh(axes, n), max_batch=batch, max_seq=MAX_SEQ, prefill_len=PREFILL)
    _check_against_eager(model, gen, PROMPTS4[:batch] if batch > 1 else PROMPTS4[2:3])


def test_generate_from_two_threads_runs_one_after_the_other(model):
    """Thread B starts while thread A is between decode steps. Both share the donated cache: B used to
    replace it under A (A then decoded on B's cache, or a donated array was reused)."""
    import threading

    gen = Generator(model, _mesh(("tp",), 2), max_batch=2, max_seq=24, prefill_len=8)
    prompts_a, prompts_b = [[5, 17, 3], [11]], [[200, 1, 9, 31, 64, 128, 250, 4], [77, 8]]
    want_a, want_b = gen.generate(prompts_a, 6).tokens, gen.generate(prompts_b, 6).tokens
    got: dict = {}
    b = threading.Thread(target=lambda: got.setdefault("b", gen.generate(prompts_b, 6).tokens))

    def pause_a(n):
        if n == 2:  # A is mid-generation: let B run (or block on the lock) before A's next step
            b.start()
            b.join(timeout=1.0)

    got["a"] = gen.generate(prompts_a, 6, progress=pause_a).tokens
    b.join()
    assert torch.equal(got["a"], want_a) and torch.equal(got["b"], want_b)


def test_kv_cache_sharding(model):
    gen = Generator(model, _mesh({"dp": 2, "tp": 2}, 4), max_batch=4, max_seq=16, prefill_len=4)
    assert gen.kv_sharding.spec == spmd.PartitionSpec("dp", "tp", None, None)
    gen4 = Generator(model, _mesh(("tp",), 4), max_batch=1, max_seq=16, prefill_len=4)
    assert gen4.kv_sharding.spec == spmd.PartitionSpec(None, None, None, None)


def test_compiled_once_for_every_position_and_call(model):
    gen = Generator(model, _mesh(("tp",), 2), max_batch=2, max_seq=24, prefill_len=4)
    miss = spmd.metrics.counter("compile_cache.miss")
    before = miss.value
    first = gen.generate([[1, 2, 3], [4]], 20)
    assert miss.value - before == 2  # one prefill and one decode program
    again = gen.generate([[1, 2, 3], [4]], 20)
    other = gen.generate([[9, 8, 7, 6], [5, 4]], 10)
    assert miss.value - before == 2
    assert torch.equal(first.tokens, again.tokens) and other.tokens.shape == (2, 10)


def test_sampling_with_temperature_equals_eager_and_is_seeded(model):
    gen = Generator(model, _mesh(("tp",), 2), max_batch=4, max_seq=MAX_SEQ, prefill_len=PREFILL)
    a = _check_against_eager(model, gen, PROMPTS4, Sampling(temperature=0.9, seed=3))
    b = gen.generate(PROMPTS4, NEW, Sampling(temperature=0.9, seed=3))
    c = gen.generate(PROMPTS4, NEW, Sampling(temperature=0.9, seed=4))
    greedy = gen.generate(PROMPTS4, NEW)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens) and not torch.equal(a.tokens, greedy.tokens)


def test_timing_streaming_and_one_shot_generate(model):
    mesh = _mesh(("tp",), 2)
    gen = Generator(model, mesh, max_batch=2, max_seq=24, prefill_len=4)
    chunks, seen = [], []
    res = gen.generate([[3, 1], [4, 1, 5]], 9, timing=True, stream_every=4, on_tokens=chunks.append,
                       progress=seen.append)
    assert [c.shape[1] for c in chunks] == [4, 4, 1] and torch.equal(torch.cat(chunks, 1), res.tokens)
    assert len(res.step_latencies_s) == 8 and res.ttft_s > 0 and res.tokens_per_s > 0 and seen[-1] == 9
    one = spmd.generate(model, mesh, [[3, 1], [4, 1, 5]], 9)
    assert torch.equal(one.tokens, res.tokens)


BAD_CALLS = [
    (dict(prompts=[list(range(1, 14))]), ValueError, "exceed prefill_len"),
    (dict(max_new_tokens=30), ValueError, "past the cache"),
    (dict(prompts=[[1]] * 3), ValueError, "exceed the cache's batch"),
    (dict(prompts=[[1], []]), ValueError, "empty prompt"),
    (dict(prompts=[]), TypeError, "non-empty list"),
    (dict(prompts=[[1, 256]]), ValueError, r"\[0, 256\)"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=2.0), TypeError, "max_new_tokens: expected an int >= 1, got float 2.0"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens: expected an int >= 1, got bool"),
    (dict(sampling="greedy"), TypeError, "sampling"),
    (dict(prompts=[1, 2]), TypeError, r"prompts\[0\]: expected a sequence"),
    (dict(prompts=[torch.tensor(3)]), TypeError, r"prompts\[0\]: expected a 1-d tensor"),
    (dict(prompts=[[1, 2.0]]), TypeError, r"prompts\[0\]: expected int token ids, got float 2.0"),
    (dict(prompts=[[np.int64(1)], [np.float32(2)]]), TypeError, r"prompts\[1\]: expected int token ids, got float32"),
    (dict(prompts=[b"\x01\x02"]), TypeError, r"prompts\[0\]: expected a sequence of int token ids .* got bytes"),
    (dict(prompts=[bytearray(b"\x01")]), TypeError, r"prompts\[0\]: expected a sequence .* got bytearray"),
    (dict(prompts=[np.array([[1]])]), TypeError, r"prompts\[0\]: expected a 1-d array of token ids, got a 2-d array"),
    (dict(prompts=np.array([[1.0, 2.0]])), TypeError, r"prompts\[0\]: expected int token ids, got float 1.0"),
    (dict(prompts=np.array([1, 2])), TypeError, "non-empty list"),
    (dict(timing="yes"), TypeError, "timing"),
    (dict(stream_every=-1), ValueError, "stream_every: expected an int >= 0, got -1"),
    (dict(stream_every=2.0), TypeError, "stream_every: expected an int >= 0, got float 2.0"),
    (dict(progress=5), TypeError, "progress: expected a callable"),
    (dict(stream_every=1, on_tokens="print"), TypeError, "on_tokens: expected a callable"),
    (dict(on_tokens=print), ValueError, r"on_tokens: given with stream_every=0 \(no streaming\)"),
    (dict(prompts=[torch.tensor([1, 2], device="meta")]), TypeError,
     r"prompts\[0\]: expected a tensor of token ids with data, got a tensor on the meta device"),
]


@pytest.mark.parametrize(("kwargs", "exc", "match"), BAD_CALLS)
def test_bad_input_is_a_clear_error_and_leaves_the_cache(bad_input_gen, kwargs, exc, match):
    gen = bad_input_gen
    before = gen.kv_cache()
    call = dict(prompts=[[1, 2], [3]], max_new_tokens=4, sampling=None) | kwargs
    with pytest.raises(exc, match=match):
        gen.generate(call.pop("prompts"), call.pop("max_new_tokens"), call.pop("sampling"), **call)
    for (k, v), (k0, v0) in zip(gen.kv_cache(), before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert gen.generate([[1, 2], [3]], 4).tokens.shape == (2, 4)


def test_numpy_integer_token_ids_are_token_ids(bad_input_gen):
    gen = bad_input_gen
    want = gen.generate([[1, 2], [3]], 4).tokens
    assert torch.equal(gen.generate([[np.int64(1), np.int32(2)], [np.uint8(3)]], 4).tokens, want)
    chunks = []
    assert torch.equal(gen.generate([[1, 2], [3]], 4, stream_every=np.int64(3), on_tokens=chunks.append).tokens, want)
    assert [c.shape[1] for c in chunks] == [3, 1]


def test_numpy_arrays_of_token_ids_are_prompts(bad_input_gen, model):
    """A 2-d integer array is a batch of equal-length prompts, as a 2-d tensor is; 1-d arrays are prompts."""
    gen = bad_input_gen
    want = gen.generate([[1, 2], [3, 4]], 4).tokens
    assert torch.equal(gen.generate(np.array([[1, 2], [3, 4]], dtype=np.int32), 4).tokens, want)
    assert torch.equal(gen.generate([np.array([1, 2]), np.array([3, 4], dtype=np.uint8)], 4).tokens, want)
    assert torch.equal(gen.generate(np.array([[1, 2], [3, 4]])[:, ::-1][:, ::-1], 4).tokens, want)  # strided
    mesh = spmd.Mesh.create(("tp",), devices="cpu:1")
    assert torch.equal(spmd.generate(model, mesh, np.array([[1, 2], [3, 4]]), 4).tokens,
                       spmd.generate(model, mesh, [[1, 2], [3, 4]], 4).tokens)


@pytest.fixture(scope="module")
def bad_input_gen(model):
    gen = Generator(model, _mesh(("tp",), 2), max_batch=2, max_seq=16, prefill_len=12)
    gen.generate([[1, 2], [3]], 4)  # the cache holds values to compare
    return gen


@pytest.mark.parametrize(("prompts", "kwargs", "match"), [
    ([1, 2, 3], {}, r"prompts\[0\]: expected a sequence"),
    ([torch.tensor(3)], {}, r"prompts\[0\]: expected a 1-d tensor"),
    ([[1, 2]], {"max_seq": "8"}, "max_seq"),
    ([[1, 2, 3], [4]], {"max_seq": 2}, r"max_seq: the longest prompt \(3 tokens\) and 4 new tokens need 6 cache "),
    ([[1, 2]], {"max_seq": 4}, r"max_seq: .* need 5 cache positions, got max_seq=4"),
])
def test_one_shot_generate_rejects_bad_arguments(model, prompts, kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        spmd.generate(model, _mesh(("tp",), 2), prompts, 4, **kwargs)


@pytest.mark.parametrize(("max_new_tokens", "kwargs", "exc", "match"), [
    (2.0, {}, TypeError, "max_new_tokens: expected an int >= 1, got float 2.0"),
    (True, {}, TypeError, "max_new_tokens: expected an int >= 1, got bool"),
    (0, {}, ValueError, "max_new_tokens: expected an int >= 1, got 0"),
    (4, {"max_seq": 8.0}, TypeError, "max_seq: expected an int >= 1, got float 8.0"),
    (4, {"max_seq": 0}, ValueError, "max_seq: expected an int >= 1, got 0"),
])
def test_one_shot_generate_checks_sizes_as_generator_does(model, max_new_tokens, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        spmd.generate(model, _mesh(("tp",), 2), [[1, 2]], max_new_tokens, **kwargs)


def test_one_shot_generate_takes_numpy_integer_sizes(model):
    mesh = _mesh(("tp",), 2)
    want = spmd.generate(model, mesh, [[1, 2], [3]], 3).tokens
    got = spmd.generate(model, mesh, [[1, 2], [3]], np.int64(3), max_seq=np.int32(5)).tokens
    assert torch.equal(got, want)


def test_bad_construction(model):
    mesh = _mesh(("tp",), 2)
    with pytest.raises(ValueError, match="prefill_len"):
        Generator(model, mesh, max_batch=1, max_seq=8, prefill_len=9)
    with pytest.raises(ValueError, match="max_batch"):
        Generator(model, mesh, max_batch=0, max_seq=8, prefill_len=4)
    with pytest.raises(TypeError, match="model"):
        Generator(torch.nn.Linear(2, 2), mesh, max_batch=1, max_seq=8, prefill_len=4)
    with pytest.raises(TypeError, match="max_seq: expected an int >= 1, got float 8.0"):
        Generator(model, mesh, max_batch=1, max_seq=8.0, prefill_len=4)
    with pytest.raises(TypeError, match="options: expected a spmd.CompileOptions or None, got dict"):
        Generator(model, mesh, max_batch=1, max_seq=8, prefill_len=4, options={"cuda_graphs": False})
    gen = Generator(model, mesh, max_batch=np.int64(1), max_seq=np.int32(8), prefill_len=np.uint8(4))
    assert (type(gen.max_batch), gen.max_seq, gen.prefill_len) == (int, 8, 4)
    with pytest.raises(ValueError, match=r"mesh: axes \['model'\] are not used by spmd.Generator; expected axes dp "
                                         r"and/or tp \(other axes only of size 1\), got Mesh\(\{'model': 2\}"):
        Generator(model, _mesh({"model": 2}, 2), max_batch=1, max_seq=8, prefill_len=4)
    with pytest.raises(ValueError, match=r"mesh: axes \['pp', 'ep'\] are not used"):
        Generator(model, _mesh({"pp": 2, "tp": 1, "ep": 2}, 4), max_batch=1, max_seq=8, prefill_len=4)
    assert Generator(model, _mesh({"model": 1, "tp": 2}, 2), max_batch=1, max_seq=8, prefill_len=4).dp is None
    # a cache of petabytes: a ValueError naming the sizes, not the allocator's RuntimeError
    with pytest.raises(ValueError, match=r"max_batch \(1\), max_seq \(1000000000000\): the KV cache .* needs about "
                                         r".* GiB available; expected a smaller max_batch or max_seq"):
        Generator(model, mesh, max_batch=1, max_seq=10**12, prefill_len=4)


@pytest.mark.parametrize("sampling", [pytest.param(Sampling(temperature=1.0, top_k=5, seed=1), marks=pytest.mark.slow),
                                      Sampling(temperature=1.0, top_p=0.9)])
def test_top_k_and_top_p_equal_eager(model, sampling):
    gen = Generator(model, _mesh(("tp",), 2), max_batch=4, max_seq=MAX_SEQ, prefill_len=PREFILL)
    _check_against_eager(model, gen, PROMPTS4, sampling)


def test_a_prefill_too_large_for_memory_is_refused_before_anything_is_placed(monkeypatch):
    """An API user gets the same up-front error as ``spmd generate``: naming prefill_len, expected vs
    available memory, before the weights are placed or anything compiles (it used to be the
    allocator's error, minutes into the prefill)."""
    from spmd.generation import checks

    monkeypatch.setattr(checks, "available_bytes", lambda device: 64 * 2**20)
    model = llama_lm("llama2-7b", 1, small=True, seed=0)
    mesh = spmd.Mesh.create({"dp": 2}, devices="cpu:2")
    before = spmd.metrics.counter("compile_cache.miss").value
    with pytest.raises(ValueError, match=r"prefill_len: a prefill of 2048 tokens needs about 0\.1 GiB .*"
                                         r"float32 \[1, 1, 2048, 2050\] twice on each of 2 virtual CPU devices.*"
                                         r"fewer mesh devices"):
        Generator(model, mesh, max_batch=2, max_seq=2050, prefill_len=2048)
    assert spmd.metrics.counter("compile_cache.miss").value == before
    Generator(model, mesh, max_batch=2, max_seq=257, prefill_len=256)  # 2 x 256 x 257 x 4 bytes fits


def test_a_kv_cache_larger_than_memory_is_refused_before_it_is_allocated(monkeypatch):
    """Each cache tensor fits on its own (Linux allows the allocation), all of them do not: the
    process used to grow until the kernel's out-of-memory killer ended it."""
    from spmd.generation import checks

    monkeypatch.setattr(checks, "available_bytes", lambda device: 8 * 2**30)
    model = llama_lm("llama2-7b", 2, small=True, seed=0)
    mesh = spmd.Mesh.create({"tp": 4}, devices="cpu:4")  # 2 KV heads: the cache is replicated over tp
    with pytest.raises(ValueError, match=r"max_batch \(1\), max_seq \(50000000\): the KV cache \(2 x 2 layers x "
                                         r"\[1, 2, 50000000, 16\], 23.8 GiB, replicated 4 times\) needs about "
                                         r"333.8 GiB on 4 virtual CPU devices \(3.5x the cache while a step runs\), "
                                         r"more than the 8.0 GiB available"):
        Generator(model, mesh, max_batch=1, max_seq=50_000_000, prefill_len=16)
    Generator(model, mesh, max_batch=1, max_seq=4096, prefill_len=16)  # 4 x 2 MiB x 4 x 3.5 fits
