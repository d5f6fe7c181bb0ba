"""NaN-propagating cross-device max/min (spmd.runtime.comm.nan_reduce).

A transport with NCCL's float max (``fmax``: NaN loses) is simulated on CPU; packed, its result
must equal ``reduce_stack`` (``torch.amax``, NaN wins). End to end, sharded ``amax``/``max``/
``amin``/``min`` with a NaN on one device must equal eager on CPU meshes, and on GPUs through NCCL.
"""

from __future__ import annotations

import math

import pytest
import torch

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P
from spmd.runtime.comm.base import reduce_stack
from spmd.runtime.comm.nan_reduce import needs_packing, run_nan_safe
from spmd.runtime.thunks import CollectiveSpec


def _dropping_transport(spec: CollectiveSpec, x: list) -> list:
    """All-reduce / reduce-scatter with fmax / fmin (NaN dropped, as NCCL's float max does)."""
    out: list = [None] * len(x)
    fold = torch.fmax if spec.reduce_op == "maximum" else torch.fmin
    for g in spec.groups:
        total = x[g[0]]
        for p in g[1:]:
            total = fold(total, x[p])
        for i, p in enumerate(g):
            out[p] = total.chunk(len(g), dim=spec.dim)[i].clone() if spec.kind == "reduce-scatter" else total.clone()
    return out


def _inputs(n: int, shape, dtype, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(n)]
    xs[1].view(-1)[::3] = math.nan  # NaNs on one device only
    xs[0].view(-1)[1] = math.inf
    return xs


@pytest.mark.parametrize("op", ["maximum", "minimum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_packed_all_reduce_and_reduce_scatter_propagate_nan_like_amax(op, dtype):
    groups = ((0, 1), (2, 3))
    for kind, out_dims in (("all-reduce", (4, 6)), ("reduce-scatter", (2, 6))):
        spec = CollectiveSpec(kind, groups=groups, dim=0, reduce_op=op, out_dims=out_dims, dtype=dtype)
        xs = _inputs(4, (4, 6), dtype, seed=7)
        plain = _dropping_transport(spec, xs)
        assert not any(t.isnan().any() for t in plain)  # the simulated transport drops NaN
        got = run_nan_safe(spec, xs, _dropping_transport)
        for g in groups:
            want = reduce_stack([xs[p] for p in g], op)
            for i, p in enumerate(g):
                w = want.chunk(len(g), dim=0)[i] if kind == "reduce-scatter" else want
                assert got[p].shape == w.shape and got[p].dtype == dtype
                torch.testing.assert_close(got[p], w, rtol=0, atol=0, equal_nan=True)


def test_only_float_max_and_min_reductions_are_packed():
    assert needs_packing(CollectiveSpec("all-reduce", reduce_op="maximum", dtype=torch.float16))
    assert needs_packing(CollectiveSpec("reduce-scatter", reduce_op="minimum", dtype=torch.float32))
    assert not needs_packing(CollectiveSpec("all-reduce", reduce_op="maximum", dtype=torch.int64))
    assert not needs_packing(CollectiveSpec("all-reduce", reduce_op="add", dtype=torch.float32))
    assert not needs_packing(CollectiveSpec("all-gather", dtype=torch.float32))


_FNS = [lambda t: t.amax(dim=1), lambda t: t.max(dim=1).values, lambda t: t.amin(dim=1),
        lambda t: t.min(dim=1).values, lambda t: t.max(), lambda t: torch.softmax(t, dim=1)]


def _nan_input(dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(20)
    x = torch.randn(6, 8, 3, generator=g, dtype=torch.float64).to(dtype)
    x[2, 5, 1] = math.nan  # on the last device of dim 1's shards
    x[4, 0, 0] = math.nan
    return x


@pytest.mark.parametrize("devices,axes,spec", [("cpu:2", ("tp",), P(None, "tp")),
                                               ("cpu:4", ("tp",), P(None, "tp")),
                                               ("cpu:4", ("dp", "tp"), P("dp", "tp"))])
def test_sharded_max_and_min_propagate_nan_like_eager_on_cpu(devices, axes, spec):
    shape = {"dp": 2, "tp": 2} if len(axes) == 2 else {"tp": int(devices.split(":")[1])}
    mesh = Mesh.create(shape, devices=devices)
    x = _nan_input()
    for fn in _FNS:
        got = spmd.jit(fn, mesh=mesh, in_shardings=(spec,), out_shardings=P())(x).to_torch()
        torch.testing.assert_close(got, fn(x), rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_max_and_min_propagate_nan_through_nccl(dtype):
    n = min(torch.cuda.device_count(), 8)
    mesh = Mesh.create({"tp": n}, devices=f"cuda:{n}")
    x = _nan_input(dtype).repeat(1, n, 1)
    for fn in _FNS:
        got = spmd.jit(fn, mesh=mesh, in_shardings=(P(None, "tp"),), out_shardings=P())(x).to_torch().cpu()
        torch.testing.assert_close(got, fn(x), rtol=1e-2, atol=1e-2, equal_nan=True)
