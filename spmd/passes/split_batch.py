"""split-batch: run a tensor-parallel program as two batch halves so one half's all-reduce hides.

In a tensor-parallel (Megatron) layer every row-parallel dot ends in an all-reduce that the
residual add and the next norm wait for: nothing runs under it. Splitting the batch into two
independent halves A and B and interleaving them lets A's all-reduce run (async, on the
communication stream) under B's GEMMs and B's under A's next ones. This is DeepSpeed Domino
(Wang et al., "Domino: Eliminating Communication in LLM Training via Generic Tensor Slicing and
Overlapping", arXiv:2409.15241) and NanoFlow's nano-batches (Zhu et al., arXiv:2408.12757),
applied to the whole partitioned program:

1. ``spmd.passes.batch_dims`` checks that the program is row-separable along the batch (dim 0
   of the per-call inputs, else dim 1) and finds the batch dim of every value. The weights
   (``weights``: parameter numbers) and values computed only from them and constants are
   shared by both halves and computed once.
2. Each per-row instruction is cloned per half with its batch dim cut to the half's rows
   (``ceil(B/2)`` and ``floor(B/2)``); a per-call input becomes two slices (views), a shared
   operand an op reads row-aligned is sliced per half, each output is the concatenation of
   its halves. All-reduces of the halves are marked (``backend_config={"split_batch": h}``):
   ``assign-streams`` turns them into all-reduce-start / all-reduce-done on the communication
   stream, and ``schedule`` starts them as soon as their operand is ready and waits as late as
   possible.
3. Order (Domino's): the program is cut into segments at the all-reduces (segment k holds
   what needs k all-reduces before it) and emitted A0 B0 A1 B1 ...: A's all-reduce ending
   segment k runs while B's segment k computes, B's while A's segment k+1 does.

Before (one device of two; ``%y`` a row-parallel dot)::

    %y = f32[8,16] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    %r = f32[8,16] all-reduce(%y), replica_groups={{0,1}}, to_apply=%add
    ROOT %o = f32[8,16] add(%r, %x2)

after (then made async by assign-streams)::

    %x.h0 = f32[4,8] slice(%x), slice={[0:4:1], [0:8:1]}
    %y.h0 = f32[4,16] dot(%x.h0, %w), ...
    %r.h0 = f32[4,16] all-reduce(%y.h0), ..., backend_config={"split_batch":0}
    %x.h1 = ... %y.h1 = ... %r.h1 = ... all-reduce(%y.h1), backend_config={"split_batch":1}
    ...
    ROOT %o = f32[8,16] concatenate(%o.h0, %o.h1), dimensions={0}

``mode``: "off" leaves every module unchanged; "on" splits every row-separable program with a
batch of at least 2; "auto" splits only where ``spmd.passes.cost_model.split_batch_pays``
predicts a gain (so small programs stay untouched).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from spmd.ir.hlo import Instruction, Module, Shape
from spmd.passes.assign_streams import SPLIT_KEY
from spmd.passes.batch_dims import BatchDims, UnsplittableError, analyze, needs_rows
from spmd.passes.cost_model import H200_NVLINK, MachineProfile, split_batch_pays

MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class SplitBatch:
    """The split-batch pass (see the module docstring).

    mode: "auto" | "on" | "off" (``CompileOptions.split_batch_overlap``).
    weights: parameter numbers shared by both halves (weights); every other parameter whose
      split dim has the batch's size is split.
    cost_model: the ``MachineProfile`` of the "auto" decision.
    Raises ValueError for an unknown mode; ``run`` raises ValueError for an unpartitioned module.
    """

    name: ClassVar[str] = "split-batch"
    mode: str = "auto"
    weights: frozenset[int] = field(default_factory=frozenset)
    cost_model: MachineProfile = H200_NVLINK

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        object.__setattr__(self, "weights", frozenset(self.weights))

    def run(self, module: Module) -> Module:
        if not module.is_partitioned:
            raise ValueError(f"split-batch: expected a partitioned module, got {module.name!r} before spmd-partition")
        if self.mode == "off":
            return module
        plan = self.plan(module)
        if plan is None:
            return module
        if self.mode == "auto" and not split_batch_pays(module.entry, plan, self.cost_model):
            return module
        _rewrite(module, plan)
        return module

    def plan(self, module: Module) -> BatchDims | None:
        """The batch dims of a row-separable split along dim 0, else dim 1; None when neither is."""
        params = [p for p in module.entry.parameters if p.attrs["parameter_number"] not in self.weights]
        for d in (0, 1):
            ranked = [p for p in params if p.shape.rank > d]
            if not ranked or ranked[0].shape.dims[d] < 2:
                continue
            batch = ranked[0].shape.dims[d]
            carriers = {p.attrs["parameter_number"]: d for p in ranked if p.shape.dims[d] == batch}
            try:
                return analyze(module.entry, carriers, batch)
            except UnsplittableError:
                continue
        return None


class _Rewriter:
    """Clones of the per-row instructions for the two halves (see ``_rewrite``)."""

    def __init__(self, module: Module, plan: BatchDims) -> None:
        self.module, self.plan = module, plan
        b = plan.batch
        self.rows = ((0, (b + 1) // 2), ((b + 1) // 2, b))
        self.used = {i.name for c in module.all_computations() for i in c.instructions}
        self.clones: tuple[dict, dict] = ({}, {})
        self.slices: dict[tuple[int, int, int], Instruction] = {}

    def fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self.used:
            k += 1
            name = f"{base}.{k}"
        self.used.add(name)
        return name

    def rows_of(self, value: Instruction, dim: int, h: int, out: list[Instruction]) -> Instruction:
        """``value``'s rows of half ``h`` along ``dim`` (a slice, emitted into ``out`` once)."""
        key = (id(value), dim, h)
        if key not in self.slices:
            unit = value.shape.dims[dim] // self.plan.batch
            lo, hi = (r * unit for r in self.rows[h])
            spans = tuple((lo, hi, 1) if i == dim else (0, n, 1) for i, n in enumerate(value.shape.dims))
            dims = tuple(hi - lo if i == dim else n for i, n in enumerate(value.shape.dims))
            s = Instruction(self.fresh(f"{value.name}.h{h}"), "slice", value.shape.with_dims(dims), [value],
                            {"slice": spans}, location=value.location)
            self.slices[key] = s
            out.append(s)
        return self.slices[key]

    def clone(self, inst: Instruction, h: int, out: list[Instruction]) -> Instruction:
        dims = self.plan.dims
        d, u = dims[inst]
        ops = []
        for k, o in enumerate(inst.operands):
            if dims[o] is not None:
                ops.append(self.clones[h][id(o)])
                continue
            dim = needs_rows(inst, k, (d, u), dims)
            ops.append(o if dim is None else self.rows_of(o, dim, h, out))
        n = self.rows[h][1] - self.rows[h][0]
        attrs = dict(inst.attrs)
        if inst.opcode in ("slice", "dynamic-slice"):
            di, ui = dims[inst.operands[0]]
            if inst.opcode == "slice":
                attrs["slice"] = tuple((0, n * ui, 1) if i == di else s for i, s in enumerate(attrs["slice"]))
            else:
                attrs["dynamic_slice_sizes"] = tuple(n * ui if i == di else s
                                                     for i, s in enumerate(attrs["dynamic_slice_sizes"]))
        if inst.opcode == "all-reduce":
            attrs["backend_config"] = {**attrs.get("backend_config", {}), SPLIT_KEY: h}
        shape = inst.shape.with_dims(tuple(n * u if i == d else s for i, s in enumerate(inst.shape.dims)))
        new = Instruction(self.fresh(f"{inst.name}.h{h}"), inst.opcode, shape, ops, attrs, inst.sharding,
                          inst.stream_id, inst.location)
        self.clones[h][id(inst)] = new
        out.append(new)
        return new


