"""gather / scatter shape inference, form classification and verifier checks (XLA semantics)."""

import pytest

from spmd.ir.hlo import Computation, Instruction, Shape
from spmd.ir.index_shapes import gather_form, scatter_form, scatter_kind
from spmd.ir.shape_inference import infer_shape
from spmd.ir.text import parse_module
from spmd.ir.verify import VerifyError, verify_module

S = Shape

ROWS_GATHER = {"offset_dims": (0, 3), "collapsed_slice_dims": (1,), "start_index_map": (1,), "index_vector_dim": 2,
               "slice_sizes": (4, 1, 6)}
ALONG_GATHER = {"offset_dims": (), "collapsed_slice_dims": (1,), "start_index_map": (1,), "index_vector_dim": 2,
                "slice_sizes": (1, 1), "operand_batching_dims": (0,), "start_indices_batching_dims": (0,)}
ROWS_SCATTER = {"update_window_dims": (1, 2), "inserted_window_dims": (1,), "scatter_dims_to_operand_dims": (1,),
                "index_vector_dim": 1}
ALONG_SCATTER = {"update_window_dims": (), "inserted_window_dims": (1,), "scatter_dims_to_operand_dims": (1,),
                 "index_vector_dim": 2, "input_batching_dims": (0,), "scatter_indices_batching_dims": (0,)}


def _comp(kind: str) -> Computation:
    x = Instruction("x", "parameter", S("f32"), (), {"parameter_number": 0})
    y = Instruction("y", "parameter", S("f32"), (), {"parameter_number": 1})
    if kind == "replace":
        return Computation("c", [x, y], y)
    root = Instruction("r", kind, S("f32"), (y, x))
    return Computation("c", [x, y, root], root)


def test_gather_shapes_of_both_forms():
    # index_select along dim 1 of [4, 10, 6] with ids [2, 3]: dims 0 and 2 kept around the ids
    assert infer_shape("gather", [S("f32", (4, 10, 6)), S("s64", (2, 3))], ROWS_GATHER) == S("f32", (4, 2, 3, 6))
    assert infer_shape("gather", [S("f32", (5, 11)), S("s64", (5, 3))], ALONG_GATHER) == S("f32", (5, 3))


def test_scatter_shape_is_the_operands():
    assert infer_shape("scatter", [S("f32", (3, 11, 4)), S("s64", (7,)), S("f32", (7, 3, 4))],
                       ROWS_SCATTER) == S("f32", (3, 11, 4))
    assert infer_shape("scatter", [S("f32", (5, 11)), S("s32", (5, 7)), S("f32", (5, 7))],
                       ALONG_SCATTER) == S("f32", (5, 11))


@pytest.mark.parametrize("opcode, shapes, attrs, match", [
    ("gather", [S("f32", (5, 11)), S("s64", (4, 3))], ALONG_GATHER, "batching dims"),
    ("gather", [S("f32", (5, 11)), S("f32", (5, 3))], ALONG_GATHER, "integers"),
    ("gather", [S("f32", (4, 10, 6)), S("s64", (2, 3))], {**ROWS_GATHER, "offset_dims": (0,)}, "offset_dims"),
    ("scatter", [S("f32", (3, 11, 4)), S("s64", (7,)), S("f32", (6, 3, 4))], ROWS_SCATTER, "batch dims"),
    ("scatter", [S("f32", (3, 11, 4)), S("s64", (7,)), S("f32", (7, 3, 5))], ROWS_SCATTER, "do not fit"),
    ("scatter", [S("f32", (3, 11, 4)), S("s64", (7,)), S("bf16", (7, 3, 4))], ROWS_SCATTER, "operand's type"),
    ("scatter", [S("f32", (5, 11)), S("s64", (5, 7)), S("f32", (5, 7))],
     {k: v for k, v in ALONG_SCATTER.items() if k != "index_vector_dim"}, "missing attribute 'index_vector_dim'"),
])
def test_bad_gathers_and_scatters_are_value_errors(opcode, shapes, attrs, match):
    with pytest.raises(ValueError, match=match):
        infer_shape(opcode, shapes, attrs)


def _inst(opcode, shapes, attrs, kind="add"):
    ops = [Instruction(f"p{i}", "parameter", s, (), {"parameter_number": i}) for i, s in enumerate(shapes)]
    attrs = dict(attrs)
    if opcode == "scatter":
        attrs["to_apply"] = _comp(kind)
    return Instruction("i", opcode, infer_shape(opcode, shapes, attrs), ops, attrs)


def test_forms_and_kinds():
    g = _inst("gather", [S("f32", (4, 10, 6)), S("s64", (2, 3))], ROWS_GATHER)
    assert (gather_form(g).kind, gather_form(g).axis) == ("rows", 1)
    g = _inst("gather", [S("f32", (5, 11)), S("s64", (5, 3))], ALONG_GATHER)
    assert gather_form(g).kind == "along" and gather_form(g).index_of == (0, 1)
    partial = {**ROWS_GATHER, "slice_sizes": (2, 1, 6)}
    assert gather_form(_inst("gather", [S("f32", (4, 10, 6)), S("s64", (2, 3))], partial)) is None
    s = _inst("scatter", [S("f32", (3, 11, 4)), S("s64", (7,)), S("f32", (7, 3, 4))], ROWS_SCATTER, "maximum")
    assert (scatter_form(s).kind, scatter_kind(s)) == ("rows", "maximum")
    s = _inst("scatter", [S("f32", (5, 11)), S("s64", (5, 7)), S("f32", (5, 7))], ALONG_SCATTER, "replace")
    assert (scatter_form(s).kind, scatter_kind(s)) == ("along", "replace")
    s.attrs["to_apply"] = _comp("subtract")
    assert scatter_kind(s) is None and scatter_form(s) is None


def test_verifier_requires_the_scatter_combiner():
    m = parse_module("""HloModule m

ENTRY %main (x: f32[4,3], i: s64[2], u: f32[2,3]) -> f32[4,3] {
  %x = f32[4,3] parameter(0)
  %i = s64[2] parameter(1)
  %u = f32[2,3] parameter(2)
  ROOT %s = f32[4,3] scatter(%x, %i, %u), index_vector_dim=1, update_window_dims={1}, inserted_window_dims={0}, \
scatter_dims_to_operand_dims={0}
}
""")
    with pytest.raises(VerifyError, match="to_apply"):
        verify_module(m)
