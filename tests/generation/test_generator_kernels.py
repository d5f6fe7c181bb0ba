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


def _decode_program(layers: int, gpu: bool):
    """(entry instructions by name, kernel thunks that are no views) of the donating decode variant."""
    model = llama_lm("llama2-7b", layers, small=True, seed=0)
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


def _per_layer(gpu: bool) -> tuple[Counter, list]:
    counts = []
    for layers in (1, 2):
        insts, kernels, program = _decode_program(layers, gpu)
        counts.append(Counter(insts[t.name].opcode for t in kernels))
    return counts[1] - counts[0], (insts, kernels, program)


@pytest.mark.parametrize("gpu", [False, True])
def test_one_kernel_writes_both_caches_per_layer(gpu):
    per_layer, (insts, kernels, program) = _per_layer(gpu)
    assert per_layer["dynamic-update-slice"] == 0
    writes = [t for t in kernels if isinstance(t, MultiOutputKernelThunk)
              and all(s.opcode == "dynamic-update-slice" for s in insts[t.name].attrs["calls"].root.operands)]
    assert len(writes) == 2  # one per layer
    for t in writes:  # both elements stored into donated cache buffers, in place
        assert len(t.buffers) == 2 and all(b >= len(program.arena_views) for b in t.buffers)
    # per layer: q rotary, the k/v cache write (with k's rotary), 2 RMS norms, SwiGLU
    assert per_layer["fusion"] == 5
    assert sum(per_layer.values()) == 13, per_layer  # 15 before: the rotary of k and two dynamic-update-slices


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
