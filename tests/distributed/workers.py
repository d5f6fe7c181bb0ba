"""Worker bodies of the multi-process tests: the held jit programs on a global mesh against one process.

Every check runs the same program on the multi-process mesh and on a single-process mesh of the
same axes (virtual CPU devices, built in the worker itself) and requires equal results; both are
also checked against PyTorch eager in float64.
"""

from __future__ import annotations

import os

import torch

import spmd
from spmd import CompileOptions, Mesh, NamedSharding
from spmd import PartitionSpec as P
from spmd.ir.sharding import MeshShape

TOL = {"rtol": 1e-5, "atol": 1e-5}


def init(rank: int, world: int, init_method: str | None, timeout_s: float = 60.0, node: int | None = None) -> None:
    """Join the run (``node`` simulates the host of this rank)."""
    torch.set_num_threads(1)
    if init_method == "auto":  # under torchrun: Mesh.create initialises from the environment
        return
    if node is not None:
        os.environ["GROUP_RANK"] = str(node)
    if init_method is None:
        spmd.distributed.initialize(timeout_s=timeout_s)
    else:
        spmd.distributed.initialize(init_method=init_method, rank=rank, world_size=world, timeout_s=timeout_s)


def local_mesh(axes: dict[str, int]) -> Mesh:
    """A single-process mesh of ``axes`` (the reference layout), even inside a multi-process run."""
    n = 1
    for s in axes.values():
        n *= s
    return Mesh(MeshShape(tuple(axes), tuple(axes.values())), "cpu", tuple(range(n)))


def mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def attention(x, wq, wk, wv, wo):
    b, s, d = x.shape
    heads = 4

    def split(t):
        return t.view(b, s, heads, -1).transpose(1, 2)

    q, k, v = split(x @ wq), split(x @ wk), split(x @ wv)
    a = torch.softmax(q @ k.transpose(-1, -2) / (d // heads) ** 0.5, dim=-1) @ v
    return x + a.transpose(1, 2).reshape(b, s, d) @ wo


def uneven(x, w):
    return (torch.tanh(x) * 3).sum(0) + (x @ w).amax(1).sum()


def matmul(x, w):
    return x @ w


def _rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def cases():
    """(name, fn, args, in_shardings, out_shardings, options) of the held programs."""
    return [
        ("mlp", mlp, (_rand(8, 16, seed=1), _rand(16, 32, seed=2), _rand(32, 16, seed=3)),
         (P("dp"), P(None, "tp"), P("tp", None)), P("dp"), None),
        ("mlp-replicated-out", mlp, (_rand(8, 16, seed=4), _rand(16, 32, seed=5), _rand(32, 16, seed=6)),
         (P(("dp", "tp")), P(), P()), P(), None),
        ("attention", attention, (_rand(2, 8, 16, seed=7), *(_rand(16, 16, seed=8 + i) for i in range(4))),
         (P("dp"), P(None, "tp"), P(None, "tp"), P(None, "tp"), P("tp", None)), P("dp"), None),
        ("uneven", uneven, (_rand(7, 10, seed=12), _rand(10, 5, seed=13)), (P("dp", "tp"), P("tp")), P(), None),
        ("reduce-scatter", matmul, (_rand(8, 16, seed=16), _rand(16, 12, seed=17)),
         (P(None, ("dp", "tp")), P(("dp", "tp"), None)), P(("dp", "tp")), None),
        ("reduce-scatter-tp", matmul, (_rand(8, 16, seed=19), _rand(16, 12, seed=22)),
         (P("dp", "tp"), P("tp", None)), P("dp", "tp"), None),
        ("sum-all", lambda x: x.sum(0), (_rand(8, 6, seed=18),), (P(("dp", "tp")),), P(), None),
        ("one-shot", mlp, (_rand(8, 16, seed=23), _rand(16, 32, seed=24), _rand(32, 16, seed=25)),
         (P("dp"), P(None, "tp"), P("tp", None)), P("dp"), CompileOptions(small_all_reduce="on")),
        ("windowed", matmul, (_rand(16, 32, seed=14), _rand(32, 24, seed=15)), (P(("dp", "tp")), P(None, "tp")),
         P(None, "tp"), CompileOptions(windowed_einsum="on")),
    ]


def check_programs(mesh: Mesh, names=None) -> None:
    """Every held program on ``mesh`` equals the single-process run (checked on rank 0: bit for bit in the
    default ``gather`` reduce mode, to rounding in ``reduce`` mode) and eager float64."""
    ref_mesh = local_mesh(dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)))
    for name, fn, args, ins, out, options in cases():
        if names is not None and name not in names:
            continue
        got = spmd.jit(fn, mesh=mesh, in_shardings=ins, out_shardings=out, options=options)(*args)
        full = spmd.distributed.process_allgather(got)
        if spmd.distributed.process_index() == 0:
            want = spmd.jit(fn, mesh=ref_mesh, in_shardings=ins, out_shardings=out, options=options)(*args)
            tol = TOL if os.environ.get("SPMD_DISTRIBUTED_REDUCE") == "reduce" else {"rtol": 0, "atol": 0}
            torch.testing.assert_close(full, want.to_torch(), **tol, msg=lambda m, n=name: f"{n}: {m}")
        eager = fn(*(a.double() for a in args)).float()
        torch.testing.assert_close(full, eager, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n} vs eager: {m}")


