"""Verifier tests: valid modules pass; each kind of error is caught with a message naming it."""

import pytest
import torch

from spmd.ir.builder import Builder
from spmd.ir.hlo import Computation, Instruction, Module, Shape
from spmd.ir.sharding import MeshShape, TensorSharding
from spmd.ir.text import parse_module
from spmd.ir.verify import VerifyError, verify_module

BASE = """\
HloModule m, num_partitions=4, mesh={dp=2,tp=2}

%add.f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%body (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8] parameter(0)
  ROOT %neg = f32[4,8] negate(%p)
}

ENTRY %main (x: f32[4,8], y: f32[4,8]) -> f32[1,8] {
  %x = f32[4,8] parameter(0), sharding={devices=[2,1,2]<=[4] last_tile_dim_replicate}
  %y = f32[4,8] parameter(1)
  %sum2 = f32[4,8] add(%x, %y)
  %ar = f32[4,8] all-reduce(%sum2), to_apply=%add.f32, replica_groups={{0,1},{2,3}}
  %cp-start = (f32[4,8], f32[4,8]) collective-permute-start(%ar), source_target_pairs={{0,1},{1,0}}, stream_id=3
  %cp-done = f32[4,8] collective-permute-done(%cp-start), stream_id=3
  %as = ((f32[4,8]), f32[4,8]) async-start(%cp-done), calls=%body, stream_id=1
  %ad = f32[4,8] async-done(%as), stream_id=1
  ROOT %out = f32[1,8] reduce-scatter(%ad), dimensions={0}, to_apply=%add.f32, replica_groups={{0,1,2,3}}
}
"""


def test_base_module_is_valid():
    verify_module(parse_module(BASE))


def _text_error(old: str, new: str) -> str:
    assert old in BASE
    m = parse_module(BASE.replace(old, new))
    with pytest.raises(VerifyError) as e:
        verify_module(m)
    assert isinstance(e.value, ValueError)
    return str(e.value)


@pytest.mark.parametrize(("old", "new", "message"), [
    ("%sum2 = f32[4,8] add(%x, %y)", "%sum2 = f32[4,9] add(%x, %y)",
     "computation %main: %sum2: shape f32[4,9] differs from the inferred shape f32[4,8]"),
    ("%sum2 = f32[4,8] add(%x, %y)\n  %ar = f32[4,8] all-reduce(%sum2)",
     "%ar = f32[4,8] all-reduce(%sum2)\n  %sum2 = f32[4,8] add(%x, %y)\n"
     "  %zz = f32[4,8] copy(%ar)\n  %xx = f32[4,8] all-reduce(%zz)",
     "%ar: operand %sum2 is not defined earlier in this computation"),
    ("  %y = f32[4,8] parameter(1)", "  %y = f32[4,8] parameter(2)", "parameter numbers [0, 2] are not 0..1"),
    ("  ROOT %neg = f32[4,8] negate(%p)", "  ROOT %x = f32[4,8] negate(%p)", "%x: name is not unique in the module"),
    ("replica_groups={{0,1},{2,3}}", "replica_groups={{0,1},{2,4}}",
     "%ar: replica_groups ((0, 1), (2, 4)) must hold distinct partition ids in [0, 4)"),
    ("replica_groups={{0,1},{2,3}}", "replica_groups={{0,1},{1,3}}", "must hold distinct partition ids"),
    ("source_target_pairs={{0,1},{1,0}}", "source_target_pairs={{0,1},{2,1}}",
     "%cp-start: source_target_pairs ((0, 1), (2, 1)): each target must be a distinct id in [0, 4)"),
    ("%cp-done = f32[4,8] collective-permute-done(%cp-start), stream_id=3",
     "%cp-done = f32[4,8] collective-permute-done(%cp-start), stream_id=2",
     "%cp-done: stream_id 2 differs from its start's 3"),
    ("%ad = f32[4,8] async-done(%as), stream_id=1",
     "%ad = f32[4,8] async-done(%as), stream_id=1\n  %ad2 = f32[4,8] async-done(%as), stream_id=1",
     "%as: must be used by exactly one async-done, got users: %ad (async-done), %ad2 (async-done)"),
    ("%ad = f32[4,8] async-done(%as), stream_id=1", "%ad = f32[4,8] collective-permute-done(%as), stream_id=1",
     "%as: must be used by exactly one async-done, got users: %ad (collective-permute-done)"),
    ("sharding={devices=[2,1,2]<=[4] last_tile_dim_replicate}", "stream_id=-1",
     "%x: stream_id must be None or an int >= 0, got -1"),
    ("dimensions={0}, to_apply", "dimensions={2}, to_apply", r"reduce-scatter: dimensions (2,) must be distinct dims"),
    ("dimensions={0}, to_apply=%add.f32", "dimensions={0}, to_apply=%body",
     "%out: to_apply=%body must take two scalars and return a scalar"),
])
def test_errors_in_text_modules(old, new, message):
    assert message in _text_error(old, new)


