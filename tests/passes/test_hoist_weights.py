"""hoist-weights: golden HLO text of the prologue and the main program, the rules, and numerics."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module
from spmd.passes.hoist_weights import HoistWeights, select_outputs
from tests.passes.test_merge_dots import DOT, _module

MERGED = _module(
    ["x: f32[4,8]", "wq: f32[8,6]", "wk: f32[8,6]", "b: f32[12]"],
    ["%c = f32[8,12] concatenate(%wq, %wk), dimensions={1}",
     f"%m = f32[4,12] dot(%x, %c), {DOT}",
     "%bb = f32[4,12] broadcast(%b), dimensions={1}",
     "ROOT %out = f32[4,12] add(%m, %bb)"],
    "f32[4,12]", p=2)

CAST = _module(
    ["x: bf16[4,8]", "w: f32[6,8]", "s: f32[]"],
    ["%wt = f32[8,6] transpose(%w), dimensions={1,0}",
     "%sb = f32[8,6] broadcast(%s), dimensions={}",
     "%two = f32[] constant(2)",
     "%twob = f32[8,6] broadcast(%two), dimensions={}",
     "%ws = f32[8,6] multiply(%wt, %twob)",
     "%wc = bf16[8,6] convert(%ws)",
     f"%y = bf16[4,6] dot(%x, %wc), {DOT}",
     "%r = f32[8,6] reshape(%wt)",
     "%n = f32[8,6] multiply(%r, %sb)",
     "ROOT %out = (bf16[4,6], f32[8,6], f32[8,6]) tuple(%y, %n, %ws)"],
    "(bf16[4,6], f32[8,6], f32[8,6])")


def _table(dims: str, extra: str = "") -> str:
    """x @ w times an iota-built cosine table of ``dims`` (``extra``: more lines before the root)."""
    return _module(
        ["x: f32[64,32]", "w: f32[32,32]"],
        [f"%i = s32[{dims}] iota(), iota_dimension=0",
         f"%f = f32[{dims}] convert(%i)",
         f"%c = f32[{dims}] cosine(%f)",
         *([extra] if extra else []),
         f"%cb = f32[64,32] broadcast(%c), dimensions={{{'0,1' if dims == '64,32' else '1'}}}",
         f"%d = f32[64,32] dot(%x, %w), {DOT}",
         "ROOT %out = f32[64,32] multiply(%d, %cb)"],
        "f32[64,32]")


TABLE = _table("64,32")


def _split(text: str, weights: set[int]):
    """Split ``text``; check the prologue feeding the main program computes what ``text`` did (fresh inputs)."""
    before = parse_module(text)
    split = HoistWeights(weights=frozenset(weights)).split(parse_module(text))
    verify_module(split.main)
    args = [[torch.randn(p.shape.dims, dtype=torch.float64).to(p.shape.torch_dtype) + 0.1
             for p in before.entry.parameters] for _ in range(before.num_partitions)]
    want = evaluate_spmd(before, args)
    if split.prologue is None:
        got = evaluate_spmd(split.main, args)
    else:
        verify_module(split.prologue)
        hoisted = evaluate_spmd(split.prologue, [[a[i] for i in split.inputs] for a in args])
        got = evaluate_spmd(split.main, [a + list(h) for a, h in zip(args, zip(*hoisted, strict=True), strict=True)])
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w, g, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    return split


class GoldenTest(TestCase):
    def test_merged_weights_move_to_the_prologue(self):
        split = _split(MERGED, {1, 2, 3})
        assert split.hoisted == ("c.hoisted",) and split.inputs == (1, 2)
        self.assertExpectedInline(print_module(split.main), """\
HloModule m, num_partitions=2, mesh={tp=2}, is_partitioned=true

ENTRY %main (x: f32[4,8], wq: f32[8,6], wk: f32[8,6], b: f32[12], c.hoisted: f32[8,12]) -> f32[4,12] {
  %x = f32[4,8] parameter(0)
  %wq = f32[8,6] parameter(1)
  %wk = f32[8,6] parameter(2)
  %b = f32[12] parameter(3)
  %c.hoisted = f32[8,12] parameter(4)
  %m = f32[4,12] dot(%x, %c.hoisted), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %bb = f32[4,12] broadcast(%b), dimensions={1}
  ROOT %out = f32[4,12] add(%m, %bb)
}
""")
        self.assertExpectedInline(print_module(split.prologue), """\
HloModule m.prologue, num_partitions=2, mesh={tp=2}, is_partitioned=true