def check_donation(mesh: Mesh) -> None:
    """A donated argument dies on every process; the result is right; the output can be donated again."""
    sh = NamedSharding(mesh, P("dp", "tp"))
    x0, y0 = _rand(8, 6, seed=20), _rand(8, 6, seed=21)
    f = spmd.jit(lambda x, y: x * 2 + y, mesh=mesh, in_shardings=(sh, sh), out_shardings=sh, donate_argnums=0)
    x, y = spmd.device_put(x0, sh), spmd.device_put(y0, sh)
    z = f(x, y)
    assert x.is_deleted and not y.is_deleted
    z2 = f(z, y)
    assert z.is_deleted
    torch.testing.assert_close(spmd.distributed.process_allgather(z2), (x0 * 2 + y0) * 2 + y0)


RESHARD_SPECS = (P(), P("dp"), P("tp"), P(None, "dp"), P("dp", "tp"), P("tp", "dp"), P(("dp", "tp"))),


def check_reshard_pairs(mesh: Mesh, specs=RESHARD_SPECS[0]) -> None:
    """Every ordered pair of ``specs`` reshards a [6, 10] value (uneven on 4 ways) exactly."""
    value = _rand(6, 10, seed=30)
    for a in specs:
        src = spmd.device_put(value, NamedSharding(mesh, a))
        for b in specs:
            if a == b:
                continue
            out = src.reshard(NamedSharding(mesh, b))
            assert out.sharding == NamedSharding(mesh, b)
            torch.testing.assert_close(spmd.distributed.process_allgather(out), value, rtol=0, atol=0,
                                       msg=lambda m, a=a, b=b: f"reshard {a} -> {b}: {m}")


def check_builders(mesh: Mesh, block_rows: tuple[int, int]) -> None:
    """make_array_from_process_local_data / make_array_from_callback equal device_put of the global value."""
    value = _rand(8, 6, seed=40)
    sh = NamedSharding(mesh, P("dp", "tp"))
    lo, hi = block_rows
    a = spmd.distributed.make_array_from_process_local_data(sh, value[lo:hi])
    assert tuple(a.shape) == (8, 6)
    b = spmd.distributed.make_array_from_callback((8, 6), sh, lambda index: value[index])
    for arr in (a, b):
        assert not arr.is_fully_addressable
        for s in arr.addressable_shards:
            torch.testing.assert_close(s.data, value[s.index], rtol=0, atol=0)
        torch.testing.assert_close(spmd.distributed.process_allgather(arr), value, rtol=0, atol=0)


def held_worker(rank: int, world: int, init_method: str | None, axes: dict, per: int, full: bool,
                node_size: int = 0, names=None, reduce: str | None = None) -> None:
    """The held jit tests on ``Mesh.create(axes, devices=f"cpu:{per}")``; ``full`` adds reshard pairs and builders;
    ``reduce`` sets ``SPMD_DISTRIBUTED_REDUCE``."""
    if reduce:
        os.environ["SPMD_DISTRIBUTED_REDUCE"] = reduce
    init(rank, world, init_method, node=rank // node_size if node_size else None)
    try:
        platform = os.environ.get("SPMD_TEST_PLATFORM", "cpu")  # "cuda" in the GPU test
        mesh = Mesh.create(axes, devices=f"{platform}:{per}")
        assert mesh.is_multi_process and mesh.process_count == world
        assert mesh.local_pids == tuple(range(rank * per, rank * per + per)), mesh.local_pids
        check_programs(mesh, names)
        check_donation(mesh)
        if full:
            check_reshard_pairs(mesh)
            rows = 8 // axes["dp"]
            dp = mesh.shape.coords(mesh.local_pids[0])["dp"]
            check_builders(mesh, (dp * rows, dp * rows + rows))
    finally:
        spmd.distributed.shutdown()
