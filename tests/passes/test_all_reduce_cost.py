"""The all-reduce cost model: ring vs one-shot latency + bandwidth, crossover, the program decision."""

from __future__ import annotations

import dataclasses
import math

import pytest

from spmd.passes.all_reduce_cost import (
    H200_PEER_COPY,
    H200_SYMMETRIC_MEMORY,
    SmallAllReduceCosts,
    crossover_bytes,
    one_shot_us,
    program_choice,
    ring_us,
)

COSTS = SmallAllReduceCosts(ring_latency_us=10.0, ring_gbps=100.0, one_shot_latency_us=3.0, join_us=1.0,
                            p2p_gbps=200.0, hbm_gbps=1000.0, whole_graph_penalty_us=20.0)


def test_formulas_by_hand():
    # ring: 10 + 2*(4-1)/4 * 1e6 B / 100e3 B/us = 10 + 15
    assert ring_us(10**6, 4, COSTS) == pytest.approx(25.0)
    # one-shot: 3 + 1 + 3 * 1e6 / 200e3 + 4 * 1e6 / 1e6 = 4 + 15 + 4
    assert one_shot_us(10**6, 4, COSTS) == pytest.approx(23.0)
    assert ring_us(10**6, 1, COSTS) == 0.0 and one_shot_us(10**6, 1, COSTS) == 0.0


@pytest.mark.parametrize("k", [4, 8])
def test_crossover_separates_the_two(k):
    x = crossover_bytes(k, COSTS)
    assert 0 < x < math.inf
    assert one_shot_us(int(x * 0.9), k, COSTS) < ring_us(int(x * 0.9), k, COSTS)
    assert one_shot_us(int(x * 1.1), k, COSTS) > ring_us(int(x * 1.1), k, COSTS)


def test_crossover_edge_cases():
    with pytest.raises(ValueError, match="at least 2"):
        crossover_bytes(1, COSTS)
    # two devices with a peer link faster than the ring: one-shot never loses by bandwidth
    assert crossover_bytes(2, H200_SYMMETRIC_MEMORY) == math.inf
    assert crossover_bytes(2, COSTS) == math.inf and crossover_bytes(3, COSTS) == math.inf
    slow = dataclasses.replace(COSTS, join_us=50.0)
    assert crossover_bytes(4, slow) == 0.0  # one-shot always slower


def test_program_choice_weighs_the_graph_penalty():
    small = [(4096, 2)] * 64  # a 32-layer TP=2 decode step: 64 all-reduces of 4 KB
    assert program_choice(small, COSTS).one_shot  # 64 * ~6 us saved beats 20 us
    assert not program_choice(small[:2], COSTS).one_shot  # two save 12 us < 20 us
    assert program_choice(small[:2], COSTS, cuda_graphs=False).one_shot
    assert not program_choice([], COSTS).one_shot
    c = program_choice(small[:2], COSTS)
    assert c.one_shot_us == pytest.approx(2 * one_shot_us(4096, 2, COSTS) + 20.0)
    assert c.ring_us == pytest.approx(2 * ring_us(4096, 2, COSTS))


def test_shipped_profiles():
    # peer copies on 2xH200: the measured joins make NCCL faster even for a few KB
    assert one_shot_us(4096, 2, H200_PEER_COPY) > ring_us(4096, 2, H200_PEER_COPY)
    # symmetric memory: the one-shot kernel wins small messages; the ring wins large ones on 8 GPUs
    assert one_shot_us(4096, 8, H200_SYMMETRIC_MEMORY) < ring_us(4096, 8, H200_SYMMETRIC_MEMORY)
    assert 100e3 < crossover_bytes(8, H200_SYMMETRIC_MEMORY) < 1e6
    assert program_choice([(4096, 2)], H200_SYMMETRIC_MEMORY).one_shot


def test_bad_transport():
    with pytest.raises(ValueError, match="transport"):
        dataclasses.replace(COSTS, transport="smoke-signals")
