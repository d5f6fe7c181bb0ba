"""reshard: every pair of shardings (partial included) over small meshes, even and uneven dims."""

import itertools

import pytest
import torch

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.hlo import Shape
from spmd.ir.sharding import MeshShape, TensorSharding, shard_tensor, unshard_tensors
from spmd.ir.verify import verify_module
from spmd.passes.reshard import build_reshard_module


def _shardings(mesh: MeshShape, rank: int) -> list[TensorSharding]:
    """Every sharding: each axis splits a dim (any order), is partial, or replicates."""
    out = []
    for assign in itertools.product([None, "p", *range(rank)], repeat=len(mesh.axis_names)):
        dims = [[a for a, c in zip(mesh.axis_names, assign, strict=False) if c == d] for d in range(rank)]
        partial = tuple(a for a, c in zip(mesh.axis_names, assign, strict=False) if c == "p")
        for perms in itertools.product(*[itertools.permutations(d) for d in dims]):
            out.append(TensorSharding(tuple(tuple(p) for p in perms), partial))
    return out


def _shards(x: torch.Tensor, s: TensorSharding, mesh: MeshShape) -> list[torch.Tensor]:
    """Per-device shards of ``x`` under ``s``; a partial value is split into random addends."""
    base = [shard_tensor(x, s.with_partial(()), mesh, d) for d in range(mesh.num_devices)]
    if not s.partial:
        return base
    out = []
    for d in range(mesh.num_devices):
        c = mesh.coords(d)
        others = {a: c[a] for a in mesh.axis_names if a not in s.partial}
        group = [p for p in range(mesh.num_devices) if all(mesh.coords(p)[a] == v for a, v in others.items())]
        noise = torch.stack([torch.randn_like(base[d], generator=torch.Generator().manual_seed(p * 7919 + 1))
                             for p in group])
        out.append(base[d] / len(group) + noise[group.index(d)] - noise.mean(0))
    return out


@pytest.mark.parametrize("mesh, dims", [
    (MeshShape(("x",), (4,)), (8, 6)),
    (MeshShape(("x",), (4,)), (5, 3)),
    (MeshShape(("a", "b"), (2, 2)), (4, 6)),
    (MeshShape(("a", "b"), (2, 3)), (5, 7)),
])
def test_reshard_every_pair(mesh, dims):
    x = torch.randn(dims)
    shardings = _shardings(mesh, len(dims))
    for src, dst in itertools.product(shardings, shardings):
        m = build_reshard_module(mesh, Shape("f32", dims), src, dst)
        outs = evaluate_spmd(m, [[t] for t in _shards(x, src, mesh)])[0]
        got = unshard_tensors(outs, dst, mesh, dims)
        torch.testing.assert_close(got, x, atol=1e-5, rtol=1e-5, msg=f"{src} -> {dst}")


def _ops(src, dst):
    m = build_reshard_module(MeshShape(("x", "y"), (2, 4)), Shape("f32", (8, 16)), src, dst)
    verify_module(m)
    return [i.opcode for i in m.entry.instructions
            if i.opcode in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "dynamic-slice")]


def test_reshard_picks_the_cheap_collective():
    S = TensorSharding
    assert _ops(S(((), ()), ("y",)), S(((), ()))) == ["all-reduce"]
    assert _ops(S(((), ()), ("y",)), S((("y",), ()))) == ["reduce-scatter"]
    assert _ops(S(((), ()), ("x", "y")), S((("x", "y"), ()))) == ["reduce-scatter", "reduce-scatter"]
    assert _ops(S((("y",), ())), S(((), ("y",)))) == ["all-to-all"]
    assert _ops(S((("x", "y"), ())), S((("x",), ()))) == ["all-gather"]
    assert _ops(S(((), ())), S((("x",), ("y",)))) == ["dynamic-slice"]
    assert _ops(S((("x",), ())), S((("x", "y"), ()))) == ["dynamic-slice"]
    assert _ops(S((("x",), ())), S((("x",), ()))) == []


def test_reshard_rejects_rank_mismatch():
    with pytest.raises(ValueError, match="rank"):
        build_reshard_module(MeshShape(("x",), (2,)), Shape("f32", (4, 4)), TensorSharding(((),)),
                             TensorSharding(((), ())))
