"""Fused attention in programs that take gradients: gradients equal PyTorch eager autograd.

The jitted step differentiates ``F.scaled_dot_product_attention`` through the ``attention-forward``
/ ``attention-backward`` custom calls; checked against eager float64 on cpu:1/2/4 and a dp x tp
mesh, with batch, head and sequence shardings (uneven too), causal, bool and additive masks, a
scale, the math fallback option and the cases that fall back to math on their own.
"""

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import CompileOptions, Mesh
from spmd import PartitionSpec as P
from spmd.frontend.joint_attention import FUSED_ATTENTION_GRAD
from spmd.frontend.torch_export import import_program
from tests.frontend.helpers import sdpa_inputs


def _attention_loss(q, k, v, mask, causal, scale):
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return (out * out.flip(-1)).sum() + out.pow(2).mean()


def _grads_fn(causal=False, scale=None):
    def f(q, k, v, *mask):
        def loss(q, k, v):
            return _attention_loss(q, k, v, mask[0] if mask else None, causal, scale)
        grads, value = torch.func.grad_and_value(loss, argnums=(0, 1, 2))(q, k, v)
        return (value, *grads)
    return f


def _inputs(b=4, h=4, s=6, d=8, mask=None, dtype=torch.float32, seed=0):
    args = sdpa_inputs(b, h, s, d, mask, dtype, seed)
    return args if mask else args[:3]


def _check(fn, args, mesh, specs, options=None, tol=1e-5):
    got = spmd.jit(fn, mesh=mesh, in_shardings=specs, options=options)(*args)
    want = fn(*(a if a.dtype == torch.bool else a.double() for a in args))
    for k, (a, e) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a.to_torch().double(), e, rtol=tol, atol=tol, msg=f"output {k}")


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("spec", [P("dp"), P(None, "dp"), P(None, None, "dp")])
def test_causal_gradients_on_1d_meshes(n, spec):
    """Batch, heads and sequence sharded (sequence-sharded q, k, v are gathered for the call)."""
    mesh = Mesh.create(("dp",), devices=f"cpu:{n}")
    _check(_grads_fn(causal=True), _inputs(), mesh, (spec, spec, spec))


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_masked_gradients_on_a_2d_mesh(mask):
    mesh = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")
    spec = P("dp", "tp")
    mspec = P("dp") if mask == "bool" else P()
    _check(_grads_fn(scale=0.3), _inputs(mask=mask), mesh, (spec, spec, spec, mspec))


def test_uneven_batch_and_heads_float64():
    mesh = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")
    spec = P("dp", "tp")
    args = _inputs(b=3, h=5, s=7, d=4, dtype=torch.float64)
    _check(_grads_fn(causal=True), args, mesh, (spec, spec, spec), tol=1e-10)


def _targets(fn, args):
    prog = import_program(fn, args)
    return [i.attrs.get("custom_call_target") for i in prog.module.entry.instructions if i.opcode == "custom-call"]


def test_program_holds_one_fused_forward_and_backward():
    targets = _targets(_grads_fn(causal=True), _inputs())
    assert targets.count("attention-forward") == 1 and targets.count("attention-backward") == 1, targets
    assert "softmax" not in targets


def test_math_fallback_option():
    """CompileOptions(fused_attention_grad=False): the math definition, same gradients."""
    mesh = Mesh.create(("dp",), devices="cpu:2")
    _check(_grads_fn(causal=True), _inputs(), mesh, (P("dp"),) * 3, options=CompileOptions(fused_attention_grad=False))
    token = FUSED_ATTENTION_GRAD.set(False)
    try:
        targets = _targets(_grads_fn(causal=True), _inputs())
    finally:
        FUSED_ATTENTION_GRAD.reset(token)
    assert "attention-backward" not in targets and "softmax" in targets, targets


def test_broadcast_kv_heads_fall_back_to_math():
    """k, v with a broadcast head dim (not the fused call's equal leading dims): math, still right."""
    q, k, v = _inputs()
    k, v = k[:, :1], v[:, :1]
    fn = _grads_fn()
    assert "attention-backward" not in _targets(fn, (q, k, v))
    _check(fn, (q, k, v), Mesh.create(("dp",), devices="cpu:2"), (P("dp"),) * 3)


def test_dropout_is_a_clear_error():
    def f(q, k, v):
        def loss(q):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1).sum()
        return torch.func.grad(loss)(q)
    with pytest.raises(ValueError, match="dropout_p > 0"):
        spmd.jit(f, mesh=Mesh.create(("dp",), devices="cpu:1"))(*_inputs())


