"""``spmd.jit`` on a global mesh over gloo processes equals the single-process run.

Layouts: 2 processes x 2 virtual devices (dp across processes, tp inside; bit-identical to one
process), 4 processes x 1 device (every axis across processes; ``reduce`` mode), and 2 simulated
hosts x 2 processes launched by torchrun (auto-initialised from its environment; ``reduce`` mode,
so an all-reduce over 4 ranks runs hierarchically: intra-host, then inter-host).
"""

from __future__ import annotations

import pytest
from launch import spawn, torchrun
from workers import held_worker


def test_two_processes_of_two_devices():
    spawn(held_worker, 2, {"dp": 2, "tp": 2}, 2, True)


@pytest.mark.slow
def test_four_processes_of_one_device():
    """``reduce`` mode: local reduction, then all_reduce / reduce_scatter_tensor across processes."""
    spawn(held_worker, 4, {"dp": 2, "tp": 2}, 1, False, 0, None, "reduce")


@pytest.mark.slow
def test_four_processes_of_one_device_reshard_pairs():
    spawn(held_worker, 4, {"dp": 2, "tp": 2}, 1, True)


def test_two_hosts_of_two_processes_under_torchrun():
    """torchrun --nnodes 2 --nproc-per-node 2 on localhost: node ranks 0 and 1 play two hosts."""
    runs = torchrun(2, 2, ["tests/distributed/torchrun_main.py", "dp=2,tp=2", "1"],
                    env={"SPMD_DISTRIBUTED_REDUCE": "reduce"})
    for node, run in enumerate(runs):
        assert run.returncode == 0, f"node {node}:\n{run.stdout}\n{run.stderr[-4000:]}"
    assert "ok 4 processes, nodes 2" in runs[0].stdout, runs[0].stdout


@pytest.mark.gpu(count=2)
def test_two_processes_of_one_gpu_under_torchrun():
    """NCCL between 2 processes of one GPU each (``reduce`` mode, the CUDA default) equals one CPU process."""
    (run,) = torchrun(1, 2, ["tests/distributed/torchrun_main.py", "dp=1,tp=2", "1"],
                      env={"SPMD_TEST_PLATFORM": "cuda", "SPMD_DISTRIBUTED_REDUCE": "reduce"})
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-4000:]}"
    assert "ok 2 processes" in run.stdout, run.stdout
