"""Failures in a multi-process run are clear errors naming the ranks, never hangs.

A rank that compiled another program, a rank that dies mid-step (the others fail within the
configured bound), and bad input (world size, per-process devices, a device of another process,
``to_torch`` of a non-addressable array, local data whose shape disagrees across ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from faults import bad_input_worker, dying_worker, leave_worker
from launch import spawn

TIMEOUT_S = 10.0


def _read(out: Path, world: int) -> list[str]:
    return [(out / f"rank{r}.txt").read_text() for r in range(world)]


@pytest.mark.parametrize("hang", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["dies", "hangs"])
def test_a_rank_dying_mid_step_fails_the_others_within_the_bound(tmp_path, hang):
    timeout_s = 5.0 if hang else TIMEOUT_S
    spawn(dying_worker, 2, str(tmp_path), timeout_s, hang, allow_fail=True)
    assert not (tmp_path / "rank1.txt").exists()
    head, text = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    elapsed, per_step = head.split()
    assert text.startswith("DistributedTimeoutError: "), text
    assert f"(collective #{int(per_step) + 1}) of program 'two_layers'" in text, text  # 2nd of the 2nd step
    assert "rank 1 did not arrive" in text, text
    assert float(elapsed) < timeout_s + 20, elapsed  # the bound, the grace for arrival keys, slack for load
    if hang:  # a live but stuck peer: the full bound was waited, then the process group's timeout fired
        assert float(elapsed) >= timeout_s * 0.9 and "Timed out" in text, (elapsed, text)


def test_bad_input_and_a_mismatched_program_are_clear_errors_naming_ranks(tmp_path):
    spawn(bad_input_worker, 2, str(tmp_path))
    for rank, text in enumerate(_read(tmp_path, 2)):
        got = dict(line.split(": ", 1) for line in text.splitlines())
        assert got["world"].startswith("ValueError: axes:") and "world size 2" in got["world"], got["world"]
        assert got["devices"].startswith("ValueError: devices:") and "rank 0 cpu:1; rank 1 cpu:2" in got["devices"]
        assert "cuda:7 is not a device of this process" in got["other-process"], got["other-process"]
        assert f"(rank {rank} has" in got["other-process"], got["other-process"]
        assert got["to_torch"].startswith("ValueError: to_torch:") and "process_allgather" in got["to_torch"]
        assert got["locally-complete"] == "[True, True]", got["locally-complete"]  # replicated / split inside
        assert got["shards"].startswith("ValueError: shards:") and "addressable_shards" in got["shards"]
        assert got["local_data"].startswith("ValueError: local_data:"), got["local_data"]
        assert "rank 0 give global float32[8, 4]" in got["local_data"], got["local_data"]
        assert "rank 1 give global float32[10, 4]" in got["local_data"], got["local_data"]
        assert got["mismatch"].startswith("ProgramMismatchError: program 'mlp'"), got["mismatch"]
        assert "rank 0 run mlp(float32[8, 16]" in got["mismatch"], got["mismatch"]
        assert "rank 1 run mlp(float32[6, 16]" in got["mismatch"], got["mismatch"]


@pytest.mark.parametrize("mode", ["order", "absent", "failed"])
def test_shutdown_waits_for_every_rank_to_leave_within_a_bound(tmp_path, mode):
    """No rank destroys its groups while a peer may still be in the last collective; a peer that
    never leaves delays the exit only by the bound, and a run that already failed does not wait."""
    spawn(leave_worker, 2, str(tmp_path), mode)
    took_s, returned = map(float, (tmp_path / "rank0.txt").read_text().split())
    entered = float((tmp_path / "rank1.txt").read_text())
    if mode == "order":
        assert returned >= entered, (returned, entered)
    elif mode == "absent":
        assert 2.0 <= took_s < 30.0, took_s
    else:
        assert took_s < 30.0, took_s  # the 60 s barrier was skipped
