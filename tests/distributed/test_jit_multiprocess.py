"""``spmd.jit`` on a global mesh over gloo processes equals the single-process run.

Layouts: 2 processes x 2 virtual devices (dp across processes, tp inside), 4 processes x 1
device (every axis across processes), and 2 simulated hosts x 2 processes launched by torchrun
(auto-initialised from its environment; an all-reduce over 4 ranks runs hierarchically).
"""

from __future__ import annotations

import pytest
from launch import spawn, torchrun
from workers import held_worker


def test_two_processes_of_two_devices():
    spawn(held_worker, 2, {"dp": 2, "tp": 2}, 2, True)


def test_four_processes_of_one_device():
    spawn(held_worker, 4, {"dp": 2, "tp": 2}, 1, False)


@pytest.mark.slow
def test_four_processes_of_one_device_reshard_pairs():
    spawn(held_worker, 4, {"dp": 2, "tp": 2}, 1, True)


def test_two_hosts_of_two_processes_under_torchrun():
    """torchrun --nnodes 2 --nproc-per-node 2 on localhost: node ranks 0 and 1 play two hosts."""
    runs = torchrun(2, 2, ["tests/distributed/torchrun_main.py", "dp=2,tp=2", "1", "mlp,sum-all,reduce-scatter"])
    for node, run in enumerate(runs):
        assert run.returncode == 0, f"node {node}:\n{run.stdout}\n{run.stderr[-4000:]}"
    assert "ok 4 processes, nodes 2" in runs[0].stdout, runs[0].stdout
