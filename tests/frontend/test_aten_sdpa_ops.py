"""ATen's fused SDPA ops and their backwards: programs where PyTorch dispatches attention to its own
fused kernel (a ``torch.utils.checkpoint`` region, a user ``torch.autograd.Function``, direct calls)
compile and equal PyTorch eager float64 on cpu:1 / cpu:2 (batch-sharded, uneven too), with and
without masks, causal and not; dropout is a clear error.
"""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P
from spmd.frontend.aten_common import UnsupportedOpError
from spmd.frontend.torch_export import import_program
from tests.frontend.helpers import sdpa_inputs

aten = torch.ops.aten


def _inputs(b=4, h=2, s=6, d=4, mask=None, dtype=torch.float64, seed=0):
    return sdpa_inputs(b, h, s, d, mask, dtype, seed)


def _loss(out):
    return (out * out.flip(-1)).sum() + out.pow(2).mean()


def _checkpoint_fn(causal):
    """torch.autograd.grad of a loss whose attention runs inside a non-reentrant checkpoint."""
    def attn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    def f(q, k, v, *mask):
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = cp.checkpoint(attn, q, k, v, mask[0] if mask else None, use_reentrant=False)
        return torch.autograd.grad(_loss(out), (q, k, v))
    return f


class _Recomputed(torch.autograd.Function):
    """Saves only q, k, v and differentiates SDPA again in its backward."""

    @staticmethod
    def forward(q, k, v, mask, causal):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, causal = inputs
        ctx.save_for_backward(q, k, v, mask)
        ctx.causal = causal

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=ctx.causal)
            return (*torch.autograd.grad(out, (q, k, v), dout), None, None)


class _CpuFlash(torch.autograd.Function):
    """ATen's CPU flash attention and its backward, called directly."""

    @staticmethod
    def forward(q, k, v, mask, causal):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, causal = inputs
        ctx.save_for_backward(q, k, v, mask, *output)
        ctx.causal = causal
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out, lse, 0.0, ctx.causal, attn_mask=mask)
        return (*grads, None, None)


def _function_fn(function, causal, use_func):
    def loss(q, k, v, mask):
        out = function.apply(q, k, v, mask, causal)
        return _loss(out[0] if isinstance(out, tuple) else out)

    def f(q, k, v, *mask):
        mask = mask[0] if mask else None
        if use_func:
            return torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v, mask)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        return torch.autograd.grad(loss(q, k, v, mask), (q, k, v))
    return f


def _check(fn, args, n, tol, options=None, targets=False):
    """``fn`` compiled on a cpu:n mesh (q, k, v batch-sharded) against eager float64; with
    ``targets``, returns the compiled program's custom-call targets."""
    args = tuple(a for a in args if a is not None)
    specs = (P("dp"),) * 3 + (P(),) * (len(args) - 3)
    jitted = spmd.jit(fn, mesh=Mesh.create(("dp",), devices=f"cpu:{n}"), in_shardings=specs, options=options)
    got = jitted(*(a.clone() for a in args))
    want = fn(*(a.clone() if a.dtype == torch.bool else a.double() for a in args))
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a.to_torch().double(), e, rtol=tol, atol=tol, msg=f"gradient {i}")
    if not targets:
        return None
    module = jitted.lower(*args).compile().module
    return [i.attrs["custom_call_target"] for i in module.entry.instructions if i.opcode == "custom-call"]


def _targets(fn, args):
    prog = import_program(fn, tuple(a for a in args if a is not None))
    return [i.attrs.get("custom_call_target") for i in prog.module.entry.instructions if i.opcode == "custom-call"]


_CASES = [(None, False), (None, True), ("bool", False), ("float", True)]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("mask,causal", _CASES)
def test_checkpointed_attention_gradients(n, mask, causal):
    _check(_checkpoint_fn(causal), _inputs(mask=mask), n, 1e-10)


@pytest.mark.parametrize("mask,causal", _CASES)
def test_checkpointed_attention_math_option(mask, causal):
    """CompileOptions(fused_attention_grad=False): the math definition forward and backward."""
    targets = _check(_checkpoint_fn(causal), _inputs(b=3, mask=mask), 2, 1e-10,
                     spmd.CompileOptions(fused_attention_grad=False), targets=True)
    assert not any(t.startswith("attention") for t in targets), targets


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_checkpointed_attention_uneven_batch(dtype, tol):
    _check(_checkpoint_fn(True), _inputs(b=3, s=7, mask="float", dtype=dtype), 2, tol)


def test_checkpointed_attention_uses_the_fused_calls():
    """Forward and recomputation: ``attention-forward`` (equal, merged by cse); backward: one
    ``attention-backward`` on the forward's packed result, no softmax of the math path."""
    args = _inputs(mask="float")
    targets = _targets(_checkpoint_fn(True), args)
    assert targets.count("attention-backward") == 1 and "softmax" not in targets, targets
    assert set(targets) == {"attention-forward", "attention-backward"}, targets
    compiled = spmd.jit(_checkpoint_fn(True), mesh=Mesh.create(("dp",), devices="cpu:2"),
                        in_shardings=(P("dp"),) * 3 + (P(),)).lower(*args).compile()
    calls = [i.attrs["custom_call_target"] for i in compiled.module.entry.instructions if i.opcode == "custom-call"]
    assert sorted(calls) == ["attention-backward", "attention-forward"], calls
    assert compiled.collectives() == []  # batch-sharded: every device attends over its own rows


