"""Compilation from many threads at once: traced once, the others wait (``spmd.compile_lock``)."""

from __future__ import annotations

import threading

import torch

import spmd
from spmd import Mesh, NamedSharding, metrics
from spmd import PartitionSpec as P

MESH = Mesh.create(("tp",), devices="cpu:2")
THREADS = 6


def _in_threads(work) -> list:
    """Run ``work(i)`` in THREADS threads released together; returns the exceptions raised."""
    errors: list = []
    barrier = threading.Barrier(THREADS)

    def run(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_one_uncompiled_function_called_from_many_threads_is_traced_once():
    f = spmd.jit(lambda x, w: torch.tanh(x @ w) * 1.5, mesh=MESH, in_shardings=(P("tp"), P()))
    inputs = [(torch.randn(8, 5), torch.randn(5, 3)) for _ in range(THREADS)]
    misses = metrics.counter("compile_cache.miss").value
    results: dict = {}
    errors = _in_threads(lambda i: results.__setitem__(i, f(*inputs[i]).to_torch()))
    assert not errors, errors[0]
    assert metrics.counter("compile_cache.miss").value == misses + 1
    for i, (x, w) in enumerate(inputs):
        torch.testing.assert_close(results[i], torch.tanh(x @ w) * 1.5)


def test_different_functions_and_lowerings_compile_concurrently():
    fns = [spmd.jit(lambda x, k=k: torch.softmax(x * (k + 1), -1), mesh=MESH, in_shardings=P("tp"))
           for k in range(THREADS)]
    x = torch.randn(4, 6)
    results: dict = {}

    def work(i: int) -> None:
        if i % 2:
            results[i] = fns[i].lower(x).compile()(x).to_torch()
        else:
            results[i] = fns[i](x).to_torch()

    errors = _in_threads(work)
    assert not errors, errors[0]
    for k in range(THREADS):
        torch.testing.assert_close(results[k], torch.softmax(x * (k + 1), -1))


def test_the_first_reshard_of_a_layout_pair_from_many_threads():
    x = torch.randn(6, 10, 3)
    arrays = [spmd.device_put(x + i, NamedSharding(MESH, P("tp"))) for i in range(THREADS)]
    target = NamedSharding(MESH, P(None, "tp"))
    results: dict = {}
    errors = _in_threads(lambda i: results.__setitem__(i, arrays[i].reshard(target)))
    assert not errors, errors[0]
    for i in range(THREADS):
        assert results[i].sharding == target
        torch.testing.assert_close(results[i].to_torch(), x + i)
