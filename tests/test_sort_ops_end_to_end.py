"""argmax / max(dim) / topk / sort / cumsum through spmd.jit on CPU meshes, with the reduced or
sorted dim sharded (uneven shards, ties, NaN), against PyTorch eager in float64."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P

MESHES = {
    "cpu1": lambda: Mesh.create(("tp",), devices="cpu:1"),
    "cpu2": lambda: Mesh.create(("tp",), devices="cpu:2"),
    "cpu4": lambda: Mesh.create(("tp",), devices="cpu:4"),
    "2d": lambda: Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4"),
}
SPECS = {
    "cpu1": [P("tp", None), P(None, "tp")],
    "cpu2": [P("tp", None), P(None, "tp"), P()],
    "cpu4": [P("tp", None), P(None, "tp")],
    "2d": [P("dp", "tp"), P("tp", "dp"), P(("dp", "tp"), None), P(None, ("tp", "dp"))],
}
CASES = [(m, s) for m in MESHES for s in range(len(SPECS[m]))]


def _ties(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2).round() / 2
    x[1, 2] = x[1, 5] = x.max() + 1  # a tie for the maximum in row 1 across shards
    return x


def _compare(fn, mesh, spec, *args):
    got = spmd.jit(fn, mesh=mesh, in_shardings=spec)(*args)
    want = fn(*args)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        g = g.to_torch() if hasattr(g, "to_torch") else g
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, w.dtype, g.shape, w.shape)
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-12, atol=1e-12, msg=f"output {k}")


def _arg_ops(x):
    return (x.argmax(-1), x.argmin(0), *x.max(dim=1), *x.min(dim=0, keepdim=True), x.argmax())


def _sort_ops(x):
    return (*torch.sort(x, dim=1, stable=True), *torch.sort(x, dim=0, descending=True, stable=True),
            *torch.topk(x, 3, dim=1), *torch.topk(x, 2, dim=0, largest=False), torch.argsort(x, dim=0, stable=True))


def _scan_ops(x, n):
    return x.cumsum(1), x.cumprod(0), n.cumsum(0), n.cumsum(1)


@pytest.mark.parametrize("mesh_name,k", CASES)
def test_arg_reductions_sharded(mesh_name, k):
    x = _ties((5, 7), seed=k)
    x[3, 4] = float("nan")
    _compare(_arg_ops, MESHES[mesh_name](), SPECS[mesh_name][k], x)


@pytest.mark.parametrize("mesh_name,k", CASES)
def test_sort_and_topk_sharded(mesh_name, k):
    _compare(_sort_ops, MESHES[mesh_name](), SPECS[mesh_name][k], _ties((5, 7), seed=10 + k))


@pytest.mark.parametrize("mesh_name,k", CASES)
def test_cumsum_cumprod_sharded(mesh_name, k):
    spec = SPECS[mesh_name][k]
    x = torch.randn(5, 7, dtype=torch.float64)
    n = torch.randint(-3, 4, (5, 7), dtype=torch.int32)
    _compare(_scan_ops, MESHES[mesh_name](), (spec, spec), x, n)


def test_exponential_race_sampler_on_given_noise():
    """gpt-fast's sampler shape: softmax over a vocab-sharded dim, top-k filter, argmax(probs / q)."""
    mesh = Mesh.create(("tp",), devices="cpu:4")

    def sample(logits, q):
        v, _ = torch.topk(logits, 5, dim=-1)
        logits = torch.where(logits < v[:, -1:], float("-inf"), logits)
        probs = torch.softmax(logits / 0.8, dim=-1)
        return (torch.argmax(probs / q, dim=-1),)

    logits = torch.randn(3, 37, dtype=torch.float64)
    q = torch.empty(3, 37, dtype=torch.float64).exponential_(1)
    _compare(sample, mesh, (P(None, "tp"), P(None, "tp")), logits, q)


def test_nan_rows_do_not_rely_on_collectives_propagating_nan(monkeypatch):
    """NCCL's float max is fmaxf (drops NaN): argmax / max(dim) must not depend on the all-reduce."""
    from functools import reduce

    from spmd.frontend.torch_export import import_program
    from spmd.ir.evaluate import _REDUCERS, evaluate_sharded
    from spmd.ir.sharding import MeshShape, TensorSharding
    from spmd.passes.spmd_partition import SpmdPartition

    monkeypatch.setitem(_REDUCERS, "maximum", lambda vals: reduce(torch.fmax, vals))
    monkeypatch.setitem(_REDUCERS, "minimum", lambda vals: reduce(torch.fmin, vals))

    def f(x):
        return (x.argmax(-1), *x.max(dim=-1), x.argmin(-1), *x.min(dim=-1))

    x = torch.tensor([[9.0, 1.0, 2.0, float("nan"), 0.0], [1.0, float("nan"), 3.0, 9.0, float("nan")],
                      [-9.0, 2.0, 0.0, 1.0, -9.0]], dtype=torch.float64)
    module = import_program(f, (x,)).module
    module.mesh = MeshShape(("tp",), (2,))
    module.entry.parameters[0].sharding = TensorSharding(((), ("tp",)))
    got = evaluate_sharded(SpmdPartition().run(module), [x], [(3,)] * 6)
    for g, w in zip(got, f(x), strict=True):
        torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("mesh_name,k", [("cpu4", 0), ("cpu4", 1), ("2d", 3)])
def test_integer_and_bool_arg_reductions_sharded(mesh_name, k):
    n = torch.randint(-3, 4, (5, 7), dtype=torch.int32)  # many ties
    _compare(lambda t: (t.argmax(1), t.argmin(0), *t.max(dim=1), *(t > 0).max(dim=0), *(t > 0).min(dim=1)),
             MESHES[mesh_name](), SPECS[mesh_name][k], n)
