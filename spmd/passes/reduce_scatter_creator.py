"""reduce-scatter-creator: an all-reduce whose result each device only slices to its own shard is a reduce-scatter.

The partitioner resolves a partial value that a sharded consumer reads by all-reducing it and
then dynamic-slicing the device's shard, often with a replicated elementwise step between (the
bias add of a row-parallel linear layer whose output is sequence-parallel). As XLA's
ReduceScatterCreator (xla/service/gpu/transforms/reduce_scatter_creator.cc, with
``spmd::MatchReduceScatter``) does, ``dynamic-slice(f(all-reduce(x), b...))`` with per-device
offsets equal to the device's shard of one dim becomes ``f(reduce-scatter(x), dynamic-slice(b)...)``:
half the bytes, and a dot feeding the all-reduce now feeds a reduce-scatter, which
``windowed-einsum`` decomposes. Before (2 devices)::

    %ar = f32[16,16] all-reduce(%mm), to_apply=%add, replica_groups={{0,1}}
    %y = f32[16,16] add(%ar, %bias.b)
    %ds = f32[8,16] dynamic-slice(%y, %off, %zero), dynamic_slice_sizes={8,16}   # %off = pid * 8

after::

    %ds.rs = f32[8,16] reduce-scatter(%mm), dimensions={0}, to_apply=%add, replica_groups={{0,1}}
    %ds.in1 = f32[8,16] dynamic-slice(%bias.b, %off, %zero), dynamic_slice_sizes={8,16}
    %ds = f32[8,16] add(%ds.rs, %ds.in1)

``f`` is a chain of elementwise ops and reshapes (the ``[B*S, H]`` → ``[B, S, H]`` view of a
linear layer's output), each the only reader of the previous one (the all-reduce too); the
reduce-scatter reads the all-reduce's operand reshaped to the sliced value's dims, and the
elementwise ops' other operands are reshaped and sliced the same way. The offsets are checked by evaluating them
on every device (they may depend on partition-id and constants only): along one dim, device
``g[k]`` of each replica group ``g`` must start at ``k * size`` with ``size * P`` the dim's
length; every other start must be 0 on every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.builder import NameSet
from spmd.ir.hlo import ELEMENTWISE_OPCODES, Computation, Instruction, Module, ancestor_ids
from spmd.passes.windowed_einsum import stable_toposort

_CHAIN = ELEMENTWISE_OPCODES | {"reshape"}  # ops between the all-reduce and the slice that commute with both


@dataclass(frozen=True)
class ReduceScatterCreator:
    """The reduce-scatter-creator pass (see the module docstring). ``enabled=False`` leaves the module as is."""

    name: ClassVar[str] = "reduce-scatter-creator"
    enabled: bool = True

    def run(self, module: Module) -> Module:
        if not self.enabled or not module.is_partitioned:
            return module
        comp = module.entry
        users = comp.users()
        names = NameSet(module)
        changed = False
        for ds in list(comp.instructions):
            match = _match(ds, users, comp, module)
            if match is None:
                continue
            ar, chain, dim = match
            _rewrite(comp, ds, ar, chain, dim, names)
            users, changed = comp.users(), True
        if changed:
            comp.instructions = stable_toposort(comp.instructions)
        return module


def _match(ds: Instruction, users, comp: Computation, module: Module):
    """(the all-reduce, the elementwise chain from it to ``ds``, the scattered dim) or None."""
    if ds.opcode != "dynamic-slice" or ds.shape.is_tuple:
        return None
    chain: list[Instruction] = []
    cur = ds.operands[0]
    while (cur.opcode in _CHAIN and users[cur] == [chain[-1] if chain else ds] and cur is not comp.root
           and not cur.shape.is_tuple):
        chain.append(cur)
        ars = [o for o in cur.operands if o.opcode == "all-reduce"]
        inner = [o for o in cur.operands if o.opcode in _CHAIN and users[o] == [cur]]
        if len(ars) + len(inner) == 0 or (not ars and len(inner) > 1):
            return None
        cur = ars[0] if ars else inner[0]
    ar = cur
    reader = chain[-1] if chain else ds
    if ar.opcode != "all-reduce" or users[ar] != [reader] or ar is comp.root or len(ar.operands) != 1:
        return None
    if reader.operands.count(ar) != 1:
        return None
    reducer = ar.attrs.get("to_apply")
    if reducer is not None and reducer.root.opcode not in ("add", "maximum", "minimum", "multiply"):
        return None
    if ar.attrs.get("backend_config"):
        return None
    dim = _scatter_dim(ds, ar, comp, module)
    return None if dim is None else (ar, chain[::-1], dim)


def _scatter_dim(ds: Instruction, ar: Instruction, comp: Computation, module: Module) -> int | None:
    """The dim ``ds`` cuts into the devices' shards of ``ar``'s replica groups, else None."""
    n = module.num_partitions
    groups = tuple(tuple(g) for g in (ar.attrs.get("replica_groups") or (tuple(range(n)),)))
    p = len(groups[0])
    if p < 2 or any(len(g) != p for g in groups):
        return None
    full, part = ds.operands[0].shape.dims, ds.shape.dims
    cut = [d for d in range(len(full)) if full[d] != part[d]]
    if len(cut) != 1 or full[cut[0]] != p * part[cut[0]]:
        return None
    d, size = cut[0], part[cut[0]]
    starts = _evaluate(ds.operands[1:], comp, module)
    if starts is None:
        return None
    for g in groups:
        for k, dev in enumerate(g):
            want = [k * size if j == d else 0 for j in range(len(full))]
            if [int(s[dev]) for s in starts] != want:
                return None
    return d


def _evaluate(values: list[Instruction], comp: Computation, module: Module) -> list[list] | None:
    """Each of ``values`` on every device, or None if one depends on something but partition-id and constants."""
    from spmd.ir.evaluate import evaluate_spmd
    from spmd.ir.hlo import Shape

    anc = ancestor_ids(values)
    insts = [i for i in comp.instructions if id(i) in anc]
    if any(i.opcode not in ("partition-id", "constant", "convert", "reshape", "dynamic-slice", "slice", "add",
                            "subtract", "multiply", "divide", "remainder", "tuple") for i in insts):
        return None
    root = Instruction("starts.out", "tuple", Shape.tuple([v.shape for v in values]), list(values))
    sub = Module("starts", Computation("starts", [*insts, root], root), [], module.mesh, True)
    try:
        out = evaluate_spmd(sub, [[] for _ in range(module.num_partitions)])
    except Exception:  # an index expression the interpreter cannot run: leave the site alone
        return None
    return [[t.item() for t in per_value] for per_value in out]


def _rewrite(comp: Computation, ds: Instruction, ar: Instruction, chain: list[Instruction], dim: int,
             names: NameSet) -> None:
    """Reduce-scatter ``ar``'s operand (reshaped to ``ds``'s operand dims) and redo the elementwise ops
    of ``chain`` on the shard, their other operands reshaped the same way and dynamic-sliced like ``ds``."""
    full = ds.operands[0].shape.dims
    new: list[Instruction] = []

    def to_full(x: Instruction, base: str) -> Instruction:
        if x.shape.dims == full:
            return x
        r = Instruction(names.fresh(base), "reshape", x.shape.with_dims(full), [x])
        new.append(r)
        return r

    attrs = {k: v for k, v in ar.attrs.items() if k not in ("channel_id", "backend_config")}
    attrs["dimensions"] = (dim,)
    x = to_full(ar.operands[0], f"{ds.name}.operand")
    rs = Instruction(names.fresh(f"{ds.name}.rs"), "reduce-scatter", ds.shape.with_dtype(ar.shape.dtype), [x], attrs,
                     location=ar.location)
    new.append(rs)
    prev, cur = ar, rs
    for k, op in enumerate(chain):
        if op.opcode == "reshape":
            prev = op
            continue
        operands = []
        for o in op.operands:
            if o is prev:
                operands.append(cur)
                continue
            of = to_full(o, f"{ds.name}.in{k}.full")
            sliced = Instruction(names.fresh(f"{ds.name}.in{k}"), "dynamic-slice", ds.shape.with_dtype(o.shape.dtype),
                                 [of, *ds.operands[1:]], {"dynamic_slice_sizes": ds.shape.dims})
            new.append(sliced)
            operands.append(sliced)
        nxt = Instruction(names.fresh(f"{op.name}.shard"), op.opcode, ds.shape.with_dtype(op.shape.dtype), operands,
                          dict(op.attrs), location=op.location)
        new.append(nxt)
        prev, cur = op, nxt
    k = comp.instructions.index(ds)
    comp.instructions[k:k] = new
    comp.replace_all_uses(ds, cur)
    for dead in (ds, *chain[::-1], ar):
        comp.instructions.remove(dead)
    cur.name, cur.sharding = ds.name, ds.sharding
