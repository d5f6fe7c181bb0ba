# ruff: noqa: E501  (golden HLO lines are long)
"""Printer/parser tests: golden round trips, typed attributes, XLA input forms, errors, speed."""

import re
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spmd.ir.builder import Builder
from spmd.ir.hlo import OPCODES, Computation, Module, Shape, SourceLocation
from spmd.ir.sharding import MeshShape, TensorSharding
from spmd.ir.text import HloParseError, parse_module, print_instruction, print_module
from spmd.ir.verify import verify_module

EVERY_OP = """\
HloModule every_op, num_partitions=4, mesh={dp=2,tp=2}

%add.f32 (add.f32.lhs: f32[], add.f32.rhs: f32[]) -> f32[] {
  %add.f32.lhs = f32[] parameter(0)
  %add.f32.rhs = f32[] parameter(1)
  ROOT %add.f32.out = f32[] add(%add.f32.lhs, %add.f32.rhs)
}

%body (p0: f32[4,8], p1: f32[8,2]) -> f32[4,2] {
  %p0 = f32[4,8] parameter(0)
  %p1 = f32[8,2] parameter(1)
  ROOT %body.dot = f32[4,2] dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_computation (param_0: f32[4,8]) -> f32[4,8] {
  %param_0 = f32[4,8] parameter(0)
  %fused.neg = f32[4,8] negate(%param_0)
  ROOT %fused.exp = f32[4,8] exponential(%fused.neg)
}

ENTRY %main (x: f32[4,8], w: f32[8,2], i: s32[3]) -> (f32[4,2], f32[4,8]) {
  %x = f32[4,8] parameter(0), sharding={devices=[2,1,2]<=[4] last_tile_dim_replicate}
  %w = f32[8,2] parameter(1), sharding={replicated}
  %i = s32[3] parameter(2)
  %abs = f32[4,8] abs(%x)
  %negate = f32[4,8] negate(%abs)
  %exponential = f32[4,8] exponential(%negate)
  %log = f32[4,8] log(%exponential)
  %log-plus-one = f32[4,8] log-plus-one(%exponential)
  %exponential-minus-one = f32[4,8] exponential-minus-one(%log-plus-one)
  %sqrt = f32[4,8] sqrt(%exponential)
  %rsqrt = f32[4,8] rsqrt(%sqrt)
  %tanh = f32[4,8] tanh(%rsqrt)
  %logistic = f32[4,8] logistic(%tanh)
  %erf = f32[4,8] erf(%logistic)
  %sine = f32[4,8] sine(%erf)
  %cosine = f32[4,8] cosine(%sine)
  %floor = f32[4,8] floor(%cosine)
  %ceil = f32[4,8] ceil(%floor)
  %sign = f32[4,8] sign(%ceil)
  %copy = f32[4,8] copy(%sign)
  %add = f32[4,8] add(%copy, %x)
  %subtract = f32[4,8] subtract(%add, %x)
  %multiply = f32[4,8] multiply(%subtract, %x)
  %divide = f32[4,8] divide(%multiply, %x)
  %maximum = f32[4,8] maximum(%divide, %x)
  %minimum = f32[4,8] minimum(%maximum, %x)
  %power = f32[4,8] power(%minimum, %x)
  %remainder = f32[4,8] remainder(%power, %x)
  %compare = pred[4,8] compare(%remainder, %x), direction=LT
  %not = pred[4,8] not(%compare)
  %and = pred[4,8] and(%compare, %not)
  %or = pred[4,8] or(%and, %not)
  %select = f32[4,8] select(%or, %x, %remainder)
  %zero = f32[] constant(0.0)
  %one = f32[] constant(1.5)
  %clamp = f32[4,8] clamp(%zero, %select, %one)
  %convert = bf16[4,8] convert(%clamp)
  %table = bf16[2,2] constant({{1.0, -inf}, {nan, 0.333984375}})
  %flags = pred[3] constant({true, false, true})
  %ints = s32[3] constant({1, -2, 3})
  %iota = s32[4,8] iota(), iota_dimension=1
  %pid = u32[] partition-id()
  %broadcast = f32[2,4,8] broadcast(%clamp), dimensions={1,2}
  %reshape = f32[8,4] reshape(%clamp)
  %transpose = f32[8,4] transpose(%clamp), dimensions={1,0}
  %slice = f32[2,3] slice(%clamp), slice={[0:4:2], [1:8:3]}
  %concatenate = f32[4,16] concatenate(%clamp, %x), dimensions={1}
  %pad = f32[6,17] pad(%clamp, %zero), padding=1_1_0x0_2_1
  %dot = f32[4,2] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="aten.mm" source_file="model.py" source_line=12}
  %bdot = f32[2,4,4] dot(%broadcast, %broadcast), lhs_batch_dims={0}, rhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_contracting_dims={2}
  %reduce = f32[4] reduce(%clamp, %zero), dimensions={1}, to_apply=%add.f32
  %gather = f32[3,8] gather(%x, %i), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,8}
  %along = f32[4,8] gather(%x, %iota), offset_dims={}, collapsed_slice_dims={1}, start_index_map={1}, index_vector_dim=2, slice_sizes={1,1}, operand_batching_dims={0}, start_indices_batching_dims={0}
  %scatter = f32[4,8] scatter(%x, %i, %gather), to_apply=%add.f32, index_vector_dim=1, update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}
  %s0 = s32[] constant(1)
  %dynamic-slice = f32[2,8] dynamic-slice(%x, %s0, %s0), dynamic_slice_sizes={2,8}
  %dynamic-update-slice = f32[4,8] dynamic-update-slice(%x, %dynamic-slice, %s0, %s0)
  %softmax = f32[4,8] custom-call(%x), custom_call_target="softmax", backend_config={"dim":1}
  %all-gather = f32[8,8] all-gather(%x), dimensions={0}, replica_groups={{0,2},{1,3}}
  %reduce-scatter = f32[2,8] reduce-scatter(%x), dimensions={0}, to_apply=%add.f32, replica_groups={{0,1},{2,3}}
  %all-reduce = f32[4,8] all-reduce(%x), to_apply=%add.f32, replica_groups={}, channel_id=1
  %all-to-all = f32[8,4] all-to-all(%x), replica_groups={{0,1},{2,3}}, split_dimension=1, concat_dimension=0
  %collective-permute = f32[4,8] collective-permute(%x), source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %ag-start = (f32[4,8], f32[8,8]) all-gather-start(%x), dimensions={0}, replica_groups={{0,1},{2,3}}, stream_id=2
  %ag-done = f32[8,8] all-gather-done(%ag-start), stream_id=2
  %ar-start = f32[4,8] all-reduce-start(%x), to_apply=%add.f32, replica_groups={{0,1,2,3}}
  %ar-done = f32[4,8] all-reduce-done(%ar-start)
  %cp-start = (f32[4,8], f32[4,8]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}, stream_id=3
  %cp-done = f32[4,8] collective-permute-done(%cp-start), stream_id=3
  %dot.0-start = ((f32[4,8], f32[8,2]), f32[4,2]) async-start(%x, %w), calls=%body, stream_id=1
  %dot.0 = f32[4,2] async-done(%dot.0-start), stream_id=1
  %fusion = f32[4,8] fusion(%log), calls=%fused_computation, kind=kLoop
  %tuple = (f32[4,2], f32[4,8]) tuple(%dot.0, %cp-done), sharding={devices=[2,1,2]<=[4] last_tile_dim_replicate}
  %get-tuple-element = f32[4,2] get-tuple-element(%tuple), index=0, frontend_attributes={_xla_stream="3"}
  ROOT %out = (f32[4,2], f32[4,8]) tuple(%get-tuple-element, %dynamic-update-slice)
}
"""

