"""schedule: starts early, dones late, stable otherwise; always def-before-use."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import pytest
from expecttest import TestCase
from hypothesis import given, settings
from hypothesis import strategies as st

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.hlo import ASYNC_DONE_OPCODES, ASYNC_START_OPCODES, Computation, Instruction, Module, Shape
from spmd.ir.sharding import MeshShape
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module
from spmd.passes.assign_streams import AssignStreams
from spmd.passes.schedule import Schedule, schedule_instructions
from spmd.passes.windowed_einsum import WindowedEinsum
from tests.passes.test_windowed_einsum import ag_module, random_args, rs_module

F = Shape("f32", (4, 4))


def _is_start(i: Instruction) -> bool:
    return i.opcode in ASYNC_START_OPCODES


def _is_done(i: Instruction) -> bool:
    return i.opcode in ASYNC_DONE_OPCODES


@st.composite
def dags(draw):
    """Random def-before-use instruction lists mixing plain ops with collective-permute start/done pairs."""
    insts = [Instruction("p", "parameter", F, attrs={"parameter_number": 0})]
    vals, pending = list(insts), []
    for k in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["op", "op", "start", "done"]))
        if kind == "op":
            ops = draw(st.lists(st.sampled_from(vals), min_size=1, max_size=2))
            inst = Instruction(f"n{k}", "add" if len(ops) == 2 else "negate", F, ops)
            vals.append(inst)
        elif kind == "start":
            inst = Instruction(f"c{k}-start", "collective-permute-start", Shape.tuple([F, F]),
                               [draw(st.sampled_from(vals))], {"source_target_pairs": ((0, 1), (1, 0))}, stream_id=1)
            pending.append(Instruction(f"c{k}", "collective-permute-done", F, [inst], stream_id=1))
        elif pending:
            inst = pending.pop(draw(st.integers(0, len(pending) - 1)))
            vals.append(inst)
        else:
            continue
        insts.append(inst)
    return insts + pending


@settings(max_examples=300, deadline=None)
@given(dags())
def test_schedule_invariants(insts):
    out = schedule_instructions(list(insts))
    pos = {id(i): k for k, i in enumerate(out)}
    assert sorted(pos.values()) == list(range(len(insts))) and len(pos) == len(insts)
    for i in out:  # def before use
        assert all(pos[id(o)] < pos[id(i)] for o in i.operands)
    spine = [i for i in insts if not _is_start(i) and not _is_done(i)]
    assert [i for i in out if not _is_start(i) and not _is_done(i)] == spine  # stable
    for i in out:
        k = pos[id(i)]
        if _is_start(i):  # as early as its operands allow: only starts between the last operand and it
            first = max((pos[id(o)] for o in i.operands), default=-1) + 1
            assert all(_is_start(x) for x in out[first:k])
        if _is_done(i):  # as late as possible: the next plain instruction needs it, or none follows
            later = [x for x in out[k + 1:] if not _is_start(x) and not _is_done(x)]
            if later:
                assert id(i) in _ancestors(later[0])


def _ancestors(inst: Instruction) -> set[int]:
    seen, stack = set(), list(inst.operands)
    while stack:
        x = stack.pop()
        if id(x) not in seen:
            seen.add(id(x))
            stack.extend(x.operands)
    return seen


def test_docstring_example():
    x = Instruction("x", "parameter", F, attrs={"parameter_number": 0})
    s0 = Instruction("d.0-start", "collective-permute-start", Shape.tuple([F, F]), [x],
                     {"source_target_pairs": ((0, 1), (1, 0))}, stream_id=1)
    d0 = Instruction("d.0", "collective-permute-done", F, [s0], stream_id=1)
    s1 = Instruction("cp-start", "collective-permute-start", Shape.tuple([F, F]), [x],
                     {"source_target_pairs": ((0, 1), (1, 0))}, stream_id=2)
    d1 = Instruction("cp", "collective-permute-done", F, [s1], stream_id=2)
    y = Instruction("y", "negate", F, [d0])
    out = schedule_instructions([x, s0, d0, s1, d1, y])
    assert [i.name for i in out] == ["x", "d.0-start", "cp-start", "d.0", "y", "cp"]
    m = Module("m", Computation("main", [x, s0, d0, s1, d1, y], y), [], MeshShape(("tp",), (2,)), True)
    assert Schedule().run(m).entry.instructions == out


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("text", [ag_module("qkv", 4, 6), rs_module("batch", 4, 5)], ids=["ag", "rs"])
def test_pipeline_numerics(text, bidirectional, p):
    """windowed-einsum → assign-streams → schedule keeps every device's result."""
    text = ag_module("lhs", p, 6) if "all-gather" in text and p == 2 else text
    ref, mod = parse_module(text), parse_module(text)
    args = random_args(ref)
    want = evaluate_spmd(ref, args)
    for pss in (WindowedEinsum(mode="on", bidirectional=bidirectional), AssignStreams(), Schedule()):
        pss.run(mod)
        verify_module(mod)
    got = evaluate_spmd(mod, args)
    for w_out, g_out in zip(want, got, strict=True):
        for w, g in zip(w_out, g_out, strict=True):
            assert ((g - w).abs().max() / w.abs().max()) < 1e-5
    first_start = next(i for i in mod.entry.instructions if i.opcode == "collective-permute-start")
    first_dot = next(i for i in mod.entry.instructions if i.opcode == "async-start")
    if "all-gather" in text:  # the first transfer is issued before the first dot
        assert mod.entry.instructions.index(first_start) < mod.entry.instructions.index(first_dot)


