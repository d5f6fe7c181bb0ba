"""HLO-lite: the typed, HLO-shaped IR every compiler stage reads and writes.

A ``Module`` holds computations; a ``Computation`` holds ``Instruction``s in a
valid (def-before-use) order with one root. Shapes and attribute values are
immutable; instructions are identity objects edited through the helpers here.

The meaning of every opcode and the Python type of each attribute are fixed by
``OPCODES`` and ``ATTRIBUTE_TYPES`` below; the printer/parser
(``spmd.ir.text``), verifier, frontend, partitioner and runtime kernels all
follow that one contract. Semantics follow XLA's operation semantics
(https://openxla.org/xla/operation_semantics) unless a note says otherwise.

Example (the text form, see ``spmd.ir.text``)::

    HloModule mlp, num_partitions=4, mesh={tp=4}

    ENTRY %main (x: f32[8,16], w: f32[16,32]) -> f32[8,32] {
      %x = f32[8,16] parameter(0), sharding={replicated}
      %w = f32[16,32] parameter(1), sharding={devices=[1,4]<=[4]}
      ROOT %dot = f32[8,32] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    }
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd.ir.sharding import MeshShape, TensorSharding

# HLO element type name -> torch dtype.
DTYPES: dict[str, torch.dtype] = {
    "pred": torch.bool,
    "s8": torch.int8,
    "s16": torch.int16,
    "s32": torch.int32,
    "s64": torch.int64,
    "u8": torch.uint8,
    "u32": torch.uint32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "f64": torch.float64,
}
TORCH_TO_HLO: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def hlo_dtype(dtype: torch.dtype) -> str:
    """HLO element type name of a torch dtype. Raises TypeError if unsupported."""
    try:
        return TORCH_TO_HLO[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported; expected one of {sorted(map(str, TORCH_TO_HLO))}") from None


@dataclass(frozen=True)
class Shape:
    """An array shape ``dtype[d0,d1,...]`` or a tuple shape ``(s0, s1, ...)``.

    ``dtype`` is an HLO element type name (``"f32"``, ``"bf16"``, ...; see
    ``DTYPES``); ``dims`` are sizes in elements. A tuple shape has
    ``dtype == "tuple"``, ``dims == ()`` and its element shapes in ``tuple_shapes``.
    """

    dtype: str
    dims: tuple[int, ...] = ()
    tuple_shapes: tuple[Shape, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype != "tuple" and self.dtype not in DTYPES:
            raise ValueError(f"unknown element type {self.dtype!r}; expected one of {sorted(DTYPES)}")
        if any((not isinstance(d, int)) or d < 0 for d in self.dims):
            raise ValueError(f"dims must be non-negative ints, got {self.dims}")

    @staticmethod
    def tuple(shapes: tuple[Shape, ...] | list[Shape]) -> Shape:
        """A tuple shape of ``shapes``."""
        return Shape("tuple", (), tuple(shapes))

    @staticmethod
    def of(tensor: torch.Tensor) -> Shape:
        """The shape of a torch tensor."""
        return Shape(hlo_dtype(tensor.dtype), tuple(tensor.shape))

    @property
    def is_tuple(self) -> bool:
        return self.dtype == "tuple"

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def size_bytes(self) -> int:
        if self.is_tuple:
            return sum(s.size_bytes for s in self.tuple_shapes)
        return self.numel * self.itemsize

    def with_dims(self, dims: tuple[int, ...]) -> Shape:
        return Shape(self.dtype, tuple(dims))

    def with_dtype(self, dtype: str) -> Shape:
        return Shape(dtype, self.dims)

    def __str__(self) -> str:
        if self.is_tuple:
            return "(" + ", ".join(str(s) for s in self.tuple_shapes) + ")"
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclass(frozen=True)
class SourceLocation:
    """Where an instruction came from in user code (for error messages)."""

    op_name: str = ""
    source_file: str = ""
    source_line: int = 0


# --------------------------------------------------------------------------- opcodes
# Elementwise opcodes (same shape in and out; operands have equal dims).
UNARY_OPCODES = frozenset({
    "abs", "negate", "exponential", "log", "sqrt", "rsqrt", "tanh", "logistic",
    "erf", "sine", "cosine", "floor", "ceil", "sign", "not", "convert", "copy",
    "log-plus-one", "exponential-minus-one",
})
BINARY_OPCODES = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "power",
    "remainder", "and", "or", "compare",
})
ELEMENTWISE_OPCODES = UNARY_OPCODES | BINARY_OPCODES | frozenset({"select", "clamp"})
COLLECTIVE_OPCODES = frozenset({
    "all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute",
})
ASYNC_START_OPCODES = frozenset({
    "all-gather-start", "all-reduce-start", "collective-permute-start", "async-start",
})
ASYNC_DONE_OPCODES = frozenset({
    "all-gather-done", "all-reduce-done", "collective-permute-done", "async-done",
})

# opcode -> one-line meaning. Every opcode the compiler may produce is here.
OPCODES: dict[str, str] = {
    **{op: "elementwise unary" for op in UNARY_OPCODES},
    **{op: "elementwise binary" for op in BINARY_OPCODES},
    "select": "select(pred, on_true, on_false), elementwise",
    "clamp": "clamp(min, x, max), elementwise",
    "parameter": "entry argument number parameter_number",
    "constant": "literal value (attribute literal, a CPU torch.Tensor)",
    "iota": "iota along iota_dimension",
    "partition-id": "u32[] id of the executing device in the mesh (row-major)",
    "broadcast": "operand dim i -> output dim dimensions[i]",
    "reshape": "row-major reshape",
    "transpose": "output dim i = operand dim dimensions[i]",
    "slice": "static slice with slice=((start, limit, stride), ...)",
    "concatenate": "concatenate operands along dimensions[0]",
    "pad": "pad(operand, value) with padding=((lo, hi, interior), ...)",
    "dot": "batch dims, then lhs free dims, then rhs free dims (XLA DotGeneral)",
    "reduce": "reduce(operand, init) over dimensions with to_apply (add/multiply/maximum/minimum/and/or)",
    "gather": "XLA gather with batching dims; kernels: rows and along forms (spmd.ir.index_shapes)",
    "scatter": "scatter(operand, indices, updates), XLA scatter combining with to_apply (spmd.ir.index_shapes)",
    "dynamic-slice": "dynamic-slice(operand, start0, start1, ...) with dynamic_slice_sizes",
    "dynamic-update-slice": "dynamic-update-slice(operand, update, start0, ...)",
    "custom-call": "custom_call_target names a kernel (spmd.ir.custom_calls)",
    "all-gather": "concatenate shards of replica_groups along dimensions[0]",
    "reduce-scatter": "sum over replica_groups then scatter along dimensions[0]",
    "all-reduce": "sum (to_apply) over replica_groups",
    "all-to-all": "split along split_dimension, exchange in replica_groups, concat along concat_dimension",
    "collective-permute": "send to source_target_pairs targets; non-targets get zeros",
    "all-gather-start": "async all-gather, finished by all-gather-done",
    "all-gather-done": "",
    "all-reduce-start": "async all-reduce, finished by all-reduce-done",
    "all-reduce-done": "",
    "collective-permute-start": "async collective-permute, finished by collective-permute-done",
    "collective-permute-done": "",
    "async-start": "run called computation (calls) on execution stream stream_id",
    "fusion": "run called computation (calls) as one kernel; kind=kLoop (spmd.passes.fuse_elementwise)",
    "async-done": "wait for the async-start operand; result is the called computation's root",
    "tuple": "tuple of operands",
    "get-tuple-element": "element index of a tuple operand",
}

# Attribute name -> Python type of its value. The text codec for each lives in
# spmd.ir.text; an attribute not named here is kept as its raw text (str).
ATTRIBUTE_TYPES: dict[str, str] = {
    "parameter_number": "int",
    "literal": "torch.Tensor (CPU)",
    "iota_dimension": "int",
    "dimensions": "tuple[int, ...]",
    "slice": "tuple[tuple[int, int, int], ...]  # (start, limit, stride) per dim",
    "padding": "tuple[tuple[int, int, int], ...]  # (lo, hi, interior) per dim",
    "lhs_batch_dims": "tuple[int, ...]",
    "rhs_batch_dims": "tuple[int, ...]",
    "lhs_contracting_dims": "tuple[int, ...]",
    "rhs_contracting_dims": "tuple[int, ...]",
    "direction": "str  # EQ NE LT LE GT GE",
    "to_apply": "Computation",
    "calls": "Computation",
    "offset_dims": "tuple[int, ...]",
    "collapsed_slice_dims": "tuple[int, ...]",
    "start_index_map": "tuple[int, ...]",
    "index_vector_dim": "int",
    "slice_sizes": "tuple[int, ...]",
    "operand_batching_dims": "tuple[int, ...]",
    "start_indices_batching_dims": "tuple[int, ...]",
    "update_window_dims": "tuple[int, ...]",
    "inserted_window_dims": "tuple[int, ...]",
    "scatter_dims_to_operand_dims": "tuple[int, ...]",
    "input_batching_dims": "tuple[int, ...]",
    "scatter_indices_batching_dims": "tuple[int, ...]",
    "dynamic_slice_sizes": "tuple[int, ...]",
    "custom_call_target": "str",
    "backend_config": "dict[str, Any]  # JSON object",
    "replica_groups": "tuple[tuple[int, ...], ...]  # partition ids",
    "channel_id": "int",
    "split_dimension": "int",
    "concat_dimension": "int",
    "source_target_pairs": "tuple[tuple[int, int], ...]",
    "index": "int",
}


class Instruction:
    """One HLO instruction: ``%name = shape opcode(operands), attr=value, ...``.

    Fields:
      name: unique within the module, without the leading ``%``.
      opcode: a key of ``OPCODES``.
      shape: the result shape (per-device shard shape after partitioning).
      operands: the instructions this one reads, in order.
      attrs: attribute name -> value, typed as ``ATTRIBUTE_TYPES`` says.
      sharding: the global sharding of the result (before partitioning), or None.
      stream_id: execution stream, 0 = the device's main compute stream; None = unassigned.
      location: where it came from in user code.
    """

    __slots__ = ("name", "opcode", "shape", "operands", "attrs", "sharding", "stream_id", "location")

    def __init__(
        self,
        name: str,
        opcode: str,
        shape: Shape,
        operands: list[Instruction] | tuple[Instruction, ...] = (),
        attrs: dict[str, Any] | None = None,
        sharding: TensorSharding | None = None,
        stream_id: int | None = None,
        location: SourceLocation | None = None,
    ) -> None:
        assert opcode in OPCODES, f"unknown opcode {opcode!r}"
        self.name = name
        self.opcode = opcode
        self.shape = shape
        self.operands = list(operands)
        self.attrs = dict(attrs or {})
        self.sharding = sharding
        self.stream_id = stream_id
        self.location = location

    def called_computations(self) -> list[Computation]:
        return [v for k, v in self.attrs.items() if k in ("to_apply", "calls")]

    def __repr__(self) -> str:
        ops = ", ".join("%" + o.name for o in self.operands)
        return f"<%{self.name} = {self.shape} {self.opcode}({ops})>"


@dataclass(eq=False)
class Computation:
    """An ordered list of instructions with one root.

    ``instructions`` are in a def-before-use order (the schedule, once the
    schedule pass has run); ``parameters`` are the ``parameter`` instructions
    ordered by parameter_number.
    """

    name: str
    instructions: list[Instruction] = field(default_factory=list)
    root: Instruction | None = None

    @property
    def parameters(self) -> list[Instruction]:
        params = [i for i in self.instructions if i.opcode == "parameter"]
        return sorted(params, key=lambda i: i.attrs["parameter_number"])

    def users(self) -> dict[Instruction, list[Instruction]]:
        """Map instruction -> instructions that use it (in order, with repeats)."""
        out: dict[Instruction, list[Instruction]] = {i: [] for i in self.instructions}
        for inst in self.instructions:
            for op in inst.operands:
                out[op].append(inst)
        return out

    def replace_all_uses(self, old: Instruction, new: Instruction) -> None:
        """Make every user of ``old`` (and the root) use ``new`` instead."""
        for inst in self.instructions:
            if inst is not new:
                inst.operands = [new if o is old else o for o in inst.operands]
        if self.root is old:
            self.root = new

    def remove_dead(self) -> None:
        """Drop instructions the root does not reach (parameters are kept)."""
        live: set[int] = set()
        stack = [self.root]
        while stack:
            inst = stack.pop()
            if id(inst) in live:
                continue
            live.add(id(inst))
            stack.extend(inst.operands)
        self.instructions = [i for i in self.instructions if id(i) in live or i.opcode == "parameter"]

    def __iter__(self) -> Iterator[Instruction]:
        return iter(self.instructions)


@dataclass(eq=False)
class Module:
    """An HLO module: the entry computation plus the computations it calls.

    ``mesh`` names the mesh axes and their sizes (no physical devices);
    ``num_partitions`` is ``mesh.num_devices``. ``is_partitioned`` is True after
    the spmd-partition pass: shapes are then per-device shard shapes.
    """

    name: str
    entry: Computation
    computations: list[Computation] = field(default_factory=list)  # non-entry, callee order
    mesh: MeshShape = field(default_factory=lambda: MeshShape((), ()))
    is_partitioned: bool = False

    @property
    def num_partitions(self) -> int:
        return self.mesh.num_devices

    def all_computations(self) -> list[Computation]:
        return [*self.computations, self.entry]

    def fresh_name(self, base: str) -> str:
        """A name not used by any instruction or computation of the module."""
        used = {i.name for c in self.all_computations() for i in c.instructions}
        used |= {c.name for c in self.all_computations()}
        if base not in used:
            return base
        for k in itertools.count(1):
            cand = f"{base}.{k}"
            if cand not in used:
                return cand
        raise AssertionError("unreachable")


def ancestor_ids(roots: list[Instruction]) -> set[int]:
    """``id()`` of every instruction ``roots`` depend on, the roots included (operands, transitively)."""
    out: set[int] = set()
    stack = list(roots)
    while stack:
        cur = stack.pop()
        if id(cur) not in out:
            out.add(id(cur))
            stack.extend(cur.operands)
    return out