SMALL = """\
HloModule mlp, num_partitions=4, mesh={tp=4}

%add.f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (x: f32[8,16], w: f32[16,32]) -> f32[8,32] {
  %x = f32[8,16] parameter(0), sharding={replicated}
  %w = f32[16,32] parameter(1), sharding={devices=[1,4]<=[4]}
  ROOT %dot = f32[8,32] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def _inst(m: Module, name: str):
    for c in m.all_computations():
        for i in c.instructions:
            if i.name == name:
                return i
    raise KeyError(name)


@pytest.mark.parametrize("text", [EVERY_OP, SMALL], ids=["every-op", "small"])
def test_golden_round_trip(text):
    m = parse_module(text)
    assert print_module(m) == text
    verify_module(m)


def test_golden_covers_every_opcode():
    m = parse_module(EVERY_OP)
    assert {i.opcode for c in m.all_computations() for i in c.instructions} == set(OPCODES)


def test_each_golden_line_round_trips_alone():
    m = parse_module(EVERY_OP)
    lines = [ln.strip().removeprefix("ROOT ") for ln in EVERY_OP.splitlines() if " = " in ln]
    printed = [print_instruction(i, m.mesh) for c in m.all_computations() for i in c.instructions]
    assert printed == lines


def test_parsed_attribute_values_are_typed():
    m = parse_module(EVERY_OP)
    assert m.mesh == MeshShape(("dp", "tp"), (2, 2)) and not m.is_partitioned
    add = m.computations[0]
    assert [c.name for c in m.computations] == ["add.f32", "body", "fused_computation"] and m.entry.name == "main"
    assert _inst(m, "reduce").attrs == {"dimensions": (1,), "to_apply": add}
    assert _inst(m, "reduce").operands == [_inst(m, "clamp"), _inst(m, "zero")]
    assert _inst(m, "slice").attrs["slice"] == ((0, 4, 2), (1, 8, 3))
    assert _inst(m, "pad").attrs["padding"] == ((1, 1, 0), (0, 2, 1))
    assert _inst(m, "compare").attrs["direction"] == "LT"
    assert _inst(m, "all-gather").attrs["replica_groups"] == ((0, 2), (1, 3))
    assert _inst(m, "all-reduce").attrs["replica_groups"] == () and _inst(m, "all-reduce").attrs["channel_id"] == 1
    assert _inst(m, "collective-permute").attrs["source_target_pairs"] == ((0, 1), (1, 0), (2, 3), (3, 2))
    sm = _inst(m, "softmax")
    assert sm.attrs == {"custom_call_target": "softmax", "backend_config": {"dim": 1}}
    assert _inst(m, "dot.0-start").attrs["calls"] is m.computations[1]
    assert _inst(m, "dot.0-start").stream_id == 1 and _inst(m, "x").stream_id is None
    assert _inst(m, "dot").location == SourceLocation("aten.mm", "model.py", 12)
    assert _inst(m, "get-tuple-element").attrs == {"index": 0, "frontend_attributes": '{_xla_stream="3"}'}
    assert _inst(m, "x").sharding == TensorSharding((("dp",), ()))
    assert _inst(m, "w").sharding == TensorSharding.replicated(2)
    assert _inst(m, "ag-start").shape == Shape.tuple([Shape("f32", (4, 8)), Shape("f32", (8, 8))])
    assert m.entry.root is _inst(m, "out") and m.entry.parameters == [_inst(m, n) for n in ("x", "w", "i")]


def test_parsed_literals():
    m = parse_module(EVERY_OP)
    table = _inst(m, "table").attrs["literal"]
    assert table.dtype == torch.bfloat16 and table.shape == (2, 2)
    assert table[0, 0].item() == 1.0 and table[0, 1].item() == float("-inf") and table[1, 0].isnan()
    assert table[1, 1].item() == 0.333984375
    assert _inst(m, "flags").attrs["literal"].tolist() == [True, False, True]
    ints = _inst(m, "ints").attrs["literal"]
    assert ints.dtype == torch.int32 and ints.tolist() == [1, -2, 3]
    one = _inst(m, "one").attrs["literal"]
    assert one.shape == () and one.dtype == torch.float32 and one.item() == 1.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_float_literals_round_trip_bit_exactly(dtype):
    g = torch.Generator().manual_seed(int(time.time_ns()) % 2**31)
    vals = torch.randn(5, 7, generator=g, dtype=torch.float64) * torch.logspace(-30, 30, 7, dtype=torch.float64)
    t = vals.to(dtype)
    t[0, 0], t[0, 1], t[0, 2], t[0, 3] = float("inf"), float("-inf"), float("nan"), -0.0
    m = _single_constant_module(t)
    back = _inst(parse_module(print_module(m)), "c").attrs["literal"]
    assert back.dtype == dtype
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}[dtype]
    assert torch.equal(back.view(bits), t.view(bits))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint32,
                                   torch.bool])
def test_integer_literals_round_trip(dtype):
    if dtype == torch.bool:
        t = torch.rand(3, 4) > 0.5
    else:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -2**62), min(info.max, 2**62)
        t = torch.tensor([[lo, hi, 0, 7]] * 2, dtype=torch.int64)
        t = torch.cat([t, torch.randint(max(lo, -1000), min(hi, 1000), (1, 4))]).to(dtype)
    back = _inst(parse_module(print_module(_single_constant_module(t))), "c").attrs["literal"]
    assert back.dtype == dtype and torch.equal(back.to(torch.int64), t.to(torch.int64))


def _single_constant_module(t):
    m = Module("c", Computation("main"), mesh=MeshShape(("x",), (1,)))
    b = Builder(m)
    b.set_root(b.constant(t, name="c"))
    return m


XLA_INPUT = """\
HloModule jit_f, entry_computation_layout={(f32[8,16]{1,0})->f32[4,18]{1,0}}, num_partitions=4

