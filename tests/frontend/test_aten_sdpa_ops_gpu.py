"""ATen's fused SDPA ops on GPU meshes: a checkpointed attention region and a user autograd.Function
calling the CUDA fused ops directly compile and equal eager (the custom calls' CUDA kernels run:
flash, memory-efficient or cuDNN)."""

import pytest
import torch

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P
from tests.frontend.helpers import checkpointed_attention_grads

aten = torch.ops.aten


def _checkpoint_fn(causal):
    return checkpointed_attention_grads(causal, lambda out: (out * out.flip(-1)).sum())


class _CudaEfficient(torch.autograd.Function):
    """The memory-efficient CUDA op and its backward, called directly."""

    @staticmethod
    def forward(q, k, v, causal):
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, causal = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.causal = causal
        ctx.mark_non_differentiable(*output[1:])

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, out, lse, seed, offset = ctx.saved_tensors
        grads = aten._scaled_dot_product_efficient_attention_backward(
            dout.contiguous(), q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], ctx.causal)
        return grads[0], grads[1], grads[2], None


def _function_fn(causal):
    def f(q, k, v):
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = _CudaEfficient.apply(q, k, v, causal)[0]
        return torch.autograd.grad((out * out.flip(-1)).sum(), (q, k, v))
    return f


def _inputs(dtype, mask):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 4, 64, 32, generator=g).to(dtype) for _ in range(3))
    return (q, k, v) + ((torch.randn(64, 64, generator=g).to(dtype),) if mask else ())


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("mask,causal", [(False, True), (True, False)])
def test_checkpointed_attention_on_gpus(dtype, tol, n, mask, causal):
    args = _inputs(dtype, mask)
    fn = _checkpoint_fn(causal)
    got = spmd.jit(fn, mesh=Mesh.create(("dp",), devices=f"cuda:{n}"),
                   in_shardings=(P("dp"),) * 3 + (P(),) * mask)(*(a.clone() for a in args))
    want = fn(*(a.cuda() for a in args))
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a.to_torch().cpu().float(), e.cpu().float(), rtol=tol, atol=tol, msg=f"grad {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_efficient_op_in_an_autograd_function(causal):
    args = _inputs(torch.float16, False)
    fn = _function_fn(causal)
    got = spmd.jit(fn, mesh=Mesh.create(("dp",), devices="cuda:1"))(*(a.clone() for a in args))
    want = fn(*(a.cuda() for a in args))
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a.to_torch().cpu().float(), e.cpu().float(), rtol=2e-2, atol=2e-2, msg=f"grad {i}")
