"""Shape conversions at the edges (0-d tensors) through spmd.jit, against PyTorch eager."""

from __future__ import annotations

import pytest
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


def test_repeat_imports_as_broadcast_and_reshape_golden():
    mesh = Mesh.create(("x",), devices="cpu:2")
    text = spmd.jit(lambda t: t.repeat(2, 1, 3), mesh=mesh, in_shardings=(P("x"),),
                    out_shardings=P()).lower(torch.randn(4, 5)).as_text("import")
    ops = [line.split("=")[1].split("(")[0].strip() for line in text.splitlines() if "aten.repeat" in line]
    assert ops == ["f32[1,4,5] reshape", "f32[2,1,1,4,3,5] broadcast", "f32[2,4,15] reshape"]
    assert "dimensions={1,3,5}" in text


@pytest.mark.parametrize("shape,reps", [((3, 4), (2, 1)), ((1, 5), (1, 3)), ((3, 4), (2, 2, 2)), ((0, 2), (3, 1)),
                                        ((2,), (3, 1, 1)), ((3, 4), (0, 1))])
@pytest.mark.parametrize("spec", [P(), P("a"), P(None, "b"), P(("a", "b"))])
def test_repeat_equals_eager(shape, reps, spec):
    """``Tensor.repeat`` was an UnsupportedOpError."""
    x = torch.randn(*shape)
    if len(spec) > x.dim():
        pytest.skip("spec longer than the rank")
    mesh = Mesh.create({"a": 2, "b": 2}, devices="cpu:4")
    for out in (P(), P("b")):
        got = spmd.jit(lambda t: t.repeat(*reps) * 2, mesh=mesh, in_shardings=(spec,), out_shardings=out)(x)
        assert torch.equal(got.to_torch(), x.repeat(*reps) * 2)
