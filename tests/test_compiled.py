"""spmd.compiled: the executable bound on first run is safe to call from several threads at once."""

from __future__ import annotations

import threading

import torch

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P


class _SlowToBind:
    """An executable whose ``run`` attribute takes a while to look up, the first time only."""

    def __init__(self, real, entered: threading.Event, release: threading.Event) -> None:
        self._real, self._entered, self._release = real, entered, release

    def __getattr__(self, name):
        if name == "run" and not self._entered.is_set():
            self._entered.set()
            self._release.wait(10)
        return getattr(self._real, name)


def test_first_runs_from_two_threads_both_bind_the_executable():
    """The first run binds the executable's run method; a second thread arriving meanwhile used to
    find the binding half made and call None ("'NoneType' object is not callable" in
    ``_execute_claimed``: random tester seed 3101 #1801, a reshard program's first call from 3 threads)."""
    mesh = Mesh.create(("tp",), devices="cpu:2")
    x = torch.randn(8, 6)
    compiled = spmd.jit(lambda t: t * 2 + 1, mesh=mesh, in_shardings=(P("tp"),), out_shardings=P()).lower(x).compile()
    entered, release = threading.Event(), threading.Event()
    compiled.executable = _SlowToBind(compiled.executable, entered, release)
    arg = lambda: spmd.device_put(x, spmd.NamedSharding(mesh, P("tp")))  # noqa: E731
    first: list = []
    worker = threading.Thread(target=lambda: first.append(compiled.execute_sharded([arg()])[0]))
    worker.start()
    try:
        assert entered.wait(30)
        second = compiled.execute_sharded([arg()])[0]
    finally:
        release.set()
        worker.join(60)
    torch.testing.assert_close(second.to_torch(), x * 2 + 1)
    torch.testing.assert_close(first[0].to_torch(), x * 2 + 1)
