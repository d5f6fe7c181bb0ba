"""Failures in a multi-process run are clear errors naming the ranks, never hangs.

A rank that compiled another program, a rank that dies mid-step (the others fail within the
configured bound), and bad input (world size, per-process devices, a device of another process,
``to_torch`` of a non-addressable array, local data whose shape disagrees across ranks, mesh axes
or a local block that is wrong on one rank only: every rank raises).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from faults import bad_input_worker, dying_worker, leave_worker, local_data_agreement_worker, mesh_agreement_worker
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
        assert got["reduce-mode"].startswith("ProgramMismatchError: program 'two_layers'"), got["reduce-mode"]


def _lines(out: Path, world: int) -> list[dict[str, str]]:
    return [dict(line.split(": ", 1) for line in text.splitlines()) for text in _read(out, world)]


def test_ranks_creating_different_meshes_all_raise(tmp_path):
    spawn(mesh_agreement_worker, 2, str(tmp_path))
    ranks = _lines(tmp_path, 2)
    for got in ranks:
        assert got["order"] == ("ValueError: axes: every process must name the same mesh axes (names and sizes, in "
                                "order), got rank 0 {'dp': 2, 'tp': 2}; rank 1 {'tp': 2, 'dp': 2}"), got["order"]
        assert got["sizes"].startswith("ValueError: axes: every process must name the same mesh axes"), got["sizes"]
        assert "rank 0 {'x': 4}; rank 1 {'x': 2, 'y': 2}" in got["sizes"], got["sizes"]
        assert got["agreed"] == "Mesh({'dp': 2, 'tp': 2}, devices=2 processes x cpu:0-1)", got["agreed"]
    assert ranks[1]["invalid"].startswith("ValueError: axes: expected unique axis names"), ranks[1]["invalid"]
    assert ranks[0]["invalid"] == f"ValueError: Mesh.create failed on rank 1: {ranks[1]['invalid'][12:]}"


def test_local_blocks_are_checked_on_every_rank(tmp_path):
    """Each rank's block is checked against its own place in the global array (blocks of unequal size
    are fine), and a bad block on one rank is an error on every rank, not on that rank alone."""
    spawn(local_data_agreement_worker, 2, str(tmp_path))
    ranks = _lines(tmp_path, 2)
    for what in ("block", "dtype", "dims"):
        assert ranks[0][what] == ranks[1][what], what  # the same error on every rank
    got = ranks[0]
    assert got["uneven"] == "(7, 4) True", got["uneven"]
    assert got["block"].startswith("ValueError: make_array_from_process_local_data failed on rank 1: rank 1 "
                                   "(local_data float32[4, 4]): local_data: expected shape [3, 4]"), got["block"]
    assert got["dtype"] == ("ValueError: local_data: processes disagree on the global array: rank 0 give global "
                            "float32[7, 4]; rank 1 give global float64[7, 4]; expected the same global shape and "
                            "dtype on every rank"), got["dtype"]
    assert "failed on rank 1: rank 1 (local_data float32[3, 4]): global_shape: expected 2 dims" in got["dims"]


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
