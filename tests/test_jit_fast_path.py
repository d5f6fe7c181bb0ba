"""``Jitted.__call__``'s fast path: positional ShardedArrays (or one-level dicts of them) laid out
as compiled skip pytree flattening and the cache key; everything else takes the full path."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

import spmd
from spmd import Mesh, NamedSharding, metrics
from spmd import PartitionSpec as P
from spmd.array import DeletedArrayError

jit_module = importlib.import_module("spmd.jit")
MESH = Mesh.create(("tp",), devices="cpu:2")


def _put(t: torch.Tensor, spec: P) -> spmd.ShardedArray:
    return spmd.device_put(t, NamedSharding(MESH, spec))


def _scale_add(x, y):
    return x * 3.0 + y


def _weighted(params, x):
    return x @ params["w"] + params["b"]


@pytest.fixture
def no_flatten(monkeypatch):
    """Make the full path fail loudly: a call that still flattens its arguments raises."""

    def fail(*args, **kwargs):
        raise AssertionError("the call took the full path (pytree flatten)")

    def arm():
        monkeypatch.setattr(jit_module, "pytree", SimpleNamespace(tree_flatten=fail))
    return arm


def test_positional_arrays_take_the_fast_path(no_flatten):
    f = spmd.jit(_scale_add, mesh=MESH, in_shardings=P("tp"), out_shardings=P("tp"))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    xa, ya = _put(x, P("tp")), _put(y, P("tp"))
    torch.testing.assert_close(f(xa, ya).to_torch(), x * 3 + y)
    assert f._fast is not None
    no_flatten()
    hits = metrics.counter("compile_cache.hit").value
    for _ in range(3):
        x2 = torch.randn(8, 4)
        out = f(_put(x2, P("tp")), ya)
        torch.testing.assert_close(out.to_torch(), x2 * 3 + y)
    assert metrics.counter("compile_cache.hit").value == hits + 3
    # arrays made with another (equal) NamedSharding object are matched by value, then by identity
    assert out.sharding is f._fast[1].output_shardings[0]


def test_dict_of_arrays_takes_the_fast_path(no_flatten):
    f = spmd.jit(_weighted, mesh=MESH, in_shardings=({"w": P(None, "tp"), "b": P("tp")}, P()),
                 out_shardings=P(None, "tp"))
    w, b, x = torch.randn(4, 6), torch.randn(6), torch.randn(5, 4)
    params = {"w": _put(w, P(None, "tp")), "b": _put(b, P("tp"))}
    torch.testing.assert_close(f(params, _put(x, P())).to_torch(), x @ w + b, rtol=1e-5, atol=1e-5)
    assert f._fast is not None and f._fast[0] == (("w", "b"), None)
    no_flatten()
    x2 = torch.randn(5, 4)
    torch.testing.assert_close(f(params, _put(x2, P())).to_torch(), x2 @ w + b, rtol=1e-5, atol=1e-5)


def test_other_layouts_and_structures_take_the_full_path():
    f = spmd.jit(_weighted, mesh=MESH, in_shardings=({"w": P(None, "tp"), "b": P("tp")}, P()),
                 out_shardings=P(None, "tp"))
    w, b, x = torch.randn(4, 6), torch.randn(6), torch.randn(5, 4)
    params = {"w": _put(w, P(None, "tp")), "b": _put(b, P("tp"))}
    f(params, _put(x, P()))
    # another key order is another pytree structure: never fed to the fast entry in the wrong
    # order; the full path matches the in_shardings by key and gives the same result
    swapped = {"b": params["b"], "w": params["w"]}
    torch.testing.assert_close(f(swapped, _put(x, P())).to_torch(), x @ w + b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="sharding tree does not match"):
        f({"w": params["w"]}, _put(x, P()))
    # torch.Tensor leaves are placed by the full path
    torch.testing.assert_close(f({"w": w, "b": b}, x).to_torch(), x @ w + b, rtol=1e-5, atol=1e-5)


def test_fast_path_misses_fall_back_correctly():
    f = spmd.jit(_scale_add, mesh=MESH, out_shardings=P("tp"))  # keep each array's own sharding
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    ya = _put(y, P("tp"))
    f(_put(x, P("tp")), ya)
    misses = metrics.counter("compile_cache.miss").value
    # another sharding of x: the cache key differs, so another compilation (not the fast entry)
    torch.testing.assert_close(f(_put(x, P()), ya).to_torch(), x * 3 + y)
    assert metrics.counter("compile_cache.miss").value == misses + 1
    # another shape: another compilation
    x3, y3 = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(f(_put(x3, P("tp")), _put(y3, P("tp"))).to_torch(), x3 * 3 + y3)
    # a deleted array raises the same error as on the full path
    dead = _put(x, P("tp"))
    dead.delete()
    with pytest.raises(DeletedArrayError, match="deleted"):
        f(dead, ya)
    # a wrong number of arguments still raises TypeError from the function
    with pytest.raises(Exception):  # noqa: B017 - whatever the tracer raises, it must not run the fast entry
        f(ya)


def test_static_arguments_never_take_the_fast_path():
    f = spmd.jit(lambda x, k: x * k, mesh=MESH, in_shardings=(P("tp"), None), out_shardings=P("tp"))
    x = torch.randn(8, 4)
    xa = _put(x, P("tp"))
    torch.testing.assert_close(f(xa, 2.0).to_torch(), x * 2)
    assert f._fast is None
    torch.testing.assert_close(f(xa, 5.0).to_torch(), x * 5)