region_0.1 {
  Arg_0.2 = f32[] parameter(0)
  Arg_1.3 = f32[] parameter(1)
  ROOT add.4 = f32[] add(f32[] Arg_0.2, f32[] Arg_1.3)
}

ENTRY main.5 {
  // a comment line
  x = f32[8,16]{1,0} parameter(0), metadata={op_type="dot" op_name="jit(f)/dot" source_file="t.py" source_line=7}
  sl = f32[4,16]{1,0} slice(f32[8,16]{1,0} x), slice={[0:4], [0:16]}
  zero = f32[] constant(0)
  p = f32[4,18]{1,0} pad(sl, zero), padding=0_0x1_1
  ar = f32[4,18] all-reduce(p), replica_groups=[2,2]<=[4], to_apply=region_0.1, backend_config="{\\"k\\":2}"
  ROOT t = f32[4,18] all-reduce(ar /*index=0*/), replica_groups=[2,2]<=[2,2]T(1,0), to_apply=region_0.1
}
"""

XLA_CANONICAL = """\
HloModule jit_f, num_partitions=4, mesh={x=4}

%region_0.1 (Arg_0.2: f32[], Arg_1.3: f32[]) -> f32[] {
  %Arg_0.2 = f32[] parameter(0)
  %Arg_1.3 = f32[] parameter(1)
  ROOT %add.4 = f32[] add(%Arg_0.2, %Arg_1.3)
}

