"""Entry point of the uncaught-exception test: ``python uncaught_main.py OUT`` (run by ``launch.scripts``).

Rank 1 raises out of the script. Its exit handler registered before ``initialize`` runs after
spmd's own (exit handlers run last registered first) and records that rank 1's exit handlers are
done. Rank 0 waits for that record, writes whether rank 1 marked itself as left, then shuts down.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path

import spmd
from spmd.distributed import init as init_module

if __name__ == "__main__":
    out = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_module.LEAVE_BARRIER_S = 10.0  # how long a rank waiting for a peer that never leaves would wait
    atexit.register(lambda: (out / f"exited{rank}").write_text("1"))
    spmd.distributed.initialize(init_method=os.environ["INIT_METHOD"], rank=rank, world_size=world, timeout_s=60)
    spmd.Mesh.create({"x": world}, devices="cpu:1")
    if rank == 1:
        raise RuntimeError("rank 1 fails")
    deadline = time.monotonic() + 60
    while not (out / "exited1").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = spmd.distributed.state.current().store.check(["leave/1/1"])  # rank 1's key of shutdown's barrier
    (out / "rank0.txt").write_text(f"rank 1 left: {left}")
    spmd.distributed.shutdown()
