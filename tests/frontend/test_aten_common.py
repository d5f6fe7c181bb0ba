"""Shared helpers of the aten converters: dim normalisation, checked through compiled programs."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P
from spmd.frontend.aten_common import norm_dim, norm_dims


def test_norm_dims():
    assert norm_dims(None, 3) == (0, 1, 2) and norm_dims([], 2) == (0, 1)
    assert norm_dims(-1, 3) == (2,) and norm_dims([2, -3, 0], 3) == (0, 2)
    assert norm_dim(-1, 0) == 0
    # a 0-d tensor has no dim to reduce: torch accepts dim 0 / -1 and reduces nothing
    assert norm_dims(0, 0) == () and norm_dims([-1], 0) == () and norm_dims(None, 0) == ()


@pytest.mark.parametrize("name", ["sum", "sum_keep", "mean", "amax", "prod", "any", "var", "logsumexp", "norm",
                                  "std_mean"])
def test_reductions_of_a_0d_tensor_over_dim_0_equal_eager(name):
    """``x.sum(0)`` of a 0-d x (as torch allows) emitted a reduce over dim 0 of a rank-0 operand:
    an IndexError inside sharding propagation."""
    fn = {"sum": lambda t: t.sum(0), "sum_keep": lambda t: t.sum(-1, keepdim=True), "mean": lambda t: t.mean([0]),
          "amax": lambda t: t.amax(0), "prod": lambda t: t.prod(0), "any": lambda t: (t > 0).any(0),
          "var": lambda t: t.var(0, correction=0), "logsumexp": lambda t: t.logsumexp(0),
          "norm": lambda t: torch.linalg.vector_norm(t, dim=0),
          "std_mean": lambda t: torch.std_mean(t, 0, correction=0)[1]}[name]
    x = torch.randn((), dtype=torch.float64)
    got = spmd.jit(fn, mesh=Mesh.create(("x",), devices="cpu:2"), in_shardings=(P(),), out_shardings=P())(x.float())
    want = fn(x)
    got = got.to_torch()
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double())


def _converter_call(op, **args):
    """Run the converter of ``op`` on an Emitter, tensors given as example tensors (their dtype and shape)."""
    from spmd.frontend.aten_common import ATEN_OPS
    from spmd.frontend.emitter import Emitter, dtype_of
    from spmd.ir.hlo import Shape

    em = Emitter()
    bound = {k: em.parameter(i, Shape(dtype_of(v.dtype), tuple(v.shape)), k) if isinstance(v, torch.Tensor) else
             [em.parameter(i, Shape(dtype_of(t.dtype), tuple(t.shape)), k) for t in v] if isinstance(v, list) else v
             for i, (k, v) in enumerate(args.items())}
    return ATEN_OPS[op](em, bound, torch.empty(4, 8))


aten = torch.ops.aten
_F = torch.tensor([1.0, 2.0])


@pytest.mark.parametrize("op, args, allowed", [
    (aten.gather.default, dict(self=torch.zeros(4, 8), dim=1, index=_F.reshape(1, 2)), "int64/int32"),
    (aten.index_select.default, dict(self=torch.zeros(4, 8), dim=1, index=_F), "int64/int32"),
    (aten.scatter.value, dict(self=torch.zeros(4, 8), dim=1, index=_F.reshape(1, 2), value=1.0, reduce=None),
     "int64/int32"),
    (aten.index_add.default, dict(self=torch.zeros(4, 8), dim=1, index=_F, source=torch.ones(4, 2), alpha=1),
     "int64/int32"),
    (aten.index_copy.default, dict(self=torch.zeros(4, 8), dim=1, index=_F, source=torch.ones(4, 2)), "int64"),
    (aten.index.Tensor, dict(self=torch.zeros(4, 8), indices=[_F]), "int64/int32/bool"),
    (aten.index_put.default, dict(self=torch.zeros(4, 8), indices=[_F], values=torch.ones(8), accumulate=False),
     "int64/int32/bool"),
    (aten.embedding.default, dict(weight=torch.zeros(4, 8), indices=_F), "int64/int32"),
    (aten.one_hot.default, dict(self=_F, num_classes=8), "int64"),
])
def test_a_float_index_is_rejected_by_every_indexing_converter(op, args, allowed):
    # index_copy_ / index_select with a float index used to truncate it (2.7 wrote slot 2) where
    # PyTorch raises; gather, scatter, x[i] and embedding are rejected by torch.export before this
    from spmd.frontend.aten_common import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=rf"expected an integer \({allowed}\) .*tensor, got float32"):
        _converter_call(op, **args)
