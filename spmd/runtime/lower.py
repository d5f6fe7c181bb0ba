"""Lowering: a scheduled, partitioned entry computation -> a flat thunk list with stream ids.

Modelled on XLA's GPU thunk emission (xla/service/gpu/runtime: one thunk per instruction,
each with an execution stream id; async collectives as start/done; WaitForStreams joins):

- ``parameter`` binds an argument slot; ``tuple`` / ``get-tuple-element`` / ``*-done`` are pure
  aliasing resolved here (no thunk).
- ``constant``, ``partition-id`` and every small value computed only from them (the offset
  arithmetic of dynamic-slice / dynamic-update-slice, small iotas) are folded once per device
  at lowering time into persistent tensors: a call pays nothing for them. The rule is
  ``spmd.passes.folding`` (shared with assign-buffers and the view analysis). On GPU, offset
  operands of dynamic-slice / dynamic-update-slice read a host copy, so the kernels never sync.
- ``async-start`` inlines its ``calls`` computation as thunks on the async-start's stream.
- collectives and their ``*-start`` forms become ``CollectiveThunk``s; an all-reduce's algorithm
  ("one-shot" or "ring", ``spmd.passes.select_all_reduce``) goes into its ``CollectiveSpec``.
- every other instruction becomes a ``KernelThunk`` from ``kernels.compile_kernel``, writing
  into its arena view when a ``BufferAssignment`` places it.
- instructions that ``spmd.passes.views`` decides are views (reshape, transpose, broadcast,
  slice of a layout that allows it) stay ops on their stream (so stream joins are unchanged)
  but run a view kernel (``kernels.compile_view_kernel``): no copy, no arena buffer. Their
  readers read the operand's memory (``Program.shares``), which the buffer assignment keeps
  live until the view's last reader.
- peephole fusions (``spmd.runtime.fusions``): dot into a dynamic-update-slice, dot + add; a
  product and its elementwise reader (``spmd.runtime.epilogue_fusion``); a skinny product and the
  RMS norm or SwiGLU fusion of its input (``spmd.runtime.fusions_prologue``).
- on GPU, a record-event / wait-event pair for every cross-stream dependency not already
  implied by an earlier join (vector clocks over streams).
- slots are dropped after their last reader when only one stream ever touches their memory;
  values shared across streams are kept until the end of the call.
- an output that may share memory with the arena, a persistent value or an undonated
  parameter (through views, in-place updates, kernels returning an operand) is copied
  before it is returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd.ir.hlo import Computation, Instruction, Module, ancestor_ids
from spmd.passes.folding import FOLD_MAX_NUMEL as FOLD_MAX_NUMEL  # re-exported: the folding threshold
from spmd.passes.folding import is_foldable
from spmd.passes.select_all_reduce import ALGORITHM_KEY
from spmd.runtime import aliasing, epilogue_fusion, fusions, multi_output
from spmd.runtime.donation import plan_donation
from spmd.runtime.fusions_prologue import fuse_prologues
from spmd.runtime.stream_joins import attach_releases, stream_joins
from spmd.runtime.thunks import (
    CollectiveSpec,
    CollectiveThunk,
    KernelThunk,
    MultiOutputKernelThunk,
    RecordEventThunk,
    Thunk,
    WaitEventThunk,
)

_COLLECTIVE_KIND = {
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-to-all": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-start": "collective-permute",
}
_PAIR_STARTS = frozenset({"all-gather-start", "collective-permute-start"})
_DONES = frozenset({"all-gather-done", "collective-permute-done", "all-reduce-done", "async-done"})
_OFFSET_FROM = {"dynamic-slice": 1, "dynamic-update-slice": 2}


@dataclass(frozen=True)
class ArenaView:
    """A preallocated output: ``size_bytes`` at ``offset_bytes`` of the per-device arena."""

    offset_bytes: int
    dims: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Program:
    """A lowered executable program for the local devices.

    Fields:
      num_slots: length of each device's per-call slot list.
      thunks: the thunk sequence (event thunks only on GPU).
      param_slots: slot of each entry parameter, by parameter number.
      output_slots: slot of each output (the flattened root).
      output_clone: per output, whether the value must be copied before it is returned
        (a persistent constant or an arena view).
      templates: per local device, the initial slot list (persistent values filled in).
      stream_ids: the execution stream ids used (always includes 0).
      num_events: events per device used by the event thunks.
      arena_views: the arena views kernels write into (``KernelThunk.buffer`` indexes it).
      arena_size_bytes: size of the per-device arena.
      donated_params: parameters whose tensors follow the arena views in a call's view list
        (outputs written into donated buffers).
      output_donors: per output, the donated parameter whose buffer it is written into, or -1
        (empty: no output is; a CUDA graph makes that parameter's static input its output).
      shares: slot -> the operand slots whose memory its value may be a view of (reshape,
        slice, ...); such a result writes no memory of its own.
      in_place: slot -> the slot whose memory the op producing it updates in place.
        (``spmd.runtime.hazards`` reads both.)
      view_slots: result slots of the kernel thunks that return a view of an operand
        without running a kernel (``spmd.passes.views`` and parameter slices).
      folded_names: names of the instructions whose values were folded at lowering time
        (``spmd.passes.folding``; persistent values in ``templates``).
    """

    num_slots: int
    thunks: list[Thunk]
    param_slots: tuple[int, ...]
    output_slots: tuple[int, ...]
    output_clone: tuple[bool, ...]
    templates: list[list[Any]]
    stream_ids: tuple[int, ...]
    num_events: int
    arena_views: tuple[ArenaView, ...]
    arena_size_bytes: int
    donated_params: tuple[int, ...] = ()
    output_donors: tuple[int, ...] = ()
    shares: dict[int, tuple[int, ...]] = field(default_factory=dict)
    in_place: dict[int, int] = field(default_factory=dict)
    view_slots: frozenset[int] = frozenset()
    folded_names: frozenset[str] = frozenset()


@dataclass(eq=False)
class Op:
    """An instruction to run (kernel or collective) before thunks are built."""

    inst: Instruction
    stream: int
    ins: list[int]
    out: int
    fn: Any = None                 # kernel closure (set by fusions or at build time)
    buffer_name: str | None = None  # instruction name whose arena offset holds the result
    alias_of: int = -1              # result shares the memory of this slot (in-place fusion)
    extra: dict = field(default_factory=dict)


class _Lowerer:
    def __init__(self, module: Module, devices: Sequence[torch.device], pids: Sequence[int],
                 buffers: Any, gpu: bool) -> None:
        self.module, self.devices, self.pids, self.buffers, self.gpu = module, list(devices), list(pids), buffers, gpu
        self.num_slots = 0
        self.refs: dict[int, Any] = {}          # id(inst) -> slot or tuple of refs
        self.slot_inst: dict[int, Instruction] = {}
        self.folded: dict[int, list[torch.Tensor]] = {}  # slot -> per local device host value
        self.ops: list[Op] = []
        self.param_slots: dict[int, int] = {}
        self.multi_ops: dict[int, Op] = {}      # result slot -> op of a multi-output fusion

    def new_slot(self, inst: Instruction) -> int:
        self.num_slots += 1
        self.slot_inst[self.num_slots - 1] = inst
        return self.num_slots - 1

    # ------------------------------------------------------------------ walk
    def walk(self, comp: Computation, stream: int, live: set[int]) -> None:
        for inst in comp.instructions:
            if id(inst) in live:
                self.refs[id(inst)] = self.lower_inst(inst, stream, live)

    def lower_inst(self, inst: Instruction, stream: int, live: set[int]) -> Any:
        op = inst.opcode
        sid = stream if inst.stream_id is None else inst.stream_id
        if op == "parameter":
            if inst.shape.is_tuple:
                raise ValueError(f"parameter %{inst.name}: tuple-shaped entry parameters are not supported")
            slot = self.new_slot(inst)
            self.param_slots[inst.attrs["parameter_number"]] = slot
            return slot
        if op == "tuple":
            return tuple(self.refs[id(o)] for o in inst.operands)
        if op == "get-tuple-element" and isinstance(self.refs[id(inst.operands[0])], tuple):
            return self.refs[id(inst.operands[0])][inst.attrs["index"]]
        if op in _DONES:
            ref = self.refs[id(inst.operands[0])]
            return ref[1] if isinstance(ref, tuple) else ref
        if op == "async-start":
            return self.lower_async_start(inst, sid)
        ins = [self.refs[id(o)] for o in inst.operands]
        if any(isinstance(r, tuple) for r in ins):
            raise ValueError(f"%{inst.name} ({op}): tuple-valued operands are not supported by the runtime")
        if op in _COLLECTIVE_KIND:
            return self.lower_collective(inst, sid, ins)
        if is_foldable(inst, all(s in self.folded for s in ins)):
            return self.fold(inst, ins)
        slot = self.new_slot(inst)
        self.ops.append(Op(inst, sid, ins, slot, buffer_name=inst.name))
        multi_output.mark(self.ops[-1], self.multi_ops)
        return slot

    def lower_async_start(self, inst: Instruction, sid: int) -> Any:
        """Inline the called computation; its ops form one unit that joins its operands first.

        An async-start waits for all of its operands before any instruction of its called
        computation runs (XLA's async semantics, and the model ``assign-buffers`` places
        buffers under): ``unit`` tags the ops so that ``stream_joins`` takes every
        cross-stream wait of the unit before the unit's first op.
        """
        body: Computation = inst.attrs["calls"]
        operand_refs = tuple(self.refs[id(o)] for o in inst.operands)
        for p in body.parameters:
            self.refs[id(p)] = operand_refs[p.attrs["parameter_number"]]
        body_live = reachable(body.root)
        first = len(self.ops)
        for b in body.instructions:
            if id(b) in body_live and b.opcode != "parameter":
                self.refs[id(b)] = self.lower_inst(b, sid, body_live)
        for op in self.ops[first:]:
            op.extra["unit"] = inst.name
        return (operand_refs, self.refs[id(body.root)])

    def lower_collective(self, inst: Instruction, sid: int, ins: list[int]) -> Any:
        slot = self.new_slot(inst)
        self.ops.append(Op(inst, sid, ins, slot, extra={"spec": collective_spec(inst, self.module.num_partitions)}))
        return (ins[0], slot) if inst.opcode in _PAIR_STARTS else slot

    # ------------------------------------------------------------------ folding
    def fold(self, inst: Instruction, ins: list[int]) -> int:
        """A new slot holding ``inst``'s value per local device, computed now on the host
        (``inst`` is ``spmd.passes.folding.is_foldable``; ``ins`` are folded slots)."""
        from spmd.runtime.kernels import compile_kernel

        slot = self.new_slot(inst)
        if inst.opcode == "partition-id":
            self.folded[slot] = [torch.tensor(p, dtype=torch.uint32) for p in self.pids]
            return slot
        fn = compile_kernel(inst)
        self.folded[slot] = [fn([self.folded[s][k] for s in ins], None) for k in range(len(self.pids))]
        return slot


def reachable(root: Instruction) -> set[int]:
    """ids of the instructions ``root`` depends on (itself included)."""
    return ancestor_ids([root])


def collective_spec(inst: Instruction, num_partitions: int) -> CollectiveSpec:
    """The transport-independent description of a collective instruction.

    Raises:
      NotImplementedError: an all-reduce / reduce-scatter whose to_apply is not
        add / maximum / minimum / multiply.
    """
    kind = _COLLECTIVE_KIND[inst.opcode]
    a = inst.attrs
    groups = tuple(tuple(g) for g in (a.get("replica_groups") or ((tuple(range(num_partitions))),)))
    reduce_op = "add"
    if a.get("to_apply") is not None:
        reduce_op = a["to_apply"].root.opcode
        if reduce_op not in ("add", "maximum", "minimum", "multiply"):
            raise NotImplementedError(f"%{inst.name}: to_apply root {reduce_op!r} is not add/maximum/minimum/multiply")
    shape = inst.shape.tuple_shapes[1] if inst.opcode in _PAIR_STARTS else inst.shape
    dims = a.get("dimensions") or (0,)
    algorithm = (a.get("backend_config") or {}).get(ALGORITHM_KEY, "ring") if kind == "all-reduce" else "ring"
    return CollectiveSpec(kind=kind, groups=groups, dim=dims[0], split_dim=a.get("split_dimension", 0),
                          concat_dim=a.get("concat_dimension", 0), reduce_op=reduce_op,
                          pairs=tuple(tuple(p) for p in a.get("source_target_pairs", ())),
                          out_dims=shape.dims, dtype=shape.torch_dtype, algorithm=algorithm)


def flatten_ref(ref: Any) -> list[int]:
    """Slots of a (possibly nested tuple) value reference, in order."""
    if isinstance(ref, tuple):
        return [s for r in ref for s in flatten_ref(r)]
    return [ref]


def lower(module: Module, devices: Sequence[torch.device], pids: Sequence[int] | None = None,
          buffers: Any = None, gpu: bool = False, fuse: bool = True,
          donated: frozenset[int] = frozenset()) -> Program:
    """Lower ``module``'s entry computation for the local devices.

    Args:
      module: a partitioned module (``is_partitioned``), scheduled (instruction order is the
        issue order).
      devices: torch device of each local device.
      pids: partition id of each local device (default: 0..len(devices)-1).
      buffers: a ``BufferAssignment`` (offsets_bytes, sizes_bytes, arena_size_bytes) or None.
      gpu: emit event thunks for cross-stream joins and place persistent values on devices.
      fuse: apply the peephole fusions of ``spmd.runtime.fusions``.
      donated: parameter numbers whose buffers outputs may be written into
        (``spmd.runtime.donation``); the run must then pass those parameters' tensors as
        extra views (``Program.donated_params``).
    Returns:
      The ``Program``.
    Raises:
      ValueError: the module is not partitioned, uses tuple-valued parameters/operands, or
        repeats an instruction name while ``buffers`` is given.
    """
    if not module.is_partitioned:
        raise ValueError(f"module: expected a partitioned module (is_partitioned=True), "
                         f"got {module.name!r} unpartitioned")
    pids = list(range(len(devices))) if pids is None else list(pids)
    lw = _Lowerer(module, devices, pids, buffers, gpu)
    entry = module.entry
    lw.walk(entry, 0, reachable(entry.root))
    params = entry.parameters
    for p in params:  # unused parameters still get a slot for binding
        if id(p) not in lw.refs:
            lw.refs[id(p)] = lw.lower_inst(p, 0, set())
    output_slots = flatten_ref(lw.refs[id(entry.root)])
    outputs = set(output_slots)
    view_sources = aliasing.mark_analysis_views(lw, buffers)
    if fuse:  # a buffer that a view aliases is never updated in place by a fusion
        fusions.fuse(lw.ops, outputs, buffers, lw.folded, view_sources)
        fuse_prologues(lw.ops, outputs, view_sources)
        epilogue_fusion.fuse_epilogues(lw.ops, outputs | set(view_sources))
    aliasing.mark_parameter_views(lw, donated)
    host_slots = _host_offset_slots(lw) if gpu else {}
    arena_views, op_buffers = _arena(lw.ops, outputs, buffers)
    aliasing.mark_materialized(lw, op_buffers)
    plan = plan_donation(lw.ops, [lw.param_slots[i] for i in range(len(params))], output_slots, donated,
                         [p.shape for p in params])
    clone = aliasing.output_clones(lw, output_slots, op_buffers, donated, plan)
    for t, k in enumerate(sorted(plan)):
        op_buffers[k] = len(arena_views) + t
    multi_output.move_buffers(lw.ops, op_buffers)
    thunks, num_events = _build_thunks(lw, op_buffers, host_slots, gpu)
    attach_releases(thunks, lw, outputs, gpu)
    templates = _templates(lw, host_slots, gpu)
    streams = sorted({0} | {t.stream_id for t in thunks})
    return Program(num_slots=lw.num_slots, thunks=thunks,
                   param_slots=tuple(lw.param_slots[i] for i in range(len(params))),
                   output_slots=tuple(output_slots), output_clone=clone, templates=templates,
                   stream_ids=tuple(streams), num_events=num_events, arena_views=tuple(arena_views),
                   arena_size_bytes=int(getattr(buffers, "arena_size_bytes", 0) or 0),
                   donated_params=tuple(plan[k] for k in sorted(plan)),
                   output_donors=_output_donors(lw, output_slots, plan), shares=aliasing.shares(lw.ops, op_buffers),
                   in_place={op.out: op.alias_of for op in lw.ops if op.alias_of >= 0},
                   view_slots=frozenset(op.out for op in lw.ops if "view" in op.extra),
                   folded_names=frozenset(lw.slot_inst[s].name for s in lw.folded))


def _output_donors(lw: _Lowerer, output_slots: list[int], plan: dict[int, int]) -> tuple[int, ...]:
    """Per output, the donated parameter whose buffer receives it (``plan``), or -1; () when none does.
    A value returned more than once is written into the buffer by its first output only (the
    others are copies, ``aliasing.output_clones``)."""
    written = {lw.ops[k].out: i for k, i in plan.items()}
    if not written:
        return ()
    first = {s: j for j, s in reversed(list(enumerate(output_slots)))}  # a value returned twice: its first output
    return tuple(written.get(s, -1) if first[s] == j else -1 for j, s in enumerate(output_slots))


def _host_offset_slots(lw: _Lowerer) -> dict[int, int]:
    """Folded slots read as dynamic-slice offsets -> a new slot holding the host copy."""
    out: dict[int, int] = {}
    for op in lw.ops:
        first = op.extra.get("offset_from", _OFFSET_FROM.get(op.inst.opcode))
        if first is None:
            continue
        for k in range(first, len(op.ins)):
            s = op.ins[k]
            if s in lw.folded:
                if s not in out:
                    out[s] = lw.new_slot(lw.slot_inst[s])
                op.ins[k] = out[s]
    return out


def _arena(ops: list[Op], outputs: set[int], buffers: Any) -> tuple[list[ArenaView], dict[int, int]]:
    """Arena views for ops the BufferAssignment places (outputs never live in the arena).

    Custom calls and fusions get none: their kernels are PyTorch functions without an ``out=`` form, so an
    arena view would cost a copy of every result (one device-to-device memcpy each); they return
    fresh memory from the caching allocator (the graph's private pool under CUDA graphs). Nor do
    the reshapes of ``aliasing.layout_views``, which view the attention kernel's output.
    """
    views: list[ArenaView] = []
    op_buffers: dict[int, int] = {}
    if buffers is None:
        return views, op_buffers
    names = [op.buffer_name for op in ops if op.buffer_name is not None]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"buffers: instruction names must be unique to key a BufferAssignment; "
                         f"repeated: {dup[:5]}")
    offsets = buffers.offsets_bytes
    strided = aliasing.layout_views(ops)
    for k, op in enumerate(ops):
        name = op.buffer_name
        if ("spec" in op.extra or "view" in op.extra or name is None or name not in offsets or op.out in outputs
                or (op.fn is None and op.inst.opcode in ("custom-call", "fusion")) or k in strided):
            continue
        shape = op.inst.shape
        if shape.is_tuple:
            continue
        op_buffers[k] = len(views)
        views.append(ArenaView(int(offsets[name]), tuple(shape.dims), shape.torch_dtype))
    return views, op_buffers


def _build_thunks(lw: _Lowerer, op_buffers: dict[int, int], host_slots: dict[int, int],
                  gpu: bool) -> tuple[list[Thunk], int]:
    """Kernel / collective thunks, with record/wait event thunks for cross-stream joins on GPU."""
    record_after, waits_before = stream_joins(lw.ops) if gpu else ({}, {})
    event_of = {p: e for e, p in enumerate(sorted(record_after))}
    thunks: list[Thunk] = []
    for k, op in enumerate(lw.ops):
        for p in waits_before.get(k, ()):
            thunks.append(WaitEventThunk(f"wait.{op.inst.name}", op.stream, event_of[p]))
        if "spec" in op.extra:
            thunks.append(CollectiveThunk(op.inst.name, op.stream, op.extra["spec"], op.ins[0], op.out))
        elif "element_buffers" in op.extra:
            thunks.append(MultiOutputKernelThunk(op.inst.name, op.stream, _kernel(op, lw.devices[0] if lw.devices
                                                                                else None), tuple(op.ins), op.out,
                                                 work=_work(op), buffers=op.extra["element_buffers"]))
        else:
            dev = lw.devices[0] if lw.devices else None
            fn = op.fn if op.fn is not None else _kernel(op, dev)
            thunks.append(KernelThunk(op.inst.name, op.stream, fn, tuple(op.ins), op.out, op_buffers.get(k, -1),
                                      work=_work(op)))
        if k in event_of:
            thunks.append(RecordEventThunk(f"record.{op.inst.name}", op.stream, event_of[k]))
    return thunks, len(event_of)


def _kernel(op: Op, dev: Any):
    """The kernel closure of an unfused op: a view kernel for a view, else ``compile_kernel``."""
    from spmd.runtime.kernels import VIEW_KERNEL_OPCODES, compile_kernel, compile_view_kernel

    if "view" in op.extra and op.inst.opcode in VIEW_KERNEL_OPCODES:
        return compile_view_kernel(op.inst)
    fn = compile_kernel(op.inst, dev)
    return aliasing.materializing(fn) if "materialize" in op.extra else fn


def _work(op: Op) -> int:
    """Rough cost of an op: result elements, times the contracted size for a dot."""
    if "work" in op.extra:
        return op.extra["work"]
    inst = op.inst
    if inst.shape.is_tuple:
        return sum(s.numel for s in inst.shape.tuple_shapes) if inst.opcode == "fusion" else 0
    return fusions.dot_work(inst) if inst.opcode == "dot" else inst.shape.numel


def _templates(lw: _Lowerer, host_slots: dict[int, int], gpu: bool) -> list[list[Any]]:
    """Per local device, the initial slot list with persistent (folded) values filled in."""
    templates = []
    for k, dev in enumerate(lw.devices):
        t: list[Any] = [None] * lw.num_slots
        for s, values in lw.folded.items():
            t[s] = values[k].to(dev) if gpu else values[k]
        for s, h in host_slots.items():
            t[h] = lw.folded[s][k]
        templates.append(t)
    return templates
