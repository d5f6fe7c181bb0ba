"""Structural, type and shape checks of HLO-lite modules (as XLA's HloVerifier).

``verify_module`` runs after every pass in tests and debug mode. It checks:
unique names (instructions module-wide, computations among themselves); every
computation has a root inside it; operands are defined earlier in the same
computation; parameter numbers are 0..n-1; attribute values have the types
``ATTRIBUTE_TYPES`` gives; shapes equal ``infer_shape`` (which also checks
dims in range); shardings name mesh axes and, before partitioning, have the
rank of the shape; replica_groups and source_target_pairs hold partition ids
< num_partitions, each at most once; every ``*-start`` is used by exactly one
matching ``*-done`` on the same stream; called computations belong to the
module. Cost: linear in the module size.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.ir.builder import infer_shape
from spmd.ir.hlo import (
    ASYNC_DONE_OPCODES,
    ASYNC_START_OPCODES,
    OPCODES,
    Computation,
    Instruction,
    Module,
)
from spmd.ir.sharding import TensorSharding
from spmd.ir.text import ATTRIBUTE_KINDS, COMPARISON_DIRECTIONS

__all__ = ["VerifyError", "verify_module"]


class VerifyError(ValueError):
    """An invalid module; the message names the computation and instruction and what is wrong."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_ints(v: Any, n: int | None = None) -> bool:
    return isinstance(v, tuple) and all(_is_int(x) for x in v) and (n is None or len(v) == n)


_KIND_CHECKS = {
    "int": _is_int,
    "ints": _is_ints,
    "groups": lambda v: isinstance(v, tuple) and all(_is_ints(g) for g in v),
    "pairs": lambda v: isinstance(v, tuple) and all(_is_ints(g, 2) for g in v),
    "slice": lambda v: isinstance(v, tuple) and all(_is_ints(g, 3) for g in v),
    "padding": lambda v: isinstance(v, tuple) and all(_is_ints(g, 3) for g in v),
    "direction": lambda v: v in COMPARISON_DIRECTIONS,
    "string": lambda v: isinstance(v, str),
    "comp": lambda v: isinstance(v, Computation),
    "json": lambda v: isinstance(v, dict),
    "bool": lambda v: isinstance(v, bool),
    "literal": lambda v: isinstance(v, torch.Tensor) and v.device.type == "cpu",
}
_REQUIRED = {"reduce": ("to_apply",), "custom-call": ("custom_call_target",), "async-start": ("calls",),
             "fusion": ("calls",), "scatter": ("to_apply",)}
_DONE_OF = {s: s.removesuffix("-start") + "-done" for s in ASYNC_START_OPCODES}


