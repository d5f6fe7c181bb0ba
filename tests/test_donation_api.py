"""``spmd.jit(..., donate_argnums=...)``: donated buffers reused for outputs, dead donated arrays,
donation that cannot alias, a donated array passed twice, donation with resharded inputs."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd import Mesh, NamedSharding, metrics
from spmd import PartitionSpec as P
from spmd.array import DeletedArrayError

MESH = Mesh.create(("tp",), devices="cpu:4")
MESH2D = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")


def _put(t, spec, mesh=MESH):
    return spmd.device_put(t, NamedSharding(mesh, spec))


def _ptrs(arr):
    return [b.data_ptr() for b in arr._buffers]


def _update(x, y):
    return x * 0.5 + torch.tanh(y)


@pytest.fixture(scope="module")
def donating():
    """``_update`` with x (argument 0) donated; all f32[8,6] split over tp on dim 0."""
    return spmd.jit(_update, mesh=MESH, in_shardings=P("tp"), out_shardings=P("tp"), donate_argnums=0)


def test_donated_buffers_are_reused_for_the_output(donating):
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    xa, ya = _put(x, P("tp")), _put(y, P("tp"))
    ptrs = _ptrs(xa)
    before = metrics.counter("donations").value
    out = donating(xa, ya)
    assert _ptrs(out) == ptrs
    assert metrics.counter("donations").value == before + 1
    torch.testing.assert_close(out.to_torch(), _update(x, y))
    assert not ya.is_deleted and torch.equal(ya.to_torch(), y)


def test_a_donated_array_is_dead(donating):
    xa, ya = _put(torch.randn(8, 6), P("tp")), _put(torch.randn(8, 6), P("tp"))
    donating(xa, ya)
    assert xa.is_deleted and "donated to _update" in repr(xa)
    msg = r"the ShardedArray f32\[8,6\] was donated to _update and can no longer be used"
    with pytest.raises(DeletedArrayError, match=r"to_torch: " + msg):
        xa.to_torch()
    with pytest.raises(DeletedArrayError, match=r"_update: argument args\[0\]: " + msg):
        donating(xa, ya)
    with pytest.raises(DeletedArrayError, match=msg):
        xa.reshard(NamedSharding(MESH, P()))
    with pytest.raises(DeletedArrayError, match=r"shards: " + msg):
        xa.shards  # noqa: B018
    with pytest.raises(DeletedArrayError, match=r"block_until_ready: " + msg):
        xa.block_until_ready()


def test_undonated_call_keeps_its_inputs():
    f = spmd.jit(_update, mesh=MESH, in_shardings=P("tp"), out_shardings=P("tp"))
    xa, ya = _put(torch.randn(8, 6), P("tp")), _put(torch.randn(8, 6), P("tp"))
    out = f(xa, ya)
    assert not xa.is_deleted
    assert set(_ptrs(out)).isdisjoint(_ptrs(xa))


def test_donated_tensor_argument_is_copied_not_consumed(donating):
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    keep = x.clone()
    out = donating(x, y)
    assert torch.equal(x, keep)
    torch.testing.assert_close(out.to_torch(), _update(keep, y))


def test_donation_into_another_output_sharding_runs_without_aliasing():
    """Donated x is split over tp on dim 0, the output is replicated: the shard sizes differ."""
    f = spmd.jit(_update, mesh=MESH, in_shardings=P("tp"), out_shardings=P(), donate_argnums=0)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    xa = _put(x, P("tp"))
    ptrs = _ptrs(xa)
    out = f(xa, _put(y, P("tp")))
    assert xa.is_deleted and out.sharding.spec == P()
    assert set(_ptrs(out)).isdisjoint(ptrs)
    torch.testing.assert_close(out.to_torch(), _update(x, y))


def test_donation_into_a_same_size_shard_of_another_sharding():
    """x split over dp, the output over tp: equal shard shapes, different layouts, still correct."""
    f = spmd.jit(lambda x: torch.exp(x), mesh=MESH2D, in_shardings=P("dp"), out_shardings=P("tp"),
                 donate_argnums=0)
    x = torch.randn(6, 4)
    xa = _put(x, P("dp"), MESH2D)
    out = f(xa)
    assert xa.is_deleted and out.sharding.spec == P("tp")
    torch.testing.assert_close(out.to_torch(), torch.exp(x))


def test_donation_with_uneven_dims():
    f = spmd.jit(_update, mesh=MESH, in_shardings=P("tp"), out_shardings=P("tp"), donate_argnums=(0,))
    x, y = torch.randn(7, 3), torch.randn(7, 3)
    xa = _put(x, P("tp"))
    ptrs = _ptrs(xa)
    out = f(xa, _put(y, P("tp")))
    assert _ptrs(out) == ptrs and out.shape == (7, 3)
    torch.testing.assert_close(out.to_torch(), _update(x, y))


def test_a_donated_array_passed_twice_is_rejected(donating):
    xa = _put(torch.randn(8, 6), P("tp"))
    with pytest.raises(ValueError, match=r"_update: argument args\[0\]: is donated, but its buffers are also "
                                         r"passed as argument args\[1\]"):
        donating(xa, xa)
    assert not xa.is_deleted
    view = spmd.ShardedArray.from_shards([b for b in xa._buffers], xa.sharding, xa.shape)
    with pytest.raises(ValueError, match=r"is donated, but its buffers are also passed"):
        donating(xa, view)
    assert not xa.is_deleted


def test_donation_with_resharded_input_kills_the_callers_array():
    f = spmd.jit(_update, mesh=MESH, in_shardings=P("tp"), out_shardings=P("tp"), donate_argnums=0,
                 reshard_inputs=True)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    f(torch.randn(8, 6), y)  # compile for the tp layout
    xa = _put(x, P())
    out = f.lower(x, y).compile().execute_sharded([xa, _put(y, P("tp"))])[0]
    assert xa.is_deleted
    torch.testing.assert_close(out.to_torch(), _update(x, y))


def test_donated_pytree_argument_donates_every_leaf():
    f = spmd.jit(lambda p, g: {"w": p["w"] - 0.1 * g, "b": p["b"] - 0.1 * g.sum(1)}, mesh=MESH,
                 in_shardings=({"w": P("tp"), "b": P("tp")}, P("tp")), out_shardings={"w": P("tp"), "b": P("tp")},
                 donate_argnums=0)
    w, b, g = torch.randn(8, 4), torch.randn(8), torch.randn(8, 4)
    params = {"w": _put(w, P("tp")), "b": _put(b, P("tp"))}
    ptrs = {k: _ptrs(v) for k, v in params.items()}
    new = f(params, _put(g, P("tp")))
    assert params["w"].is_deleted and params["b"].is_deleted
    assert _ptrs(new["w"]) == ptrs["w"] and _ptrs(new["b"]) == ptrs["b"]
    torch.testing.assert_close(new["w"].to_torch(), w - 0.1 * g)
    torch.testing.assert_close(new["b"].to_torch(), b - 0.1 * g.sum(1))


def test_outputs_never_alias_undonated_inputs():
    """An identity/view output is a fresh array: donating its input later must not change it."""
    ident = spmd.jit(lambda x: (x, x.reshape(4, 16)), mesh=MESH, in_shardings=P("tp"))
    bump = spmd.jit(lambda x: x + 1, mesh=MESH, in_shardings=P("tp"), out_shardings=P("tp"), donate_argnums=0)
    x = torch.randn(8, 8)
    xa = _put(x, P("tp"))
    same, view = ident(xa)
    bumped = bump(xa)
    assert torch.equal(same.to_torch(), x) and torch.equal(view.to_torch(), x.reshape(4, 16))
    torch.testing.assert_close(bumped.to_torch(), x + 1)


@pytest.mark.gpu(count=2)
def test_gpu_donated_buffers_are_reused():
    mesh = Mesh.create(("x",), devices="cuda:2")
    f = spmd.jit(_update, mesh=mesh, in_shardings=P("x"), out_shardings=P("x"), donate_argnums=0)
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    xa = spmd.device_put(x, NamedSharding(mesh, P("x")))
    ptrs = _ptrs(xa)
    out = f(xa, spmd.device_put(y, NamedSharding(mesh, P("x"))))
    assert _ptrs(out) == ptrs and xa.is_deleted
    torch.testing.assert_close(out.to_torch(), _update(x, y))


# Donation is a permission, never a change of the result: a donated buffer receives an output
# only of exactly its shard shape and dtype, once nothing else reads it (regressions of issue 20).

MESHES = {"cpu1": Mesh.create(("tp",), devices="cpu:1"), "cpu2": Mesh.create(("tp",), devices="cpu:2"),
          "cpu4": MESH, "2d": MESH2D}


def _check_donating_call(fn, args, in_specs, out_spec, donate, mesh):
    """Run ``fn`` jitted with ``donate`` on fresh arrays; compare with eager (float64 reference)."""
    f = spmd.jit(fn, mesh=mesh, in_shardings=in_specs, out_shardings=out_spec, donate_argnums=donate)
    expected = fn(*args)
    reference = fn(*[a.double() for a in args])
    arrays = [_put(a, s, mesh) for a, s in zip(args, in_specs)]
    donated_ptrs = {p for i in donate for p in _ptrs(arrays[i])}
    out = f(*arrays)
    got = out.to_torch()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.double(), reference, atol=1e-5, rtol=1e-5)
    assert all(arrays[i].is_deleted for i in donate)
    return out, donated_ptrs


@pytest.mark.parametrize("mesh", MESHES.values(), ids=MESHES.keys())
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
def test_an_unread_donated_argument_of_another_dtype_keeps_the_output_dtype(mesh, dtype):
    x, d = torch.randn(4, 6), torch.randn(4, 6).to(dtype)
    out, donated = _check_donating_call(lambda x, d: x * 2, [x, d], [P(), P()], P(), (1,), mesh)
    assert out.dtype == torch.float32 and donated.isdisjoint(_ptrs(out))


@pytest.mark.parametrize("mesh", MESHES.values(), ids=MESHES.keys())
def test_an_unread_donated_argument_of_another_shape_is_not_reused(mesh):
    """Same element count ([1,6,8] vs [8,6,1]) and a smaller one: neither buffer receives the outputs."""
    x, d, e = torch.randn(8, 6), torch.randn(1, 6, 8), torch.randn(1)
    out, donated = _check_donating_call(lambda x, d, e: x.reshape(8, 6, 1) * 2, [x, d, e], [P(), P(), P()], P(),
                                        (1, 2), mesh)
    assert donated.isdisjoint(_ptrs(out))


def test_an_unread_donated_argument_of_the_same_shard_shape_is_reused():
    x, d = torch.randn(8, 6), torch.randn(8, 6)
    out, donated = _check_donating_call(lambda x, d: x * 2, [x, d], [P("tp"), P("tp")], P("tp"), (1,), MESH)
    assert set(_ptrs(out)) == donated


@pytest.mark.parametrize("mesh", [MESHES["cpu2"], MESH2D], ids=["cpu2", "2d"])
@pytest.mark.parametrize("fn", [lambda x: x.T, lambda x: x ** 3], ids=["transpose", "cube"])
def test_a_replicated_donated_input_with_a_sharded_output(mesh, fn):
    """Slices of a donated parameter are not views: the donating program places them in the arena."""
    _check_donating_call(fn, [torch.randn(4, 4)], [P()], P("tp", None), (0,), mesh)


@pytest.mark.parametrize("mesh", MESHES.values(), ids=MESHES.keys())
@pytest.mark.parametrize("case", ["reshape", "chunk", "reshape-both", "transpose-reshape"])
def test_donated_inputs_read_through_a_reshape_or_chunk_into_another_sharding(mesh, case):
    fn, in_specs, out_spec = {
        "reshape": (lambda x, y: x.reshape(4, 8) + y, [P("tp"), P()], P(None, "tp")),
        "chunk": (lambda x, y: torch.cat(x.chunk(2, dim=1)[::-1], dim=1) * y.reshape(8, 4), [P("tp"), P(None, "tp")],
                  P(None, "tp")),
        "reshape-both": (lambda x, y: x.reshape(4, 8) + y, [P("tp"), P()], P("tp")),
        "transpose-reshape": (lambda x, y: x.T.reshape(8, 4) * torch.tanh(y.reshape(8, 4)), [P(None, "tp"), P("tp")],
                              P("tp")),
    }[case]
    _check_donating_call(fn, [torch.randn(8, 4), torch.randn(4, 8)], in_specs, out_spec, (0, 1), mesh)


def test_a_non_contiguous_donated_shard_is_not_written():
    """``from_shards`` adopts the caller's tensors as they are: a transposed one is not an ``out=`` buffer."""
    f = spmd.jit(lambda x: x + 1, mesh=MESHES["cpu2"], in_shardings=P("tp"), out_shardings=P("tp"), donate_argnums=0)
    x = torch.randn(6, 4)
    shards = [x[:3].T.contiguous().T, x[3:].T.contiguous().T]
    assert not shards[0].is_contiguous()
    xa = spmd.ShardedArray.from_shards(shards, NamedSharding(MESHES["cpu2"], P("tp")), (6, 4))
    out = f(xa)
    torch.testing.assert_close(out.to_torch(), x + 1)
    assert xa.is_deleted