ENTRY %main (wq: f32[8,6], wk: f32[8,6]) -> (f32[8,12]) {
  %wq = f32[8,6] parameter(0)
  %wk = f32[8,6] parameter(1)
  %c = f32[8,12] concatenate(%wq, %wk), dimensions={1}, stream_id=0
  ROOT %hoisted = (f32[8,12]) tuple(%c), stream_id=0
}
""")

    def test_the_prologue_takes_only_the_weights_it_reads(self):
        """Another program of the same weights (a decode step: other per-call inputs, in other
        places) gets the same prologue text but for its name: the runtime shares its values."""
        decode = _module(
            ["wq: f32[8,6]", "wk: f32[8,6]", "tok: f32[2,8]", "slot: s32[]"],
            ["%c = f32[8,12] concatenate(%wq, %wk), dimensions={1}",
             f"ROOT %m = f32[2,12] dot(%tok, %c), {DOT}"],
            "f32[2,12]", p=2)
        split = _split(decode, {0, 1})
        assert split.inputs == (0, 1)
        merged = _split(MERGED, {1, 2, 3})
        assert print_module(split.prologue) == print_module(merged.prologue)  # golden text above

    def test_weight_values_come_first_and_split_off_from_the_constants(self):
        """A cosine table (constant-only, defined first) and a negated weight: the weight value is
        hoisted first, and ``select_outputs`` gives each group its own prologue."""
        text = _module(
            ["x: f32[64,32]", "w: f32[32,32]"],
            ["%i = s32[64,32] iota(), iota_dimension=0",
             "%f = f32[64,32] convert(%i)",
             "%c = f32[64,32] cosine(%f)",
             "%n = f32[32,32] negate(%w)",
             f"%d = f32[64,32] dot(%x, %n), {DOT}",
             "ROOT %out = f32[64,32] multiply(%d, %c)"],
            "f32[64,32]")
        split = _split(text, {1})
        assert split.hoisted == ("n.hoisted", "c.hoisted") and split.num_weight_values == 1
        assert split.inputs == (1,)
        weights, used = select_outputs(split.prologue, [0])
        constants, none = select_outputs(split.prologue, [1])
        assert used == (0,) and none == ()
        self.assertExpectedInline(print_module(weights).split("ENTRY", 1)[1], """\
 %main (w: f32[32,32]) -> (f32[32,32]) {
  %w = f32[32,32] parameter(0)
  %n = f32[32,32] negate(%w), stream_id=0
  ROOT %hoisted = (f32[32,32]) tuple(%n), stream_id=0
}
""")
        self.assertExpectedInline(print_module(constants).split("ENTRY", 1)[1], """\
 %main () -> (f32[64,32]) {
  %i = s32[64,32] iota(), iota_dimension=0, stream_id=0
  %f = f32[64,32] convert(%i), stream_id=0
  %c = f32[64,32] cosine(%f), stream_id=0
  ROOT %hoisted = (f32[64,32]) tuple(%c), stream_id=0
}
""")
        with pytest.raises(ValueError, match="indices"):
            select_outputs(split.prologue, [2])

    def test_cast_chain_with_constants_is_hoisted_views_and_broadcasts_are_not(self):
        # %wc (a cast of a scaled transpose) and the output %ws pay; %r is a view of a view (free),
        # %sb a broadcast of a weight (a view that would grow the cache).
        split = _split(CAST, {1, 2})
        assert split.hoisted == ("ws.hoisted", "wc.hoisted") and split.inputs == (1,)
        self.assertExpectedInline(print_module(split.main), """\
HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

ENTRY %main (x: bf16[4,8], w: f32[6,8], s: f32[], ws.hoisted: f32[8,6], wc.hoisted: bf16[8,6]) -> (bf16[4,6], f32[8,6], f32[8,6]) {
  %x = bf16[4,8] parameter(0)
  %w = f32[6,8] parameter(1)
  %s = f32[] parameter(2)
  %ws.hoisted = f32[8,6] parameter(3)
  %wc.hoisted = bf16[8,6] parameter(4)
  %wt = f32[8,6] transpose(%w), dimensions={1,0}
  %sb = f32[8,6] broadcast(%s), dimensions={}
  %y = bf16[4,6] dot(%x, %wc.hoisted), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %r = f32[8,6] reshape(%wt)
  %n = f32[8,6] multiply(%r, %sb)
  ROOT %out = (bf16[4,6], f32[8,6], f32[8,6]) tuple(%y, %n, %ws.hoisted)
}
""")
        self.assertExpectedInline(print_module(split.prologue).split("ENTRY", 1)[1], """\
 %main (w: f32[6,8]) -> (f32[8,6], bf16[8,6]) {
  %w = f32[6,8] parameter(0)
  %wt = f32[8,6] transpose(%w), dimensions={1,0}, stream_id=0
  %two = f32[] constant(2.0), stream_id=0
  %twob = f32[8,6] broadcast(%two), dimensions={}, stream_id=0
  %ws = f32[8,6] multiply(%wt, %twob), stream_id=0
  %wc = bf16[8,6] convert(%ws), stream_id=0
  ROOT %hoisted = (f32[8,6], bf16[8,6]) tuple(%ws, %wc), stream_id=0
}
""")


    def test_a_constant_table_that_costs_kernels_moves_to_the_prologue(self):
        """The table's last computed value is hoisted (not its convert, nor the broadcast: a view)."""
        split = _split(TABLE, {1})
        assert split.hoisted == ("c.hoisted",) and split.inputs == ()
        self.assertExpectedInline(print_module(split.main).split("ENTRY", 1)[1], """\
 %main (x: f32[64,32], w: f32[32,32], c.hoisted: f32[64,32]) -> f32[64,32] {
  %x = f32[64,32] parameter(0)
  %w = f32[32,32] parameter(1)
  %c.hoisted = f32[64,32] parameter(2)
  %cb = f32[64,32] broadcast(%c.hoisted), dimensions={0,1}
  %d = f32[64,32] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %out = f32[64,32] multiply(%d, %cb)
}
""")
        self.assertExpectedInline(print_module(split.prologue).split("ENTRY", 1)[1], """\
 %main () -> (f32[64,32]) {
  %i = s32[64,32] iota(), iota_dimension=0, stream_id=0
  %f = f32[64,32] convert(%i), stream_id=0
  %c = f32[64,32] cosine(%f), stream_id=0
  ROOT %hoisted = (f32[64,32]) tuple(%c), stream_id=0
}
""")


