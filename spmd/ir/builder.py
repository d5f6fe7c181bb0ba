"""A builder that appends HLO-lite instructions with inferred shapes, and ``clone_module``.

``Builder`` creates instructions with fresh module-unique names, at the end
of a computation or before an anchor instruction (``insert_before``) so that
passes can rewrite in place; shapes come from ``infer_shape``
(``spmd.ir.shape_inference``, re-exported here). ``clone_module``
deep-copies a module.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from spmd.ir.hlo import BINARY_OPCODES, DTYPES, UNARY_OPCODES, Computation, Instruction, Module, Shape, hlo_dtype
from spmd.ir.shape_inference import INT_DTYPES, infer_shape

__all__ = ["Builder", "clone_module", "infer_shape"]


# ----------------------------------------------------------------------------- names
class NameSet:
    """Module-wide used names (instructions and computations); ``fresh(base)`` reserves a new one."""

    def __init__(self, module: Module) -> None:
        self.used: set[str] = set()
        self.next: dict[str, int] = {}
        self.sync(module)

    @staticmethod
    def count(module: Module) -> int:
        comps = module.all_computations()
        return len(comps) + sum(len(c.instructions) for c in comps)

    def sync(self, module: Module) -> None:
        for c in module.all_computations():
            self.used.add(c.name)
            self.used.update(i.name for i in c.instructions)
        self.expected = self.count(module)

    def fresh(self, base: str) -> str:
        if base not in self.used:
            self.used.add(base)
            return base
        k = self.next.get(base, 1)
        while f"{base}.{k}" in self.used:
            k += 1
        self.next[base] = k + 1
        name = f"{base}.{k}"
        self.used.add(name)
        return name


_REGISTRY: weakref.WeakKeyDictionary[Module, NameSet] = weakref.WeakKeyDictionary()


def _names_for(module: Module) -> NameSet:
    names = _REGISTRY.get(module)
    if names is None:
        names = _REGISTRY[module] = NameSet(module)
    elif names.expected != NameSet.count(module):
        names.sync(module)  # edited by hand since: pick up its names
    return names


def _dtype_name(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return hlo_dtype(dtype)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or a torch.dtype, got {dtype!r}")
    return dtype


def _identity(kind: str, dtype: str) -> float | int | bool:
    if kind == "add":
        return False if dtype == "pred" else 0
    if dtype == "pred":
        return kind == "minimum"
    if dtype in INT_DTYPES:
        info = torch.iinfo(DTYPES[dtype])
        return info.min if kind == "maximum" else info.max
    return -math.inf if kind == "maximum" else math.inf


class _InsertionScope:
    """Returned by ``Builder.insert_before``; as a context manager it restores the previous point."""

    def __init__(self, builder: Builder, previous: Instruction | None) -> None:
        self.builder, self.previous = builder, previous

    def __enter__(self) -> Builder:
        return self.builder

    def __exit__(self, *exc: object) -> None:
        self.builder._set_anchor(self.previous)


class Builder:
    """Appends instructions with inferred shapes and fresh module-unique names.

    ``Builder(module, computation)`` appends to ``computation`` (default: the
    entry). ``insert_before(anchor)`` switches to inserting just before
    ``anchor`` (also usable as ``with b.insert_before(x): ...``);
    ``append_at_end()`` switches back. Names are ``base``, ``base.1``, ... with
    O(1) generation per name; the used-name set is shared by every builder of
    the module and re-synchronised when instructions were added by hand. Every
    method raises ValueError (from ``infer_shape``) for inconsistent operands.
    """

    def __init__(self, module: Module, computation: Computation | None = None) -> None:
        self.module = module
        self.computation = module.entry if computation is None else computation
        self._names = _names_for(module)
        self._anchor: Instruction | None = None
        self._index = 0

    @staticmethod
    def new_computation(module: Module, name: str) -> Builder:
        """A builder of a new empty computation (fresh name from ``name``) appended to module.computations."""
        comp = Computation(_names_for(module).fresh(name))
        module.computations.append(comp)
        _names_for(module).expected += 1
        return Builder(module, comp)

    # -- insertion point
    def insert_before(self, anchor: Instruction) -> _InsertionScope:
        previous = self._anchor
        self._set_anchor(anchor)
        return _InsertionScope(self, previous)

    def append_at_end(self) -> None:
        self._set_anchor(None)

    def _set_anchor(self, anchor: Instruction | None) -> None:
        self._anchor = anchor
        if anchor is not None:
            self._index = self._find(anchor)

    def _find(self, anchor: Instruction) -> int:
        for k, inst in enumerate(self.computation.instructions):
            if inst is anchor:
                return k
        raise ValueError(f"anchor %{anchor.name} is not in computation %{self.computation.name}")

    def fresh_name(self, base: str) -> str:
        """A module-unique name derived from ``base``; it is reserved."""
        return self._names.fresh(base)

    # -- generic
    def add(self, opcode: str, operands: Sequence[Instruction] = (), attrs: dict[str, Any] | None = None, *,
            shape: Shape | None = None, name: str | None = None, **fields: Any) -> Instruction:
        """Create ``opcode(operands)`` with ``attrs`` at the insertion point and return it.

        ``shape`` is needed where ``infer_shape`` needs it; given elsewhere it
        must equal the inferred shape (dot: it sets the result dtype).
        ``fields`` go to Instruction (sharding, stream_id, location).
        """
        attrs = dict(attrs or {})
        inferred = infer_shape(opcode, [o.shape for o in operands], attrs, shape=shape,
                               num_partitions=self.module.num_partitions)
        if shape is not None and shape != inferred:
            raise ValueError(f"{opcode}: shape {shape} differs from the inferred {inferred}")
        inst = Instruction(self.fresh_name(name or opcode), opcode, inferred, list(operands), attrs, **fields)
        insts = self.computation.instructions
        if self._anchor is None:
            insts.append(inst)
        else:
            if self._index >= len(insts) or insts[self._index] is not self._anchor:
                self._index = self._find(self._anchor)
            insts.insert(self._index, inst)
            self._index += 1
        self._names.expected += 1
        return inst

    def set_root(self, inst: Instruction) -> Instruction:
        self.computation.root = inst
        return inst

    # -- leaves
    def param(self, shape: Shape, name: str | None = None, number: int | None = None, **fields: Any) -> Instruction:
        """A parameter; ``number`` defaults to the count of existing parameters."""
        if number is None:
            number = sum(1 for i in self.computation.instructions if i.opcode == "parameter")
        return self.add("parameter", (), {"parameter_number": number}, shape=shape, name=name or "param", **fields)

    def constant(self, value: Any, dtype: str | torch.dtype | None = None, name: str | None = None) -> Instruction:
        """A constant from a tensor, Python scalar or nested list (a CPU copy is stored)."""
        t = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
        if dtype is not None:
            t = t.to(DTYPES[_dtype_name(dtype)])
        return self.add("constant", (), {"literal": t}, name=name)

    def iota(self, shape: Shape, dimension: int, name: str | None = None) -> Instruction:
        return self.add("iota", (), {"iota_dimension": dimension}, shape=shape, name=name)

    def partition_id(self, name: str | None = None) -> Instruction:
        return self.add("partition-id", name=name)

    # -- elementwise
    def unary(self, op: str, x: Instruction, name: str | None = None) -> Instruction:
        if op not in UNARY_OPCODES or op == "convert":
            raise ValueError(f"op must be a unary opcode other than convert, got {op!r}")
        return self.add(op, [x], name=name)

    def binary(self, op: str, a: Instruction, b: Instruction, name: str | None = None) -> Instruction:
        if op not in BINARY_OPCODES or op == "compare":
            raise ValueError(f"op must be a binary opcode other than compare, got {op!r}")
        return self.add(op, [a, b], name=name)

    def compare(self, a: Instruction, b: Instruction, direction: str, name: str | None = None) -> Instruction:
        return self.add("compare", [a, b], {"direction": direction}, name=name)

    def select(self, pred: Instruction, on_true: Instruction, on_false: Instruction, name: str | None = None):
        return self.add("select", [pred, on_true, on_false], name=name)

    def clamp(self, lo: Instruction, x: Instruction, hi: Instruction, name: str | None = None) -> Instruction:
        return self.add("clamp", [lo, x, hi], name=name)

    def convert(self, x: Instruction, dtype: str | torch.dtype, name: str | None = None) -> Instruction:
        return self.add("convert", [x], shape=x.shape.with_dtype(_dtype_name(dtype)), name=name)

    # -- shape ops
    def broadcast(self, x: Instruction, dims: Sequence[int], dimensions: Sequence[int], name: str | None = None):
        """Broadcast ``x`` to ``x.dtype[dims]``; operand dim i becomes output dim dimensions[i]."""
        return self.add("broadcast", [x], {"dimensions": tuple(dimensions)}, shape=x.shape.with_dims(tuple(dims)),
                        name=name)

    def reshape(self, x: Instruction, dims: Sequence[int], name: str | None = None) -> Instruction:
        return self.add("reshape", [x], shape=x.shape.with_dims(tuple(dims)), name=name)

    def transpose(self, x: Instruction, dimensions: Sequence[int], name: str | None = None) -> Instruction:
        return self.add("transpose", [x], {"dimensions": tuple(dimensions)}, name=name)

    def slice(self, x: Instruction, starts: Sequence[int], limits: Sequence[int],
              strides: Sequence[int] | None = None, name: str | None = None) -> Instruction:
        strides = strides if strides is not None else [1] * len(starts)
        if not len(starts) == len(limits) == len(strides) == x.shape.rank:
            raise ValueError(f"slice: starts, limits, strides need {x.shape.rank} entries each, got "
                             f"{len(starts)}, {len(limits)}, {len(strides)}")
        return self.add("slice", [x], {"slice": tuple(zip(starts, limits, strides, strict=True))}, name=name)

    def concatenate(self, operands: Sequence[Instruction], dim: int, name: str | None = None) -> Instruction:
        return self.add("concatenate", operands, {"dimensions": (dim,)}, name=name)

    def pad(self, x: Instruction, value: Instruction, padding: Sequence[tuple[int, int, int]], name: str | None = None):
        """Pad with ``padding`` = (lo, hi, interior) per dim."""
        return self.add("pad", [x, value], {"padding": tuple(tuple(p) for p in padding)}, name=name)

    def dot(self, a: Instruction, b: Instruction, lhs_contracting: Sequence[int], rhs_contracting: Sequence[int],
            lhs_batch: Sequence[int] = (), rhs_batch: Sequence[int] = (), dtype: str | torch.dtype | None = None,
            name: str | None = None) -> Instruction:
        """DotGeneral; empty batch dims are left out of attrs (as XLA prints them)."""
        attrs: dict[str, Any] = {}
        if lhs_batch or rhs_batch:
            attrs.update(lhs_batch_dims=tuple(lhs_batch), rhs_batch_dims=tuple(rhs_batch))
        attrs.update(lhs_contracting_dims=tuple(lhs_contracting), rhs_contracting_dims=tuple(rhs_contracting))
        shape = None
        if dtype is not None:
            shape = infer_shape("dot", [a.shape, b.shape], attrs).with_dtype(_dtype_name(dtype))
        return self.add("dot", [a, b], attrs, shape=shape, name=name)

    def scalar_computation(self, kind: str, dtype: str) -> Computation:
        """The computation ``%{kind}.{dtype}`` (a, b) -> kind(a, b), created once per module."""
        if kind not in ("add", "maximum", "minimum", "multiply"):
            raise ValueError(f"kind must be add, maximum, minimum or multiply, got {kind!r}")
        cname = f"{kind}.{dtype}"
        for comp in self.module.computations:
            if comp.name == cname:
                return comp
        b = Builder.new_computation(self.module, cname)
        lhs = b.param(Shape(dtype, ()), name=f"{cname}.lhs")
        rhs = b.param(Shape(dtype, ()), name=f"{cname}.rhs")
        b.set_root(b.add(kind, [lhs, rhs], name=f"{cname}.out"))
        return b.computation

    def reduce(self, x: Instruction, dims: Sequence[int], kind: str = "add", name: str | None = None) -> Instruction:
        """Reduce ``dims`` of ``x`` with kind in add/maximum/minimum (init: the identity)."""
        comp = self.scalar_computation(kind, x.shape.dtype)
        init = self.constant(_identity(kind, x.shape.dtype), x.shape.dtype)
        return self.add("reduce", [x, init], {"dimensions": tuple(dims), "to_apply": comp}, name=name)

    def gather(self, x: Instruction, indices: Instruction, *, offset_dims: Sequence[int],
               collapsed_slice_dims: Sequence[int], start_index_map: Sequence[int], index_vector_dim: int,
               slice_sizes: Sequence[int], name: str | None = None) -> Instruction:
        attrs = {"offset_dims": tuple(offset_dims), "collapsed_slice_dims": tuple(collapsed_slice_dims),
                 "start_index_map": tuple(start_index_map), "index_vector_dim": index_vector_dim,
                 "slice_sizes": tuple(slice_sizes)}
        return self.add("gather", [x, indices], attrs, name=name)

    def dynamic_slice(self, x: Instruction, starts: Sequence[Instruction], sizes: Sequence[int],
                      name: str | None = None) -> Instruction:
        return self.add("dynamic-slice", [x, *starts], {"dynamic_slice_sizes": tuple(sizes)}, name=name)

    def dynamic_update_slice(self, x: Instruction, update: Instruction, starts: Sequence[Instruction],
                             name: str | None = None) -> Instruction:
        return self.add("dynamic-update-slice", [x, update, *starts], name=name)

    def custom_call(self, target: str, operands: Sequence[Instruction], shape: Shape,
                    config: dict[str, Any] | None = None, name: str | None = None) -> Instruction:
        attrs: dict[str, Any] = {"custom_call_target": target}
        if config is not None:
            attrs["backend_config"] = dict(config)
        return self.add("custom-call", operands, attrs, shape=shape, name=name)

    # -- collectives (replica_groups: partition ids; empty = all devices)
    def all_gather(self, x: Instruction, dim: int, replica_groups: Sequence[Sequence[int]], name: str | None = None):
        return self.add("all-gather", [x], {"dimensions": (dim,), "replica_groups": _groups(replica_groups)},
                        name=name)

    def reduce_scatter(self, x: Instruction, dim: int, replica_groups: Sequence[Sequence[int]],
                       kind: str = "add", name: str | None = None) -> Instruction:
        attrs = {"dimensions": (dim,), "to_apply": self.scalar_computation(kind, x.shape.dtype),
                 "replica_groups": _groups(replica_groups)}
        return self.add("reduce-scatter", [x], attrs, name=name)

    def all_reduce(self, x: Instruction, replica_groups: Sequence[Sequence[int]], kind: str = "add",
                   name: str | None = None) -> Instruction:
        attrs = {"to_apply": self.scalar_computation(kind, x.shape.dtype), "replica_groups": _groups(replica_groups)}
        return self.add("all-reduce", [x], attrs, name=name)

    def all_to_all(self, x: Instruction, split_dimension: int, concat_dimension: int,
                   replica_groups: Sequence[Sequence[int]], name: str | None = None) -> Instruction:
        attrs = {"replica_groups": _groups(replica_groups), "split_dimension": split_dimension,
                 "concat_dimension": concat_dimension}
        return self.add("all-to-all", [x], attrs, name=name)

    def collective_permute(self, x: Instruction, pairs: Sequence[tuple[int, int]], name: str | None = None):
        return self.add("collective-permute", [x], {"source_target_pairs": _groups(pairs)}, name=name)

    # -- tuples
    def tuple(self, operands: Sequence[Instruction], name: str | None = None) -> Instruction:
        return self.add("tuple", operands, name=name)

    def get_tuple_element(self, t: Instruction, index: int, name: str | None = None) -> Instruction:
        return self.add("get-tuple-element", [t], {"index": index}, name=name)


def _groups(groups: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(i) for i in g) for g in groups)


def clone_module(m: Module) -> Module:
    """A deep copy of ``m``: new computations and instructions (same names), copied attrs.

    Shardings, shapes and locations are immutable and shared; literals are
    cloned; to_apply/calls point at the copies of the called computations.
    """
    comp_map: dict[int, Computation] = {id(c): Computation(c.name) for c in m.all_computations()}
    for comp in m.all_computations():
        new = comp_map[id(comp)]
        inst_map: dict[int, Instruction] = {}
        for inst in comp.instructions:
            attrs = {}
            for k, v in inst.attrs.items():
                if isinstance(v, Computation):
                    v = comp_map.get(id(v), v)
                elif isinstance(v, torch.Tensor):
                    v = v.clone()
                elif isinstance(v, (dict, list)):
                    v = copy.deepcopy(v)
                attrs[k] = v
            ops = [inst_map.get(id(o), o) for o in inst.operands]
            inst_map[id(inst)] = Instruction(inst.name, inst.opcode, inst.shape, ops, attrs, inst.sharding,
                                             inst.stream_id, inst.location)
        new.instructions = [inst_map[id(i)] for i in comp.instructions]
        new.root = inst_map.get(id(comp.root), comp.root) if comp.root is not None else None
    return Module(m.name, comp_map[id(m.entry)], [comp_map[id(c)] for c in m.computations], m.mesh, m.is_partitioned)