def _built() -> tuple[Module, Builder]:
    m = Module("m", Computation("main"), mesh=MeshShape(("dp", "tp"), (2, 2)))
    b = Builder(m)
    x = b.param(Shape("f32", (4, 8)), name="x")
    b.set_root(b.reduce(b.unary("negate", x), [1]))
    verify_module(m)
    return m, b


def _error(m: Module) -> str:
    with pytest.raises(VerifyError) as e:
        verify_module(m)
    return str(e.value)


def test_root_missing_or_outside():
    m, b = _built()
    m.entry.root = None
    assert _error(m) == "computation %main: root is not set"
    m.entry.root = Instruction("elsewhere", "partition-id", Shape("u32", ()))
    assert "%elsewhere: root is not an instruction of this computation" in _error(m)


def test_operand_from_another_computation():
    m, b = _built()
    foreign = m.computations[0].instructions[0]
    b.set_root(b.add("negate", [foreign]))
    assert "computation %main: %negate.1: operand %add.f32.lhs is not defined earlier in this computation" \
        in _error(m)


def test_called_computation_not_in_module():
    m, b = _built()
    m.computations.clear()
    assert "to_apply=%add.f32 is not a computation of the module" in _error(m)


def test_computation_names_unique_and_entry_separate():
    m, _ = _built()
    m.computations.append(Computation("add.f32", [], None))
    assert "two computations are named %add.f32" in _error(m)
    m.computations[-1] = m.entry
    assert "the entry computation %main is also in computations" in _error(m)


def test_sharding_rank_and_axes():
    m, b = _built()
    x = m.entry.parameters[0]
    x.sharding = TensorSharding((("dp",),))
    assert "%x: sharding <[dp]> has rank 1, shape f32[4,8] has rank 2" in _error(m)
    m.is_partitioned = True  # after partitioning shapes are per device: rank not compared
    verify_module(m)
    x.sharding = TensorSharding((("pp",), ()))
    assert "uses axes ['pp'] not in mesh {dp=2,tp=2}" in _error(m)
    x.sharding = "{replicated}"
    assert "sharding must be a TensorSharding, got str" in _error(m)


def test_attribute_types():
    m, b = _built()
    reduce = m.entry.root
    reduce.attrs["dimensions"] = [1]
    assert "%reduce: attribute dimensions must be ints (ATTRIBUTE_TYPES), got [1]" in _error(m)
    reduce.attrs["dimensions"] = (1,)
    c = reduce.operands[1]
    c.attrs["literal"] = 0.0
    assert "attribute literal must be literal" in _error(m)
    c.attrs["literal"] = torch.tensor(0.0)
    reduce.attrs["to_apply"] = "add.f32"
    assert "attribute to_apply must be comp" in _error(m)


def test_async_done_without_start_and_start_as_root():
    m, b = _built()
    x = m.entry.parameters[0]
    fake = b.add("tuple", [x, x])
    b.set_root(b.add("collective-permute-done", [fake]))
    assert "%collective-permute-done: operand must be one matching collective-permute-start" in _error(m)
    m, b = _built()
    x = m.entry.parameters[0]
    b.set_root(b.add("all-reduce-start", [x], {"replica_groups": ()}))
    assert "must be used by exactly one all-reduce-done, got users: none" in _error(m)


def test_unknown_opcode_and_missing_attribute():
    m, b = _built()
    b.set_root(b.add("copy", [m.entry.parameters[0]]))
    m.entry.root.opcode = "fused"
    assert "%copy: unknown opcode 'fused'" in _error(m)
    m, b = _built()
    del m.entry.root.attrs["to_apply"]
    assert "%reduce: reduce needs attribute to_apply" in _error(m)
    m, b = _built()
    del m.entry.root.attrs["dimensions"]
    assert "%reduce: reduce: missing attribute 'dimensions'" in _error(m)
