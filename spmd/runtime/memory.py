"""Peak device memory of one executable, per device, from its buffer assignment and thunk sequence.

In the spirit of JAX's ``compiled.memory_analysis()`` (XLA's ``CompiledMemoryStats``: argument,
output, alias and temp sizes) and XLA's heap simulator (xla/service/heap_simulator.cc), which
replays the schedule and reports the peak of the bytes live at once.

The runtime holds three kinds of device memory during a call (``spmd.runtime.lower``):

- the arguments (every entry parameter's per-device shard, live for the whole call; donated
  ones too: the caller's arrays own them until the call returns);
- the per-device arena of the ``BufferAssignment`` (``spmd.passes.assign_buffers``), allocated
  once per executable and reused by every call;
- values the kernels allocate themselves (collective results, fusions and custom calls, program
  outputs, kernels that may return a view of an operand): live from their thunk until the thunk
  that releases their slot (``KernelThunk.release``), or to the end of the call. An output that
  the donation plan writes into a donated parameter's buffer (``Program.output_donors``) costs
  nothing extra (XLA's "alias" bytes); an output the lowering clones costs its bytes again.

The simulation replays the thunks of local device 0 (all devices run the same program on
equal padded shard shapes) and follows storages, not slots: a view keeps its operand's
storage alive (``Program.view_slots``), an in-place result is its operand's storage
(``Program.in_place``), and a result that *may* be a view of an operand
(``Program.shares``: reshape, slice, ... without a guaranteed view layout) is counted both as
holding its operands' storages and as a fresh allocation of its own bytes, so the reported
peak is an upper bound of what the call allocates (the caching allocator's rounding and
fragmentation aside).
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd.ir.hlo import Instruction, Module
from spmd.runtime.thunks import CollectiveThunk, KernelThunk, MultiOutputKernelThunk

__all__ = ["MemoryAnalysis", "analyze_program", "memory_analysis"]


@dataclass(frozen=True)
class MemoryAnalysis:
    """Per-device memory of one executable, in bytes (every device of the mesh alike).

    Fields:
      argument_size_bytes: entry parameters' per-device shards (weights, optimizer state, batch,
        the random key, hoisted weight values).
      output_size_bytes: the outputs' per-device shards.
      alias_size_bytes: output bytes written into donated argument buffers (not allocated again).
      arena_size_bytes: the ``BufferAssignment`` arena (temporaries placed at fixed offsets).
      heap_temp_peak_bytes: peak of the temporaries the kernels allocate outside the arena,
        outputs excluded.
      constant_size_bytes: values folded at lowering time (small persistent constants).
      peak_size_bytes: the most bytes live at once during a call: arguments + arena + constants
        + the peak of heap temporaries and (not aliased) outputs at the same point.
      num_devices: devices of the mesh.
    """

    argument_size_bytes: int
    output_size_bytes: int
    alias_size_bytes: int
    arena_size_bytes: int
    heap_temp_peak_bytes: int
    constant_size_bytes: int
    peak_size_bytes: int
    num_devices: int = 1

    @property
    def temp_size_bytes(self) -> int:
        """Arena plus heap temporaries at their peak (JAX's ``temp_size_in_bytes``)."""
        return self.arena_size_bytes + self.heap_temp_peak_bytes

    def summary(self) -> str:
        """One line, e.g. ``peak 12.50 MiB/device (args 4.00, out 4.00, alias 4.00, temp 8.50 = arena 6.00 +
        heap 2.50)``: in MiB when the peak is at least 1 MiB, else in KiB (at least 1 KiB) or bytes, so a small
        program does not read as all zeros."""
        unit, scale = next((u, b) for u, b in (("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                           if self.peak_size_bytes >= b or b == 1)
        fmt = (lambda n: str(n)) if scale == 1 else (lambda n: f"{n / scale:.2f}")
        return (f"peak {fmt(self.peak_size_bytes)} {unit}/device (args {fmt(self.argument_size_bytes)}, "
                f"out {fmt(self.output_size_bytes)}, alias {fmt(self.alias_size_bytes)}, "
                f"temp {fmt(self.temp_size_bytes)} = arena {fmt(self.arena_size_bytes)} + heap "
                f"{fmt(self.heap_temp_peak_bytes)})")


def _instructions(module: Module) -> dict[str, Instruction]:
    """Instruction name -> instruction, over the entry and the async-start bodies it inlines."""
    out: dict[str, Instruction] = {}
    stack = [module.entry]
    while stack:
        comp = stack.pop()
        for inst in comp.instructions:
            out.setdefault(inst.name, inst)
            called = inst.attrs.get("calls") if inst.opcode == "async-start" else None
            if called is not None:
                stack.append(called)
    return out


def _result_bytes(inst: Instruction) -> int:
    shape = inst.shape
    if shape.is_tuple:  # a pair start (all-gather-start, collective-permute-start): its result
        return shape.tuple_shapes[-1].size_bytes
    return shape.size_bytes


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if hasattr(t, "numel") else 0


def analyze_program(module: Module, program, num_devices: int = 1) -> MemoryAnalysis:
    """The ``MemoryAnalysis`` of a lowered ``spmd.runtime.lower.Program`` of ``module``.

    Args:
      module: the partitioned, scheduled module the program was lowered from (result shapes).
      program: the ``Program`` (thunks with releases, arena views, outputs, donation plan).
      num_devices: devices of the mesh (reported only).
    Returns:
      The per-device ``MemoryAnalysis`` (replay of local device 0).
    """
    insts = _instructions(module)
    params = module.entry.parameters
    param_of = {s: i for i, s in enumerate(program.param_slots)}
    argument = sum(p.shape.size_bytes for p in params)
    template = program.templates[0] if program.templates else []
    constants = {s for s, v in enumerate(template) if v is not None}
    constant_bytes = sum(_tensor_bytes(template[s]) for s in constants)

    heap = _Heap()
    outputs = set(program.output_slots)
    peak_total = peak_temps = 0
    for th in program.thunks:
        if isinstance(th, CollectiveThunk):
            held = frozenset({heap.alloc(_spec_bytes(th.spec), th.out in outputs)})
        elif isinstance(th, KernelThunk):
            held = _result_storage(th, program, heap, insts, th.out in outputs)
        else:
            continue
        heap.bind(th.out, held)
        peak_total = max(peak_total, heap.total)
        peak_temps = max(peak_temps, heap.total - heap.output_bytes)
        for s in th.release:
            heap.drop(s)
    writers = {th.out: th for th in program.thunks if isinstance(th, (KernelThunk, CollectiveThunk))}
    aliased = clones = 0
    donors = program.output_donors or (-1,) * len(program.output_slots)
    for slot, clone, donor in zip(program.output_slots, program.output_clone, donors, strict=True):
        nbytes = _slot_bytes(slot, program, insts, module, param_of, writers)
        if donor >= 0:
            aliased += nbytes
        elif clone:
            clones += nbytes
    heap_peak = max(peak_total, heap.total + clones)
    output_bytes = sum(_slot_bytes(s, program, insts, module, param_of, writers) for s in program.output_slots)
    return MemoryAnalysis(
        argument_size_bytes=argument, output_size_bytes=output_bytes, alias_size_bytes=aliased,
        arena_size_bytes=int(program.arena_size_bytes), heap_temp_peak_bytes=peak_temps,
        constant_size_bytes=constant_bytes,
        peak_size_bytes=argument + int(program.arena_size_bytes) + constant_bytes + heap_peak,
        num_devices=num_devices)


def _spec_bytes(spec) -> int:
    import torch

    n = 1
    for d in spec.out_dims:
        n *= d
    return n * torch.empty((), dtype=spec.dtype).element_size()


class _Heap:
    """Storages kept alive by slots, with reference counts and the running total of their bytes."""

    def __init__(self) -> None:
        self.size: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self.is_output: set[int] = set()
        self.slots: dict[int, frozenset[int]] = {}
        self.total = 0
        self.output_bytes = 0

    def alloc(self, nbytes: int, output: bool) -> int:
        sid = len(self.size)
        self.size[sid] = nbytes
        self.count[sid] = 0
        if output:
            self.is_output.add(sid)
        return sid

    def held(self, slot: int) -> frozenset[int]:
        return self.slots.get(slot, frozenset())

    def bind(self, slot: int, storages: frozenset[int]) -> None:
        self.drop(slot)
        self.slots[slot] = storages
        for s in storages:
            if self.count[s] == 0:
                self.total += self.size[s]
                self.output_bytes += self.size[s] if s in self.is_output else 0
            self.count[s] += 1

    def drop(self, slot: int) -> None:
        for s in self.slots.pop(slot, ()):
            self.count[s] -= 1
            if self.count[s] == 0:
                self.total -= self.size[s]
                self.output_bytes -= self.size[s] if s in self.is_output else 0


def _result_storage(th: KernelThunk, program, heap: _Heap, insts, output: bool) -> frozenset[int]:
    """Heap storages a kernel thunk's result keeps alive (a fresh one where it may allocate)."""
    if isinstance(th, MultiOutputKernelThunk):  # fresh memory for the elements given no buffer
        shapes = insts[th.name].shape.tuple_shapes if th.name in insts else ()
        nbytes = sum(s.size_bytes for s, b in zip(shapes, th.buffers, strict=False) if b < 0)
        return frozenset({heap.alloc(nbytes, output)}) if nbytes else frozenset()
    if th.buffer >= 0:
        return frozenset()  # an arena view (or a donated parameter's buffer): no heap bytes
    if th.out in program.in_place:
        return heap.held(program.in_place[th.out])
    held = frozenset().union(*(heap.held(s) for s in th.ins))
    if th.out in program.view_slots:
        return held
    fresh = frozenset({heap.alloc(_result_bytes(insts[th.name]), output)}) if th.name in insts else frozenset()
    return held | fresh if th.out in program.shares else fresh


def _slot_bytes(slot: int, program, insts, module: Module, param_of: dict[int, int], writers: dict) -> int:
    """Bytes of the value in ``slot`` (an output: a thunk's result or a parameter)."""
    if slot in param_of:
        return module.entry.parameters[param_of[slot]].shape.size_bytes
    th = writers.get(slot)
    if isinstance(th, CollectiveThunk):
        return _spec_bytes(th.spec)
    if th is not None:
        return _result_bytes(insts[th.name]) if th.name in insts else 0
    template = program.templates[0] if program.templates else []
    return _tensor_bytes(template[slot]) if slot < len(template) and template[slot] is not None else 0


def memory_analysis(compiled, donated: frozenset[int] | None = None) -> MemoryAnalysis:
    """The ``MemoryAnalysis`` of a ``spmd.compiled.Compiled`` (the program variant of its donated inputs).

    ``donated``: parameter numbers whose buffers the call gives up (default: the compiled
    ``donate_argnums`` leaves). Raises TypeError when ``compiled`` has no executable.
    """
    executable = getattr(compiled, "executable", None)
    executable = getattr(executable, "executable", executable)  # a CUDA-graph runner wraps it
    if executable is None or not hasattr(executable, "_variant"):
        raise TypeError(f"compiled: expected a spmd Compiled executable, got {type(compiled).__name__}")
    if donated is None:
        donated = frozenset(getattr(compiled, "_donated", frozenset()))
    program, _ = executable._variant(frozenset(donated))
    return analyze_program(executable.module, program, len(executable.mesh.devices))
