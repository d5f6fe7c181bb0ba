"""Unpartitioned test programs (built in IR) and the numerics check of the partitioner tests."""

from __future__ import annotations

import math

import torch

from spmd.ir.builder import Builder, clone_module
from spmd.ir.evaluate import evaluate, evaluate_sharded
from spmd.ir.hlo import Computation, Module, Shape
from spmd.ir.sharding import MeshShape, TensorSharding
from spmd.ir.verify import verify_module
from spmd.passes.propagate_sharding import PropagateSharding
from spmd.passes.spmd_partition import SpmdPartition

F32 = "f32"


def spec(*dims, partial=()) -> TensorSharding:
    """A TensorSharding from PartitionSpec-like entries: None, "tp" or ("dp", "tp")."""
    out = []
    for d in dims:
        out.append(() if d is None else (d,) if isinstance(d, str) else tuple(d))
    return TensorSharding(tuple(out), tuple(partial))


def mesh_of(**axes: int) -> MeshShape:
    return MeshShape(tuple(axes), tuple(axes.values()))


def new_module(name: str, mesh: MeshShape) -> tuple[Module, Builder]:
    m = Module(name, Computation("main"), [], mesh)
    return m, Builder(m)


def partition(m: Module) -> Module:
    """Propagate and partition a copy of ``m``; both results are verified."""
    prop = PropagateSharding().run(clone_module(m))
    verify_module(prop)
    pm = SpmdPartition().run(prop)
    verify_module(pm)
    return pm


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item() or 1.0
    return (got - ref).abs().max().item() / scale


def check_numerics(m: Module, args: list[torch.Tensor], tol: float = 1e-5) -> Module:
    """Partition ``m``, run both versions, assert relative error < ``tol``; returns the partitioned module."""
    ref = evaluate(m, args)
    pm = partition(m)
    root = m.entry.root
    elems = root.operands if root.opcode == "tuple" else [root]
    got = evaluate_sharded(pm, args, [e.shape.dims for e in elems])
    assert len(got) == len(ref)
    for g, r in zip(got, ref, strict=False):
        assert g.shape == r.shape
        err = rel_err(g, r)
        assert err < tol, f"relative error {err}"
    return pm


def opcodes(m: Module) -> list[str]:
    return [i.opcode for i in m.entry.instructions]


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(m: Module) -> list[str]:
    return [op for op in opcodes(m) if op in COLLECTIVES]


def random_args(m: Module) -> list[torch.Tensor]:
    return [torch.randn(p.shape.dims) for p in m.entry.parameters]


# --------------------------------------------------------------------------- programs
def matmul(mesh, M, K, N, sa, sb, so=None) -> Module:
    m, b = new_module("matmul", mesh)
    x = b.param(Shape(F32, (M, K)), "x", sharding=sa)
    w = b.param(Shape(F32, (K, N)), "w", sharding=sb)
    y = b.dot(x, w, [1], [0], name="y")
    y.sharding = so
    b.set_root(y)
    return m


def mlp(mesh, B, D, F, sx, sw1, sw2, so=None) -> Module:
    """Megatron MLP: y = gelu(x @ w1) @ w2."""
    m, b = new_module("mlp", mesh)
    x = b.param(Shape(F32, (B, D)), "x", sharding=sx)
    w1 = b.param(Shape(F32, (D, F)), "w1", sharding=sw1)
    w2 = b.param(Shape(F32, (F, D)), "w2", sharding=sw2)
    h = b.dot(x, w1, [1], [0], name="h")
    g = b.custom_call("gelu", [h], h.shape, name="g")
    y = b.dot(g, w2, [1], [0], name="y")
    y.sharding = so
    b.set_root(y)
    return m


def _linear(b: Builder, x, w, name):
    return b.dot(x, w, [x.shape.rank - 1], [0], name=name)


def _heads(b: Builder, t, B, S, nh, hd, name):
    r = b.reshape(t, (B, S, nh, hd), name=name + ".split")
    return b.transpose(r, (0, 2, 1, 3), name=name + ".heads")


