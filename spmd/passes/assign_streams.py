"""assign-streams: async-start/async-done with execution stream ids for windowed einsum.

After windowed-einsum, the partial dots (``backend_config={"windowed_einsum": step}``)
and the collective-permutes of the ring run on extra execution streams, as XLA's
multi-streamed windowed einsum does (openxla/xla#7854, #8707: the GEMM is wrapped in an
async-start/async-done pair carrying an execution stream id; a stream that consumes
another stream's value waits for it). Before::

    %ag.chunk1 = f32[4,6] collective-permute(%x), source_target_pairs={{0,1},{1,0}}
    %d.0 = f32[4,5] dot(%x, %w), ..., backend_config={"windowed_einsum":0}
    %d.acc0 = f32[8,5] dynamic-update-slice(%d.init, %d.0, %ag.off0, %zero)

after (``fuse_update=True``: the dot and the dynamic-update-slice it feeds form one
async unit, so that the runtime writes the GEMM straight into the accumulator)::

    %d.acc0.body (d.acc0.arg0: f32[8,5], ...) -> f32[8,5] {
      %d.0.op = f32[4,5] dot(%d.acc0.arg1, %d.acc0.arg2), ...
      ROOT %d.acc0.op = f32[8,5] dynamic-update-slice(%d.acc0.arg0, %d.0.op, ...)
    }
    %ag.chunk1-start = (f32[4,6], f32[4,6]) collective-permute-start(%x), ..., stream_id=3
    %ag.chunk1 = f32[4,6] collective-permute-done(%ag.chunk1-start), stream_id=3
    %d.acc0-start = ((f32[8,5], f32[4,6], f32[6,5], s32[], s32[]), f32[8,5]) async-start(...),
        calls=%d.acc0.body, stream_id=1
    %d.acc0 = f32[8,5] async-done(%d.acc0-start), stream_id=1

The all-reduces of the two batch halves of ``spmd.passes.split_batch`` (``backend_config``
with ``"split_batch"``) become all-reduce-start / all-reduce-done on the communication stream
too, so one half's all-reduce runs under the other half's dots.

Compute streams are 1..num_compute_streams, assigned round-robin over the partial
dots in program order; the communication stream is num_compute_streams + 1; every
other entry instruction without a stream (parameters aside) gets stream 0. Joins stay explicit: a
consumer of an ``*-done`` on another stream waits for it (see docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.hlo import Computation, Instruction, Module, Shape
from spmd.passes.windowed_einsum import ACCUMULATE_KEY, MARK, STREAMS_KEY, stable_toposort

SPLIT_KEY = "split_batch"  # backend_config key of the all-reduces of a batch half (spmd.passes.split_batch)

AUTO_MAX_STREAMS = 2  # compute streams the cost model may advise (cost_model.decide)


@dataclass(frozen=True)
class AssignStreams:
    """The assign-streams pass (see the module docstring).

    num_compute_streams: number of extra compute streams (>= 1) the partial dots rotate over;
      None = per site, as the windowed-einsum cost model advised (``"compute_streams"`` in
      the partial dot's backend_config, 1 where absent).
    fuse_update: move a partial dot's single dynamic-update-slice user (its update operand)
      into the same async computation.
    A partial dot marked ``"accumulate": true`` takes its single ``add`` user (the sum with
    a received accumulator) into its async computation, and that add's dynamic-update-slice
    user under ``fuse_update``: the runtime then runs one addmm into the result's rows.
    A dynamic-slice read only by a partial dot moves into the dot's async computation too.
    Raises ValueError for num_compute_streams < 1.
    """

    name: ClassVar[str] = "assign-streams"
    num_compute_streams: int | None = 2
    fuse_update: bool = True

    def __post_init__(self) -> None:
        n = self.num_compute_streams
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"num_compute_streams must be an int >= 1 or None, got {n!r}")

    @property
    def comm_stream(self) -> int:
        """Stream id of the collective-permutes when ``num_compute_streams`` is fixed (else the
        most it can be; ``run`` uses one past the compute streams actually advised)."""
        return (self.num_compute_streams or AUTO_MAX_STREAMS) + 1

    def _comm_stream_for(self, units: dict) -> int:
        """One past the highest compute stream in use: stream ids stay dense (0, 1, .., n+1), so a
        program the cost model gives one compute stream is exactly the program that
        ``num_compute_streams=1`` compiles (no unused stream between compute and communication).
        """
        if self.num_compute_streams is not None:
            return self.num_compute_streams + 1
        dots = [next(u for u in unit if u.opcode == "dot") for unit in units.values()]
        return 1 + max((self._streams_for(d) for d in dots), default=1)

    def _streams_for(self, dot: Instruction) -> int:
        if self.num_compute_streams is not None:
            return self.num_compute_streams
        advised = dot.attrs.get("backend_config", {}).get(STREAMS_KEY, 1)
        return max(1, min(int(advised), AUTO_MAX_STREAMS))

    def run(self, module: Module) -> Module:
        comp = module.entry
        names = {i.name for c in module.all_computations() for i in c.instructions}
        names |= {c.name for c in module.all_computations()}
        units = self._units(comp)
        comm_stream = self._comm_stream_for(units)
        fused = {id(i) for unit in units.values() for i in unit[:-1]}
        out: list[Instruction] = []
        repl: dict[int, Instruction] = {}  # id(replaced instruction) -> its *-done
        turn = 0
        for inst in comp.instructions:
            if id(inst) in fused:
                continue
            if id(inst) in units:
                unit = units[id(inst)]
                dot = next(u for u in unit if u.opcode == "dot")
                stream = 1 + turn % self._streams_for(dot)
                turn += 1
                old, pair = unit[-1], _wrap_async(module, unit, stream, names)
            elif inst.opcode == "collective-permute":
                old, pair = inst, _split_permute(inst, comm_stream, names)
            elif inst.opcode == "all-reduce" and SPLIT_KEY in inst.attrs.get("backend_config", {}):
                old, pair = inst, _split_all_reduce(inst, comm_stream, names)
            else:
                if inst.stream_id is None and inst.opcode != "parameter":
                    inst.stream_id = 0
                out.append(inst)
                continue
            repl[id(old)] = pair[1]
            out.extend(pair)
        for inst in out:
            inst.operands = [repl.get(id(o), o) for o in inst.operands]
        comp.root = repl.get(id(comp.root), comp.root)
        comp.instructions = stable_toposort(out)
        return module

    def _units(self, comp: Computation) -> dict[int, list[Instruction]]:
        """id(the root of a unit) -> [dynamic-slice operands..., partial dot, (its update)], in order."""
        users = comp.users()
        units: dict[int, list[Instruction]] = {}
        for inst in comp.instructions:
            if inst.opcode != "dot" or MARK not in inst.attrs.get("backend_config", {}):
                continue
            unit = [o for o in dict.fromkeys(inst.operands)
                    if o.opcode == "dynamic-slice" and users[o] == [inst] and o is not comp.root] + [inst]
            last = inst
            add = users[inst][0] if len(users[inst]) == 1 else None
            if (inst.attrs["backend_config"].get(ACCUMULATE_KEY) and add is not None and add.opcode == "add"
                    and add.operands.count(inst) == 1 and add is not comp.root):
                unit.append(add)
                last = add
            dus = users[last][0] if len(users[last]) == 1 else None
            if (self.fuse_update and dus is not None and dus.opcode == "dynamic-update-slice"
                    and dus.operands.index(last) == 1 and dus.operands.count(last) == 1):
                unit.append(dus)
            units[id(unit[-1])] = unit
        return units


def _fresh(names: set[str], base: str) -> str:
    cand, k = base, 0
    while cand in names:
        k += 1
        cand = f"{base}.{k}"
    names.add(cand)
    return cand


def _wrap_async(module: Module, unit: list[Instruction], stream: int, names: set[str]) -> list[Instruction]:
    """Move ``unit`` (a dot, optionally its dynamic-update-slice user) into an async computation.

    Returns [async-start, async-done]; the done takes the name and sharding of the unit's root.
    """
    root = unit[-1]
    inside = {id(i) for i in unit}
    external: list[Instruction] = []
    for i in unit:
        for o in i.operands:
            if id(o) not in inside and all(o is not e for e in external):
                external.append(o)
    mapping: dict[int, Instruction] = {}
    body: list[Instruction] = []
    for k, o in enumerate(external):
        mapping[id(o)] = Instruction(_fresh(names, f"{root.name}.arg{k}"), "parameter", o.shape,
                                     attrs={"parameter_number": k})
        body.append(mapping[id(o)])
    for i in unit:
        mapping[id(i)] = Instruction(_fresh(names, f"{i.name}.op"), i.opcode, i.shape,
                                     [mapping[id(o)] for o in i.operands], dict(i.attrs))
        body.append(mapping[id(i)])
    called = Computation(_fresh(names, f"{root.name}.body"), body, body[-1])
    module.computations.append(called)
    shape = Shape.tuple([Shape.tuple([o.shape for o in external]), root.shape])
    start = Instruction(_fresh(names, f"{root.name}-start"), "async-start", shape, external, {"calls": called},
                        stream_id=stream)
    done = Instruction(root.name, "async-done", root.shape, [start], sharding=root.sharding, stream_id=stream)
    return [start, done]


def _split_all_reduce(ar: Instruction, stream: int, names: set[str]) -> list[Instruction]:
    """[all-reduce-start, all-reduce-done] on ``stream`` for an all-reduce of one batch half
    (``spmd.passes.split_batch``); the done takes ``ar``'s name."""
    start = Instruction(_fresh(names, f"{ar.name}-start"), "all-reduce-start", ar.shape, ar.operands, dict(ar.attrs),
                        stream_id=stream)
    done = Instruction(ar.name, "all-reduce-done", ar.shape, [start], sharding=ar.sharding, stream_id=stream)
    return [start, done]


def _split_permute(cp: Instruction, stream: int, names: set[str]) -> list[Instruction]:
    """[collective-permute-start, collective-permute-done] on ``stream``; the done takes ``cp``'s name."""
    shape = Shape.tuple([cp.operands[0].shape, cp.shape])
    start = Instruction(_fresh(names, f"{cp.name}-start"), "collective-permute-start", shape, cp.operands,
                        dict(cp.attrs), stream_id=stream)
    done = Instruction(cp.name, "collective-permute-done", cp.shape, [start], sharding=cp.sharding, stream_id=stream)
    return [start, done]
