"""``torchrun --nproc-per-node 2 -m spmd demo`` / ``train`` print the single-process numbers, from rank 0 only."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from launch import ROOT, TIMEOUT_S, torchrun


def _agreement(stdout: str) -> str:
    """The 'cosine min | max abs diff' cells of the demo's agreement table."""
    row = next(line for line in stdout.splitlines() if "match" in line and "│" in line)
    return " ".join(re.split(r"\s*│\s*", row.strip("│ "))[:2])


@pytest.mark.slow
def test_torchrun_demo_gives_the_single_process_numbers():
    one = subprocess.run([sys.executable, "-m", "spmd", "demo", "--device", "cpu", "--iters", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert one.returncode == 0, one.stderr
    (two,) = torchrun(1, 2, ["-m", "spmd", "demo", "--device", "cpu", "--iters", "1"])
    assert two.returncode == 0, two.stderr[-4000:]
    assert "2 processes x cpu:0-1" in two.stdout and two.stdout.count("agreement with") == 1  # rank 0 prints
    assert _agreement(two.stdout) == _agreement(one.stdout), (two.stdout, one.stdout)


@pytest.mark.slow
def test_torchrun_train_gives_the_single_process_losses():
    args = ["train", "--device", "cpu", "--steps", "3", "--mesh", "dp=2,tp=2"]
    one = subprocess.run([sys.executable, "-m", "spmd", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert one.returncode == 0, one.stderr
    (two,) = torchrun(1, 2, ["-m", "spmd", *args])
    assert two.returncode == 0, two.stderr[-4000:]
    losses = [re.findall(r"step\s+\d+\s+loss (\S+)", r.stdout) for r in (one, two)]
    assert losses[0] and losses[0] == losses[1], losses
