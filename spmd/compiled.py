"""``Compiled``: a lowered program bound to an executable, run on ``ShardedArray``s.

Input and output shardings are fixed at compile time; every call only checks
the arguments against them, binds their per-device buffers, enqueues the
executable and wraps the output buffers (asynchronously on GPU: the outputs
carry per-device ready events).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Sequence

import torch
import torch.utils._pytree as pytree

from spmd import metrics
from spmd.array import ShardedArray, device_put
from spmd.ir.hlo import Module
from spmd.sharding import NamedSharding

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


class Compiled:
    """An executable for fixed argument shapes, dtypes and shardings.

    Call it with the same argument structure ``lower`` saw, or use
    ``execute_sharded`` with the flat list of ``ShardedArray`` inputs.

    Attributes:
      input_shardings / output_shardings: one ``NamedSharding`` per flat
        tensor input / output, computed once at compile time.
      module: the final (partitioned, scheduled) HLO-lite module.
    """

    def __init__(self, lowered, executable, output_shardings, output_shapes, output_dtypes, buffers):
        self.lowered = lowered
        self.executable = executable
        self.module: Module = lowered.result.module
        self.mesh = lowered.jitted.mesh
        self.name = lowered.jitted.__name__
        self.input_shardings: list[NamedSharding] = [leaf.sharding for leaf in lowered.in_leaves]
        self.output_shardings: list[NamedSharding] = output_shardings
        self._output_shapes = output_shapes
        self._output_dtypes = output_dtypes
        self._donated = frozenset(self._donated_leaves())
        self.buffers = buffers

    def _donated_leaves(self) -> list[int]:
        """Flat tensor-input indices that belong to donated positional arguments."""
        jitted = self.lowered.jitted
        if not jitted.donate_argnums:
            return []
        args = pytree.tree_unflatten(list(range(self.lowered.arg_tree.num_leaves)), self.lowered.arg_tree)
        donated_leaf_ids = {i for a in jitted.donate_argnums if a < len(args) for i in pytree.tree_leaves(args[a])}
        tensor_ids = [i for i in range(self.lowered.arg_tree.num_leaves) if i not in self.lowered.static_leaves]
        return [k for k, i in enumerate(tensor_ids) if i in donated_leaf_ids]

    # ------------------------------------------------------------------ calls
    def __call__(self, *args):
        leaves, tree = pytree.tree_flatten(args)
        if tree != self.lowered.arg_tree:
            raise ValueError(f"{self.name}: arguments have structure {tree}, expected {self.lowered.arg_tree}")
        return self._call_flat(leaves)

    def _call_flat(self, leaves: list):
        tensors = []
        for i, leaf in enumerate(leaves):
            if i in self.lowered.static_leaves:
                if leaf != self.lowered.static_leaves[i]:
                    raise ValueError(f"{self.name}: static argument leaf {i} is {leaf!r}, "
                                     f"compiled for {self.lowered.static_leaves[i]!r}")
            else:
                tensors.append(leaf)
        outputs = self.execute_sharded(tensors)
        return pytree.tree_unflatten(outputs, self.lowered.out_tree)

    def execute_sharded(self, args: Sequence[ShardedArray | torch.Tensor]) -> list[ShardedArray]:
        """Run on the flat list of tensor inputs; returns the flat list of outputs.

        Raises:
          ValueError: wrong number of arguments, or an argument whose shape,
            dtype, mesh or sharding differs from the compiled one (resharded on
            device instead when the jit allowed it), or a donated array.
          TypeError: an argument that is neither a ShardedArray nor a Tensor.
        """
        start = time.perf_counter()
        if len(args) != len(self.input_shardings):
            raise ValueError(f"{self.name}: expected {len(self.input_shardings)} array arguments, got {len(args)}")
        arrays = [self._bind(i, a) for i, a in enumerate(args)]
        buffers = [a._buffers for a in arrays]
        ready = [a._ready_events for a in arrays]
        out_buffers, events = self.executable.run(buffers, ready, self._donated)
        for i in self._donated:
            arrays[i].delete(reason=f"donated to {self.name}")
            metrics.counter("donations").inc()
        outs = [
            ShardedArray._from_buffers(b, s, shape, dtype, events)
            for b, s, shape, dtype in zip(out_buffers, self.output_shardings, self._output_shapes, self._output_dtypes)
        ]
        metrics.timer("execute").record(time.perf_counter() - start)
        return outs

    def _bind(self, i: int, arg) -> ShardedArray:
        leaf = self.lowered.in_leaves[i]
        name = f"{self.name} argument {i}"
        if isinstance(arg, torch.Tensor):
            self._check_meta(name, tuple(arg.shape), arg.dtype, leaf)
            metrics.counter("transfer.to_device").inc()
            return device_put(arg, leaf.sharding)
        if not isinstance(arg, ShardedArray):
            raise TypeError(f"{name}: expected a ShardedArray or torch.Tensor, got {type(arg).__name__}")
        arg._check_alive(name)
        self._check_meta(name, tuple(arg.shape), arg.dtype, leaf)
        if arg.sharding != leaf.sharding:
            if not self.lowered.jitted.reshard_inputs:
                raise ValueError(f"{name}: expected sharding {leaf.sharding}, got {arg.sharding} "
                                 "(pass reshard_inputs=True to spmd.jit to reshard on device)")
            arg = arg.reshard(leaf.sharding)
        return arg

    @staticmethod
    def _check_meta(name: str, shape, dtype, leaf) -> None:
        if shape != leaf.shape or dtype != leaf.dtype:
            raise ValueError(f"{name}: expected {leaf.dtype}{list(leaf.shape)}, got {dtype}{list(shape)}")

    # ------------------------------------------------------------ inspection
    def collectives(self) -> list[dict]:
        """Collectives of the final program: opcode, per-device bytes moved, replica group size."""
        out = []
        for inst in self.module.entry.instructions:
            op = inst.opcode.removesuffix("-start")
            if op not in COLLECTIVES:
                continue
            shape = inst.shape.tuple_shapes[0] if inst.shape.is_tuple else inst.shape
            groups = inst.attrs.get("replica_groups") or ((),)
            n = len(groups[0]) or self.module.num_partitions
            out.append({"name": inst.name, "opcode": op, "bytes_per_device": _bytes_moved(op, shape.size_bytes, n),
                        "group_size": n})
        return out

    def collectives_summary(self) -> str:
        """One line per collective kind: count and bytes each device sends."""
        counts: Counter = Counter()
        nbytes: Counter = Counter()
        for c in self.collectives():
            counts[c["opcode"]] += 1
            nbytes[c["opcode"]] += c["bytes_per_device"]
        if not counts:
            return "no collectives"
        return "\n".join(f"{op}: {counts[op]} x, {nbytes[op] / 2**20:.3f} MiB sent per device" for op in sorted(counts))


def _bytes_moved(op: str, operand_bytes: int, n: int) -> int:
    """Bytes one device sends for a ring implementation of ``op`` on an operand of ``operand_bytes``."""
    if n <= 1:
        return 0
    if op == "all-gather":
        return operand_bytes * (n - 1)
    if op == "reduce-scatter":
        return operand_bytes * (n - 1) // n
    if op == "all-reduce":
        return 2 * operand_bytes * (n - 1) // n
    if op == "all-to-all":
        return operand_bytes * (n - 1) // n
    return operand_bytes


def compile_module(lowered) -> Compiled:
    """Build the executable of a ``Lowered`` program and fix its output shardings."""
    from spmd.passes.assign_buffers import assign_buffers
    from spmd.runtime.executor import Executable

    module = lowered.result.module
    buffers = assign_buffers(module)
    lowered.result.buffers = buffers
    executable = Executable(module, lowered.jitted.mesh, buffers)
    shardings, shapes, dtypes = output_layout(lowered)
    return Compiled(lowered, executable, shardings, shapes, dtypes, buffers)


def output_layout(lowered):
    """Output NamedShardings (from the partitioned module's root), global shapes and dtypes."""
    mesh = lowered.jitted.mesh
    root = lowered.result.module.entry.root
    outputs = root.operands if root.opcode == "tuple" else [root]
    shardings = []
    for out in outputs:
        ts = out.sharding
        assert ts is not None and not ts.partial, f"output {out.name} has no final sharding: {ts}"
        shardings.append(NamedSharding.from_tensor_sharding(mesh, ts))
    shapes = [shape for shape, _ in lowered.out_avals]
    dtypes = [dtype for _, dtype in lowered.out_avals]
    return shardings, shapes, dtypes
