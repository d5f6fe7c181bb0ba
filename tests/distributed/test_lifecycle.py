"""The end of a run: ``shutdown`` frees the process groups, programs of an ended run raise instead of
running, and a rank that dies on an uncaught exception leaves without waiting for its peers."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import scripts, spawn
from lifecycle import after_shutdown_worker

NEEDS_RUN = "needs a multi-process run; call spmd.distributed.initialize() first (or launch with torchrun)"


@pytest.fixture(scope="module")
def after_shutdown(tmp_path_factory) -> list[dict[str, str]]:
    """Per rank, what ``after_shutdown_worker`` saw (one 2-process run shared by the tests of this module)."""
    out = tmp_path_factory.mktemp("after_shutdown")
    spawn(after_shutdown_worker, 2, str(out))
    return [dict(line.split(": ", 1) for line in (out / f"rank{r}.txt").read_text().splitlines()) for r in range(2)]


def test_shutdown_frees_the_process_groups_and_their_threads(after_shutdown):
    """A gloo group stops its worker threads only when it is freed; one alive at interpreter exit can
    abort the process ("terminate called without an active exception"). Neither the programs the
    ``jit`` objects still hold nor torch's own module defaults (``torch.distributed.nn.functional``,
    imported by the first ``torch.export``) may keep a group alive past ``shutdown``."""
    for got in after_shutdown:
        assert got["alive"].startswith("0 of "), got["alive"]
        before, after = got["threads"].split()
        assert after == before, got["threads"]  # gloo's worker and event-loop threads have ended


def test_programs_of_an_ended_run_raise_instead_of_running(after_shutdown):
    for got in after_shutdown:
        for what, name in (("jit", "matmul"), ("jit-arrays", "matmul"), ("compiled", "matmul"),
                           ("parallelize", "Linear"), ("allgather", "process_allgather")):
            assert got[what] == f"ValueError: {name}: {NEEDS_RUN}", (what, got[what])
        assert got["second-run-jit"] == "True"  # a jit object compiles again for the next run
        assert got["second-run-compiled"].startswith(
            "ValueError: matmul: compiled for a multi-process run that has ended"), got["second-run-compiled"]


def test_a_rank_exiting_on_an_uncaught_exception_does_not_wait_for_its_peers(tmp_path):
    """Rank 1 raises; rank 0 waits until rank 1's process has run its exit handlers. Rank 1 must
    not wait in the leave barrier for rank 0 (it would until the bound), and must mark itself as
    left, so rank 0 does not wait for it either."""
    runs = scripts(2, [str(Path(__file__).with_name("uncaught_main.py")), str(tmp_path)])
    assert runs[1].returncode == 1, runs[1].stderr[-3000:]
    assert "RuntimeError: rank 1 fails" in runs[1].stderr, runs[1].stderr[-3000:]
    assert "spmd.distributed: rank 1 exits on an uncaught exception; it leaves the run without waiting" \
        in runs[1].stderr, runs[1].stderr[-3000:]
    assert runs[0].returncode == 0, runs[0].stderr[-3000:]
    assert (tmp_path / "rank0.txt").read_text() == "rank 1 left: True", runs[0].stderr[-3000:]
    assert "terminate called" not in runs[0].stderr + runs[1].stderr