def _merge_heads(b: Builder, t, B, S, nh, hd):
    t = b.transpose(t, (0, 2, 1, 3), name="attn.t")
    return b.reshape(t, (B, S, nh * hd), name="attn.merged")


def _softmax_attention(b: Builder, q, k, v, hd):
    scores = b.dot(q, k, [3], [3], [0, 1], [0, 1], name="scores")
    scale = b.broadcast(b.constant(1.0 / math.sqrt(hd), F32), scores.shape.dims, (), name="scale")
    scaled = b.binary("multiply", scores, scale, name="scaled")
    probs = b.custom_call("softmax", [scaled], scaled.shape, {"dim": -1}, name="probs")
    return b.dot(probs, v, [3], [2], [0, 1], [0, 1], name="ctx")


def transformer_block(mesh, B, S, H, nh, F, sx, tp="tp", fused_attention=True, so=None) -> Module:
    """Pre-LN block: x + attn(ln1(x)); then + mlp(ln2(.)). Weights Megatron-sharded over ``tp``."""
    hd = H // nh
    m, b = new_module("block", mesh)
    x = b.param(Shape(F32, (B, S, H)), "x", sharding=sx)
    col, row, rep1 = spec(None, tp), spec(tp, None), spec(None)
    g1 = b.param(Shape(F32, (H,)), "ln1.w", sharding=rep1)
    b1 = b.param(Shape(F32, (H,)), "ln1.b", sharding=rep1)
    wq, wk, wv = (b.param(Shape(F32, (H, H)), n, sharding=col) for n in ("wq", "wk", "wv"))
    wo = b.param(Shape(F32, (H, H)), "wo", sharding=row)
    g2 = b.param(Shape(F32, (H,)), "ln2.w", sharding=rep1)
    b2 = b.param(Shape(F32, (H,)), "ln2.b", sharding=rep1)
    w1 = b.param(Shape(F32, (H, F)), "w1", sharding=col)
    w2 = b.param(Shape(F32, (F, H)), "w2", sharding=row)
    ln1 = b.custom_call("layer-norm", [x, g1, b1], x.shape, {"normalized_ndim": 1}, name="ln1")
    q, k, v = (_heads(b, _linear(b, ln1, w, n), B, S, nh, hd, n) for w, n in ((wq, "q"), (wk, "k"), (wv, "v")))
    if fused_attention:
        ctx = b.custom_call("attention", [q, k, v], q.shape, {"is_causal": True}, name="attn")
    else:
        ctx = _softmax_attention(b, q, k, v, hd)
    attn = _linear(b, _merge_heads(b, ctx, B, S, nh, hd), wo, "attn.out")
    h = b.binary("add", x, attn, name="resid1")
    ln2 = b.custom_call("layer-norm", [h, g2, b2], h.shape, {"normalized_ndim": 1}, name="ln2")
    act = b.custom_call("gelu", [_linear(b, ln2, w1, "fc1")], Shape(F32, (B, S, F)), name="act")
    y = b.binary("add", h, _linear(b, act, w2, "fc2"), name="resid2")
    y.sharding = so
    b.set_root(y)
    return m


def reduction(mesh, dims, sx, kind, reduce_dims, so=None, mean=False) -> Module:
    """reduce(x) over ``reduce_dims`` with kind add/maximum/minimum; ``mean`` divides by the count."""
    m, b = new_module("reduction", mesh)
    x = b.param(Shape(F32, tuple(dims)), "x", sharding=sx)
    e = b.unary("exponential", x, name="e")  # padding of e is nonzero: masking must work
    r = b.reduce(e, reduce_dims, kind, name="r")
    if mean:
        count = math.prod(dims[d] for d in reduce_dims)
        c = b.broadcast(b.constant(float(count), F32), r.shape.dims, (), name="count")
        r = b.binary("divide", r, c, name="mean")
    r.sharding = so
    b.set_root(r)
    return m