# --------------------------------------------------------------------------- rules
def test_constant_tables_stay_without_weights_when_small_or_per_device():
    assert HoistWeights().split(parse_module(TABLE)).prologue is None  # no weights: nothing is hoisted
    assert _split(_table("32"), {1}).prologue is None  # 32 elements: the lowering folds the table
    per_device = TABLE.replace("%i = s32[64,32] iota(), iota_dimension=0",
                               "%pid = u32[] partition-id()\n  %pc = s32[] convert(%pid)\n"
                               "  %i = s32[64,32] broadcast(%pc), dimensions={}")
    assert "partition-id" in per_device and _split(per_device, {1}).prologue is None


def test_only_weights_are_hoisted():
    # wk is not a weight (a per-call input, or donated): the concatenation reads it, so it stays
    split = _split(MERGED, {1, 3})
    assert split.prologue is None and "concatenate" in print_module(split.main)


def test_nothing_is_hoisted_without_weights_or_when_disabled():
    for p in (HoistWeights(), HoistWeights(enabled=False, weights=frozenset({1, 2}))):
        text = print_module(p.run(parse_module(MERGED)))
        assert text == print_module(parse_module(MERGED))


def test_view_only_chains_stay():
    text = _module(["x: f32[4,6]", "w: f32[6,8]"],
                   ["%wt = f32[8,6] transpose(%w), dimensions={1,0}",
                    "%ws = f32[4,6] slice(%wt), slice={[0:4:1], [0:6:1]}",
                    "ROOT %y = f32[4,6] add(%x, %ws)"],
                   "f32[4,6]")
    assert _split(text, {1}).prologue is None


def test_collectives_are_not_hoisted():
    text = _module(["x: f32[4,8]", "w: f32[4,8]"],
                   ["%g = f32[8,8] all-gather(%w), dimensions={0}, replica_groups={{0,1}}",
                    "%gn = f32[8,8] negate(%g)",
                    "%wn = f32[4,8] negate(%w)",
                    "%xw = f32[4,8] add(%x, %wn)",
                    "ROOT %out = (f32[8,8], f32[4,8]) tuple(%gn, %xw)"],
                   "(f32[8,8], f32[4,8])", p=2)
    split = _split(text, {1})
    assert split.hoisted == ("wn.hoisted",)
    assert "all-gather" not in print_module(split.prologue) and "all-gather" in print_module(split.main)


def test_a_program_of_weights_only_returns_the_hoisted_value():
    text = _module(["w: f32[4,8]"], ["ROOT %e = f32[4,8] exponential(%w)"], "f32[4,8]")
    split = _split(text, {0})
    assert split.main.entry.root.opcode == "parameter" and split.hoisted == ("e.hoisted",)


def test_unpartitioned_module_is_a_value_error():
    text = MERGED.replace(", is_partitioned=true", "")
    with pytest.raises(ValueError, match="partitioned"):
        HoistWeights(weights=frozenset({1})).split(parse_module(text))
    with pytest.raises(TypeError, match="enabled"):
        HoistWeights(enabled=1)


def test_options_are_checked():
    import spmd

    with pytest.raises(TypeError, match="hoist_weights"):
        spmd.CompileOptions(hoist_weights=1)
    mesh = spmd.Mesh.create(("tp",), devices="cpu:1")
    with pytest.raises(TypeError, match="weight_argnums"):
        spmd.jit(lambda x: x, mesh=mesh, weight_argnums="0")
    with pytest.raises(TypeError, match="weight_argnums"):
        spmd.jit(lambda x: x, mesh=mesh, weight_argnums=(-1,))
