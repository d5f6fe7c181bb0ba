"""batch_dims: the batch dim of every value, op by op, and the ops that make a program unsplittable."""

from __future__ import annotations

import pytest

from spmd.ir.text import parse_module
from spmd.passes.batch_dims import UnsplittableError, analyze, needs_rows
from tests.passes.test_merge_dots import _module


def _dims(params: list[str], body: list[str], result: str, carriers: dict[int, int], batch: int) -> dict[str, object]:
    comp = parse_module(_module(params, body, result)).entry
    return {i.name: b for i, b in analyze(comp, carriers, batch).dims.items()}


def test_reshape_merges_the_batch_as_the_outer_factor_and_splits_it_back():
    dims = _dims(["x: f32[4,6,8]", "w: f32[8,8]"],
                 ["%f = f32[24,8] reshape(%x)",
                  "%y = f32[24,8] dot(%f, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
                  "%t = f32[8,24] transpose(%y), dimensions={1,0}",
                  "%u = f32[24,8] transpose(%t), dimensions={1,0}",
                  "ROOT %b = f32[4,6,8] reshape(%u)"],
                 "f32[4,6,8]", {0: 0}, 4)
    assert dims["f"] == (0, 6) and dims["y"] == (0, 6) and dims["t"] == (1, 6) and dims["b"] == (0, 1)
    assert dims["w"] is None


def test_a_reshape_that_puts_the_batch_inside_a_dim_is_unsplittable():
    with pytest.raises(UnsplittableError, match="%f"):
        _dims(["x: f32[4,6]"], ["ROOT %f = f32[6,4] reshape(%x)"], "f32[6,4]", {0: 0}, 4)


def test_attention_and_dot_batch_dims():
    dims = _dims(["q: f32[2,4,5,8]", "k: f32[2,4,5,8]"],
                 ["%s = f32[2,4,5,5] dot(%q, %k), lhs_batch_dims={0,1}, rhs_batch_dims={0,1}, "
                  "lhs_contracting_dims={3}, rhs_contracting_dims={3}",
                  'ROOT %a = f32[2,4,5,8] custom-call(%q, %k, %k), custom_call_target="attention"'],
                 "f32[2,4,5,8]", {0: 0, 1: 0}, 2)
    assert dims["s"] == (0, 1) and dims["a"] == (0, 1)
    with pytest.raises(UnsplittableError, match="attends"):
        _dims(["q: f32[2,4,5,8]"], ['ROOT %a = f32[2,4,5,8] custom-call(%q, %q, %q), custom_call_target="attention"'],
              "f32[2,4,5,8]", {0: 2}, 5)


def test_embedding_gather_follows_the_indices():
    dims = _dims(["ids: s32[3,5]", "table: f32[10,8]"],
                 ["ROOT %e = f32[3,5,8] gather(%table, %ids), offset_dims={2}, collapsed_slice_dims={0}, "
                  "start_index_map={0}, index_vector_dim=2, slice_sizes={1,8}"],
                 "f32[3,5,8]", {0: 0}, 3)
    assert dims["e"] == (0, 1)


def test_shared_operands_are_sliced_where_rows_align():
    comp = parse_module(_module(["x: f32[4,8]", "w: f32[8,8]", "b: f32[4,8]"],
                                ["%y = f32[4,8] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
                                 "ROOT %o = f32[4,8] add(%y, %b)"], "f32[4,8]")).entry
    plan = analyze(comp, {0: 0}, 4)
    y, o = comp.instructions[-2], comp.instructions[-1]
    assert needs_rows(y, 1, plan.dims[y], plan.dims) is None  # the weight of a free-dim batch: read whole
    assert needs_rows(o, 1, plan.dims[o], plan.dims) == 0  # a shared addend: its rows of the half


@pytest.mark.parametrize("body, result, match", [
    (["ROOT %s = f32[8] reduce(%x, %z), dimensions={0}, to_apply=%add"], "f32[8]", "reduces"),
    (['ROOT %s = f32[4,8] custom-call(%x), custom_call_target="softmax", backend_config={"dim":0}'], "f32[4,8]",
     "normalizes"),
    (["ROOT %c = f32[8,8] concatenate(%x, %x), dimensions={0}"], "f32[8,8]", "concatenates"),
    (["ROOT %g = f32[8,8] all-gather(%x), dimensions={0}, replica_groups={{0}}"], "f32[8,8]", "gathers"),
])
def test_ops_that_mix_rows(body, result, match):
    text = _module(["x: f32[4,8]"], ["%z = f32[] constant(0)", *body], result).replace("\nENTRY", """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s.1 = f32[] add(%a, %b)
}

ENTRY""")
    with pytest.raises(UnsplittableError, match=match):
        analyze(parse_module(text).entry, {0: 0}, 4)
