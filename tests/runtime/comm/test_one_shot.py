"""One-shot all-reduce on virtual CPU devices (``spmd.runtime.comm.one_shot``): numerics against the ring,
bit-identical devices, fixed staging buffers, selection by size, CUDA-graph-style replay and donation."""

from __future__ import annotations

import pytest
import torch
from graph_programs import under_graph_runner, unwrap

import spmd
from spmd.runtime.comm.base import reduce_stack
from spmd.runtime.comm.cpu import CpuCommunicator
from spmd.runtime.comm.one_shot import StagingBuffers, one_shot_cpu, reduce_staged
from spmd.runtime.graphs import HostReplayBackend
from spmd.runtime.thunks import CollectiveSpec

P = spmd.PartitionSpec
OPS = ("add", "maximum", "minimum", "multiply")
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _spec(dims, dtype, op, groups, algorithm="one-shot"):
    return CollectiveSpec("all-reduce", groups=groups, reduce_op=op, out_dims=tuple(dims), dtype=dtype,
                          algorithm=algorithm)


def _inputs(n, dims, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(dims, dtype=torch.float64, generator=gen) + 0.1).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("groups", [((0, 1, 2, 3),), ((0, 2), (1, 3)), ((3, 1, 0, 2),)], ids=str)
def test_equals_the_ring_bit_for_bit_on_every_device(dtype, op, groups):
    dims = (3, 5, 7)
    xs = _inputs(4, dims, dtype, seed=len(groups) * 7 + OPS.index(op))
    comm = CpuCommunicator(4)
    one = comm.run(_spec(dims, dtype, op, groups), xs)
    ring = comm.run(_spec(dims, dtype, op, groups, "ring"), xs)
    for g in groups:
        want = reduce_stack([xs[p] for p in g], op)
        ref64 = reduce_stack([xs[p].double() for p in g], op)
        for p in g:
            assert one[p].dtype == dtype and one[p].shape == dims
            assert torch.equal(one[p], one[g[0]]), f"device {p} differs from device {g[0]}"
            assert torch.equal(one[p], ring[p]) and torch.equal(one[p], want)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-6
            torch.testing.assert_close(one[p].double(), ref64, rtol=tol, atol=tol)


def test_bf16_sum_rounds_once():
    # float32 accumulation then one rounding: 256 + 1 + 1 - 256 keeps both ones (sequential bf16 adds lose them)
    xs = [torch.tensor([v], dtype=torch.bfloat16) for v in (256.0, 1.0, 1.0, -256.0)]
    out = one_shot_cpu(_spec((1,), torch.bfloat16, "add", ((0, 1, 2, 3),)), xs, StagingBuffers(["cpu"] * 4))
    assert [o.item() for o in out] == [2.0] * 4


def test_staging_buffers_are_fixed_and_results_fresh():
    comm = CpuCommunicator(2)
    spec = _spec((4, 8), torch.float32, "add", ((0, 1),))
    xs = _inputs(2, (4, 8), torch.float32, seed=1)
    first = comm.run(spec, xs)
    bufs = comm.staging.get(spec, (0, 1), 0)
    ptrs = [b.data_ptr() for b in bufs]
    assert len(comm.staging) == 1 and comm.staging.size_bytes == 2 * 2 * 4 * 8 * 4
    first_copy = [t.clone() for t in first]
    ys = _inputs(2, (4, 8), torch.float32, seed=2)
    second = comm.run(spec, ys)
    assert [b.data_ptr() for b in comm.staging.get(spec, (0, 1), 0)] == ptrs and len(comm.staging) == 1
    staged = {b.data_ptr() + k * b[0].nbytes for b in bufs for k in range(2)}
    for a, b in zip(first, second, strict=True):
        assert a.data_ptr() not in staged and b.data_ptr() not in staged and a.data_ptr() != b.data_ptr()
    assert all(torch.equal(a, c) for a, c in zip(first, first_copy, strict=True))  # a later run leaves results alone
    assert torch.equal(second[0], ys[0] + ys[1])
    comm.run(_spec((4, 8), torch.float32, "add", ((0, 1),)), xs, stream_id=1)  # another stream: its own buffers
    comm.run(_spec((4, 8), torch.bfloat16, "add", ((0, 1),)), [x.bfloat16() for x in xs])
    assert len(comm.staging) == 3


def test_noncontiguous_operands():
    base = _inputs(2, (6, 4), torch.float32, seed=3)
    xs = [b.t() for b in base]  # [4, 6] views
    out = CpuCommunicator(2).run(_spec((4, 6), torch.float32, "add", ((0, 1),)), xs)
    assert torch.equal(out[0], (base[0] + base[1]).t()) and out[0].is_contiguous()


@pytest.mark.parametrize("dims", [(), (0, 3), (1,)], ids=str)
def test_scalar_and_empty_operands(dims):
    xs = [torch.randn(dims) for _ in range(3)] if dims != (0, 3) else [torch.zeros(dims)] * 3
    out = CpuCommunicator(3).run(_spec(dims, torch.float32, "add", ((0, 1, 2),)), xs)
    assert all(o.shape == dims and torch.equal(o, reduce_stack(xs, "add")) for o in out)


