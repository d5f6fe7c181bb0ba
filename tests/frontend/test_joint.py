"""Joint forward + backward import: gradients taken inside a jitted function equal PyTorch's.

Each case computes (loss, grads) with torch.autograd.grad, Tensor.backward or torch.func; the
jitted float32 result is checked against the same function run eagerly in float64.
"""

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P
from spmd.frontend.torch_export import import_program


def _loss(w, b, x, g):
    """Linear, then the backward set of a transformer: softmax, log-softmax, layer norm, RMS norm,
    GELU (exact and tanh), SiLU, ReLU, SDPA (causal), mean/sum reductions, casts."""
    y = F.linear(x, w, b)
    q = y.view(2, 3, 2, 4).transpose(1, 2)
    att = F.scaled_dot_product_attention(q, q * 0.5, q, is_causal=True)
    terms = [
        F.softmax(y, -1).pow(2).sum(-1).mean(), F.log_softmax(y, -1).mean(),
        F.layer_norm(y, (8,), g, b).pow(2).mean(), F.rms_norm(y, (8,), g).pow(2).mean(),
        F.gelu(y).mean(), F.gelu(y, approximate="tanh").mean(), F.silu(y).mean(), F.relu(y).mean(),
        att.pow(2).mean(), y.to(torch.float64).sum().to(y.dtype) * 1e-3,
    ]
    return sum(terms)


def _by_autograd(w, b, x, g):
    with torch.enable_grad():
        w, b, g = (t.detach().requires_grad_() for t in (w, b, g))
        loss = _loss(w, b, x, g)
        return (loss.detach(), *torch.autograd.grad(loss, (w, b, g)))


def _by_backward(w, b, x, g):
    with torch.enable_grad():
        w, b, g = (t.detach().requires_grad_() for t in (w, b, g))
        loss = _loss(w, b, x, g)
        loss.backward()
        return loss.detach(), w.grad, b.grad, g.grad


def _by_func(w, b, x, g):
    grads, loss = torch.func.grad_and_value(_loss, argnums=(0, 1, 3))(w, b, x, g)
    return (loss, *grads)


def _inputs():
    torch.manual_seed(0)
    return torch.randn(8, 5), torch.randn(8), torch.randn(6, 5), torch.rand(8) + 0.5


@pytest.mark.parametrize("fn", [_by_autograd, _by_backward, _by_func])
@pytest.mark.parametrize("n", [1, 2])
def test_gradients_match_pytorch(fn, n):
    mesh = Mesh.create(("dp",), devices=f"cpu:{n}")
    args = _inputs()
    got = spmd.jit(fn, mesh=mesh, in_shardings=(P(), P(), P("dp"), P()))(*args)
    want = _by_func(*(a.double() for a in args))
    for k, (a, e) in enumerate(zip(got, want)):
        torch.testing.assert_close(a.to_torch().double(), e, rtol=1e-4, atol=1e-5, msg=f"output {k}")


def test_joint_program_has_no_backward_custom_ops():
    """Backward ops are decomposed into HLO-lite primitives (nothing new for the partitioner) except
    attention, which is one fused forward and one fused backward call."""
    prog = import_program(_by_func, _inputs())
    opcodes = {i.opcode for i in prog.module.entry.instructions}
    targets = {i.attrs.get("custom_call_target") for i in prog.module.entry.instructions if i.opcode == "custom-call"}
    assert "dot" in opcodes and "reduce" in opcodes
    assert targets <= {"softmax", "layer-norm", "gelu", "silu", "attention-forward", "attention-backward"}, targets
    assert {"attention-forward", "attention-backward"} <= targets
    assert len(prog.module.entry.parameters) == 4


@pytest.mark.parametrize("table_spec", [P(), P("tp"), P(None, "tp")])
def test_embedding_and_cross_entropy_gradients(table_spec):
    """Embedding backward with repeated token ids (index_put with accumulate), on a vocabulary-sharded
    table too, and cross-entropy with ignored labels and label smoothing, through a tied output layer."""
    def f(table, ids, labels):
        def loss(t):
            h = F.embedding(ids, t)  # [2, 3, 4]
            logits = h.reshape(6, 4) @ t.T  # [6, 10]
            return F.cross_entropy(logits, labels, ignore_index=-100, label_smoothing=0.1)
        g, value = torch.func.grad_and_value(loss)(table)
        return value, g

    torch.manual_seed(0)
    table = torch.randn(10, 4)
    ids = torch.tensor([[1, 3, 1], [9, 1, 0]])
    labels = torch.tensor([2, -100, 3, 3, 1, 0])
    mesh = Mesh.create(("tp",), devices="cpu:2")
    got = spmd.jit(f, mesh=mesh, in_shardings=(table_spec, P(), P()))(table, ids, labels)
    want = f(table.double(), ids, labels)
    for a, e in zip(got, want):
        torch.testing.assert_close(a.to_torch().double(), e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2])
