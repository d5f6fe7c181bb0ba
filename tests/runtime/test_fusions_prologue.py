"""Fusion (d): a skinny 16-bit product takes over the RMS norm or SwiGLU fusion of its input,
checked on the lowered program (which kernels remain) and against float64 eager on CPU meshes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import PartitionSpec as P
from spmd.generation import Generator, Sampling
from spmd.models.llama import RMSNorm
from spmd.models.llama_lm import llama_lm
from spmd.passes.assign_buffers import assign_buffers
from spmd.runtime.lower import lower
from spmd.runtime.thunks import KernelThunk


def _prologue_kernels(program) -> list[KernelThunk]:
    return [t for t in program.thunks if isinstance(t, KernelThunk)
            and getattr(t.fn, "__qualname__", "").startswith("make_prologue_product")]


def _program(f, args, n: int):
    module = f.lower(*args).result.module
    return lower(module, [torch.device("cpu")] * n, list(range(n)), assign_buffers(module), gpu=True)


def _check(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Within a few bf16 roundings of the float64 result (relative to the result's scale)."""
    scale = ref.abs().max().item()
    torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=2e-2 * scale)


class NormLinear(torch.nn.Module):
    def __init__(self, k: int, n: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(k, 1e-5)
        self.proj = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
        self.to(dtype)

    def forward(self, x, keep_normed: bool = False):
        h = self.norm(x)
        return (self.proj(h), h) if keep_normed else self.proj(h)


def _norm_linear(rows: int, n: int, keep_normed: bool = False, mesh_spec: str = "cpu:1"):
    torch.manual_seed(rows + n)
    model = NormLinear(48, 40, torch.bfloat16)
    x = torch.randn(rows, 1, 48).bfloat16()
    mesh = spmd.Mesh.create(("dp",), devices=mesh_spec)
    spec = P("dp", None, None) if n > 1 else P()
    params = {k: v.detach() for k, v in model.named_parameters()}
    f = spmd.jit(lambda p, x: torch.func.functional_call(model, p, (x, keep_normed)), mesh=mesh,
                 in_shardings=(None, spec), options=spmd.CompileOptions(cuda_graphs=False))
    args = (params, spmd.device_put(x, spmd.NamedSharding(mesh, spec)))
    with torch.no_grad():
        model64 = NormLinear(48, 40, torch.float64)
        model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
        ref = model64(x.double(), keep_normed)
    return f, args, ref


@pytest.mark.parametrize(("rows", "n", "fused"), [(1, 1, 1), (5, 1, 1), (16, 1, 1), (17, 1, 0), (8, 2, 1)])
def test_rms_norm_into_the_product_of_up_to_16_rows(rows, n, fused):
    f, args, ref = _norm_linear(rows, n, mesh_spec=f"cpu:{n}")
    assert len(_prologue_kernels(_program(f, args, n))) == fused
    _check(f(*args).to_torch(), ref)


def test_a_norm_that_is_also_returned_stays_a_kernel():
    f, args, (ref, ref_h) = _norm_linear(2, 1, keep_normed=True)
    assert not _prologue_kernels(_program(f, args, 1))
    got, h = f(*args)
    _check(got.to_torch(), ref)
    _check(h.to_torch(), ref_h)


class GatedMLP(torch.nn.Module):
    """``h + down(silu(gate(h)) * up(h))`` with the gate and up projections as one weight."""

    def __init__(self, k: int, inner: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up = torch.nn.Linear(k, 2 * inner, bias=False)
        self.down = torch.nn.Linear(inner, k, bias=False)
        self.inner = inner
        self.to(dtype)

    def forward(self, h):
        gu = self.gate_up(h)
        return h + self.down(F.silu(gu[..., :self.inner]) * gu[..., self.inner:])


@pytest.mark.parametrize("n", [1, 2])
def test_swiglu_into_the_residual_accumulating_down_product(n):
    torch.manual_seed(n)
    model = GatedMLP(32, 56, torch.bfloat16)
    h = torch.randn(4, 1, 32).bfloat16()
    mesh = spmd.Mesh.create(("dp",), devices=f"cpu:{n}")
    spec = P("dp", None, None)
    params = {k: v.detach() for k, v in model.named_parameters()}
    f = spmd.jit(lambda p, h: torch.func.functional_call(model, p, (h,)), mesh=mesh, in_shardings=(None, spec),
                 options=spmd.CompileOptions(cuda_graphs=False))
    args = (params, spmd.device_put(h, spmd.NamedSharding(mesh, spec)))
    kernels = _prologue_kernels(_program(f, args, n))
    assert len(kernels) == 1 and len(kernels[0].ins) == 3  # [residual, gate-up product, down weight]
    with torch.no_grad():
        model64 = GatedMLP(32, 56, torch.float64)
        model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
        _check(f(*args).to_torch(), model64(h.double()))


def _decode_kernels(layers: int, dtype: torch.dtype):
    model = llama_lm("llama2-7b", layers, small=True, seed=3, num_kv_heads=4, dtype=dtype)
    gen = Generator(model, spmd.Mesh.create(("tp",), devices="cpu:1"), max_batch=2, max_seq=12, prefill_len=4)
    prompts = [[9, 2, 7], [4]]
    res = gen.generate(prompts, 6)
    (compiled,) = gen.programs(Sampling())[1]._cache.values()
    ex = compiled.executable
    program = max(ex._variants.items(), key=lambda kv: len(kv[0]))[1][0]
    insts = {i.name: i for i in ex.module.entry.instructions}
    kernels = [t for t in program.thunks if isinstance(t, KernelThunk) and t.out not in program.view_slots]
    return Counter(insts[t.name].opcode for t in kernels), len(_prologue_kernels(program)), (gen, model, prompts, res)


def test_a_bf16_decode_layer_runs_its_norms_and_swiglu_inside_its_products():
    from spmd.generation.reference import reference_generate

    one, pro_one, _ = _decode_kernels(1, torch.bfloat16)
    two, pro_two, (gen, model, prompts, res) = _decode_kernels(2, torch.bfloat16)
    per_layer = two - one
    # MHA, per layer: q/k rotary + both cache writes (one fusion), attention, the qkv, o, gate-up
    # and down products; the two RMS norms and SwiGLU run inside the qkv, gate-up and down kernels
    assert per_layer["fusion"] == 1 and pro_two - pro_one == 3, per_layer
    assert pro_one == 4  # and the final norm inside the lm-head product
    tokens, start = gen.pad_prompts(gen._check_prompts(prompts))
    ref, _ = reference_generate(model, tokens, start, 6, 12, None)
    assert torch.equal(res.tokens, ref[:2])


def test_float32_decode_keeps_its_fusions():
    one, pro_one, _ = _decode_kernels(1, torch.float32)
    assert pro_one == 0 and one["fusion"] >= 4


def _hf_norm(x, g):
    x32 = x.float()
    return g * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _norm_then_another_product(a, b, w0, w1, w2, g):
    x = a @ w0
    n = _hf_norm(x, g)
    t = b @ w1  # scheduled between the norm and its product; its arena bytes are x's (dead there)
    return n @ w2 + t


@pytest.mark.parametrize("n", [1, 2])
def test_a_norm_is_not_moved_past_a_product_that_reuses_its_inputs_bytes(n):
    torch.manual_seed(11)
    k = 32
    a, b = torch.randn(4, k).bfloat16(), torch.randn(4, k).bfloat16()
    w0, w1, w2 = ((torch.randn(k, k) / 5).bfloat16() for _ in range(3))
    g = (torch.rand(k) + 0.5).bfloat16()
    mesh = spmd.Mesh.create(("dp",), devices=f"cpu:{n}")
    specs = (P("dp"), P("dp"), P(), P(), P(), P())
    f = spmd.jit(_norm_then_another_product, mesh=mesh, in_shardings=specs,
                 options=spmd.CompileOptions(cuda_graphs=False))
    args = [spmd.device_put(t, spmd.NamedSharding(mesh, s)) for t, s in zip((a, b, w0, w1, w2, g), specs, strict=True)]
    assert not _prologue_kernels(_program(f, args, n))
    _check(f(*args).to_torch(), _norm_then_another_product(a.double(), b.double(), w0.double(), w1.double(),
                                                          w2.double(), g.double()))


def test_only_views_may_run_between_a_fusion_and_the_op_that_takes_it_over():
    from types import SimpleNamespace

    from spmd.runtime.fusions import only_views_between

    ops = [SimpleNamespace(extra={}), SimpleNamespace(extra={"view": True}), SimpleNamespace(extra={}),
           SimpleNamespace(extra={})]
    assert only_views_between(ops, 0, 2)  # a view between: its result is no new memory
    assert only_views_between(ops, 2, 3)  # adjacent
    assert not only_views_between(ops, 0, 3)  # op 2 writes memory in between
    assert only_views_between(ops, 0, 3, removed={2})  # unless a fusion removed it
