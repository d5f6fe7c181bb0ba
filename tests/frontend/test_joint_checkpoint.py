"""``torch.utils.checkpoint`` in programs that take gradients: attention inside a checkpointed region
trains (gradients equal eager float64 on cpu:1 / cpu:2), random ops inside one are a clear error,
and other saved-tensor hooks (``save_on_cpu``) keep random ops.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P


def _mesh(n):
    return Mesh.create(("dp",), devices=f"cpu:{n}")


def _encoder_grads_fn(layer, checkpointed=True):
    def f(params, x):
        params = {k: v.requires_grad_() for k, v in params.items()}

        def run(x):
            return torch.func.functional_call(layer, params, (x,))
        y = cp.checkpoint(run, x, use_reentrant=False) if checkpointed else run(x)
        return torch.autograd.grad((y * y.flip(-1)).sum(), list(params.values()))
    return f


@pytest.mark.parametrize("n", [1, 2])
def test_checkpointed_transformer_encoder_layer_gradients(n):
    """nn.MultiheadAttention inside the region: its SDPA is ATen's fused op in the forward and the
    recomputation alike."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double()
    params = {k: v.detach().clone() for k, v in layer.named_parameters()}
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    fn = _encoder_grads_fn(layer)
    got = spmd.jit(fn, mesh=_mesh(n), in_shardings=(None, P("dp")))(params, x)
    want = fn({k: v.clone() for k, v in params.items()}, x)
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a.to_torch(), e, rtol=1e-10, atol=1e-10, msg=f"gradient {i}")


def test_checkpointed_attention_dropout_is_a_clear_error():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True).double()
    params = {k: v.detach().clone() for k, v in layer.named_parameters()}
    with pytest.raises(ValueError, match="inside torch.utils.checkpoint"):
        spmd.jit(_encoder_grads_fn(layer), mesh=_mesh(1))(params, torch.randn(2, 5, 8, dtype=torch.float64))


def _region_grad_fn(region, hooks=None):
    def f(x):
        x = x.requires_grad_()
        if hooks is None:
            y = cp.checkpoint(region, x, use_reentrant=False)
        else:
            with hooks():
                y = region(x)
        return y, torch.autograd.grad((y * y).sum(), x)[0]
    return f


@pytest.mark.parametrize("region", [
    lambda x: F.dropout(x, 0.5, training=True),
    lambda x: x * torch.rand_like(x),
    lambda x: x * torch.empty_like(x).uniform_(),
])
def test_random_ops_inside_a_checkpoint_are_a_clear_error(region):
    """The recomputation would draw other numbers than the forward (wrong gradients): refused."""
    with pytest.raises(ValueError, match="inside torch.utils.checkpoint"):
        spmd.jit(_region_grad_fn(region), mesh=_mesh(1))(torch.randn(16, dtype=torch.float64))


def test_inactive_dropout_inside_a_checkpoint_compiles():
    fn = _region_grad_fn(lambda x: F.dropout(x, 0.5, training=False) * x)
    x = torch.randn(16, dtype=torch.float64)
    got = spmd.jit(fn, mesh=_mesh(2), in_shardings=(P("dp"),))(x)
    for a, e in zip(got, fn(x.clone()), strict=True):
        torch.testing.assert_close(a.to_torch(), e, rtol=1e-12, atol=1e-12)


def test_dropout_under_save_on_cpu_keeps_one_mask():
    """Other saved-tensor hooks recompute nothing: dropout compiles, and the gradient reads the
    forward's mask (zero exactly where the output is)."""
    fn = _region_grad_fn(lambda x: F.dropout(x, 0.5, training=True), hooks=torch.autograd.graph.save_on_cpu)
    y, g = spmd.jit(fn, mesh=_mesh(2), in_shardings=(P("dp"),))(torch.randn(64, dtype=torch.float64) + 5)
    y, g = y.to_torch(), g.to_torch()
    assert bool(((y == 0) == (g == 0)).all()) and 0 < int((y == 0).sum()) < 64


