"""spmd-partition: rewrite a sharded global module into the one per-device program.

For every instruction (in order) the partitioner asks ``sharding_rules.plan`` for the operand
shardings under which the op can run locally, reshards the operands to them
(``spmd.passes.reshard``), emits the local op on padded shard shapes, and reshards the local
result to the instruction's own sharding. This is GSPMD's recursive partitioning
(Xu et al. 2021, arXiv:2105.04663 §3; XLA ``xla/service/spmd/spmd_partitioner.cc``,
``dot_handler.cc``). ``Sharding`` custom calls become a reshard and disappear. Padding rows
(dims that do not divide their axes) have unspecified contents; they are masked with the op's
identity before a reduce over them or a dot contracting them.

Example (mesh {tp=4}; Megatron MLP, out replicated)::

    before:
      %h = f32[8,32] dot(%x, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,4]<=[4]}
      %g = f32[8,32] custom-call(%h), custom_call_target="gelu", sharding={devices=[1,4]<=[4]}
      ROOT %y = f32[8,16] dot(%g, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={replicated}
    after:
      %h = f32[8,8] dot(%x, %w1), ...
      %g = f32[8,8] custom-call(%h), custom_call_target="gelu"
      %y = f32[8,16] dot(%g, %w2), ...                      (partial over tp)
      ROOT %all-reduce = f32[8,16] all-reduce(%y), replica_groups={{0,1,2,3}}, to_apply=%add.f32

Parameters keep their global ``sharding`` (shapes become shard shapes); the root carries its
global sharding (a tuple root's elements carry theirs) and is never partial unless asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.hlo import ASYNC_DONE_OPCODES, ASYNC_START_OPCODES, COLLECTIVE_OPCODES, Computation, Instruction, Module
from spmd.ir.sharding import TensorSharding
from spmd.passes.partition_index import partition_dus, partition_gather, partition_scatter
from spmd.passes.partition_iota import partition_iota
from spmd.passes.partition_scan import partition_custom_call
from spmd.passes.propagate_sharding import PropagateSharding
from spmd.passes.reshard import IDENTITY, Emitter, local_shape, mask_padding, normalize, reshard
from spmd.passes.sharding_rules import HALF_FLOATS, Plan, dot_dims, plan, reduce_kind

_NOT_ALLOWED = COLLECTIVE_OPCODES | ASYNC_START_OPCODES | ASYNC_DONE_OPCODES | {"partition-id"}


@dataclass(frozen=True)
class SpmdPartition:
    """The spmd-partition pass (see the module docstring).

    ``run(module)`` returns a new module with ``is_partitioned=True``. Instructions without a
    sharding get one from ``PropagateSharding`` first. ``float32_partial_sums``: a 16-bit dot
    whose contraction is split sums float32 partial products and rounds once (False: 16-bit
    partials summed in 16 bits, as XLA and PyTorch's async tensor parallelism do).
    ``dot_gather_discount`` scales the cost of all-gathering a dot operand when choosing a dot's
    plan (see ``sharding_rules._dot``).
    Raises (from ``run``): ValueError for a partitioned input or one that already contains
    collectives, partition-id or async ops.
    """

    name: ClassVar[str] = "spmd-partition"
    dot_gather_discount: float = 1.0
    float32_partial_sums: bool = True

    def run(self, module: Module) -> Module:
        """Partition ``module`` (see the class docstring)."""
        if module.is_partitioned:
            raise ValueError(f"module {module.name!r}: expected an unpartitioned module, got a partitioned one")
        for inst in module.entry.instructions:
            if inst.opcode in _NOT_ALLOWED:
                raise ValueError(f"%{inst.name}: opcode {inst.opcode!r} is not allowed before spmd-partition")
        if any(i.sharding is None and not i.shape.is_tuple for i in module.entry.instructions):
            module = PropagateSharding(dot_gather_discount=self.dot_gather_discount,
                                       float32_partial_sums=self.float32_partial_sums).run(module)
        entry = Computation(module.entry.name)
        out = Module(module.name, entry, list(module.computations), module.mesh, is_partitioned=True)
        _Partitioner(out, module.entry, self.dot_gather_discount, self.float32_partial_sums).run()
        return out


class _Partitioner:
    """Walks the global entry computation, emitting the local one."""

    def __init__(self, out: Module, src: Computation, gather_discount: float = 1.0,
                 float32_partial_sums: bool = True) -> None:
        self.gather_discount = gather_discount
        self.float32_partial_sums = float32_partial_sums
        self.em = Emitter(out, out.entry)
        self.em._names.used |= {i.name for i in src.instructions}
        self.src = src
        self.mesh = out.mesh
        self.values: dict[int, tuple[Instruction, object]] = {}
        self.reshards: dict[tuple, Instruction] = {}
        self.widened: dict[int, tuple[Instruction, TensorSharding]] = {}  # 16-bit dot -> its float32 sum

    def run(self) -> None:
        for inst in self.src.instructions:
            self.values[id(inst)] = self.visit(inst)
        root = self.src.root
        local, sh = self.values[id(root)]
        if root.opcode == "tuple" or root.shape.is_tuple:
            local = self._final_tuple(root, local, sh)
        else:
            want = root.sharding if root.sharding is not None else sh.with_partial(())
            local = self._reshard(local, sh, want, root)
            local.sharding = want
        self.em.computation.root = local

    # ------------------------------------------------------------------ helpers
    def _reshard(self, x: Instruction, src, dst, inst: Instruction) -> Instruction:
        """``x`` resharded from ``src`` to ``dst``; one value is resharded once however many ops use it."""
        key = (id(x), src, dst)
        hit = self.reshards.get(key)
        if hit is None:
            hit = self.reshards[key] = reshard(self.em, x, src, dst, inst.shape.dims)
        return hit

    def _final_tuple(self, root: Instruction, local: Instruction, shardings) -> Instruction:
        """A root tuple whose elements are not partial and carry their global sharding."""
        elems = []
        for k, (elem, s) in enumerate(zip(local.operands, shardings, strict=False)):
            want = s.with_partial(())
            y = self._reshard(elem, s, want, root.operands[k]) if s != want else elem
            if y.sharding != want:
                y = self.em.emit("copy", y.shape, [y], sharding=want)
            elems.append(y)
        if all(a is b for a, b in zip(elems, local.operands, strict=False)):
            return local
        return self.em.emit("tuple", local.shape.tuple([e.shape for e in elems]), elems, name=root.name + ".out")

    def _emit_local(self, inst: Instruction, operands, result: TensorSharding, attrs=None) -> Instruction:
        shape = local_shape(inst.shape, result, self.mesh) if not inst.shape.is_tuple else inst.shape
        local = Instruction(inst.name, inst.opcode, shape, operands,
                            dict(inst.attrs if attrs is None else attrs), result, location=inst.location)
        self.em.computation.instructions.append(local)
        return local

    # ------------------------------------------------------------------ visit
    def visit(self, inst: Instruction):
        op = inst.opcode
        if op == "parameter":
            s = normalize(inst.sharding, self.mesh)
            return self._emit_local(inst, [], s), s
        if op == "tuple":
            ops = [self.values[id(o)] for o in inst.operands]
            local = self.em.emit("tuple", inst.shape.tuple([x.shape for x, _ in ops]), [x for x, _ in ops],
                                 name=inst.name)
            return local, tuple(s for _, s in ops)
        if op == "get-tuple-element":
            tup, shs = self.values[id(inst.operands[0])]
            k = inst.attrs["index"]
            local = self._emit_local(inst, [tup], shs[k])
            return self._finish(inst, local, shs[k])
        if op == "custom-call" and inst.attrs.get("custom_call_target") == "Sharding":
            x, s = self.values[id(inst.operands[0])]
            want = normalize(inst.sharding, self.mesh)
            return self._reshard(x, s, want, inst), want
        current = [self.values[id(o)][1] for o in inst.operands]
        p = plan(inst, current, normalize(inst.sharding, self.mesh), self.mesh, self.gather_discount)
        ops = [self._reshard(self.values[id(o)][0], c, want, o)
               for o, c, want in zip(inst.operands, current, p.operands, strict=False)]
        handler = _HANDLERS.get(op, _Partitioner._generic)
        local, produced = handler(self, inst, ops, p)
        return self._finish(inst, local, produced)

    def _finish(self, inst: Instruction, local: Instruction, produced: TensorSharding):
        want = normalize(inst.sharding, self.mesh) if inst.sharding is not None else produced
        return self._reshard(local, produced, want, inst), want

    # ------------------------------------------------------------------ per-op handlers
    def _generic(self, inst: Instruction, ops, p: Plan):
        return self._emit_local(inst, ops, p.result), p.result

    def _dot(self, inst: Instruction, ops, p: Plan):
        lb, rb, lc, rc, lf, rf = dot_dims(inst)
        lhs, rhs = inst.operands
        ops = [mask_padding(self.em, ops[0], p.operands[0], lhs.shape.dims, lc, 0.0),
               mask_padding(self.em, ops[1], p.operands[1], rhs.shape.dims, rc, 0.0)]
        if not (self.float32_partial_sums and self.mesh.axes_size(p.result.partial) > 1
                and inst.shape.dtype in HALF_FLOATS):
            return self._emit_local(inst, ops, p.result), p.result
        return self._widened_partial(inst, ops, p.result)

    def _widened_partial(self, inst: Instruction, ops, partial: TensorSharding):
        """A 16-bit dot whose contracting dims are split: each device's partial product stays
        float32 through the reduction and the sum rounds once (as one device's GEMM accumulates
        in float32 and rounds once), instead of every device rounding its term to 16 bits."""
        wide = Instruction(inst.name, inst.opcode, inst.shape.with_dtype("f32"), (), dict(inst.attrs),
                           location=inst.location)
        local = self._emit_local(wide, ops, partial)
        want = normalize(inst.sharding, self.mesh) if inst.sharding is not None else partial
        full = want.with_partial(())
        summed = self._reshard(local, partial, full, inst)
        self.widened[id(inst)] = (summed, full)
        return self.em.emit("convert", summed.shape.with_dtype(inst.shape.dtype), [summed], sharding=full), full

    def _add(self, inst: Instruction, ops, p: Plan):
        """The bias add of a linear / addmm / baddbmm whose 16-bit dot was summed in float32 is added
        in float32 too and rounded once, as ATen adds the bias in the GEMM's float32 epilogue."""
        k = next((k for k, o in enumerate(inst.operands) if id(o) in self.widened and _bias_add(o, inst)), None)
        if k is None or p.result.partial or any(s.partial for s in p.operands):
            return self._generic(inst, ops, p)
        summed, sharding = self.widened[id(inst.operands[k])]
        wide = list(ops)
        wide[k] = self._reshard(summed, sharding, p.operands[k], inst.operands[k])
        wide[1 - k] = self.em.emit("convert", ops[1 - k].shape.with_dtype("f32"), [ops[1 - k]],
                                   sharding=p.operands[1 - k])
        f32 = Instruction(inst.name, "add", inst.shape.with_dtype("f32"), (), {}, location=inst.location)
        local = self._emit_local(f32, wide, p.result)
        return self.em.emit("convert", local.shape.with_dtype(inst.shape.dtype), [local], sharding=p.result), p.result

    def _reduce(self, inst: Instruction, ops, p: Plan):
        kind = reduce_kind(inst)
        x_sh = p.operands[0]
        red = tuple(inst.attrs["dimensions"])
        red_axes = tuple(a for d in red for a in x_sh.dims[d])
        identity = IDENTITY.get(kind)
        if identity is None or not (red_axes or x_sh.partial):
            return self._emit_local(inst, ops, p.result), p.result
        x = mask_padding(self.em, ops[0], x_sh, inst.operands[0].shape.dims, red, identity)
        init = ops[1]
        keep_init = not _is_constant(inst.operands[1], identity)
        if keep_init:
            ops_init = self.em.constant(identity, inst.shape.dtype)
        else:
            ops_init = init
        local = self._emit_local(inst, [x, ops_init], p.result)
        produced = p.result
        if kind != "add":
            order = [a for a in self.mesh.axis_names if a in red_axes]
            local = self.em.emit("all-reduce", local.shape, [local], {
                "replica_groups": self.mesh.groups(tuple(order)),
                "to_apply": self.em.reducer(kind, local.shape.dtype)}, produced)
        if keep_init:
            full = produced.with_partial(())
            local = self._reshard(local, produced, full, inst)
            b = self.em.broadcast_scalar(init, local.shape)
            local = self.em.emit(kind, local.shape, [local, b], sharding=full)
            produced = full
        return local, produced

    def _slice(self, inst: Instruction, ops, p: Plan):
        local = p.operands[0].shard_dims(inst.operands[0].shape.dims, self.mesh)
        pieces = zip(inst.attrs["slice"], local, strict=True)
        attrs = {**inst.attrs, "slice": tuple((0, n, 1) if p.operands[0].dims[d] else tuple(sl)
                                              for d, (sl, n) in enumerate(pieces))}
        return self._emit_local(inst, ops, p.result, attrs), p.result

    def _dynamic_slice(self, inst: Instruction, ops, p: Plan):
        shape = local_shape(inst.shape, p.result, self.mesh)
        attrs = {**inst.attrs, "dynamic_slice_sizes": shape.dims}
        return self._emit_local(inst, ops, p.result, attrs), p.result


_BIAS_OPS = frozenset({"aten.linear.default", "aten.addmm.default", "aten.baddbmm.default"})


def _bias_add(dot: Instruction, add: Instruction) -> bool:
    """Whether ``add`` adds the bias of the same ATen linear / addmm / baddbmm call as ``dot``."""
    loc = dot.location
    return loc is not None and loc.op_name in _BIAS_OPS and add.location == loc


def _is_constant(inst: Instruction, value) -> bool:
    """Whether ``inst`` is a scalar constant equal to ``value``."""
    if inst.opcode != "constant":
        return False
    lit = inst.attrs["literal"]
    return lit.numel() == 1 and float(lit.reshape(()).item()) == float(value)


_HANDLERS = {
    "iota": partition_iota,
    "custom-call": partition_custom_call,
    "dot": _Partitioner._dot,
    "add": _Partitioner._add,
    "reduce": _Partitioner._reduce,
    "gather": partition_gather,
    "scatter": partition_scatter,
    "dynamic-update-slice": partition_dus,
    "dynamic-slice": _Partitioner._dynamic_slice,
    "slice": _Partitioner._slice,
}
