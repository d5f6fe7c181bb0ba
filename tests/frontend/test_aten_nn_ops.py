"""softmax / log_softmax conversions on shapes at the edge: a 0-d input, against PyTorch eager."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_and_log_softmax_of_a_0d_tensor(dtype):
    """Over the 0-d tensor itself (1 and 0, as eager): the softmax custom call's dim was taken
    modulo rank 0 (ZeroDivisionError) and log_softmax reduced dim 0 of a rank-0 operand."""
    mesh = Mesh.create(("x",), devices="cpu:2")
    x = torch.randn(()).to(dtype)
    fn = lambda t: (t.softmax(0), t.log_softmax(-1), torch.log_softmax(t, 0, dtype=torch.float32))  # noqa: E731
    got = spmd.jit(fn, mesh=mesh, in_shardings=(P(),), out_shardings=P())(x)
    for g, w in zip(got, fn(x), strict=True):
        g = g.to_torch()
        assert g.shape == () and g.dtype == w.dtype
        assert torch.equal(g, w)
