"""Select-all-reduce: mark small all-reduces to run as a one-shot reduction instead of the ring.

A decode step of a tensor-parallel Llama has two all-reduces of a few KB per layer; NCCL's ring
pays its start-up (~8 µs in a CUDA graph, ~20 µs eager) on each. The one-shot algorithm
(``spmd.runtime.comm.one_shot``: every device copies all operands of its group into fixed
staging buffers, then reduces them locally in group order) pays one step instead. This pass
writes the choice into the module: an all-reduce that runs one-shot carries
``backend_config={"algorithm":"one-shot"}`` (kept when assign-streams turns it into an
all-reduce-start); every other all-reduce runs the transport's ring. The lowering reads the key
into ``CollectiveSpec.algorithm``.

Eligible all-reduces: a replica group of at least 2 devices, a reduction the runtime knows
(add / maximum / minimum / multiply) and at most ``max_bytes`` per device. ``mode``:

- "off": nothing is marked;
- "on": every eligible all-reduce is marked;
- "auto": eligible all-reduces the cost model (``spmd.passes.all_reduce_cost``) predicts faster
  one-shot are marked, and only when the program as a whole gains (``program_choice``: with
  peer copies, one-shot all-reduces cost the program its per-device CUDA graphs). An all-reduce
  whose group spans processes (``process_ids``: a multi-process mesh) is priced with
  ``cross_process_costs`` (PyTorch's symmetric-memory kernel), the others with ``costs`` (peer
  copies in one process); each kind is decided on its own.

The number marked is counted in ``spmd.metrics`` (``select-all-reduce.one_shot``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from spmd import metrics
from spmd.ir.hlo import Instruction, Module
from spmd.passes.all_reduce_cost import (
    H200_PEER_COPY,
    H200_SYMMETRIC_MEMORY,
    SmallAllReduceCosts,
    one_shot_us,
    program_choice,
    ring_us,
)

ALGORITHM_KEY = "algorithm"  # backend_config key of an all-reduce's algorithm
ONE_SHOT = "one-shot"
MODES = ("auto", "on", "off")
REDUCE_OPS = ("add", "maximum", "minimum", "multiply")
#: Default ``CompileOptions.small_all_reduce_max_bytes``: 512 KiB per device. Each one-shot
#: all-reduce shape keeps ``k`` staging buffers of its size per device; above a few hundred KB the
#: ring's ``2 (k-1)/k`` traffic beats the one-shot's ``k-1`` copies on 4-8 NVLink GPUs
#: (``spmd.passes.all_reduce_cost.crossover_bytes``).
DEFAULT_MAX_BYTES = 512 * 1024


@dataclass(frozen=True)
class SelectAllReduce:
    """The select-all-reduce pass (see the module docstring).

    mode: "auto" | "on" | "off" (``CompileOptions.small_all_reduce``).
    max_bytes: largest all-reduce (bytes per device) that may run one-shot.
    costs: the constants of the "auto" decision for groups inside one process.
    cross_process_costs: the same for groups that span processes.
    process_ids: per partition id, the process that drives it (``Mesh.process_ids``; empty: one process).
    cuda_graphs: whether the program will be replayed as a CUDA graph (the "auto" decision then
      counts ``costs.whole_graph_penalty_us``).
    Raises ValueError for an unknown mode or a negative ``max_bytes``; TypeError for a
    ``max_bytes`` that is not an int. ``run`` raises ValueError for an unpartitioned module.
    """

    name: ClassVar[str] = "select-all-reduce"
    mode: str = "auto"
    max_bytes: int = DEFAULT_MAX_BYTES
    costs: SmallAllReduceCosts = H200_PEER_COPY
    cross_process_costs: SmallAllReduceCosts = H200_SYMMETRIC_MEMORY
    process_ids: tuple[int, ...] = ()
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"small_all_reduce: expected one of {MODES}, got {self.mode!r}")
        if not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool):
            raise TypeError(f"small_all_reduce_max_bytes: expected an int (bytes), got {self.max_bytes!r}")
        if self.max_bytes < 0:
            raise ValueError(f"small_all_reduce_max_bytes: expected >= 0 (bytes), got {self.max_bytes}")

    def run(self, module: Module) -> Module:
        if not module.is_partitioned:
            raise ValueError(f"select-all-reduce: expected a partitioned module, got {module.name!r} "
                             f"before spmd-partition")
        if self.mode == "off":
            return module
        sites = [(inst, k) for inst in module.entry.instructions
                 if (k := eligible_group_size(inst, module.num_partitions, self.max_bytes))]
        if self.mode == "auto":
            sites = self._auto(sites, module.num_partitions)
        for inst, _ in sites:
            inst.attrs["backend_config"] = {**(inst.attrs.get("backend_config") or {}), ALGORITHM_KEY: ONE_SHOT}
        metrics.counter("select-all-reduce.one_shot").inc(len(sites))
        return module

    def _auto(self, sites: list[tuple[Instruction, int]], num_partitions: int) -> list[tuple[Instruction, int]]:
        """The sites "auto" marks: per cost kind (in-process, cross-process), those the model predicts
        faster one-shot, when their program-level choice (``program_choice``) says one-shot."""
        chosen = []
        for costs, cross in ((self.costs, False), (self.cross_process_costs, True)):
            mine = [(i, k) for i, k in sites if self._spans_processes(i, num_partitions) is cross
                    and one_shot_us(i.shape.size_bytes, k, costs) < ring_us(i.shape.size_bytes, k, costs)]
            if program_choice([(i.shape.size_bytes, k) for i, k in mine], costs, self.cuda_graphs).one_shot:
                chosen += mine
        order = {id(i): n for n, (i, _) in enumerate(sites)}
        return sorted(chosen, key=lambda s: order[id(s[0])])

    def _spans_processes(self, inst: Instruction, num_partitions: int) -> bool:
        if not self.process_ids:
            return False
        groups = inst.attrs.get("replica_groups") or ((tuple(range(num_partitions))),)
        return any(len({self.process_ids[p] for p in g}) > 1 for g in groups)


def eligible_group_size(inst: Instruction, num_partitions: int, max_bytes: int) -> int:
    """The replica group size of ``inst`` when it is an all-reduce that may run one-shot, else 0.

    May: an array-shaped all-reduce of at most ``max_bytes`` per device, a known reduction and
    groups of equal size >= 2 (a group of one device needs no communication).
    """
    if inst.opcode != "all-reduce" or inst.shape.is_tuple or inst.shape.size_bytes > max_bytes:
        return 0
    to_apply = inst.attrs.get("to_apply")
    if to_apply is None or to_apply.root.opcode not in REDUCE_OPS:
        return 0
    groups = inst.attrs.get("replica_groups") or ((tuple(range(num_partitions))),)
    sizes = {len(g) for g in groups}
    k = sizes.pop() if len(sizes) == 1 else 0
    return k if k >= 2 else 0


def algorithm_of(inst: Instruction) -> str:
    """"one-shot" or "ring": the algorithm this pass chose for an all-reduce (-start)."""
    return (inst.attrs.get("backend_config") or {}).get(ALGORITHM_KEY, "ring")