ENTRY %main.5 (x: f32[8,16]) -> f32[4,18] {
  %x = f32[8,16] parameter(0), metadata={op_name="jit(f)/dot" source_file="t.py" source_line=7}
  %sl = f32[4,16] slice(%x), slice={[0:4:1], [0:16:1]}
  %zero = f32[] constant(0.0)
  %p = f32[4,18] pad(%sl, %zero), padding=0_0_0x1_1_0
  %ar = f32[4,18] all-reduce(%p), to_apply=%region_0.1, backend_config={"k":2}, replica_groups={{0,1},{2,3}}
  ROOT %t = f32[4,18] all-reduce(%ar), to_apply=%region_0.1, replica_groups={{0,2},{1,3}}
}
"""


def test_xla_input_forms_parse_to_canonical_text():
    m = parse_module(XLA_INPUT)
    assert print_module(m) == XLA_CANONICAL
    assert m.mesh == MeshShape(("x",), (4,))
    verify_module(m)
    assert print_module(parse_module(XLA_CANONICAL)) == XLA_CANONICAL


def test_header_defaults_and_flags():
    body = "\n\nENTRY %main () -> u32[] {\n  ROOT %p = u32[] partition-id()\n}\n"
    assert parse_module("HloModule m" + body).mesh == MeshShape(("x",), (1,))
    assert parse_module("HloModule m, num_partitions=8" + body).mesh == MeshShape(("x",), (8,))
    text = "HloModule m, num_partitions=8, mesh={dp=2,tp=4}, is_partitioned=true" + body
    m = parse_module(text)
    assert m.mesh == MeshShape(("dp", "tp"), (2, 4)) and m.is_partitioned and m.num_partitions == 8
    assert print_module(m) == text
    empty = Module("e", parse_module(text).entry)
    assert print_module(empty).startswith("HloModule e, num_partitions=1, mesh={}\n")
    assert parse_module(print_module(empty)).mesh == MeshShape((), ())


def test_instruction_without_root_marker_uses_last_and_no_entry_uses_last_computation():
    m = parse_module("HloModule m\n\n%c {\n  %a = f32[2] parameter(0)\n  %b = f32[2] negate(%a)\n}\n")
    assert m.entry.name == "c" and m.entry.root.name == "b"


def test_attribute_out_of_fast_path_forms():
    text = SMALL.replace("lhs_contracting_dims={1}", "lhs_contracting_dims= { 1 }")
    m = parse_module(text)
    assert m.entry.root.attrs["lhs_contracting_dims"] == (1,) and print_module(m) == SMALL


def test_forward_computation_reference_resolves():
    text = SMALL.replace("ENTRY %main", "%main").split("\n\n")
    reordered = "\n\n".join([text[0], text[2].replace("%main", "ENTRY %main") + "\n", text[1]])
    reordered = reordered.replace(
        "  ROOT %dot = f32[8,32] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n",
        "  %dot = f32[8,32] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n"
        "  ROOT %ar = f32[8,32] all-reduce(%dot), to_apply=%add.f32, replica_groups={}\n")
    m = parse_module(reordered)
    assert m.entry.root.attrs["to_apply"] is m.computations[0]


def test_print_instruction_without_mesh_and_sharding_printing():
    m = parse_module(SMALL)
    w = m.entry.parameters[1]
    assert print_instruction(w, m.mesh) == "%w = f32[16,32] parameter(1), sharding={devices=[1,4]<=[4]}"
    assert print_instruction(w) == f"%w = f32[16,32] parameter(1), sharding={w.sharding}"
    w.sharding = TensorSharding(((), ()), partial=("tp",))
    assert parse_module(print_module(m)).entry.parameters[1].sharding == w.sharding


def _err(text):
    with pytest.raises(HloParseError) as e:
        parse_module(text)
    return e.value


_HEAD = "HloModule m, num_partitions=2\n\nENTRY %main (a: f32[4]) -> f32[4] {\n  %a = f32[4] parameter(0)\n"
ERRORS = [
    ("ENTRY %main {\n}\n", 1, 1, "'HloModule'"),
    (_HEAD + "  ROOT %b = f32[4] frobnicate(%a)\n}\n", 5, 20, "a known opcode"),
    (_HEAD + "  ROOT %b = f32[4] negate(%zz)\n}\n", 5, 27, "an instruction of computation %main"),
    (_HEAD + "  ROOT %b = q32[4] negate(%a)\n}\n", 5, 13, "an element type"),
    (_HEAD + "  ROOT %b = f32[4] negate(%a\n}\n", 5, 29, "')'"),
    (_HEAD + "  ROOT %b = f32[4] negate(%a)\n", 6, 1, "'}' closing computation %main"),
    (_HEAD + "  ROOT %b = f32[] reduce(%a, %a), dimensions={0}, to_apply=%nope\n}\n", 5, 60,
     "the name of a computation"),
    (_HEAD + "  ROOT %b = pred[4] compare(%a, %a), direction=XX\n}\n", 5, 48, "one of ['EQ'"),
    (_HEAD + "  ROOT %b = f32[4] transpose(%a), dimensions={0,a}\n}\n", 5, 49, "an integer"),
    (_HEAD + "  ROOT %b = f32[3] constant({1, 2})\n}\n", 5, 29, "3 literal values for f32[3], found 2 values"),
    (_HEAD + "  ROOT %b = f32[3] constant({1, x, 2})\n}\n", 5, 33, "a f32 literal value"),
    (_HEAD + "  %a = f32[4] negate(%a)\n  ROOT %c = f32[4] negate(%a)\n}\n", 5, 3, "a unique instruction name"),
    (_HEAD + "  ROOT %b = f32[4] negate(%a), sharding={devices=[2]<=[3]}\n}\n", 5, 41, "a sharding over mesh"),
    (_HEAD + "  ROOT %b = f32[4] slice(%a), slice={[0:4:1:2]}\n}\n", 5, 38, "[start:limit]"),
    (_HEAD + "  ROOT %b = f32[4] negate(%a) stream_id=1\n}\n", 5, 31, "','"),
    (_HEAD + "  ROOT %b = f32[4] negate(%a), stream_id=x\n}\n", 5, 42, "an integer stream id"),
    (_HEAD + "  ROOT %b = f32[4] copy(%a), index=0, index=1\n}\n", 5, 39, "attribute index once"),
    (_HEAD + "  ROOT %b = f32[4] copy(%a), index=1_0\n}\n", 5, 37, "end of the index value"),
    (_HEAD + "  ROOT %b = f32[4] transpose(%a), dimensions={0,1_0}\n}\n", 5, 50, "'}'"),
    ("HloModule m, num_partitions=3, mesh={a=2}\n", 1, 29, "num_partitions=2 to match mesh={a=2}, found 3"),
]


@pytest.mark.parametrize(("text", "line", "col", "expected"), ERRORS)
def test_parse_errors_give_position_and_expectation(text, line, col, expected):
    e = _err(text)
    assert isinstance(e, ValueError)
    assert (e.line, e.column) == (line, col), str(e)
    assert str(e).startswith(f"line {line}:{col}: expected ") and expected in str(e), str(e)
    assert re.search(r"found ('.*'|end of line|end of text|\d+|a second)", str(e))


def _big_module(n: int) -> Module:
    m = Module("big", Computation("main"), mesh=MeshShape(("tp",), (4,)))
    b = Builder(m)
    x = b.param(Shape("f32", (64, 128)), name="x")
    w = b.param(Shape("f32", (128, 128)), name="w")
    for k in range(n // 5):
        y = b.dot(x, w, (1,), (0,))
        y = b.binary("add", y, x)
        y = b.all_reduce(y, [[0, 1, 2, 3]])
        y.stream_id = k % 3
        c = b.compare(y, x, "GT")
        x = b.select(c, y, x)
    b.set_root(x)
    return m


def _print_parse_s(m) -> tuple[float, float, str, object]:
    """Best-of-3 CPU seconds of printing and of parsing ``m`` (this process only), the text and the parse."""
    prints, parses = [], []
    for _ in range(3):
        t0 = time.process_time()
        text = print_module(m)
        t1 = time.process_time()
        back = parse_module(text)
        t2 = time.process_time()
        prints.append(t1 - t0)
        parses.append(t2 - t1)
    return min(prints), min(parses), text, back


def test_print_and_parse_5000_instructions_fast():
    """Printing and parsing scale linearly: 5x the instructions cost well under 25x (quadratic) the
    time. A ratio on one machine, so the test does not depend on how fast or busy the machine is."""
    small_print, small_parse, _, _ = _print_parse_s(_big_module(1000))
    big_print, big_parse, text, back = _print_parse_s(_big_module(5000))
    assert len(back.entry.instructions) >= 5000 and print_module(back) == text
    assert big_print < 10 * small_print + 0.01 and big_parse < 10 * small_parse + 0.01, (
        small_print, big_print, small_parse, big_parse)


# ----------------------------------------------------------------------------- random modules
_UNARY = ["abs", "negate", "exponential", "tanh", "logistic", "copy", "floor", "sine"]
_BINARY = ["add", "subtract", "multiply", "maximum", "minimum", "divide"]


@st.composite
def random_modules(draw):
    """Random well-formed modules built with Builder over a random mesh."""
    mesh = draw(st.sampled_from([MeshShape(("x",), (1,)), MeshShape(("tp",), (2,)), MeshShape(("dp", "tp"), (2, 2))]))
    m = Module(draw(st.sampled_from(["m", "jit_f", "mod.1"])), Computation("main"), mesh=mesh)
    b = Builder(m)
    g = mesh.num_devices
    dtype = draw(st.sampled_from(["f32", "bf16", "f16"]))
    dims = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)).copy())
    dims = (dims[0] * g, *dims[1:])
    vals = [b.param(Shape(dtype, dims), name="p")]
    for _ in range(draw(st.integers(1, 12))):
        x = draw(st.sampled_from(vals))
        kind = draw(st.sampled_from(["unary", "binary", "const", "reduce", "transpose", "gather_scatter",
                                     "permute", "slice", "meta"]))
        if kind == "unary":
            y = b.unary(draw(st.sampled_from(_UNARY)), x)
        elif kind == "binary":
            y = b.binary(draw(st.sampled_from(_BINARY)), x, draw(st.sampled_from(vals)))
        elif kind == "const":
            lit = torch.randn(dims).to(getattr(torch, {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[dtype]))
            y = b.binary("multiply", x, b.constant(lit))
        elif kind == "reduce":
            d = draw(st.integers(0, len(dims) - 1))
            r = b.reduce(x, [d], draw(st.sampled_from(["add", "maximum"])))
            y = b.broadcast(r, dims, [i for i in range(len(dims)) if i != d])
        elif kind == "transpose":
            perm = draw(st.permutations(range(len(dims))))
            y = b.transpose(b.transpose(x, perm), [perm.index(i) for i in range(len(dims))])
        elif kind == "gather_scatter":
            y = b.all_gather(b.reduce_scatter(x, 0, ()), 0, ())
        elif kind == "permute":
            y = b.collective_permute(x, [(i, (i + 1) % g) for i in range(g)])
        elif kind == "slice":
            y = b.slice(x, [0] * len(dims), dims, [1] * len(dims))
        else:
            y = b.unary("copy", x)
            y.stream_id = draw(st.none() | st.integers(0, 3))
            y.location = draw(st.none() | st.builds(SourceLocation, st.text("ab\"c.", max_size=5),
                                                     st.just("f.py"), st.integers(0, 99)))
            y.sharding = draw(st.none() | st.just(TensorSharding(((mesh.axis_names[-1],),) + ((),) * (len(dims) - 1))))
            y.attrs["frontend_attributes"] = draw(st.sampled_from(['{a="1"}', "{}", "x_y"]))
        vals.append(y)
    b.set_root(b.tuple(vals[-2:]) if len(vals) > 2 and draw(st.booleans()) else vals[-1])
    return m


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_modules())
def test_random_modules_round_trip_and_verify(m):
    verify_module(m)
    text = print_module(m)
    back = parse_module(text)
    assert print_module(back) == text
    verify_module(back)
    old = [(i.name, i.opcode, i.shape, [o.name for o in i.operands]) for i in m.entry.instructions]
    assert old == [(i.name, i.opcode, i.shape, [o.name for o in i.operands]) for i in back.entry.instructions]