@pytest.mark.parametrize("function,use_func", [(_Recomputed, False), (_CpuFlash, False), (_CpuFlash, True)])
@pytest.mark.parametrize("mask,causal", _CASES)
def test_autograd_function_gradients(function, use_func, mask, causal):
    """torch.autograd.grad, and torch.func.grad where PyTorch allows it (not with requires_grad_
    inside the Function's backward)."""
    if function is _CpuFlash and mask == "bool":
        mask = "float"  # ATen's CPU flash kernel takes an additive mask
    n = 2 if use_func else 1
    _check(_function_fn(function, causal, use_func), _inputs(mask=mask), n, 1e-10)


@pytest.mark.parametrize("function", [_Recomputed, _CpuFlash])
def test_autograd_function_float32(function):
    _check(_function_fn(function, True, False), _inputs(b=3, mask="float", dtype=torch.float32), 2, 1e-5)


def _direct_fn(causal, detour):
    """Forward and backward ATen ops called directly; ``detour`` hands the backward a logsumexp that
    is not the forward's own result (the math backward from the saved statistics)."""
    def f(q, k, v, dout, mask):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask)
        if detour:
            lse = (lse + 0.5) - 0.5
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask)
        return (out, lse, *grads)
    return f


def _cuda_efficient(q, k, v, dout, mask, causal):
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, 0.0, causal)
    grads = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, mask, out, lse, seed, offset, 0.0, [True, True, True, True], causal)
    return out, lse, *grads


def _cuda_flash(q, k, v, dout, mask, causal):
    r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
    grads = aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, r[0], r[1], r[2], r[3], r[4], r[5], 0.0, causal, r[6], r[7])
    return r[0], r[1], *grads


def _cuda_cudnn(q, k, v, dout, mask, causal):
    r = aten._scaled_dot_product_cudnn_attention(q, k, v, mask, True, 0.0, causal, False)
    grads = aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, r[0], r[1], r[6], r[7], mask, r[2], r[3], r[4], r[5], 0.0, causal)
    return r[0], r[1], *grads


def _overrideable(q, k, v, dout, mask, causal):
    r = aten._scaled_dot_product_fused_attention_overrideable(q, k, v, mask, 0.0, causal, False)
    grads = aten._scaled_dot_product_fused_attention_overrideable_backward(
        dout, q, k, v, mask, [True, True, True, True], r[0], r[1], r[2], r[3], r[4], r[5], 0.0, causal, r[6], r[7])
    return r[0], r[1], *grads


