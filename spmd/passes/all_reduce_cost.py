"""Cost model of one all-reduce: the transport's ring (NCCL) against a one-shot reduction.

Both are latency + bandwidth (alpha-beta) models, the form of Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005), per device, for
``size_bytes`` per device and ``k`` devices in the replica group:

- ring (NCCL): ``ring_latency_us + 2 (k-1)/k * size_bytes / ring_gbps`` -- the reduce-scatter +
  all-gather ring moves ``2 (k-1)/k`` of the message over each link.
- one-shot: ``one_shot_latency_us + join_us + (k-1) * size_bytes / p2p_gbps +
  k * size_bytes / hbm_gbps`` -- every device pulls all ``k-1`` peer operands (one peer copy
  each, all at once, bound by the device's incoming link bandwidth), then one kernel reads the
  ``k`` staged operands and writes the sum. ``join_us`` is what the cross-device ordering of
  the copies costs (graph edges across devices, or none where the kernel synchronizes in device
  memory, as torch's symmetric-memory one-shot kernel does).

Both are device times. Host issue cost (eager mode: the peer-copy one-shot issues about
``2 + 3 (k-1)`` calls per device -- events, copies, the reduction -- where NCCL issues one) is not
modelled: eager execution of small programs is host-bound either way, and CUDA graphs remove it.

The one-shot wins for small messages (no ring start-up, one step) and loses for large ones
(``k-1`` full copies into every device instead of ``2 (k-1)/k``). Published one-shot kernels
with in-kernel flag synchronization (TensorRT-LLM's and vLLM's custom all-reduce, PyTorch's
``symm_mem.one_shot_all_reduce``) reach 4-7 µs on NVLink where NCCL needs ~8-20 µs.

Programs: a one-shot all-reduce made of peer copies ties the devices together with CUDA-level
dependencies, so a CUDA graph can no longer be captured as one graph per device
(``spmd.runtime.graphs_cuda_split``) and the replays of the one graph over all devices leave
``whole_graph_penalty_us`` idle per replay (15-19 µs measured on 2xH200). ``program_choice``
therefore decides for a whole program: one-shot for every eligible all-reduce when the sum of
their predicted savings beats that penalty by ``margin``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: The transports a ``SmallAllReduceCosts`` can describe.
TRANSPORTS = ("peer-copy", "symmetric-memory")


@dataclass(frozen=True)
class SmallAllReduceCosts:
    """Latency / bandwidth constants of the two all-reduce algorithms on one machine (µs, GB/s).

    ring_latency_us: NCCL all-reduce start-up inside a CUDA graph, size-independent.
    ring_gbps: NCCL ring bandwidth per link direction.
    one_shot_latency_us: the one-shot's kernels without bandwidth: peer-copy start-up plus the
      local reduction kernel (the local staging copy runs at the same time as the peer copies).
    join_us: cross-device ordering of one one-shot all-reduce (0 where the kernel synchronizes).
    p2p_gbps: peer copy bandwidth into one device.
    hbm_gbps: device memory bandwidth (the local reduction).
    whole_graph_penalty_us: per program, the idle gap per replay of one graph over all devices
      instead of one graph per device (0 where the one-shot keeps the devices independent).
    transport: "peer-copy" (one process drives all GPUs) or "symmetric-memory" (one process per
      GPU, ``torch.ops.symm_mem.one_shot_all_reduce``).
    """

    ring_latency_us: float
    ring_gbps: float
    one_shot_latency_us: float
    join_us: float
    p2p_gbps: float
    hbm_gbps: float
    whole_graph_penalty_us: float
    transport: str = "peer-copy"

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: expected one of {TRANSPORTS}, got {self.transport!r}")


# 2xH200 over NVLink, one process driving both GPUs. Sources: the spmd.runtime.comm.cuda docstring
# (MiniLM's [8,128,384] f32 all-reduce: 6.2 µs peer copy, 2.0 µs add, 16.3 µs NCCL ring kernel),
# spmd.passes.cost_model (NCCL 8 µs start-up, 230 GB/s; peer copy 378 GB/s; HBM 4.8 TB/s) and
# spmd.runtime.graphs_cuda_split (15-19 µs idle per replay of a graph over both devices).
# join_us is set so that the model reproduces the measured losses of peer-copy all-reduces inside
# CUDA graphs (MiniLM replayed in 1033 against 980 µs with NCCL, the transformer block in 117
# against 97 µs): with these constants "auto" keeps NCCL on this machine.
# benchmarks/small_allreduce.py measures both algorithms in and out of CUDA graphs to refit them.
H200_PEER_COPY = SmallAllReduceCosts(ring_latency_us=8.0, ring_gbps=230.0, one_shot_latency_us=4.0, join_us=9.0,
                                     p2p_gbps=378.0, hbm_gbps=4800.0, whole_graph_penalty_us=17.0)
# One process per GPU with torch's symmetric memory: the one-shot kernel reads the peers' buffers
# over NVLink and synchronizes through signal pads (published 4-7 µs), no CUDA-level joins.
H200_SYMMETRIC_MEMORY = SmallAllReduceCosts(ring_latency_us=8.0, ring_gbps=230.0, one_shot_latency_us=5.0,
                                            join_us=0.0, p2p_gbps=378.0, hbm_gbps=4800.0,
                                            whole_graph_penalty_us=0.0, transport="symmetric-memory")


def ring_us(size_bytes: int, k: int, costs: SmallAllReduceCosts) -> float:
    """Predicted µs of a ring (NCCL) all-reduce of ``size_bytes`` per device over ``k`` devices (0 for k <= 1)."""
    if k <= 1:
        return 0.0
    return costs.ring_latency_us + 2.0 * (k - 1) / k * size_bytes / (costs.ring_gbps * 1e3)


def one_shot_us(size_bytes: int, k: int, costs: SmallAllReduceCosts) -> float:
    """Predicted µs of a one-shot all-reduce of ``size_bytes`` per device over ``k`` devices (0 for k <= 1)."""
    if k <= 1:
        return 0.0
    return (costs.one_shot_latency_us + costs.join_us + (k - 1) * size_bytes / (costs.p2p_gbps * 1e3)
            + k * size_bytes / (costs.hbm_gbps * 1e3))


def crossover_bytes(k: int, costs: SmallAllReduceCosts) -> float:
    """Message size (bytes per device) above which the ring is predicted faster; inf when never.

    Raises ValueError for ``k`` < 2.
    """
    if k < 2:
        raise ValueError(f"k: expected a replica group of at least 2 devices, got {k}")
    fixed = costs.ring_latency_us - costs.one_shot_latency_us - costs.join_us  # µs the one-shot saves at 0 bytes
    per_byte = ((k - 1) / (costs.p2p_gbps * 1e3) + k / (costs.hbm_gbps * 1e3)
                - 2.0 * (k - 1) / k / (costs.ring_gbps * 1e3))  # µs per byte it loses
    if per_byte <= 0:
        return float("inf") if fixed >= 0 else 0.0
    return max(fixed / per_byte, 0.0)


@dataclass(frozen=True)
class ProgramChoice:
    """The decision for one program: whether its eligible all-reduces go one-shot, and the µs
    predicted per replay for all of them as ring (``ring_us``) and as one-shot (``one_shot_us``,
    the whole-graph penalty included when ``cuda_graphs``)."""

    one_shot: bool
    ring_us: float
    one_shot_us: float


def program_choice(sites: Sequence[tuple[int, int]], costs: SmallAllReduceCosts, cuda_graphs: bool = True,
                   margin: float = 0.03) -> ProgramChoice:
    """Whether the all-reduces ``sites`` (``(size_bytes, k)`` each) should all run one-shot.

    One-shot is chosen when its total (plus ``costs.whole_graph_penalty_us`` under CUDA graphs)
    is below the ring total by more than ``margin`` of the ring total. No sites: never.
    """
    ring = sum(ring_us(b, k, costs) for b, k in sites)
    one = sum(one_shot_us(b, k, costs) for b, k in sites)
    if cuda_graphs and sites:
        one += costs.whole_graph_penalty_us
    return ProgramChoice(bool(sites) and one < ring * (1.0 - margin), ring, one)
