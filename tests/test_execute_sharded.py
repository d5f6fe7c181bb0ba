"""``Compiled.execute_sharded``: ShardedArrays in and out, input checks, output shardings fixed at
compile time, resharding of inputs, uneven dims, host overhead, asynchronous dispatch on GPU."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd import Mesh, NamedSharding, ShardedArray, metrics
from spmd import PartitionSpec as P

MESH = Mesh.create(("tp",), devices="cpu:4")
MESH2D = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")


def _mlp(x, w1, w2):
    return torch.nn.functional.gelu(x @ w1) @ w2


@pytest.fixture(scope="module")
def mlp():
    """The tensor-parallel MLP compiled once for x f32[8,16], w1 f32[16,32], w2 f32[32,16]."""
    f = spmd.jit(_mlp, mesh=MESH, in_shardings=(P(), P(None, "tp"), P("tp", None)), out_shardings=P())
    args = (torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16))
    return f, f.lower(*args).compile()


def _put(t, spec, mesh=MESH):
    return spmd.device_put(t, NamedSharding(mesh, spec))


def _mlp_args():
    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16)
    arrays = [_put(x, P()), _put(w1, P(None, "tp")), _put(w2, P("tp", None))]
    return (x, w1, w2), arrays


def test_execute_sharded_takes_and_returns_sharded_arrays(mlp):
    _, c = mlp
    host, arrays = _mlp_args()
    (y,) = c.execute_sharded(arrays)
    assert isinstance(y, ShardedArray) and y.sharding == NamedSharding(MESH, P())
    assert y.shape == (8, 16) and y.dtype == torch.float32
    torch.testing.assert_close(y.to_torch(), _mlp(*host), rtol=1e-5, atol=1e-5)
    assert not any(a.is_deleted for a in arrays)


def test_call_accepts_tensors_and_arrays_alike(mlp):
    f, c = mlp
    host, arrays = _mlp_args()
    want = _mlp(*host)
    torch.testing.assert_close(c(*host).to_torch(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f(arrays[0], host[1], arrays[2]).to_torch(), want, rtol=1e-5, atol=1e-5)


def test_outputs_chain_into_the_next_call_without_rechecks():
    f = spmd.jit(lambda a, b: a * b + a, mesh=MESH, in_shardings=P("tp"), out_shardings=P("tp"))
    a, b = torch.randn(8, 3), torch.randn(8, 3)
    c = f.lower(a, b).compile()
    y = c.execute_sharded([a, b])[0]
    assert y.sharding is c.input_shardings[0] or y.sharding == c.input_shardings[0]
    z = c.execute_sharded([y, y])[0]
    r = a * b + a
    torch.testing.assert_close(z.to_torch(), r * r + r)


def test_output_shardings_are_computed_once_per_compilation():
    f = spmd.jit(lambda a: (a + 1, a.sum(0)), mesh=MESH, in_shardings=P("tp"))
    a = torch.randn(8, 4)
    before = metrics.counter("output_shardings.computed").value
    c = f.lower(a).compile()
    after_compile = metrics.counter("output_shardings.computed").value
    assert after_compile - before in (0, 1)  # 0 when the process-wide cache already held it
    arr = _put(a, P("tp"))
    for _ in range(20):
        y, s = c.execute_sharded([arr])
    assert metrics.counter("output_shardings.computed").value == after_compile
    assert [y.sharding, s.sharding] == c.output_shardings
    torch.testing.assert_close(s.to_torch(), a.sum(0))


# ----------------------------------------------------------------- errors


def test_wrong_number_of_arguments(mlp):
    f, c = mlp
    host, arrays = _mlp_args()
    with pytest.raises(ValueError, match=r"_mlp: expected 3 array arguments, got 2"):
        c.execute_sharded(arrays[:2])
    with pytest.raises(ValueError, match=r"_mlp: expected 3 positional arguments, got 2"):
        c(*host[:2])


def test_wrong_shape_and_dtype_name_the_argument(mlp):
    _, c = mlp
    host, arrays = _mlp_args()
    with pytest.raises(ValueError, match=r"argument args\[1\]: expected torch.float32\[16, 32\], "
                                         r"got torch.float32\[16, 8\]"):
        c.execute_sharded([arrays[0], torch.randn(16, 8), arrays[2]])
    bad = _put(host[2].double(), P("tp", None))
    with pytest.raises(ValueError, match=r"argument args\[2\]: expected torch.float32\[32, 16\], "
                                         r"got torch.float64\[32, 16\]"):
        c.execute_sharded([arrays[0], arrays[1], bad])
    with pytest.raises(TypeError, match=r"argument args\[0\]: expected a ShardedArray or torch.Tensor, got list"):
        c.execute_sharded([[1.0], arrays[1], arrays[2]])


def test_wrong_sharding_without_reshard_inputs(mlp):
    _, c = mlp
    host, arrays = _mlp_args()
    wrong = _put(host[1], P("tp", None))
    with pytest.raises(ValueError, match=r"argument args\[1\]: expected sharding .*spec=P\(None, 'tp'\).*, "
                                         r"got .*spec=P\('tp', None\).*reshard_inputs=True"):
        c.execute_sharded([arrays[0], wrong, arrays[2]])
    assert not wrong.is_deleted


def test_arguments_on_another_mesh(mlp):
    f, c = mlp
    host, arrays = _mlp_args()
    other = Mesh.create(("tp",), devices="cpu:2")
    x_other = _put(host[0], P(), other)
    with pytest.raises(ValueError, match=r"argument args\[0\]: expected an array on mesh .*'tp': 4.*got one on "
                                         r"mesh .*'tp': 2"):
        c.execute_sharded([x_other, arrays[1], arrays[2]])
    with pytest.raises(ValueError, match=r"args\[0\]: array lives on mesh .*'tp': 2.*expected the jit mesh"):
        f(x_other, arrays[1], arrays[2])


def test_partition_spec_errors_name_the_argument():
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"argument args\[0\]: unknown mesh axis 'zz' in P\('zz'\); "
                                         r"mesh axes are \('tp',\)"):
        spmd.jit(lambda a: a, mesh=MESH, in_shardings=P("zz"))(x)
    with pytest.raises(ValueError, match=r"argument args\[0\]: mesh axis 'tp' is used 2 times"):
        spmd.jit(lambda a: a, mesh=MESH, in_shardings=P("tp", "tp"))(x)
    with pytest.raises(ValueError, match=r"argument args\[0\]: P\(None, None, 'tp'\) has 3 entries but the array "
                                         r"has 2 dims"):
        spmd.jit(lambda a: a, mesh=MESH, in_shardings=P(None, None, "tp"))(x)
    with pytest.raises(ValueError, match=r"out_shardings\[0\]: P\('tp', None, None\) has 3 entries"):
        spmd.jit(lambda a: a, mesh=MESH, out_shardings=P("tp", None, None))(x)


def test_deleted_arguments_raise(mlp):
    _, c = mlp
    _, arrays = _mlp_args()
    arrays[1].delete()
    with pytest.raises(spmd.array.DeletedArrayError, match=r"argument args\[1\]: the ShardedArray f32\[16,32\] "
                                                           r"was deleted"):
        c.execute_sharded(arrays)


# ------------------------------------------------------------ resharding


def test_reshard_inputs_reshards_on_device():
    f = spmd.jit(lambda a, b: a @ b, mesh=MESH2D, in_shardings=(P("dp", None), P(None, "tp")),
                 out_shardings=P("dp", "tp"), reshard_inputs=True)
    a, b = torch.randn(6, 8), torch.randn(8, 10)
    c = f.lower(a, b).compile()
    a_wrong = _put(a, P(None, ("dp", "tp")), MESH2D)
    before = metrics.counter("reshards").value
    y = c.execute_sharded([a_wrong, _put(b, P("tp"), MESH2D)])[0]
    assert metrics.counter("reshards").value == before + 2
    torch.testing.assert_close(y.to_torch(), a @ b, rtol=1e-5, atol=1e-5)
    assert a_wrong.sharding.spec == P(None, ("dp", "tp")) and not a_wrong.is_deleted


# ------------------------------------------------------------ uneven dims


SPECS_2D = [P(), P("dp"), P("tp"), P(None, "dp"), P("dp", "tp"), P("tp", "dp"), P(("dp", "tp")),
            P(None, ("tp", "dp"))]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 11), cols=st.integers(1, 7), spec=st.sampled_from(SPECS_2D),
       seed=st.integers(0, 2**31 - 1))
def test_uneven_dims_round_trip_exactly(rows, cols, spec, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    arr = _put(x, spec, MESH2D)
    assert arr.shape == (rows, cols)
    assert torch.equal(arr.to_torch(), x)
    again = ShardedArray.from_shards([s.data.clone() for s in arr.shards], arr.sharding, (rows, cols))
    assert torch.equal(again.to_torch(), x)
    padded = arr.sharding.shard_shape((rows, cols))
    assert all(tuple(b.shape) == padded for b in arr._buffers)


def test_uneven_dims_through_a_compiled_program():
    f = spmd.jit(lambda a, b: torch.tanh(a) @ b, mesh=MESH2D, in_shardings=(P("dp", "tp"), P("tp")),
                 out_shardings=P(None, "dp"))
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    y = f(a, b)
    assert y.shape == (5, 3) and y.sharding.spec == P(None, "dp")
    torch.testing.assert_close(y.to_torch(), torch.tanh(a) @ b, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ overhead


def test_per_call_overhead_is_small():
    """The compiled layer adds little on top of ``Executable.run`` for a tiny add on cpu:2."""
    mesh = Mesh.create(("x",), devices="cpu:2")
    s = NamedSharding(mesh, P("x"))
    c = spmd.jit(lambda a, b: a + b, mesh=mesh, in_shardings=P("x"), out_shardings=P("x")).lower(
        torch.randn(8, 4), torch.randn(8, 4)).compile()
    args = [spmd.device_put(torch.randn(8, 4), s), spmd.device_put(torch.randn(8, 4), s)]
    bufs = [a._buffers for a in args]

    def per_call(fn, n=300):
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t) / n)
        return best

    run = per_call(lambda: c.executable.run(bufs))
    full = per_call(lambda: c.execute_sharded(args))
    assert full - run < max(30e-6, run), (full, run)


def test_ready_events_flow_from_inputs_to_the_runtime_and_to_outputs(mlp, monkeypatch):
    """The plumbing of asynchronous dispatch, checked with stand-in events on CPU devices."""
    _, c = mlp
    host, arrays = _mlp_args()
    seen = {}
    real_run = c._run

    class Event:
        def __init__(self):
            self.waited = False

        def synchronize(self):
            self.waited = True

    def run(args, arg_ready=None, donated=frozenset(), trace=None):
        seen["arg_ready"] = arg_ready
        outs, _ = real_run(args, None, donated, trace)
        return outs, [Event() for _ in range(4)]

    monkeypatch.setattr(c, "_run", run)
    (y,) = c.execute_sharded(arrays)
    assert seen["arg_ready"] is None  # nothing to wait for
    events = y._ready_events
    assert len(events) == 4 and not any(e.waited for e in events)
    (z,) = c.execute_sharded([y, arrays[1], arrays[2]])
    assert seen["arg_ready"] == [events, (None,) * 4, (None,) * 4]  # the consumer waits on the device
    assert not any(e.waited for e in events)
    torch.testing.assert_close(z.to_torch(), _mlp(_mlp(*host), *host[1:]), rtol=1e-4, atol=1e-4)
    assert all(e.waited for e in z._ready_events)  # to_torch waited for the devices


# ------------------------------------------------------------ GPU


def _gpu_chain(cuda_graphs):
    mesh = Mesh.create(("x",), devices="cuda:2")

    def heavy(a, w):
        for _ in range(16):
            a = torch.tanh(a @ w)
        return a

    f = spmd.jit(heavy, mesh=mesh, in_shardings=(P("x"), P()), out_shardings=P("x"),
                 options=spmd.CompileOptions(cuda_graphs=cuda_graphs))
    a, w = torch.randn(8192, 2048), torch.randn(2048, 2048) / 2048 ** 0.5
    return f, a, w, spmd.device_put(a, NamedSharding(mesh, P("x"))), spmd.device_put(w, NamedSharding(mesh, P()))


def _finished(y) -> bool:
    """Whether the devices finished computing ``y`` (its ready events, or the caller's streams
    where a CUDA-graph replay ordered the work on them)."""
    if y._ready_events is not None:
        return all(ev.query() for ev in y._ready_events)
    return all(torch.cuda.current_stream(d).query() for d in (0, 1))


def _reference(a, w, steps):
    ref, w = a.cuda(0), w.cuda(0)
    for _ in range(steps):
        ref = torch.tanh(ref @ w)
    return ref.cpu()


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("cuda_graphs", [False, None])
def test_gpu_call_returns_before_the_devices_finish(cuda_graphs):
    f, a, w, aa, ww = _gpu_chain(cuda_graphs)
    f(aa, ww).block_until_ready()  # compile and warm up
    torch.cuda.synchronize(0), torch.cuda.synchronize(1)
    y = f(aa, ww)
    if cuda_graphs is False:
        assert y._ready_events is not None and len(y._ready_events) == 2
    assert not _finished(y)  # still running
    y.block_until_ready()
    assert _finished(y)
    torch.testing.assert_close(y.to_torch(), _reference(a, w, 16), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("cuda_graphs", [False, None])
def test_gpu_consumer_waits_on_the_device_not_the_host(cuda_graphs):
    f, a, w, aa, ww = _gpu_chain(cuda_graphs)
    f(f(aa, ww), ww).block_until_ready()
    torch.cuda.synchronize(0), torch.cuda.synchronize(1)
    waits = metrics.timer("wait_for_devices").total_samples
    y = f(aa, ww)
    z = f(y, ww)  # enqueued behind y on the devices
    assert not _finished(y)  # the host did not wait for y
    assert metrics.timer("wait_for_devices").total_samples == waits
    torch.testing.assert_close(z.to_torch(), _reference(a, w, 32), rtol=1e-3, atol=1e-3)
    assert metrics.timer("wait_for_devices").total_samples > waits
