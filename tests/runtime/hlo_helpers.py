"""Small helpers to build partitioned HLO-lite modules by hand in runtime tests."""

from __future__ import annotations

import itertools

import torch

from spmd.ir.hlo import Computation, Instruction, Module, Shape
from spmd.ir.sharding import MeshShape


class Builder:
    """Appends instructions to one computation with fresh names."""

    _ids = itertools.count()

    def __init__(self, name: str = "main") -> None:
        self.comp = Computation(name)
        self.params = 0

    def add(self, opcode: str, shape: Shape, operands=(), stream_id=None, **attrs) -> Instruction:
        inst = Instruction(f"{opcode.replace('-', '_')}.{next(self._ids)}", opcode, shape, list(operands),
                           attrs, stream_id=stream_id)
        self.comp.instructions.append(inst)
        self.comp.root = inst
        return inst

    def param(self, dtype: str, dims) -> Instruction:
        p = self.add("parameter", Shape(dtype, tuple(dims)), parameter_number=self.params)
        self.params += 1
        return p

    def const(self, value: torch.Tensor) -> Instruction:
        from spmd.ir.hlo import hlo_dtype

        return self.add("constant", Shape(hlo_dtype(value.dtype), tuple(value.shape)), literal=value)

    def s32(self, v: int) -> Instruction:
        return self.const(torch.tensor(v, dtype=torch.int32))

    def binary(self, opcode: str, a: Instruction, b: Instruction, stream_id=None) -> Instruction:
        return self.add(opcode, a.shape, [a, b], stream_id=stream_id)

    def dot(self, a: Instruction, b: Instruction, lc=(1,), rc=(0,), stream_id=None) -> Instruction:
        m = [d for i, d in enumerate(a.shape.dims) if i not in lc]
        n = [d for i, d in enumerate(b.shape.dims) if i not in rc]
        return self.add("dot", Shape(a.shape.dtype, tuple(m + n)), [a, b], stream_id=stream_id,
                        lhs_contracting_dims=tuple(lc), rhs_contracting_dims=tuple(rc))

    def offset(self, pid_scale: int, add: int = 0, mod: int | None = None) -> Instruction:
        """s32 scalar ((partition_id + add) % mod) * pid_scale."""
        pid = self.add("partition-id", Shape("u32", ()))
        x = self.add("convert", Shape("s32", ()), [pid])
        if add:
            x = self.binary("add", x, self.s32(add))
        if mod is not None:
            x = self.binary("remainder", x, self.s32(mod))
        return self.binary("multiply", x, self.s32(pid_scale))


def module(b: Builder, mesh: MeshShape, root: Instruction | None = None, extra=()) -> Module:
    if root is not None:
        b.comp.root = root
    return Module("m", b.comp, list(extra), mesh=mesh, is_partitioned=True)


class FakeMesh:
    """Stand-in for ``spmd.mesh.Mesh``: devices, shape, platform."""

    def __init__(self, shape: MeshShape, platform: str = "cpu") -> None:
        self.shape = shape
        self.platform = platform
        n = shape.num_devices
        self.devices = tuple(torch.device("cpu") for _ in range(n)) if platform == "cpu" else \
            tuple(torch.device("cuda", i) for i in range(n))


def sum_computation(opcode: str = "add", dtype: str = "f32") -> Computation:
    c = Builder("sum")
    a = c.param(dtype, ())
    b = c.param(dtype, ())
    c.binary(opcode, a, b)
    return c.comp
