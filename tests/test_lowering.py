"""``spmd.lowering``: the process-wide compile-cache key."""

import torch

import spmd
from spmd import NamedSharding
from spmd import PartitionSpec as P


def _ident(x):
    return x * 2


def test_cache_key_tells_size_one_axes_apart():
    # On {tp: 1}, P() and P("tp") print alike in HLO text; the cache must still keep their
    # executables apart, so each output comes back with the sharding asked for (found by tests/fuzz).
    mesh = spmd.Mesh.create({"tp": 1}, devices="cpu:1")
    x = torch.randn(4, 6)
    for spec in (P(), P("tp"), P(None, "tp")):
        out = spmd.jit(_ident, mesh=mesh, in_shardings=P(), out_shardings=spec)(x)
        assert out.sharding == NamedSharding(mesh, spec)
        torch.testing.assert_close(out.to_torch(), x * 2)


def test_resharded_argument_on_a_size_one_axis_is_accepted():
    mesh = spmd.Mesh.create({"tp": 1}, devices="cpu:1")
    x = torch.randn(6, 7, 8, dtype=torch.float64)
    spmd.device_put(x, NamedSharding(mesh, P(None, "tp"))).reshard(NamedSharding(mesh, P()))  # fills the cache
    a = spmd.device_put(x, NamedSharding(mesh, P(None, "tp"))).reshard(NamedSharding(mesh, P("tp")))
    assert a.sharding == NamedSharding(mesh, P("tp"))
    f = spmd.jit(_ident, mesh=mesh, in_shardings=P("tp"), out_shardings=P())
    torch.testing.assert_close(f(a).to_torch(), x * 2)