@pytest.mark.parametrize("n", [1, 2])
def test_enable_gqa_gradients(n):
    """enable_gqa=True (4 query heads over 2 kv heads): fused, with k / v gradients summed per group."""
    q, k, v = _inputs()
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()

    def f(q, k, v):
        def loss(q, k, v):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return (out * out.flip(-1)).sum()
        grads, value = torch.func.grad_and_value(loss, argnums=(0, 1, 2))(q, k, v)
        return (value, *grads)
    assert "attention-backward" in _targets(f, (q, k, v))
    _check(f, (q, k, v), Mesh.create(("dp",), devices=f"cpu:{n}"), (P("dp"),) * 3)



@pytest.mark.parametrize("mask_grad", [False, True])
def test_enable_gqa_gradients_on_the_math_path(mask_grad):
    """enable_gqa=True where the fused op does not apply (a mask that needs a gradient, or
    fused_attention_grad=False): the math definition repeats the kv heads (was NotImplementedError)."""
    q, k, v, mask = _inputs(mask="float")
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    argnums = (0, 1, 2, 3) if mask_grad else (0, 1, 2)

    def f(q, k, v, mask):
        def loss(q, k, v, mask):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            return (out * out.flip(-1)).sum()
        grads, value = torch.func.grad_and_value(loss, argnums=argnums)(q, k, v, mask)
        return (value, *grads)
    options = None if mask_grad else CompileOptions(fused_attention_grad=False)
    _check(f, (q, k, v, mask), Mesh.create(("dp",), devices="cpu:2"), (P("dp"),) * 3 + (P(),), options)

def _second_derivative_fn(sdpa):
    def f(q):
        def inner(q):
            return sdpa(q, q * 0.5, q).pow(2).sum()
        return torch.func.grad(lambda q: torch.func.grad(inner)(q).pow(2).sum())(q)
    return f


def _math_sdpa(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v


def test_second_derivatives_are_a_clear_error_or_the_math_path():
    q = _inputs(b=2, h=2, s=4, d=4)[0]
    mesh = Mesh.create(("dp",), devices="cpu:2")
    with pytest.raises(ValueError, match="second derivatives"):
        spmd.jit(_second_derivative_fn(F.scaled_dot_product_attention), mesh=mesh)(q)
    got = spmd.jit(_second_derivative_fn(F.scaled_dot_product_attention), mesh=mesh, in_shardings=(P("dp"),),
                   options=CompileOptions(fused_attention_grad=False))(q)
    want = _second_derivative_fn(_math_sdpa)(q.double())
    torch.testing.assert_close(got.to_torch().double(), want, rtol=1e-5, atol=1e-5)


def _grad_of_query():
    def f(q, k, v, *m):
        out = F.scaled_dot_product_attention(q.requires_grad_(), k, v, attn_mask=m[0] if m else None)
        return out, torch.autograd.grad(out.sum(), q)[0]
    return f


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.uint8])
def test_mask_of_another_dtype_is_refused_like_eager(dtype):
    """Eager refuses a mask that is not bool, float32 or the query's dtype; the math definition
    would have added an integer mask as a bias (a value eager never computes)."""
    q, k, v = sdpa_inputs(2, 2, 6, 8, None, torch.float64, 0)[:3]
    mask = (torch.rand(6, 6) > 0.5).to(dtype)
    fn = _grad_of_query()
    with pytest.raises(RuntimeError, match="attn_mask dtype"):
        fn(q.clone(), k, v, mask)
    with pytest.raises(TypeError, match=f"attn_mask must be bool, float32 .* got {dtype}"):
        spmd.jit(fn, mesh=Mesh.create(("dp",), devices="cpu:1"))(q, k, v, mask)


def test_float32_mask_on_float64_query_equals_eager():
    q, k, v = sdpa_inputs(3, 2, 6, 8, None, torch.float64, 1)[:3]
    mask = torch.randn(6, 6, dtype=torch.float32)
    fn = _grad_of_query()
    got = spmd.jit(fn, mesh=Mesh.create(("dp",), devices="cpu:2"), in_shardings=(P("dp"), P("dp"), P("dp"), P()))(
        q, k, v, mask)
    for a, e in zip(got, fn(q.clone(), k, v, mask), strict=True):
        torch.testing.assert_close(a.to_torch(), e, rtol=1e-10, atol=1e-10)


def test_key_and_value_of_different_lengths_are_a_clear_error():
    """Eager's CPU kernel reads past value's end here; the compiled program refuses it."""
    q, k = sdpa_inputs(2, 2, 6, 8, None, torch.float64, 0)[:2]
    v = torch.randn(2, 2, 7, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="key and value must have the same sequence length"):
        spmd.jit(_grad_of_query(), mesh=Mesh.create(("dp",), devices="cpu:1"))(q, k, v)