def _rewrite(module: Module, plan: BatchDims) -> None:
    """Replace the entry computation of ``module`` by its two interleaved halves (module docstring)."""
    comp, dims = module.entry, plan.dims
    rw = _Rewriter(module, plan)
    root = comp.root
    outputs = root.operands if root.opcode == "tuple" else [root]
    shared, per_row = [], []
    for inst in comp.instructions:
        if inst is root and root.opcode == "tuple":
            continue
        (per_row if dims[inst] is not None and inst.opcode != "parameter" else shared).append(inst)
    level: dict[int, int] = {}
    for inst in per_row:
        level[id(inst)] = max((level.get(id(o), 0) + (o.opcode == "all-reduce") for o in inst.operands
                               if dims[o] is not None and o.opcode != "parameter"), default=0)
    body: list[Instruction] = []
    for inst in comp.instructions:  # per-call parameters: their halves are slices (views)
        if inst.opcode == "parameter" and dims[inst] is not None:
            for h in (0, 1):
                rw.clones[h][id(inst)] = rw.rows_of(inst, dims[inst][0], h, body)
    for lvl in range(max(level.values(), default=-1) + 1):
        for h in (0, 1):
            for inst in per_row:
                if level[id(inst)] == lvl:
                    rw.clone(inst, h, body)
    joined = [_join(rw, o, body) if dims[o] is not None else o for o in outputs]
    if root.opcode == "tuple":
        new_root = Instruction(root.name, "tuple", Shape.tuple([j.shape for j in joined]), joined,
                               dict(root.attrs), root.sharding, root.stream_id, root.location)
        body.append(new_root)
    else:
        new_root = joined[0]
    comp.instructions = [*shared, *body]
    comp.root = new_root
    comp.remove_dead()


def _join(rw: _Rewriter, out: Instruction, body: list[Instruction]) -> Instruction:
    """The output ``out`` as the concatenation of its halves along its batch dim."""
    d, _ = rw.plan.dims[out]
    halves = [rw.clones[h][id(out)] for h in (0, 1)]
    cat = Instruction(rw.fresh(f"{out.name}.joined"), "concatenate", out.shape, halves, {"dimensions": (d,)},
                      out.sharding, out.stream_id, out.location)
    body.append(cat)
    return cat
