"""Launch gloo worker processes with a hard timeout (no test can hang).

``spawn(fn, world, *args)`` runs ``fn(rank, world, init_method, *args)`` in ``world`` fresh
processes (``torch.multiprocessing`` spawn) and raises when one fails; after ``timeout_s`` every
process still alive is killed and the test fails. ``torchrun(...)`` runs real torchrun agents
(one per simulated host) as subprocesses with the same bound. ``scripts(world, argv)`` runs a
script as ``world`` plain interpreter processes, so that what happens when a script ends (an
uncaught exception, exit handlers) is the interpreter's own.
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


def scripts(world: int, argv: list[str], timeout_s: float = TIMEOUT_S) -> list[subprocess.CompletedProcess]:
    """Run ``python <argv>`` as ranks ``0 .. world - 1`` (environment ``RANK``, ``WORLD_SIZE`` and
    ``INIT_METHOD``, a ``file://`` store); returns the finished processes, output captured as text.

    Raises TimeoutError showing every rank's output when one still runs after ``timeout_s``."""
    store = Path(tempfile.mkdtemp()) / "store"
    logs = Path(tempfile.mkdtemp())
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "WORLD_SIZE": str(world), "INIT_METHOD": f"file://{store}"}
        with open(logs / f"{rank}.out", "w") as out, open(logs / f"{rank}.err", "w") as err:
            procs.append(subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=out, stderr=err))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        hung, out = _finish(procs, logs)
    if hung:
        shown = "\n".join(f"--- rank {r} (exit {c.returncode}):\n{c.stdout}\n{c.stderr[-3000:]}"
                           for r, c in enumerate(out))
        raise TimeoutError(f"ranks {hung} still running after {timeout_s} s\n{shown}")
    return out


def _finish(procs: list, logs: Path) -> tuple[list[int], list[subprocess.CompletedProcess]]:
    """Kill the processes still running; (their indices, every process with its ``<i>.out`` / ``<i>.err``)."""
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    out = [subprocess.CompletedProcess(p.args, p.returncode, (logs / f"{i}.out").read_text(),
                                       (logs / f"{i}.err").read_text()) for i, p in enumerate(procs)]
    return hung, out


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def torchrun(nnodes: int, nproc: int, argv: list[str], timeout_s: float = TIMEOUT_S,
             env: dict | None = None, grace_s: float = 20.0) -> list[subprocess.CompletedProcess]:
    """Run ``torchrun --nnodes nnodes --node-rank i --nproc-per-node nproc <argv>`` for every node on localhost.

    Returns the finished processes (stdout and stderr captured as text). When one node's agent
    fails, the others get ``grace_s`` seconds before they are killed (a surviving agent would
    otherwise wait out torchrun's 300 s exit barrier); after ``timeout_s`` all are killed and the
    TimeoutError shows every node's output, so a hang on any node is visible.
    """
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    logs = Path(tempfile.mkdtemp())
    procs = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node}",
               f"--nproc-per-node={nproc}", "--master-addr=localhost", f"--master-port={port}", *argv]
        with open(logs / f"{node}.out", "w") as out, open(logs / f"{node}.err", "w") as err:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=err, text=True))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + grace_s)
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        hung, out = _finish(procs, logs)
    if hung and not any(p.returncode not in (0, -9) for p in procs):  # a hang, not a failure
        shown = "\n".join(f"--- node {n} (exit {r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
                          for n, r in enumerate(out))
        raise TimeoutError(f"torchrun nodes {hung} still running after {timeout_s} s\n{shown}")
    return out
