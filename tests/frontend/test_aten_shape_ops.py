"""Shape conversions at the edges (0-d tensors) through spmd.jit, against PyTorch eager."""

from __future__ import annotations

import torch

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P


def test_transpose_and_movedim_of_a_0d_tensor():
    """``x.transpose(0, -1)`` of a 0-d x is x in eager; the converter indexed an empty permutation."""
    x = torch.randn(())
    fn = lambda t: (t.transpose(0, -1) + 1, t.transpose(-1, -1) * 2, t.t() - 1)  # noqa: E731
    got = spmd.jit(fn, mesh=Mesh.create(("x",), devices="cpu:2"), in_shardings=(P(),), out_shardings=P())(x)
    for g, w in zip(got, fn(x), strict=True):
        assert g.to_torch().shape == () and torch.equal(g.to_torch(), w)
