"""Worker bodies of the failure tests: a mismatched program, a rank dying mid-step, bad input.

Each worker writes what it saw to ``<out>/rank<r>.txt`` (the test reads them), so a worker that
is expected to fail does not need to propagate its exception through the launcher.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from workers import init, mlp

import spmd
from spmd import Mesh, NamedSharding
from spmd import PartitionSpec as P


def _write(out: str, rank: int, text: str) -> None:
    Path(out, f"rank{rank}.txt").write_text(text)


def _catch(fn) -> str:
    try:
        fn()
    except Exception as e:  # the tests read the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def two_layers(x, w1, w2):
    return mlp(mlp(x, w1, w2), w1, w2)


def dying_worker(rank: int, world: int, init_method: str, out: str, timeout_s: float, hang: bool = False) -> None:
    """After one good step, rank 1 exits (or, with ``hang``, stops) at the second collective of the next step.

    Writes ``"<seconds rank 0 waited> <collectives per step>\n<error>"``."""
    init(rank, world, init_method, timeout_s=timeout_s)
    mesh = Mesh.create({"tp": world}, devices="cpu:1")
    args = (torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16))
    f = spmd.jit(two_layers, mesh=mesh, in_shardings=(P(), P(None, "tp"), P("tp", None)), out_shardings=P())
    f(*args)
    comm = next(iter(f._cache.values())).executable._comm
    per_step = comm.calls + 1  # collectives of one step
    assert per_step >= 2, per_step
    if rank == 1:
        run = type(comm).run

        def die(self, *a, **k):
            if self.calls + 1 == per_step + 1:  # about to run the second collective of the second step
                deadline = time.monotonic() + (4 * timeout_s if hang else 0)
                while time.monotonic() < deadline and not Path(out, "rank0.txt").exists():
                    time.sleep(0.2)  # hang until rank 0 has failed (bounded)
                os._exit(3)
            return run(self, *a, **k)

        type(comm).run = die
    start = time.monotonic()
    text = _catch(lambda: spmd.distributed.process_allgather(f(*args)))
    _write(out, rank, f"{time.monotonic() - start:.1f} {per_step}\n{text}")
    os._exit(0)  # the group cannot be shut down cleanly with a dead peer


def bad_input_worker(rank: int, world: int, init_method: str, out: str) -> None:
    """Each bad input raises a clear error on every rank, naming the argument and ranks; then rank 1
    compiles the MLP for a batch of 6 instead of 8: every rank gets ProgramMismatchError."""
    init(rank, world, init_method, timeout_s=60)
    try:
        lines = [
            "world: " + _catch(lambda: Mesh.create({"x": 3 * world}, devices="cpu:2")),
            "devices: " + _catch(lambda: Mesh.create({"x": 3}, devices=f"cpu:{1 + rank}")),
            "other-process: " + _catch(lambda: Mesh.create({"x": world}, devices=[torch.device("cuda", 7)])),
        ]
        mesh = Mesh.create({"dp": world, "tp": 2}, devices="cpu:2")
        a = spmd.device_put(torch.randn(8, 4), NamedSharding(mesh, P("dp")))
        lines.append("to_torch: " + _catch(a.to_torch))
        value = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))  # the same on every rank
        inside = [spmd.device_put(value, NamedSharding(mesh, spec)) for spec in (P(), P(None, "tp"))]
        lines.append("locally-complete: " + str([torch.equal(b.to_torch(), value) for b in inside]))
        lines.append("shards: " + _catch(lambda: a.shards))
        local = torch.randn(4 + rank, 4)
        lines.append("local_data: " + _catch(lambda: spmd.distributed.make_array_from_process_local_data(
            NamedSharding(mesh, P("dp")), local)))
        batch = 6 if rank == 1 else 8
        x, w1, w2 = torch.randn(batch, 16), torch.randn(16, 32), torch.randn(32, 16)
        f = spmd.jit(mlp, mesh=mesh, in_shardings=(P("dp"), P(), P()), out_shardings=P("dp"))
        lines.append("mismatch: " + _catch(lambda: f(x, w1, w2)))
        # ranks that reduce across processes differently would wait in different collectives
        os.environ["SPMD_DISTRIBUTED_REDUCE"] = "gather" if rank == 0 else "reduce"
        x = torch.randn(8, 16)
        g = spmd.jit(two_layers, mesh=mesh, in_shardings=(P("dp"), P(), P()), out_shardings=P("dp"))
        lines.append("reduce-mode: " + _catch(lambda: g(x, w1, w2)))
        _write(out, rank, "\n".join(lines))
    finally:
        spmd.distributed.shutdown()


def leave_worker(rank: int, world: int, init_method: str, out: str, mode: str) -> None:
    """``shutdown``'s leave barrier. ``order``: rank 1 leaves 1.5 s late; rank 0's shutdown must return
    after rank 1 entered its own. ``absent``: rank 1 exits without shutdown; rank 0's returns, no error,
    after the (shortened) bound. ``failed``: as ``absent`` after a failed wait: no barrier at all.
    Rank 0 writes ``"<seconds its shutdown took> <wall time it returned>"``, rank 1 ``"<wall time it entered>"``."""
    from spmd.distributed import init as init_module

    init_module.LEAVE_BARRIER_S = 2.0 if mode == "absent" else 60.0
    init(rank, world, init_method, timeout_s=60)
    Mesh.create({"x": world}, devices="cpu:1")
    if rank == 1:
        if mode == "order":
            time.sleep(1.5)
        _write(out, rank, f"{time.time()}")
        if mode == "order":
            spmd.distributed.shutdown()
        os._exit(0)
    while mode != "order" and not Path(out, "rank1.txt").exists():
        time.sleep(0.05)
    if mode == "failed":
        spmd.distributed.state.current().failed = True
    start = time.monotonic()
    spmd.distributed.shutdown()
    _write(out, rank, f"{time.monotonic() - start} {time.time()}")


def mesh_agreement_worker(rank: int, world: int, init_method: str, out: str) -> None:
    """``Mesh.create`` with other axes on rank 1 (names in another order, other sizes, an invalid
    argument on rank 1 only): every rank raises. Then an agreed mesh is still built."""
    init(rank, world, init_method, timeout_s=60)
    try:
        lines = [
            "order: " + _catch(lambda: Mesh.create({"dp": 2, "tp": 2} if rank == 0 else {"tp": 2, "dp": 2},
                                                   devices="cpu:2")),
            "sizes: " + _catch(lambda: Mesh.create({"x": 4} if rank == 0 else {"x": 2, "y": 2}, devices="cpu:2")),
            "invalid: " + _catch(lambda: Mesh.create(("x",) if rank == 0 else ("x", "x"), devices="cpu:2")),
            "agreed: " + repr(Mesh.create({"dp": world, "tp": 2}, devices="cpu:2")),
        ]
        _write(out, rank, "\n".join(lines))
    finally:
        spmd.distributed.shutdown()


def local_data_agreement_worker(rank: int, world: int, init_method: str, out: str) -> None:
    """``make_array_from_process_local_data`` over ``dp`` across 2 processes of global shape [7, 4]
    (blocks of 4 and 3 rows): the right uneven blocks build the array; a wrong block, a dtype or a
    global shape of another rank on rank 1 only make every rank raise the same error."""
    init(rank, world, init_method, timeout_s=60)
    try:
        mesh = Mesh.create({"dp": world, "tp": 2}, devices="cpu:2")
        sh = NamedSharding(mesh, P("dp"))
        value = torch.randn(7, 4, generator=torch.Generator().manual_seed(3))
        block = value[:4] if rank == 0 else value[4:]
        a = spmd.distributed.make_array_from_process_local_data(sh, block, (7, 4))
        exact = all(torch.equal(s.data, value[s.index]) for s in a.addressable_shards)
        make = spmd.distributed.make_array_from_process_local_data
        lines = [
            f"uneven: {tuple(a.shape)} {exact}",
            "block: " + _catch(lambda: make(sh, value[:4], (7, 4))),  # rank 1's block has 3 rows
            "dtype: " + _catch(lambda: make(sh, block if rank == 0 else block.double(), (7, 4))),
            "dims: " + _catch(lambda: make(sh, block, (7, 4) if rank == 0 else (7,))),
        ]
        _write(out, rank, "\n".join(lines))
    finally:
        spmd.distributed.shutdown()
