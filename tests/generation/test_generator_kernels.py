"""Kernels of the compiled decode step, per decoder layer (the lowering that CUDA runs, built on CPU).

Per layer, a decode step writes its new key and value rows into the donated KV cache. With
in-place update fusions (``spmd.passes.fuse_update_slice``) the rotary embedding of k, the k
write and the v write are one kernel (a multi-output fusion of two dynamic-update-slices that
stores into both donated caches), not three. The counts come from the difference between a
two-layer and a one-layer model, so the per-step work (embedding, sampling) cancels.
"""

from collections import Counter

import pytest
import torch

import spmd
from spmd.generation import Generator, Sampling
from spmd.models.llama_lm import llama_lm
from spmd.runtime.lower import lower
from spmd.runtime.thunks import KernelThunk, MultiOutputKernelThunk


def _decode_program(layers: int, gpu: bool, kv_heads: int = 2):
    """(entry instructions by name, kernel thunks that are no views, the program) of the donating
    decode variant; ``kv_heads`` 2 (GQA: 4 query heads) or 4 (multi-head attention, as Llama-2-7B)."""
    model = llama_lm("llama2-7b", layers, small=True, seed=0, num_kv_heads=kv_heads)
    gen = Generator(model, spmd.Mesh.create(("tp",), devices="cpu:1"), max_batch=2, max_seq=16, prefill_len=4)
    gen.generate([[1, 2, 3], [4]], 2)
    (compiled,) = gen.programs(Sampling())[1]._cache.values()
    ex = compiled.executable
    donated, program = max(ex._variants.items(), key=lambda kv: len(kv[0]))
    program = program[0]
    if gpu:  # the CUDA lowering: the same passes and fusions, plus event thunks and host offset copies
        program = lower(ex.module, ex.devices, ex.pids, ex._buffers, gpu=True, donated=donated)
    insts = {i.name: i for i in ex.module.entry.instructions}
    kernels = [t for t in program.thunks if isinstance(t, KernelThunk) and t.out not in program.view_slots]
    return insts, kernels, program


def _per_layer(gpu: bool, kv_heads: int = 2) -> tuple[Counter, list]:
    counts = []
    for layers in (1, 2):
        insts, kernels, program = _decode_program(layers, gpu, kv_heads)
        counts.append(Counter(insts[t.name].opcode for t in kernels))
    return counts[1] - counts[0], (insts, kernels, program)


def _cache_writes(insts, kernels) -> list[MultiOutputKernelThunk]:
    return [t for t in kernels if isinstance(t, MultiOutputKernelThunk)
            and sum(s.opcode == "dynamic-update-slice" for s in insts[t.name].attrs["calls"].root.operands) == 2]


@pytest.mark.parametrize(("gpu", "kv_heads"), [(False, 2), (True, 2), pytest.param(True, 4, marks=pytest.mark.slow)])
def test_one_kernel_writes_both_caches_per_layer(gpu, kv_heads):
    per_layer, (insts, kernels, program) = _per_layer(gpu, kv_heads)
    assert per_layer["dynamic-update-slice"] == 0
    writes = _cache_writes(insts, kernels)
    assert len(writes) == 2  # one per layer
    for t in writes:  # both caches stored into their donated buffers, in place
        roots = insts[t.name].attrs["calls"].root.operands
        cache_buffers = [b for b, r in zip(t.buffers, roots, strict=True) if r.opcode == "dynamic-update-slice"]
        assert all(b >= len(program.arena_views) for b in cache_buffers)
        assert program.output_donors  # the cache outputs are the donated cache arguments
    if kv_heads == 2:
        # GQA, per layer: q rotary, the k/v cache write (with k's rotary), 2 RMS norms, SwiGLU;
        # 15 kernels before (rotary of k and two dynamic-update-slices apart)
        assert per_layer["fusion"] == 5 and sum(per_layer.values()) == 13, per_layer
    else:
        # MHA (q has the k update's dims): q's rotary joins the cache write, 3 outputs, one kernel;
        # 4 fusions per layer (q/k rotary + k/v writes, 2 RMS norms, SwiGLU); 12 kernels before
        assert all(len(t.buffers) == 3 for t in writes)
        assert per_layer["fusion"] == 4 and sum(per_layer.values()) == 10, per_layer


def test_decode_with_fused_cache_writes_equals_eager_kv():
    from spmd.generation.reference import reference_generate

    model = llama_lm("llama2-7b", 2, small=True, seed=3)
    gen = Generator(model, spmd.Mesh.create(("tp",), devices="cpu:1"), max_batch=2, max_seq=12, prefill_len=4)
    prompts = [[9, 2, 7], [4]]
    res = gen.generate(prompts, 6)
    tokens, start = gen.pad_prompts(gen._check_prompts(prompts))
    ref, ref_kv = reference_generate(model, tokens, start, 6, 12, None)
    assert torch.equal(res.tokens, ref[:2])
    for (k, v), (rk, rv) in zip(gen.kv_cache(), ref_kv, strict=True):
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)
