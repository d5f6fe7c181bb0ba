"""Instruction emitter for the frontend: appends HLO-lite instructions with their shapes.

Every method computes the result ``Shape`` itself (XLA semantics, see ``spmd.ir.hlo``) and
tags the instruction with the current ``location`` (the ATen op and user file:line being
converted). Methods that would be no-ops (a convert to the same dtype, a reshape to the same
dims, an identity transpose) return their operand unchanged, which keeps the IR compact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from spmd.ir.hlo import Computation, Instruction, Shape, SourceLocation, hlo_dtype
from spmd.ir.sharding import TensorSharding

_REDUCE_IDENTITY = {"add": 0, "multiply": 1, "maximum": -math.inf, "minimum": math.inf, "and": True, "or": False}


class Emitter:
    """Builds the entry computation's instruction list and the reduce computations it calls."""

    def __init__(self) -> None:
        self.instructions: list[Instruction] = []
        self.computations: list[Computation] = []
        self.location = SourceLocation()
        self.base_name = "op"
        self._counts: dict[str, int] = {}
        self._reducers: dict[tuple[str, str], Computation] = {}

    # ------------------------------------------------------------------ basics
    def fresh(self, base: str) -> str:
        """A name unique in the module: ``base``, ``base.1``, ``base.2``, ..."""
        k = self._counts.get(base, 0)
        self._counts[base] = k + 1
        return base if k == 0 else f"{base}.{k}"

    def emit(self, opcode: str, shape: Shape, operands: Sequence[Instruction] = (),
             attrs: dict | None = None, sharding: TensorSharding | None = None) -> Instruction:
        inst = Instruction(self.fresh(self.base_name), opcode, shape, list(operands), attrs,
                           sharding=sharding, location=self.location)
        self.instructions.append(inst)
        return inst

    def parameter(self, number: int, shape: Shape, name: str, label: str = "") -> Instruction:
        """Entry parameter ``number``; ``label`` (e.g. a parameter FQN) is its location's op_name."""
        inst = Instruction(self.fresh(name), "parameter", shape, (), {"parameter_number": number},
                           location=SourceLocation(op_name=label or name))
        self.instructions.append(inst)
        return inst

    def constant(self, value: torch.Tensor) -> Instruction:
        """A constant holding a CPU copy of ``value``."""
        value = value.detach().to("cpu").clone()
        return self.emit("constant", Shape.of(value), (), {"literal": value})

    def scalar(self, value: float | int | bool, dtype: str, dims: Sequence[int] = ()) -> Instruction:
        """Scalar ``value`` of HLO dtype ``dtype`` broadcast to ``dims``."""
        c = self.constant(torch.tensor(value, dtype=Shape(dtype).torch_dtype))
        return self.broadcast(c, tuple(dims), ()) if dims else c

    # ------------------------------------------------------------------ shape ops
    def convert(self, x: Instruction, dtype: str) -> Instruction:
        if x.shape.dtype == dtype:
            return x
        return self.emit("convert", x.shape.with_dtype(dtype), (x,))

    def broadcast(self, x: Instruction, dims: tuple[int, ...], mapping: tuple[int, ...]) -> Instruction:
        """XLA broadcast: operand dim i -> output dim ``mapping[i]``."""
        if tuple(dims) == x.shape.dims and tuple(mapping) == tuple(range(len(dims))):
            return x
        return self.emit("broadcast", x.shape.with_dims(tuple(dims)), (x,), {"dimensions": tuple(mapping)})

    def broadcast_to(self, x: Instruction, dims: Sequence[int]) -> Instruction:
        """NumPy-style broadcast of ``x`` to ``dims`` (trailing dims aligned; size-1 dims stretch)."""
        dims = tuple(dims)
        if x.shape.dims == dims:
            return x
        offset = len(dims) - x.shape.rank
        if offset < 0:
            raise ValueError(f"cannot broadcast {x.shape} to {dims}")
        keep = [i for i, d in enumerate(x.shape.dims) if d == dims[i + offset]]
        for i, d in enumerate(x.shape.dims):
            if d != dims[i + offset] and d != 1:
                raise ValueError(f"cannot broadcast {x.shape} to {dims}")
        x = self.reshape(x, tuple(x.shape.dims[i] for i in keep))
        return self.broadcast(x, dims, tuple(i + offset for i in keep))

    def reshape(self, x: Instruction, dims: Sequence[int]) -> Instruction:
        dims = tuple(dims)
        if x.shape.dims == dims:
            return x
        assert math.prod(dims) == x.shape.numel, (x.shape, dims)
        return self.emit("reshape", x.shape.with_dims(dims), (x,))

    def transpose(self, x: Instruction, perm: Sequence[int]) -> Instruction:
        perm = tuple(perm)
        if perm == tuple(range(len(perm))):
            return x
        return self.emit("transpose", x.shape.with_dims(tuple(x.shape.dims[p] for p in perm)), (x,),
                         {"dimensions": perm})

    def slice(self, x: Instruction, spec: Sequence[tuple[int, int, int]]) -> Instruction:
        """Static slice, ``spec`` = (start, limit, stride) per dim."""
        spec = tuple(tuple(s) for s in spec)
        if all(s == (0, n, 1) for s, n in zip(spec, x.shape.dims, strict=True)):
            return x
        dims = tuple(max(0, -(-(lim - st) // stride)) for st, lim, stride in spec)
        return self.emit("slice", x.shape.with_dims(dims), (x,), {"slice": spec})

    def concatenate(self, xs: Sequence[Instruction], dim: int) -> Instruction:
        if len(xs) == 1:
            return xs[0]
        dims = list(xs[0].shape.dims)
        dims[dim] = sum(x.shape.dims[dim] for x in xs)
        return self.emit("concatenate", xs[0].shape.with_dims(tuple(dims)), xs, {"dimensions": (dim,)})

    def iota(self, dims: Sequence[int], dim: int, dtype: str) -> Instruction:
        return self.emit("iota", Shape(dtype, tuple(dims)), (), {"iota_dimension": dim})

    # ------------------------------------------------------------------ compute ops
    def unary(self, opcode: str, x: Instruction) -> Instruction:
        return self.emit(opcode, x.shape, (x,))

    def binary(self, opcode: str, a: Instruction, b: Instruction) -> Instruction:
        assert a.shape == b.shape, (opcode, a.shape, b.shape)
        return self.emit(opcode, a.shape, (a, b))

    def compare(self, a: Instruction, b: Instruction, direction: str) -> Instruction:
        assert a.shape == b.shape, (a.shape, b.shape)
        return self.emit("compare", a.shape.with_dtype("pred"), (a, b), {"direction": direction})

    def select(self, pred: Instruction, on_true: Instruction, on_false: Instruction) -> Instruction:
        return self.emit("select", on_true.shape, (pred, on_true, on_false))

    def dot(self, a: Instruction, b: Instruction, lhs_batch: Sequence[int], rhs_batch: Sequence[int],
            lhs_contract: Sequence[int], rhs_contract: Sequence[int]) -> Instruction:
        """DotGeneral: result dims = batch, lhs free, rhs free; dtype of ``a``."""
        lb, rb, lc, rc = (tuple(v) for v in (lhs_batch, rhs_batch, lhs_contract, rhs_contract))
        lfree = [d for i, d in enumerate(a.shape.dims) if i not in lb and i not in lc]
        rfree = [d for i, d in enumerate(b.shape.dims) if i not in rb and i not in rc]
        dims = tuple(a.shape.dims[i] for i in lb) + tuple(lfree) + tuple(rfree)
        attrs = {"lhs_contracting_dims": lc, "rhs_contracting_dims": rc}
        if lb:
            attrs = {"lhs_batch_dims": lb, "rhs_batch_dims": rb, **attrs}
        return self.emit("dot", a.shape.with_dims(dims), (a, b), attrs)

    def reducer(self, kind: str, dtype: str) -> Computation:
        """The scalar computation ``%<kind>.<dtype>`` (x, y) -> kind(x, y), created once."""
        key = (kind, dtype)
        if key not in self._reducers:
            name = self.fresh(f"{kind}.{dtype}")
            s = Shape(dtype)
            x = Instruction(f"{name}.x", "parameter", s, (), {"parameter_number": 0})
            y = Instruction(f"{name}.y", "parameter", s, (), {"parameter_number": 1})
            root = Instruction(f"{name}.r", kind, s, (x, y))
            comp = Computation(name, [x, y, root], root)
            self.computations.append(comp)
            self._reducers[key] = comp
        return self._reducers[key]

    def reduce(self, x: Instruction, dims: Sequence[int], kind: str) -> Instruction:
        """Reduce ``x`` over ``dims`` with ``kind`` (add/multiply/maximum/minimum/and/or) from its identity."""
        dims = tuple(sorted(set(dims)))
        if not dims:
            return x
        dtype = x.shape.dtype
        identity = _REDUCE_IDENTITY[kind]
        tdtype = x.shape.torch_dtype
        if isinstance(identity, float) and math.isinf(identity) and not tdtype.is_floating_point:
            info = torch.iinfo(tdtype)
            identity = info.min if identity < 0 else info.max
        init = self.scalar(identity, dtype)
        out_dims = tuple(d for i, d in enumerate(x.shape.dims) if i not in dims)
        return self.emit("reduce", Shape(dtype, out_dims), (x, init),
                         {"dimensions": dims, "to_apply": self.reducer(kind, dtype)})

    def gather_rows(self, table: Instruction, ids: Instruction) -> Instruction:
        """Embedding lookup ``table[ids]``: table ``[V, *rest]``, ids ``[*batch]`` -> ``[*batch, *rest]``."""
        nb = ids.shape.rank
        rest = table.shape.dims[1:]
        attrs = {
            "offset_dims": tuple(range(nb, nb + len(rest))),
            "collapsed_slice_dims": (0,),
            "start_index_map": (0,),
            "index_vector_dim": nb,
            "slice_sizes": (1, *rest),
        }
        return self.emit("gather", table.shape.with_dims(ids.shape.dims + rest), (table, ids), attrs)

    def custom_call(self, target: str, operands: Sequence[Instruction], shape: Shape,
                    config: dict | None = None, sharding: TensorSharding | None = None) -> Instruction:
        attrs = {"custom_call_target": target}
        if config:
            attrs["backend_config"] = dict(config)
        return self.emit("custom-call", shape, operands, attrs, sharding=sharding)

    def tuple(self, xs: Sequence[Instruction]) -> Instruction:
        return self.emit("tuple", Shape.tuple([x.shape for x in xs]), xs)


def dtype_of(t: torch.Tensor | torch.dtype) -> str:
    """HLO dtype name of a tensor or torch dtype (TypeError if unsupported)."""
    return hlo_dtype(t if isinstance(t, torch.dtype) else t.dtype)
