"""Worker bodies of the run-lifecycle tests: what ``shutdown`` frees, and programs that outlive their run.

Each worker writes ``name: value`` lines to ``<out>/rank<r>.txt`` (the test reads them).
"""

from __future__ import annotations

import os
import threading
import weakref

import torch
import torch.distributed as dist
from faults import _catch, _write
from workers import init, matmul

import spmd
from spmd import Mesh, NamedSharding
from spmd import PartitionSpec as P
from spmd.models.plans import Plan


def _native_threads() -> int:
    """Threads of this process that Python did not start (gloo's workers and its event loop among them)."""
    return len(os.listdir("/proc/self/task")) - threading.active_count()


def after_shutdown_worker(rank: int, world: int, init_method: str, out: str) -> None:
    """A jitted matmul, a parallelized module and a gather on ``{"dp": world, "tp": 2}``; then ``shutdown``
    while the ``jit`` objects, their programs and the arrays are still held.

    Writes how many of the run's process groups are still alive after ``shutdown`` and the native
    thread counts before ``initialize`` and after ``shutdown``; the errors of calling the held
    programs after it; then, in a second run, whether the ``jit`` object computes again and the
    error of the first run's ``Compiled``."""
    before = _native_threads()
    init(rank, world, init_method)
    mesh = Mesh.create({"dp": world, "tp": 2}, devices="cpu:2")
    gen = torch.Generator().manual_seed(0)  # the same values on every rank
    x, w = torch.randn(8, 16, generator=gen), torch.randn(16, 12, generator=gen)
    f = spmd.jit(matmul, mesh=mesh, in_shardings=(P("dp"), P(None, "tp")), out_shardings=P("dp", "tp"))
    xa, wa = spmd.device_put(x, NamedSharding(mesh, P("dp"))), spmd.device_put(w, NamedSharding(mesh, P(None, "tp")))
    y = f(xa, wa)
    f(xa, wa)  # the call fast path is set up
    torch.testing.assert_close(spmd.distributed.process_allgather(y), x @ w, rtol=1e-5, atol=1e-5)
    compiled = f.lower(x, w).compile()
    pm = spmd.parallelize(torch.nn.Linear(16, 4), mesh, Plan(rules=()), input_shardings=(P("dp"),))
    pm(x)
    state = spmd.distributed.state.current()
    groups = [weakref.ref(g) for g in {dist.group.WORLD, *state.groups.values()}]
    spmd.distributed.shutdown()
    lines = [f"alive: {sum(g() is not None for g in groups)} of {len(groups)}",
             f"threads: {before} {_native_threads()}",
             "jit: " + _catch(lambda: f(x, w)),
             "jit-arrays: " + _catch(lambda: f(xa, wa)),
             "compiled: " + _catch(lambda: compiled(x, w)),
             "parallelize: " + _catch(lambda: pm(x)),
             "allgather: " + _catch(lambda: spmd.distributed.process_allgather(y))]
    init(rank, world, f"{init_method}-second-run")
    try:
        got = spmd.distributed.process_allgather(f(xa, wa))
        lines.append(f"second-run-jit: {torch.allclose(got, x @ w, rtol=1e-5, atol=1e-5)}")
        lines.append("second-run-compiled: " + _catch(lambda: compiled(x, w)))
    finally:
        spmd.distributed.shutdown()
    _write(out, rank, "\n".join(lines))