def _math_reference(q, k, v, dout, mask, causal):
    """(out, logsumexp, dq, dk, dv[, dmask]) by autograd of SDPA's math definition (float64)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    leaves = (q, k, v) if mask is None else (q, k, v, mask.detach().requires_grad_())
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        s = s + leaves[3]
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(s, -1) @ v
    return (out.detach(), torch.logsumexp(s, -1).detach(), *torch.autograd.grad(out, leaves, dout))


@pytest.mark.parametrize("op,masked", [(_cuda_efficient, True), (_cuda_flash, False), (_cuda_cudnn, True),
                                       (_overrideable, True)])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_op_conversions_on_cpu(op, masked, causal):
    """The CUDA ops' conversions (traced with fake tensors, run on cpu:2): out, logsumexp (its
    first Sq columns / its [B, H, Sq, 1] shape) and the gradients (of the bias too) equal the math.

    The bias gradient takes the math backward, whose probabilities come from the op's float32
    log-sum-exp (float32 accuracy); the others take the fused backward (float64 accuracy)."""
    q, k, v, _ = _inputs(b=3, s=5)
    dout = torch.randn_like(q)
    mask = torch.randn(3, 2, 5, 5, dtype=torch.float64) if masked else None

    def fn(q, k, v, dout, *mask):
        return op(q, k, v, dout, mask[0] if mask else None, causal)
    args = (q, k, v, dout) + ((mask,) if masked else ())
    got = spmd.jit(fn, mesh=Mesh.create(("dp",), devices="cpu:2"), in_shardings=(P("dp"),) * len(args))(*args)
    want = _math_reference(q, k, v, dout, mask, causal)
    got = [g.to_torch() for g in got if g is not None]
    assert got[1].dtype == torch.float32  # the CUDA kernels' statistics are float32
    got[1] = got[1].flatten(2)[..., :q.shape[-2]].double()
    assert len(got) == (6 if op in (_cuda_efficient, _overrideable) else 5)
    for i, (a, e) in enumerate(zip(got, want, strict=False)):
        tol = 1e-6 if i == 1 or len(got) == 6 else 1e-10
        torch.testing.assert_close(a, e, rtol=tol, atol=tol, msg=f"result {i}")


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("detour", [False, True])
def test_direct_calls_forward_program(n, causal, detour):
    """A forward program (torch.export) of both ops: out, logsumexp and gradients equal eager."""
    q, k, v, mask = _inputs(b=3, s=5, mask="float")
    dout = torch.randn_like(q)
    fn = _direct_fn(causal, detour)
    got = spmd.jit(fn, mesh=Mesh.create(("dp",), devices=f"cpu:{n}"),
                   in_shardings=(P("dp"),) * 4 + (P(),))(q, k, v, dout, mask)
    want = fn(q, k, v, dout, mask)
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a.to_torch(), e, rtol=1e-10, atol=1e-10, msg=f"result {i}")


def test_direct_calls_fused_or_math_backward():
    q, k, v, mask = _inputs(b=2, s=5, mask="float")
    args = (q, k, v, torch.randn_like(q), mask)
    assert "attention-backward" in _targets(_direct_fn(False, False), args)
    assert "attention-backward" not in _targets(_direct_fn(False, True), args)


@pytest.mark.parametrize("detour", [False, True])
def test_fully_masked_rows_match_eager(detour):
    """A row with nothing to attend to: logsumexp 0 (ATen's CPU kernel), zero output and gradients, as ATen's kernel."""
    q, k, v, _ = _inputs(b=2, s=5)
    mask = torch.zeros(5, 5, dtype=torch.float64)
    mask[2] = float("-inf")
    dout = torch.randn_like(q)
    fn = _direct_fn(False, detour)
    got = spmd.jit(fn, mesh=Mesh.create(("dp",), devices="cpu:1"))(q, k, v, dout, mask)
    want = fn(q, k, v, dout, mask)
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a.to_torch(), e, rtol=1e-10, atol=1e-10, msg=f"result {i}")


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.25, False)[0], "dropout_p=0.25"),
    (lambda q, k, v: aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.5)[0], "dropout_p=0.5"),
    (lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, True)[0], "return_debug_mask"),
])
def test_dropout_and_debug_masks_are_clear_errors(call, match):
    with pytest.raises(UnsupportedOpError, match=match):
        import_program(call, _inputs()[:3])


def test_checkpointed_dropout_is_a_clear_error():
    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)

    def f(q, k, v):
        q = q.requires_grad_()
        return torch.autograd.grad(cp.checkpoint(attn, q, k, v, use_reentrant=False).sum(), q)
    with pytest.raises(ValueError, match="dropout_p > 0"):
        spmd.jit(f, mesh=Mesh.create(("dp",), devices="cpu:1"))(*_inputs()[:3])


@pytest.mark.parametrize("n", [1, 2])
def test_reentrant_checkpoint_with_backward(n):
    """use_reentrant=True (PyTorch allows it with Tensor.backward only): the region's forward runs
    under no_grad, its recomputation and ATen's fused backward inside the engine."""
    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def f(q, k, v):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        _loss(cp.checkpoint(attn, q, k, v, use_reentrant=True)).backward()
        return q.grad, k.grad, v.grad
    _check(f, _inputs(), n, 1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_checkpointed_attention_close_to_eager(dtype):
    """16-bit q, k, v: float32 statistics; the gradients' error against float64 is that of eager's
    own 16-bit kernels (within a factor of 2, plus one 16-bit ulp of the largest gradient)."""
    args = _inputs(b=2, s=8, d=8, mask="float", dtype=dtype, seed=3)
    fn = _checkpoint_fn(True)
    got = spmd.jit(fn, mesh=Mesh.create(("dp",), devices="cpu:2"),
                   in_shardings=(P("dp"),) * 3 + (P(),))(*(a.clone() for a in args))
    eager = fn(*(a.clone() for a in args))
    want = fn(*(a.double() for a in args))
    for i, (a, e, w) in enumerate(zip(got, eager, want, strict=True)):
        eager_err = float((e.double() - w).abs().max())
        ulp = float(w.abs().max()) * torch.finfo(dtype).eps
        assert float((a.to_torch().double() - w).abs().max()) <= 2 * eager_err + ulp, f"gradient {i}"


@pytest.mark.parametrize("grad", [False, True])
def test_key_and_value_of_different_lengths_are_a_clear_error(grad):
    """ATen's CPU flash kernel does not check this (it reads past value's end, eager corrupts the
    heap); the forward and backward converters refuse it before anything runs."""
    q, k = _inputs()[:2]
    v = torch.randn(4, 2, 7, 4, dtype=torch.float64)

    def fn(q, k, v):
        if grad:
            q = q.requires_grad_()
        out = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]
        return torch.autograd.grad(out.sum(), q)[0] if grad else out

    with pytest.raises(ValueError, match="key and value must have the same sequence length"):
        spmd.jit(fn, mesh=Mesh.create(("dp",), devices="cpu:1"))(q, k, v)
