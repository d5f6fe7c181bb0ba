"""One executable called from several threads; many calls without memory growth; the persistent
per-device thread pool of virtual CPU devices."""

from __future__ import annotations

import gc
import sys
import threading

import pytest
import torch

import spmd
from spmd import Mesh, NamedSharding
from spmd import PartitionSpec as P

MESH = Mesh.create(("tp",), devices="cpu:4")


def _mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


@pytest.fixture(scope="module")
def mlp():
    """A tensor-parallel MLP (all-reduce inside) compiled once; x f32[16,32], w1 f32[32,64], w2 f32[64,32]."""
    f = spmd.jit(_mlp, mesh=MESH, in_shardings=(P(), P(None, "tp"), P("tp", None)), out_shardings=P())
    return f.lower(torch.randn(16, 32), torch.randn(32, 64), torch.randn(64, 32)).compile()


def test_concurrent_calls_from_four_threads(mlp):
    errors: list = []
    barrier = threading.Barrier(4)

    def worker(seed: int) -> None:
        try:
            g = torch.Generator().manual_seed(seed)
            barrier.wait()
            for _ in range(25):
                host = (torch.randn(16, 32, generator=g), torch.randn(32, 64, generator=g),
                        torch.randn(64, 32, generator=g))
                y = mlp(*host).to_torch()
                torch.testing.assert_close(y, _mlp(*host), rtol=1e-4, atol=1e-4)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_virtual_cpu_devices_run_on_a_persistent_pool():
    """Big enough segments run as one task per device on the executable's own pool, made once."""
    f = spmd.jit(lambda a, b: torch.tanh(a @ b), mesh=MESH, in_shardings=(P("tp"), P()), out_shardings=P("tp"))
    a, b = torch.randn(512, 256), torch.randn(256, 256)
    c = f.lower(a, b).compile()
    pool = c.executable._pool
    assert pool is not None and pool._max_workers == 3
    c(a, b)
    threads = {t.ident for t in pool._threads}
    assert threads  # the per-device work went to the pool
    for _ in range(5):
        y = c(a, b)
    after = {t.ident for t in pool._threads}
    assert c.executable._pool is pool and threads <= after and len(after) <= 3  # reused, never more than 3
    assert all(t.is_alive() for t in pool._threads)
    assert all(t.name.startswith("spmd-cpu") for t in pool._threads)
    torch.testing.assert_close(y.to_torch(), torch.tanh(a @ b), rtol=1e-5, atol=1e-5)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _memory_growth(calls: int) -> tuple[int, int]:
    """(Python allocated blocks growth, RSS growth in bytes) over ``calls`` executions after a warm-up."""
    mesh = Mesh.create(("x",), devices="cpu:2")
    s = NamedSharding(mesh, P("x"))
    c = spmd.jit(lambda a, b: a * b + 1.0, mesh=mesh, in_shardings=P("x"), out_shardings=P("x")).lower(
        torch.randn(64, 64), torch.randn(64, 64)).compile()
    a, b = spmd.device_put(torch.randn(64, 64), s), spmd.device_put(torch.randn(64, 64), s)
    for _ in range(500):
        c.execute_sharded([a, b])
    gc.collect()
    blocks0, rss0 = sys.getallocatedblocks(), _rss_bytes()
    y = None
    for _ in range(calls):
        y = c.execute_sharded([a, b])[0]
    gc.collect()
    blocks1, rss1 = sys.getallocatedblocks(), _rss_bytes()
    torch.testing.assert_close(y.to_torch(), a.to_torch() * b.to_torch() + 1.0)
    return blocks1 - blocks0, rss1 - rss0


def test_no_memory_growth_over_10000_calls():
    blocks, rss = _memory_growth(10_000)
    # One leaked Python object per call would be >= 10000 blocks; one leaked 16 KiB output 160 MiB.
    assert blocks < 500, blocks
    assert rss < 8 * 2**20, rss