class _Checker:
    def __init__(self, m: Module) -> None:
        self.m = m
        self.comp: Computation | None = None
        self.comp_ids = {id(c) for c in m.computations}

    def fail(self, inst: Instruction | None, msg: str) -> VerifyError:
        where = f"computation %{self.comp.name}" if self.comp is not None else f"module {self.m.name}"
        return VerifyError(f"{where}: %{inst.name}: {msg}" if inst is not None else f"{where}: {msg}")

    def run(self) -> None:
        m = self.m
        if any(c is m.entry for c in m.computations):
            raise VerifyError(f"module {m.name}: the entry computation %{m.entry.name} is also in computations")
        seen_comps: set[str] = set()
        seen_names: set[str] = set()
        for comp in m.all_computations():
            if comp.name in seen_comps:
                raise VerifyError(f"module {m.name}: two computations are named %{comp.name}")
            seen_comps.add(comp.name)
            self.comp = comp
            self.computation(comp, seen_names)

    def computation(self, comp: Computation, seen_names: set[str]) -> None:
        if comp.root is None:
            raise self.fail(None, "root is not set")
        defined: set[int] = set()
        numbers: list[int] = []
        for inst in comp.instructions:
            if inst.name in seen_names:
                raise self.fail(inst, "name is not unique in the module")
            seen_names.add(inst.name)
            if inst.opcode not in OPCODES:
                raise self.fail(inst, f"unknown opcode {inst.opcode!r}")
            for op in inst.operands:
                if id(op) not in defined:
                    raise self.fail(inst, f"operand %{op.name} is not defined earlier in this computation")
            defined.add(id(inst))
            self.instruction(inst)
            if inst.opcode == "parameter":
                numbers.append(inst.attrs["parameter_number"])
        if id(comp.root) not in defined:
            raise self.fail(comp.root, "root is not an instruction of this computation")
        if sorted(numbers) != list(range(len(numbers))):
            raise self.fail(None, f"parameter numbers {sorted(numbers)} are not 0..{len(numbers) - 1}")
        self.async_pairs(comp)

    def instruction(self, inst: Instruction) -> None:
        self.attributes(inst)
        try:
            shape = infer_shape(inst.opcode, [o.shape for o in inst.operands], inst.attrs, shape=inst.shape,
                                num_partitions=self.m.num_partitions)
        except ValueError as e:
            raise self.fail(inst, str(e)) from None
        if shape != inst.shape:
            raise self.fail(inst, f"shape {inst.shape} differs from the inferred shape {shape}")
        if inst.stream_id is not None and (not _is_int(inst.stream_id) or inst.stream_id < 0):
            raise self.fail(inst, f"stream_id must be None or an int >= 0, got {inst.stream_id!r}")
        self.sharding(inst)
        self.partition_ids(inst)

    def attributes(self, inst: Instruction) -> None:
        for key in _REQUIRED.get(inst.opcode, ()):
            if key not in inst.attrs:
                raise self.fail(inst, f"{inst.opcode} needs attribute {key}")
        for key, value in inst.attrs.items():
            kind = ATTRIBUTE_KINDS.get(key)
            check = _KIND_CHECKS.get(kind) if kind is not None else None
            if check is not None and not check(value):
                raise self.fail(inst, f"attribute {key} must be {kind} (ATTRIBUTE_TYPES), got {value!r}")
            if kind == "comp":
                if id(value) not in self.comp_ids:
                    raise self.fail(inst, f"{key}=%{value.name} is not a computation of the module")
                if key == "to_apply" and (len(value.parameters) != 2 or value.root is None or value.root.shape.rank):
                    raise self.fail(inst, f"to_apply=%{value.name} must take two scalars and return a scalar")

    def sharding(self, inst: Instruction) -> None:
        s = inst.sharding
        if s is None:
            return
        if not isinstance(s, TensorSharding):
            raise self.fail(inst, f"sharding must be a TensorSharding, got {type(s).__name__}")
        unknown = [a for a in s.used_axes() if a not in self.m.mesh.axis_names]
        if unknown:
            raise self.fail(inst, f"sharding {s} uses axes {unknown} not in mesh {self.m.mesh}")
        if not self.m.is_partitioned and not inst.shape.is_tuple and s.rank != inst.shape.rank:
            raise self.fail(inst, f"sharding {s} has rank {s.rank}, shape {inst.shape} has rank {inst.shape.rank}")

    def partition_ids(self, inst: Instruction) -> None:
        n = self.m.num_partitions
        groups = inst.attrs.get("replica_groups", ())
        ids = [i for g in groups for i in g]
        if any(not 0 <= i < n for i in ids) or len(set(ids)) != len(ids):
            raise self.fail(inst, f"replica_groups {groups} must hold distinct partition ids in [0, {n})")
        pairs = inst.attrs.get("source_target_pairs", ())
        for col, what in ((0, "source"), (1, "target")):
            ids = [p[col] for p in pairs]
            if any(not 0 <= i < n for i in ids) or len(set(ids)) != len(ids):
                raise self.fail(inst, f"source_target_pairs {pairs}: each {what} must be a distinct id in [0, {n})")

    def async_pairs(self, comp: Computation) -> None:
        users = comp.users()
        for inst in comp.instructions:
            if inst.opcode in ASYNC_START_OPCODES:
                done = _DONE_OF[inst.opcode]
                us = users[inst]
                if len(us) != 1 or us[0].opcode != done:
                    got = ", ".join(f"%{u.name} ({u.opcode})" for u in us) or "none"
                    raise self.fail(inst, f"must be used by exactly one {done}, got users: {got}")
                if us[0].stream_id != inst.stream_id:
                    raise self.fail(us[0], f"stream_id {us[0].stream_id} differs from its start's {inst.stream_id}")
                if comp.root is inst:
                    raise self.fail(inst, "an async start cannot be the root")
            elif inst.opcode in ASYNC_DONE_OPCODES:
                start = inst.operands[0] if len(inst.operands) == 1 else None
                if start is None or _DONE_OF.get(start.opcode) != inst.opcode:
                    raise self.fail(inst, f"operand must be one matching {inst.opcode.replace('-done', '-start')}")


def verify_module(m: Module) -> None:
    """Check ``m``; raise VerifyError (a ValueError) naming the first problem found."""
    _Checker(m).run()
