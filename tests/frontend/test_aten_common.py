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
