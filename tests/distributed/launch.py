"""Launch gloo worker processes with a hard timeout (no test can hang).

``spawn(fn, world, *args)`` runs ``fn(rank, world, init_method, *args)`` in ``world`` fresh
processes (``torch.multiprocessing`` spawn) and raises when one fails; after ``timeout_s`` every
process still alive is killed and the test fails. ``torchrun(...)`` runs real torchrun agents
(one per simulated host) as subprocesses with the same bound.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
#: Hard bound of one launch, in seconds: generous for a loaded 2-core machine.
TIMEOUT_S = 240


def spawn(fn, world: int, *args, timeout_s: float = TIMEOUT_S, allow_fail: bool = False) -> None:
    """Run ``fn(rank, world, init_method, *args)`` on ``world`` processes; raise on failure or timeout.

    With ``allow_fail`` the processes' exit codes are ignored (the test reads what they wrote).
    """
    store = Path(tempfile.mkdtemp()) / "store"
    ctx = mp.start_processes(fn, args=(world, f"file://{store}", *args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if allow_fail:  # let the others run on when one exits (joining would terminate them)
                if not any(p.is_alive() for p in ctx.processes):
                    return
                time.sleep(0.5)
            elif ctx.join(timeout=0.5):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker processes still running after {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def torchrun(nnodes: int, nproc: int, argv: list[str], timeout_s: float = TIMEOUT_S,
             env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``torchrun --nnodes nnodes --node-rank i --nproc-per-node nproc <argv>`` for every node on localhost.

    Returns the finished processes (stdout and stderr captured as text); kills all after ``timeout_s``.
    """
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    procs = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node}",
               f"--nproc-per-node={nproc}", "--master-addr=localhost", f"--master-port={port}", *argv]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out