def test_one_array_donated_by_two_threads_at_once_runs_once(donating):
    # Two concurrent calls donating one array: the second must raise, not run on the buffers the
    # first is overwriting (both calls used to return one shared, wrong buffer).
    import threading

    compiled = donating.lower(_put(torch.randn(8, 6), P("tp")), _put(torch.randn(8, 6), P("tp"))).compile()
    compiled.execute_sharded([_put(torch.randn(8, 6), P("tp")), _put(torch.randn(8, 6), P("tp"))])  # binds _run
    entered, release, real = threading.Event(), threading.Event(), compiled._run

    def held_run(*args, **kwargs):
        entered.set()
        release.wait(10)
        return real(*args, **kwargs)

    compiled._run = held_run
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    xa, ya = _put(x, P("tp")), _put(y, P("tp"))
    first = []
    worker = threading.Thread(target=lambda: first.append(compiled.execute_sharded([xa, ya])[0]))
    worker.start()
    try:
        assert entered.wait(30)
        with pytest.raises(DeletedArrayError, match="args\\[0\\].*another thread"):
            compiled.execute_sharded([xa, ya])
    finally:
        release.set()
        worker.join(60)
        compiled._run = real
    torch.testing.assert_close(first[0].to_torch(), _update(x, y))
    with pytest.raises(DeletedArrayError, match="donated to _update"):
        xa.to_torch()


def test_a_failed_donating_call_leaves_the_array_usable(donating):
    compiled = donating.lower(_put(torch.randn(8, 6), P("tp")), _put(torch.randn(8, 6), P("tp"))).compile()
    compiled.execute_sharded([_put(torch.randn(8, 6), P("tp")), _put(torch.randn(8, 6), P("tp"))])  # binds _run
    real = compiled._run

    def failing_run(*args, **kwargs):
        raise KeyboardInterrupt

    compiled._run = failing_run
    x = torch.randn(8, 6)
    xa = _put(x, P("tp"))
    try:
        with pytest.raises(KeyboardInterrupt):
            compiled.execute_sharded([xa, _put(torch.randn(8, 6), P("tp"))])
    finally:
        compiled._run = real
    torch.testing.assert_close(xa.to_torch(), x)