def test_reduce_staged_bad_op():
    with pytest.raises(ValueError, match="reduce op: expected one of"):
        reduce_staged(torch.zeros(2, 3), "subtract")


# ---------------------------------------------------------------------------------------- through spmd.jit
def _row_parallel(mesh_axes, n, mode, max_bytes=1 << 20, **jit_kw):
    mesh = spmd.Mesh.create(mesh_axes, devices=f"cpu:{n}")

    def f(x, w):
        return torch.tanh(x @ w)

    return spmd.jit(f, mesh=mesh, in_shardings=(P(None, "tp"), P("tp", None)), out_shardings=P(),
                    options=spmd.CompileOptions(small_all_reduce=mode, small_all_reduce_max_bytes=max_bytes), **jit_kw)


@pytest.mark.parametrize(("axes", "n"), [(("tp",), 2), (("tp",), 4), ({"dp": 2, "tp": 2}, 4)])
def test_jit_on_equals_off_bitwise(axes, n):
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(5, 12 * n, generator=gen), torch.randn(12 * n, 7, generator=gen)  # 5, 7: uneven
    on, off = _row_parallel(axes, n, "on"), _row_parallel(axes, n, "off")
    got, ref = on(x, w), off(x, w)
    collectives = on.lower(x, w).compile().collectives()
    [ar] = [c for c in collectives if c["opcode"] == "all-reduce"]
    k = ar["group_size"]
    assert ar["algorithm"] == "one-shot" and ar["bytes_per_device"] == 5 * 7 * 4 * (k - 1)  # a copy to every peer
    assert [c["algorithm"] for c in off.lower(x, w).compile().collectives()] == ["ring"]
    shards = [s.data for s in got.shards]
    assert all(torch.equal(s, shards[0]) for s in shards)
    assert torch.equal(got.to_torch(), ref.to_torch())
    torch.testing.assert_close(got.to_torch().double(), torch.tanh(x.double() @ w.double()), rtol=1e-5, atol=1e-5)


def test_concurrent_calls_share_the_staging_buffers_safely():
    import threading

    f = _row_parallel(("tp",), 2, "on")
    gen = torch.Generator().manual_seed(9)
    cases = [(torch.randn(6, 64, generator=gen), torch.randn(64, 40, generator=gen)) for _ in range(4)]
    want = [f(x, w).to_torch() for x, w in cases]  # one thread: the reference bits
    got: dict = {}
    barrier = threading.Barrier(4)

    def worker(t):
        barrier.wait()
        got[t] = [f(*cases[t]).to_torch() for _ in range(30)]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in range(4):
        assert all(torch.equal(g, want[t]) for g in got[t])


def test_jit_selects_by_size_threshold():
    x, w = torch.randn(4, 16), torch.randn(16, 8)  # all-reduce of [4, 8] f32 = 128 bytes per device

    def algos(max_bytes):
        c = _row_parallel(("tp",), 2, "on", max_bytes).lower(x, w).compile()
        return [k["algorithm"] for k in c.collectives()]

    assert algos(127) == ["ring"] and algos(128) == ["one-shot"]
    text = _row_parallel(("tp",), 2, "on", 128).lower(x, w).as_text("schedule")
    assert 'all-reduce(%matmul), to_apply=%add.f32, backend_config={"algorithm":"one-shot"}' in text


def _accumulate(acc, x, w):
    return acc + x @ w


def test_donation_and_graph_style_replay():
    """acc is donated and the all-reduced sum written into it; the graph runner (host replay) rebinds
    fresh inputs into its static buffers on every call while the staging buffers stay the same."""
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    j = spmd.jit(_accumulate, mesh=mesh, in_shardings=(P(), P(None, "tp"), P("tp", None)), out_shardings=P(),
                 donate_argnums=(0,), options=spmd.CompileOptions(small_all_reduce="on", cuda_graphs=False))
    gen = torch.Generator().manual_seed(11)
    acc0 = torch.randn(4, 8, generator=gen)
    compiled = j.lower(acc0, torch.randn(4, 32), torch.randn(32, 8)).compile()
    c, runner = under_graph_runner(compiled, backend=HostReplayBackend)
    comm = unwrap(compiled.executable)._comm
    acc, want, ptrs = spmd.device_put(acc0, compiled.input_shardings[0]), acc0.double(), None
    for _ in range(5):
        x, w = torch.randn(4, 32, generator=gen), torch.randn(32, 8, generator=gen)
        acc = c(acc, x, w)
        want = want + x.double() @ w.double()
        torch.testing.assert_close(acc.to_torch().double(), want, rtol=1e-5, atol=1e-5)
        shards = [s.data for s in acc.shards]
        assert torch.equal(shards[0], shards[1])
        now = [b.data_ptr() for bufs in comm.staging._bufs.values() for b in bufs]
        assert ptrs is None or now == ptrs
        ptrs = now
    assert len(comm.staging) == 1