@pytest.mark.parametrize("n", [1, 2])
def test_attention_under_save_on_cpu(n):
    def f(q, k, v):
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with torch.autograd.graph.save_on_cpu():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad((out * out.flip(-1)).sum(), (q, k, v))
    args = tuple(torch.randn(2, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    got = spmd.jit(f, mesh=_mesh(n), in_shardings=(P("dp"),) * 3)(*args)
    for a, e in zip(got, f(*(t.clone() for t in args)), strict=True):
        torch.testing.assert_close(a.to_torch(), e, rtol=1e-10, atol=1e-10)


def _reentrant_backward_fn(region, preserve_rng_state=True):
    def f(x):
        x = x.requires_grad_()
        y = cp.checkpoint(region, x, use_reentrant=True, preserve_rng_state=preserve_rng_state)
        y.sum().backward()
        return y, x.grad
    return f


@pytest.mark.parametrize("preserve_rng_state", [True, False])
@pytest.mark.parametrize("region", [
    lambda x: F.dropout(x, 0.5, training=True),
    lambda x: x * torch.rand_like(x),
    lambda x: torch.sin(x) * torch.bernoulli(torch.full_like(x, 0.5)),
])
def test_random_ops_inside_a_reentrant_checkpoint_are_a_clear_error(region, preserve_rng_state):
    """use_reentrant=True recomputes the region in CheckpointFunction.backward: its random ops
    would draw a fresh mask there (eager restores the RNG state), so the gradient would not belong
    to the forward; refused. Without preserve_rng_state eager's own recomputation draws other
    numbers, which no compiled program reproduces: refused too."""
    fn = _reentrant_backward_fn(region, preserve_rng_state)
    with pytest.raises(ValueError, match="inside torch.utils.checkpoint"):
        spmd.jit(fn, mesh=_mesh(1))(torch.randn(16, dtype=torch.float64))


def test_reentrant_checkpoint_is_restored_after_the_error():
    """The trace's marks on CheckpointFunction are gone afterwards: eager dropout inside a reentrant
    checkpoint still recomputes the forward's mask (zeros of the output and gradient line up)."""
    fn = _reentrant_backward_fn(lambda x: F.dropout(x, 0.5, training=True))
    saved = dict(cp.CheckpointFunction.__dict__)
    with pytest.raises(ValueError, match="inside torch.utils.checkpoint"):
        spmd.jit(fn, mesh=_mesh(1))(torch.randn(16, dtype=torch.float64))
    assert all(cp.CheckpointFunction.__dict__[k] is saved[k] for k in ("forward", "backward"))
    y, g = fn(torch.randn(64, dtype=torch.float64) + 5)
    assert bool(((y == 0) == (g == 0)).all()) and 0 < int((y == 0).sum()) < 64


@pytest.mark.parametrize("grad", ["autograd.grad", "func.grad"])
def test_dropout_inside_a_reentrant_checkpoint_with_grad_is_a_clear_error(grad):
    """PyTorch itself refuses both (reentrant checkpoints support .backward() only): autograd.grad
    in the recomputation, which the compiled program never reaches (it stops at the dropout in the
    forward), torch.func.grad before the forward runs (CheckpointFunction has no setup_context),
    which the compiled program reports as eager does."""
    def loss(x):
        return cp.checkpoint(lambda x: F.dropout(x, 0.5, training=True), x, use_reentrant=True).sum()

    def f(x):
        if grad == "func.grad":
            return torch.func.grad(loss)(x)
        return torch.autograd.grad(loss(x.requires_grad_()), x)[0]
    match = "setup_context" if grad == "func.grad" else "dropout inside torch.utils.checkpoint"
    with pytest.raises(ValueError, match=match):
        spmd.jit(f, mesh=_mesh(1))(torch.randn(16, dtype=torch.float64))


@pytest.mark.parametrize("n", [1, 2])
def test_reentrant_checkpoint_without_random_ops_equals_eager(n):
    """Inactive dropout and deterministic ops inside a reentrant checkpoint compile, and their
    gradients (read through .backward()) equal eager's in float64."""
    w = torch.randn(8, 8, dtype=torch.float64)

    def region(x, w):
        return F.dropout(torch.tanh(x @ w), 0.5, training=False) * x

    def f(x, w):
        x, w = x.requires_grad_(), w.requires_grad_()
        y = cp.checkpoint(region, x, w, use_reentrant=True)
        (y * y.flip(-1)).sum().backward()
        return y, x.grad, w.grad
    x = torch.randn(6, 8, dtype=torch.float64)
    got = spmd.jit(f, mesh=_mesh(n), in_shardings=(P("dp"), None))(x, w)
    for i, (a, e) in enumerate(zip(got, f(x.clone(), w.clone()), strict=True)):
        torch.testing.assert_close(a.to_torch(), e, rtol=1e-10, atol=1e-10, msg=f"output {i}")


@pytest.mark.parametrize("region", [
    lambda x: torch.ops.aten.native_dropout(x, 0.5, True)[0],
    lambda x: x * torch.ops.aten.rand_like(x),
])
def test_direct_aten_random_ops_inside_a_checkpoint_are_a_clear_error(region):
    """ATen calls below the torch-function check: the recomputation drew other numbers (gradients
    silently differed from the forward's draw)."""
    with pytest.raises(ValueError, match="inside torch.utils.checkpoint"):
        spmd.jit(_region_grad_fn(region), mesh=_mesh(1))(torch.randn(16, dtype=torch.float64))


def test_direct_aten_dropout_that_is_off_inside_a_checkpoint_compiles():
    fn = _region_grad_fn(lambda x: torch.ops.aten.native_dropout(x, 0.5, False)[0] * x)
    x = torch.randn(16, dtype=torch.float64)
    for a, e in zip(spmd.jit(fn, mesh=_mesh(2))(x), fn(x.clone()), strict=True):
        torch.testing.assert_close(a.to_torch(), e, rtol=1e-12, atol=1e-12)