class GoldenTest(TestCase):
    def test_all_gather_p2(self):
        mod = parse_module(ag_module("lhs", 2, 4))
        for pss in (WindowedEinsum(mode="on", bidirectional=False), AssignStreams(), Schedule()):
            pss.run(mod)
        verify_module(mod)
        self.assertExpectedInline(print_module(mod).split("ENTRY", 1)[1], """\
 %main (x: f32[4,6], w: f32[6,5]) -> f32[8,5] {
  %x = f32[4,6] parameter(0)
  %ag.chunk1-start = (f32[4,6], f32[4,6]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}, stream_id=3
  %w = f32[6,5] parameter(1)
  %pid = u32[] partition-id(), stream_id=0
  %pid.s32 = s32[] convert(%pid), stream_id=0
  %f32.0 = f32[] constant(0.0), stream_id=0
  %d.init = f32[8,5] broadcast(%f32.0), dimensions={}, stream_id=0
  %c4 = s32[] constant(4), stream_id=0
  %ag.off0 = s32[] multiply(%pid.s32, %c4), stream_id=0
  %zero = s32[] constant(0), stream_id=0
  %d.acc0-start = ((f32[4,6], f32[6,5], f32[8,5], s32[], s32[]), f32[8,5]) async-start(%x, %w, %d.init, %ag.off0, %zero), calls=%d.acc0.body, stream_id=1
  %c1 = s32[] constant(1), stream_id=0
  %ag.off1.sum = s32[] add(%pid.s32, %c1), stream_id=0
  %c2 = s32[] constant(2), stream_id=0
  %ag.off1.idx = s32[] remainder(%ag.off1.sum, %c2), stream_id=0
  %ag.off1 = s32[] multiply(%ag.off1.idx, %c4), stream_id=0
  %ag.chunk1 = f32[4,6] collective-permute-done(%ag.chunk1-start), stream_id=3
  %d.acc0 = f32[8,5] async-done(%d.acc0-start), stream_id=1
  %d-start = ((f32[4,6], f32[6,5], f32[8,5], s32[], s32[]), f32[8,5]) async-start(%ag.chunk1, %w, %d.acc0, %ag.off1, %zero), calls=%d.body, stream_id=2
  ROOT %d = f32[8,5] async-done(%d-start), stream_id=2
}
""")