def test_dropout_backward_uses_the_forward_mask(n):
    """native_dropout's mask is one value of the joint program: the gradient sees the forward's mask."""
    def f(w, x):
        def loss(w):
            y = F.dropout(x @ w, 0.5, training=True)
            return y.pow(2).sum(), y
        g, (_, y) = torch.func.grad_and_value(loss, has_aux=True)(w)
        return g, y

    torch.manual_seed(0)
    w, x = torch.randn(4, 5), torch.randn(6, 4)
    g, y = spmd.jit(f, mesh=Mesh.create(("dp",), devices=f"cpu:{n}"), in_shardings=(P(), P("dp")))(w, x)
    g, y = g.to_torch(), y.to_torch()
    keep = y != 0
    assert 0 < int(keep.sum()) < keep.numel()
    torch.testing.assert_close(y[keep], ((x @ w) / 0.5)[keep])
    torch.testing.assert_close(g, x.T @ (2 * y * keep / 0.5), rtol=1e-5, atol=1e-5)


def test_gradients_inside_a_module_forward_are_a_clear_error():
    class GradInForward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.func.grad(lambda t: F.softmax(self.lin(t), -1).pow(2).sum())(x)

    with pytest.raises(TypeError, match="gradients taken inside an nn.Module's forward.*functional_call"):
        import_program(GradInForward(), (torch.randn(2, 4),))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("how", ["func", "autograd"])
def test_captured_tensors_are_constants_of_the_joint_program(fused, how):
    """Tensors the function closes over (an SDPA mask, a key/value memory, a scale) are real
    tensors among the traced fake ones: they become constants, in the fused and the math attention."""
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(5, 7, generator=g) > 0.4
    mask[:, 0] = True
    memory = torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64)
    scale = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)

    def loss(q):
        o = F.scaled_dot_product_attention(q, memory, -memory, attn_mask=~mask)
        return (o * scale).sin().sum()

    def f(q):
        if how == "func":
            return torch.func.grad_and_value(loss)(q)
        with torch.enable_grad():
            q = q.detach().requires_grad_()
            value = loss(q)
            return torch.autograd.grad(value, q)[0], value.detach()

    q = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    mesh = Mesh.create(("dp",), devices="cpu:2")
    got = spmd.jit(f, mesh=mesh, in_shardings=(P("dp"),),
                   options=spmd.CompileOptions(fused_attention_grad=fused))(q)
    for a, e in zip(got, f(q), strict=True):
        torch.testing.assert_close(a.to_torch(), e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("masks", [False, True])
def test_multihead_attention_without_weights_gradients(masks):
    """nn.MultiheadAttention(need_weights=False) calls SDPA from inside F.multi_head_attention_forward,
    out of the trace's view: its ATen fused kernel's backward had no conversion (UnsupportedOpError)."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).double()
    x, memory = torch.randn(4, 6, 16, dtype=torch.float64), torch.randn(4, 7, 16, dtype=torch.float64)
    pad = torch.rand(4, 7) > 0.7
    pad[:, 0] = False

    def f(x, memory, pad):
        def loss(x):
            kw = {"key_padding_mask": pad, "attn_mask": torch.eye(6, 7, dtype=torch.bool)} if masks else {}
            out, weights = mha(x, memory, memory, need_weights=False, **kw)
            assert weights is None
            return out.sin().sum()
        return torch.func.grad_and_value(loss)(x)

    got = spmd.jit(f, mesh=Mesh.create(("dp",), devices="cpu:2"), in_shardings=(P("dp"),) * 3)(x, memory, pad)
    for a, e in zip(got, f(x, memory, pad), strict=True):
        torch.testing.assert_close(a.to_torch(), e, rtol=1e-10, atol=1e-12)
