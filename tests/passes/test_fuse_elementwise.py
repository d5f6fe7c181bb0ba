"""fuse-elementwise: golden HLO text, what stays unfused, random DAGs, numerics through the pipeline."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import copy
import re

import pytest
import torch
from expecttest import TestCase
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spmd
import spmd.passes.fuse_elementwise as fe
from benchmarks.workloads import WORKLOADS, make_inputs
from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module
from spmd.models.bert import BertConfig, BertSentenceEncoder
from spmd.models.common import init_random_
from spmd.models.plans import bert_plan
from spmd.parallelize import parallelize
from spmd.passes.fuse_elementwise import FuseElementwise
from spmd.passes.windowed_einsum import WindowedEinsum
from tests.passes.fuse_elementwise_programs import (  # noqa: F401  (re-exported for other tests)
    AFTER_ALL_REDUCE,
    CASES,
    DOT,
    LN,
    SUM,
    _mask,
    module,
    random_args,
)
from tests.passes.test_windowed_einsum import ag_module

P = spmd.PartitionSpec

def fuse(text: str, **options) -> tuple[str, object]:
    """Run the pass on ``text``; verify, round-trip the text, and compare values on random inputs."""
    before, mod = parse_module(text), parse_module(text)
    FuseElementwise(**options).run(mod)
    verify_module(mod)
    out = print_module(mod)
    assert print_module(parse_module(out)) == out
    called = set(re.findall(r"calls=(%[\w.]+)", out))
    defined = set(re.findall(r"^(%fused_computation[\w.]*) \(", out, flags=re.M))
    assert defined == called, f"fused computations defined {defined}, called {called}"
    args = random_args(before)
    for want, got in zip(evaluate_spmd(before, args), evaluate_spmd(mod, args), strict=True):
        for w, g in zip(want, got, strict=True):
            assert w.dtype == g.dtype and w.shape == g.shape
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, equal_nan=True)
    return out, mod


def entry(text: str) -> str:
    return text.split("ENTRY", 1)[1]


def fusions(mod) -> list:
    return [i for i in mod.entry.instructions if i.opcode == "fusion"]


# --------------------------------------------------------------------------- programs
SHARED_PRODUCER = module(
    ["x: f32[4,8]", "bias: f32[8]"],
    ["%bb = f32[4,8] broadcast(%bias), dimensions={1}",
     "%a = f32[4,8] add(%x, %bb)",
     "%t = f32[4,8] tanh(%a)",
     "%e = f32[4,8] exponential(%t)",
     "%m = f32[4,8] multiply(%bb, %e)",
     "ROOT %out = (f32[4,8], f32[4,8]) tuple(%a, %m)"],
    "(f32[4,8], f32[4,8])")

ADDMM = module(
    ["x: f32[4,8]", "w: f32[8,8]", "b: f32[8]"],
    [f"%d = f32[4,8] dot(%x, %w), {DOT}",
     "%bb = f32[4,8] broadcast(%b), dimensions={1}",
     "%a = f32[4,8] add(%d, %bb)",
     '%g = f32[4,8] custom-call(%a), custom_call_target="gelu", backend_config={"approximate":"none"}',
     "ROOT %r = f32[4,8] multiply(%g, %x)"],
    "f32[4,8]")


class GoldenTest(TestCase):
    def test_bias_residual_and_layer_norm_after_an_all_reduce_become_one_fusion(self):
        out, mod = fuse(AFTER_ALL_REDUCE)
        self.assertExpectedInline(out.split("%fused_computation", 1)[1], """\
 (param_0: f32[8], param_1: f32[4,8,8], param_2: f32[4,8,8], param_3: f32[8], param_4: f32[8]) -> f32[4,8,8] {
  %param_0 = f32[8] parameter(0)
  %param_1 = f32[4,8,8] parameter(1)
  %param_2 = f32[4,8,8] parameter(2)
  %param_3 = f32[8] parameter(3)
  %param_4 = f32[8] parameter(4)
  %bb.1 = f32[4,8,8] broadcast(%param_0), dimensions={2}
  %x.1 = f32[4,8,8] add(%param_1, %bb.1)
  %y.1 = f32[4,8,8] add(%x.1, %param_2)
  ROOT %ln.1 = f32[4,8,8] custom-call(%y.1, %param_3, %param_4), custom_call_target="layer-norm", backend_config={"normalized_ndim":1,"eps":1e-05}
}

ENTRY %main (h: f32[4,8,16], w: f32[16,8], bias: f32[8], res: f32[4,8,8], g: f32[8], beta: f32[8]) -> f32[4,8,8] {
  %h = f32[4,8,16] parameter(0)
  %w = f32[16,8] parameter(1)
  %bias = f32[8] parameter(2)
  %res = f32[4,8,8] parameter(3)
  %g = f32[8] parameter(4)
  %beta = f32[8] parameter(5)
  %dot = f32[4,8,8] dot(%h, %w), lhs_contracting_dims={2}, rhs_contracting_dims={0}
  %ar = f32[4,8,8] all-reduce(%dot), to_apply=%add.f32, replica_groups={{0,1}}
  ROOT %fusion = f32[4,8,8] fusion(%bias, %ar, %res, %g, %beta), calls=%fused_computation, kind=kLoop
}
""")
        assert len(fusions(mod)) == 1

    def test_a_producer_read_outside_stays_and_a_broadcast_is_duplicated(self):
        out, mod = fuse(SHARED_PRODUCER)
        self.assertExpectedInline(out.split("%fused_computation", 1)[1], """\
 (param_0: f32[8], param_1: f32[4,8]) -> f32[4,8] {
  %param_0 = f32[8] parameter(0)
  %param_1 = f32[4,8] parameter(1)
  %bb.1 = f32[4,8] broadcast(%param_0), dimensions={1}
  %t.1 = f32[4,8] tanh(%param_1)
  %e.1 = f32[4,8] exponential(%t.1)
  ROOT %m.1 = f32[4,8] multiply(%bb.1, %e.1)
}

ENTRY %main (x: f32[4,8], bias: f32[8]) -> (f32[4,8], f32[4,8]) {
  %x = f32[4,8] parameter(0)
  %bias = f32[8] parameter(1)
  %bb = f32[4,8] broadcast(%bias), dimensions={1}
  %a = f32[4,8] add(%x, %bb)
  %fusion = f32[4,8] fusion(%bias, %a), calls=%fused_computation, kind=kLoop
  ROOT %out = (f32[4,8], f32[4,8]) tuple(%a, %fusion)
}
""")

    def test_the_bias_add_of_a_16_bit_dot_is_left_for_addmm(self):
        out, _ = fuse(ADDMM.replace("f32[", "bf16["))
        self.assertExpectedInline(entry(out), """\
 %main (x: bf16[4,8], w: bf16[8,8], b: bf16[8]) -> bf16[4,8] {
  %x = bf16[4,8] parameter(0)
  %w = bf16[8,8] parameter(1)
  %b = bf16[8] parameter(2)
  %d = bf16[4,8] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %bb = bf16[4,8] broadcast(%b), dimensions={1}
  %a = bf16[4,8] add(%d, %bb)
  ROOT %fusion = bf16[4,8] fusion(%a, %x), calls=%fused_computation, kind=kLoop
}
""")

    def test_a_float32_bias_add_read_only_by_fusing_ops_joins_their_fusion(self):
        """Inductor's unfused bias: a plain GEMM, and the bias add inside the GELU's kernel."""
        out, _ = fuse(ADDMM)
        self.assertExpectedInline(entry(out), """\
 %main (x: f32[4,8], w: f32[8,8], b: f32[8]) -> f32[4,8] {
  %x = f32[4,8] parameter(0)
  %w = f32[8,8] parameter(1)
  %b = f32[8] parameter(2)
  %d = f32[4,8] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %fusion = f32[4,8] fusion(%b, %d, %x), calls=%fused_computation, kind=kLoop
}
""")

    def test_a_float32_bias_add_read_by_a_view_is_left_for_addmm(self):
        """Merged q/k/v: the bias-added product is sliced for the attention (no kernel to fuse into)."""
        text = module(
            ["x: f32[4,8]", "w: f32[8,8]", "b: f32[8]"],
            [f"%d = f32[4,8] dot(%x, %w), {DOT}",
             "%bb = f32[4,8] broadcast(%b), dimensions={1}",
             "%a = f32[4,8] add(%d, %bb)",
             "%s = f32[4,4] slice(%a), slice={[0:4:1], [0:4:1]}",
             "ROOT %r = f32[4,4] tanh(%s)"],
            "f32[4,4]")
        out, _ = fuse(text)
        assert "%a = f32[4,8] add(%d, %bb)" in entry(out)

    def test_an_add_of_a_dot_and_a_computed_bias_is_not_a_fusion_root(self):
        text = module(
            ["x: f32[4,8]", "w: f32[8,8]", "b: s32[8]"],
            [f"%d = f32[4,8] dot(%x, %w), {DOT}",
             "%bc = f32[8] convert(%b)",
             "%bf = f32[8] negate(%bc)",
             "%bb = f32[4,8] broadcast(%bf), dimensions={1}",
             "ROOT %a = f32[4,8] add(%d, %bb)"],
            "f32[4,8]")
        out, mod = fuse(text)
        self.assertExpectedInline(entry(out), """\
 %main (x: f32[4,8], w: f32[8,8], b: s32[8]) -> f32[4,8] {
  %x = f32[4,8] parameter(0)
  %w = f32[8,8] parameter(1)
  %b = s32[8] parameter(2)
  %d = f32[4,8] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %fusion = f32[8] fusion(%b), calls=%fused_computation, kind=kLoop
  %bb = f32[4,8] broadcast(%fusion), dimensions={1}
  ROOT %a = f32[4,8] add(%d, %bb)
}
""")

    def test_a_concatenate_of_negated_halves_fuses_with_its_multiply_add(self):
        """Rotary embedding's rotate-half: the negate and the concatenate cost no kernels of their own."""
        text = module(["x: f32[4,8]", "c: f32[4,8]"], [
            "%lo = f32[4,4] slice(%x), slice={[0:4:1], [0:4:1]}",
            "%hi = f32[4,4] slice(%x), slice={[0:4:1], [4:8:1]}",
            "%n = f32[4,4] negate(%hi)",
            "%r = f32[4,8] concatenate(%n, %lo), dimensions={1}",
            "%m = f32[4,8] multiply(%r, %c)",
            "ROOT %o = f32[4,8] add(%m, %x)"], "f32[4,8]")
        out, mod = fuse(text)
        self.assertExpectedInline(out.split("%fused_computation", 1)[1], """\
 (param_0: f32[4,8], param_1: f32[4,8]) -> f32[4,8] {
  %param_0 = f32[4,8] parameter(0)
  %param_1 = f32[4,8] parameter(1)
  %hi.1 = f32[4,4] slice(%param_0), slice={[0:4:1], [4:8:1]}
  %n.1 = f32[4,4] negate(%hi.1)
  %lo.1 = f32[4,4] slice(%param_0), slice={[0:4:1], [0:4:1]}
  %r.1 = f32[4,8] concatenate(%n.1, %lo.1), dimensions={1}
  %m.1 = f32[4,8] multiply(%r.1, %param_1)
  ROOT %o.1 = f32[4,8] add(%m.1, %param_0)
}

ENTRY %main (x: f32[4,8], c: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8] parameter(0)
  %c = f32[4,8] parameter(1)
  ROOT %fusion = f32[4,8] fusion(%x, %c), calls=%fused_computation, kind=kLoop
}
""")
        assert len(fusions(mod)) == 1

    def test_ops_on_different_streams_are_not_fused_together(self):
        text = module(["x: f32[4,8]"], [
            "%a = f32[4,8] negate(%x), stream_id=1",
            "%b = f32[4,8] tanh(%a), stream_id=1",
            "%c = f32[4,8] exponential(%b)",
            "ROOT %d = f32[4,8] sqrt(%c)"], "f32[4,8]")
        out, mod = fuse(text)
        self.assertExpectedInline(out.split("\n\n", 1)[1], """\
%fused_computation (param_0: f32[4,8]) -> f32[4,8] {
  %param_0 = f32[4,8] parameter(0)
  %c.1 = f32[4,8] exponential(%param_0)
  ROOT %d.1 = f32[4,8] sqrt(%c.1)
}

%fused_computation.1 (param_0.1: f32[4,8]) -> f32[4,8] {
  %param_0.1 = f32[4,8] parameter(0)
  %a.1 = f32[4,8] negate(%param_0.1)
  ROOT %b.1 = f32[4,8] tanh(%a.1)
}

ENTRY %main (x: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8] parameter(0)
  %fusion.1 = f32[4,8] fusion(%x), calls=%fused_computation.1, kind=kLoop, stream_id=1
  ROOT %fusion = f32[4,8] fusion(%fusion.1), calls=%fused_computation, kind=kLoop
}
""")

    def test_a_residual_add_read_by_two_fusions_is_recomputed_in_both(self):
        text = module(["x: f32[4,8]", "y: f32[4,8]"], [
            "%t = f32[4,8] tanh(%x)",
            "%p = f32[4,8] add(%t, %y)",
            "%l1 = f32[4,8] exponential(%p)",
            "%l2 = f32[4,8] log(%p)",
            "ROOT %out = (f32[4,8], f32[4,8]) tuple(%l1, %l2)"], "(f32[4,8], f32[4,8])")
        out, mod = fuse(text)
        self.assertExpectedInline(entry(out), """\
 %main (x: f32[4,8], y: f32[4,8]) -> (f32[4,8], f32[4,8]) {
  %x = f32[4,8] parameter(0)
  %y = f32[4,8] parameter(1)
  %t = f32[4,8] tanh(%x)
  %fusion.1 = f32[4,8] fusion(%t, %y), calls=%fused_computation.1, kind=kLoop
  %fusion = f32[4,8] fusion(%t, %y), calls=%fused_computation, kind=kLoop
  ROOT %out = (f32[4,8], f32[4,8]) tuple(%fusion.1, %fusion)
}
""")
        assert len(mod.computations) == 2  # no fused computation left over for %p itself

    def test_widening_converts_below_a_recomputed_producer_are_recomputed_too(self):
        """An MSE loss on 16-bit values: ``d = f32(p) - f32(y)`` is read by the loss reduce and by
        the gradient. ``d`` is recomputed in both fusions, and so are the widening converts it
        reads: each fusion reads p and y in bf16; no convert kernel, no float32 copy stored."""
        text = module(["p: bf16[4,8]", "y: bf16[4,8]"], [
            "%pf = f32[4,8] convert(%p)",
            "%yf = f32[4,8] convert(%y)",
            "%d = f32[4,8] subtract(%pf, %yf)",
            "%sq = f32[4,8] multiply(%d, %d)",
            "%z = f32[] constant(0)",
            "%l = f32[] reduce(%sq, %z), dimensions={0,1}, to_apply=%add.f32",
            "%two = f32[4,8] add(%d, %d)",
            "%g = bf16[4,8] convert(%two)",
            "ROOT %out = (f32[], bf16[4,8]) tuple(%l, %g)"], "(f32[], bf16[4,8])", reducers=True)
        out, mod = fuse(text)
        self.assertExpectedInline(entry(out), """\
 %main (p: bf16[4,8], y: bf16[4,8]) -> (f32[], bf16[4,8]) {
  %p = bf16[4,8] parameter(0)
  %y = bf16[4,8] parameter(1)
  %z = f32[] constant(0.0)
  %fusion.1 = f32[] fusion(%p, %y, %z), calls=%fused_computation.1, kind=kLoop
  %fusion = bf16[4,8] fusion(%p, %y), calls=%fused_computation, kind=kLoop
  ROOT %out = (f32[], bf16[4,8]) tuple(%fusion.1, %fusion)
}
""")
        for f in fusions(mod):
            assert {o.name for o in f.operands} - {"z"} == {"p", "y"}

    def test_a_narrowing_convert_below_a_recomputed_producer_is_an_input(self):
        """A convert to a narrower type below a recomputed producer stays a kernel whose result the
        fusions read (recomputing it would read the wide value in every fusion)."""
        text = module(["p: f32[4,8]"], [
            "%pb = bf16[4,8] convert(%p)",
            "%d = bf16[4,8] subtract(%pb, %pb)",
            "%a = bf16[4,8] exponential(%d)",
            "%b = bf16[4,8] log(%d)",
            "ROOT %out = (bf16[4,8], bf16[4,8]) tuple(%a, %b)"], "(bf16[4,8], bf16[4,8])")
        _, mod = fuse(text)
        assert [i.opcode for i in mod.entry.instructions if i.opcode != "parameter"] == [
            "convert", "fusion", "fusion", "tuple"]
        assert all([o.name for o in f.operands] == ["pb"] for f in fusions(mod))


# --------------------------------------------------------------------------- what is left alone
def test_a_lone_kernel_is_not_fused_and_min_kernels_sets_the_threshold():
    lone = module(["x: f32[4,8]"], ["%bb = f32[2,4,8] broadcast(%x), dimensions={1,2}",
                                    "ROOT %t = f32[2,4,8] tanh(%bb)"], "f32[2,4,8]")
    assert fuse(lone)[0] == print_module(parse_module(lone))
    _, mod = fuse(lone, min_kernels=1)
    assert [i.opcode for i in fusions(mod)[0].attrs["calls"].instructions] == ["parameter", "broadcast", "tanh"]
    pair = module(["x: f32[4,8]"], ["%a = f32[4,8] tanh(%x)", "ROOT %b = f32[4,8] exponential(%a)"], "f32[4,8]")
    assert len(fusions(fuse(pair)[1])) == 1
    assert fuse(pair, min_kernels=3)[0] == print_module(parse_module(pair))


def test_partition_id_arithmetic_of_a_windowed_einsum_is_left_to_the_lowering(monkeypatch):
    mod = parse_module(ag_module("lhs", 2, 4))
    WindowedEinsum(mode="on").run(mod)
    text = print_module(mod)
    assert "partition-id" in text and "remainder" in text
    assert fuse(text)[0] == text
    monkeypatch.setattr(fe, "folded_instructions", lambda comp: set())  # the control: without the rule
    assert len(fusions(fuse(text)[1])) == 2


def test_pads_of_a_slice_backward_fuse_into_their_consumer():
    """rotate_half's backward after simplify: two edge pads and their sum are one fusion; a pad with
    interior or negative padding stays a kernel of its own."""
    text = module(["a: f32[2,4]", "b: f32[2,4]", "c: f32[2,8]"],
                  ["%z = f32[] constant(0)",
                   "%n = f32[2,4] negate(%a)",
                   "%lo = f32[2,8] pad(%n, %z), padding=0_0_0x0_4_0",
                   "%hi = f32[2,8] pad(%b, %z), padding=0_0_0x4_0_0",
                   "%s = f32[2,8] add(%lo, %hi)",
                   "ROOT %m = f32[2,8] multiply(%s, %c)"], "f32[2,8]")
    _, mod = fuse(text)
    assert [i.opcode for i in mod.entry.instructions if i.opcode not in ("parameter", "constant")] == ["fusion"]
    assert sum(i.opcode == "pad" for i in fusions(mod)[0].attrs["calls"].instructions) == 2
    crop = module(["a: f32[2,4]", "c: f32[2,3]"],
                  ["%z = f32[] constant(0)", "%n = f32[2,4] negate(%a)",
                   "%p = f32[2,3] pad(%n, %z), padding=0_0_0x0_-1_0",
                   "ROOT %m = f32[2,3] multiply(%p, %c)"], "f32[2,3]")
    assert [i.opcode for i in fuse(crop)[1].entry.instructions if i.opcode not in ("parameter", "constant")] == [
        "negate", "pad", "multiply"]


def test_rotate_half_concatenate_fuses_into_the_rotary_embedding():
    """q * cos + cat(-q2, q1) * sin (rotary embeddings) is one fusion: the concatenate and the
    negate no longer run as kernels of their own."""
    text = module(["q: f32[2,8]", "cos: f32[2,8]", "sin: f32[2,8]"],
                  ["%q1 = f32[2,4] slice(%q), slice={[0:2:1], [0:4:1]}",
                   "%q2 = f32[2,4] slice(%q), slice={[0:2:1], [4:8:1]}",
                   "%n = f32[2,4] negate(%q2)",
                   "%rot = f32[2,8] concatenate(%n, %q1), dimensions={1}",
                   "%a = f32[2,8] multiply(%q, %cos)",
                   "%b = f32[2,8] multiply(%rot, %sin)",
                   "ROOT %r = f32[2,8] add(%a, %b)"], "f32[2,8]")
    _, mod = fuse(text)
    assert [i.opcode for i in mod.entry.instructions if i.opcode != "parameter"] == ["fusion"]
    body = {i.opcode for i in fusions(mod)[0].attrs["calls"].instructions}
    assert {"concatenate", "negate", "slice"} <= body


def test_a_fusion_read_only_by_a_transpose_writes_the_transposed_order():
    """The transposed value feeds a reshape that merges the transposed dims (a copy as a transpose
    of a row-major value); computed by the fusion, the reshape is a view. A fusion with another
    user keeps its order."""
    text = module(["a: f32[2,3,4]", "b: f32[2,3,4]", "w: f32[4,5]"],
                  ["%m = f32[2,3,4] multiply(%a, %b)",
                   "%e = f32[2,3,4] exponential(%m)",
                   "%t = f32[3,2,4] transpose(%e), dimensions={1,0,2}",
                   "%r = f32[6,4] reshape(%t)",
                   f"ROOT %d = f32[6,5] dot(%r, %w), {DOT}"], "f32[6,5]")
    _, mod = fuse(text)
    assert [i.opcode for i in mod.entry.instructions if i.opcode != "parameter"] == ["fusion", "reshape", "dot"]
    (f,) = fusions(mod)
    assert f.shape.dims == (3, 2, 4) and f.attrs["calls"].root.opcode == "transpose"
    shared = text.replace(f"ROOT %d = f32[6,5] dot(%r, %w), {DOT}",
                          f"%d = f32[6,5] dot(%r, %w), {DOT}\n  ROOT %out = (f32[6,5], f32[2,3,4]) tuple(%d, %e)")
    shared = shared.replace("-> f32[6,5]", "-> (f32[6,5], f32[2,3,4])")
    _, mod = fuse(shared)
    assert [f.shape.dims for f in fusions(mod)] == [(2, 3, 4)]
    assert "transpose" in [i.opcode for i in mod.entry.instructions]


def test_silu_read_by_two_products_is_recomputed_in_both():
    """SwiGLU: silu(gate) * up in the forward, dout * silu(gate) in the backward: two fusions, no
    silu kernel (it was one silu and two multiplies)."""
    text = module(["g: f32[4,8]", "u: f32[4,8]", "d: f32[4,8]"],
                  ['%s = f32[4,8] custom-call(%g), custom_call_target="silu"',
                   "%p = f32[4,8] multiply(%s, %u)",
                   "%q = f32[4,8] multiply(%d, %s)",
                   "ROOT %out = (f32[4,8], f32[4,8]) tuple(%p, %q)"], "(f32[4,8], f32[4,8])")
    _, mod = fuse(text)
    assert [i.opcode for i in mod.entry.instructions if i.opcode != "parameter"] == ["fusion", "fusion", "tuple"]


def test_a_producer_also_read_through_a_reshape_by_a_dot_is_not_recomputed():
    """The residual-gradient sum of a layer boundary: g = a + norm_backward(...) is read by a dot
    (through a reshape) and by the next residual sum. Recomputing g in that sum would leave g's
    own kernel for the dot and cut the norm backward off into a fusion of its own; instead g
    roots one fusion with it, which the next sum reads."""
    text = module(["a: f32[4,8]", "b: f32[4,8]", "c: f32[4,8]", "w: f32[8,8]"],
                  ["%t = f32[4,8] tanh(%b)",
                   "%e = f32[4,8] exponential(%t)",
                   "%g = f32[4,8] add(%a, %e)",
                   "%r = f32[4,8] reshape(%g)",
                   f"%d = f32[4,8] dot(%r, %w), {DOT}",
                   "%n = f32[4,8] multiply(%g, %c)",
                   "ROOT %out = (f32[4,8], f32[4,8]) tuple(%d, %n)"], "(f32[4,8], f32[4,8])")
    _, mod = fuse(text)
    assert [i.opcode for i in mod.entry.instructions if i.opcode != "parameter"] == [
        "fusion", "reshape", "dot", "multiply", "tuple"]
    assert [i.opcode for i in fusions(mod)[0].attrs["calls"].instructions if i.opcode != "parameter"] == [
        "tanh", "exponential", "add"]


def test_disabled_pass_and_unpartitioned_module():
    assert fuse(AFTER_ALL_REDUCE, enabled=False)[0] == AFTER_ALL_REDUCE
    with pytest.raises(ValueError, match="not partitioned"):
        FuseElementwise().run(parse_module(AFTER_ALL_REDUCE.replace(", is_partitioned=true", "")))


def test_dots_collectives_and_custom_calls_other_than_norms_are_not_fused():
    out, mod = fuse(AFTER_ALL_REDUCE)
    body = fusions(mod)[0].attrs["calls"]
    assert {i.opcode for i in body.instructions} == {"parameter", "broadcast", "add", "custom-call"}
    assert [i.opcode for i in mod.entry.instructions if i.opcode != "parameter"] == ["dot", "all-reduce", "fusion"]


def test_a_concatenate_of_more_than_eight_operands_is_not_fused():
    """A collective bucket's concatenate stays one ATen cat (Inductor would copy per operand)."""
    names = [f"x{k}" for k in range(9)]
    text = module([f"{n}: f32[2,4]" for n in names], [
        *[f"%n{k} = f32[2,4] negate(%{n})" for k, n in enumerate(names)],
        f"%c = f32[2,36] concatenate({', '.join(f'%n{k}' for k in range(9))}), dimensions={{1}}",
        "ROOT %t = f32[2,36] tanh(%c)"], "f32[2,36]")
    out, mod = fuse(text)
    assert "%c = f32[2,36] concatenate(" in entry(out)
    assert fe.MAX_FUSED_CONCAT_OPERANDS == 8


# --------------------------------------------------------------------------- random elementwise DAGs
M = "f32[3,4]"
UNARY = ["negate", "tanh", "abs", "sine", "logistic"]
BINARY = ["add", "multiply", "subtract", "maximum", "minimum"]


@st.composite
def dags(draw) -> str:
    """A random program over x, y [3,4], v [4], mask s32[3,4], w [4,4] of elementwise ops,
    broadcasts, reductions, norms, dots (fusion barriers) and an addmm-shaped bias add; the
    root tuple reads a random subset of the values (outside users)."""
    vals = ["%x", "%y"]
    body = ["%c = f32[] constant(0.5)", "%zero = f32[] constant(0)", "%ninf = f32[] constant(-inf)"]
    for k in range(draw(st.integers(2, 9))):
        a, b = (draw(st.sampled_from(vals)) for _ in range(2))
        kind = draw(st.sampled_from(["unary", "binary", "binary", "bias", "scale", "reduce", "norm", "select",
                                     "mask", "dot", "addmm"]))
        n = f"%v{k}"
        if kind == "unary":
            body.append(f"{n} = {M} {draw(st.sampled_from(UNARY))}({a})")
        elif kind == "binary":
            body.append(f"{n} = {M} {draw(st.sampled_from(BINARY))}({a}, {b})")
        elif kind == "bias":
            body += [f"{n}.b = {M} broadcast(%v), dimensions={{1}}", f"{n} = {M} add({a}, {n}.b)"]
        elif kind == "scale":
            body += [f"{n}.c = {M} broadcast(%c), dimensions={{}}", f"{n} = {M} multiply({n}.c, {a})"]
        elif kind == "reduce":
            red, init = draw(st.sampled_from([("add", "%zero"), ("max", "%ninf")]))
            body += [f"{n}.r = f32[3] reduce({a}, {init}), dimensions={{1}}, to_apply=%{red}.f32",
                     f"{n}.rb = {M} broadcast({n}.r), dimensions={{0}}", f"{n} = {M} subtract({a}, {n}.rb)"]
        elif kind == "norm":
            target = draw(st.sampled_from(['"layer-norm", backend_config={"normalized_ndim":1}',
                                           '"softmax", backend_config={"dim":1}', '"gelu"', '"silu"']))
            body.append(f"{n} = {M} custom-call({a}), custom_call_target={target}")
        elif kind == "select":
            body += [f"{n}.p = pred[3,4] compare({a}, {b}), direction=GT", f"{n} = {M} select({n}.p, {a}, {b})"]
        elif kind == "mask":
            body += [f"{n}.f = {M} convert(%mask)", f"{n} = {M} multiply({n}.f, {a})"]
        else:
            body.append(f"{n}.d = {M} dot({a}, %w), {DOT}")
            body.append(f"{n} = {M} add({n}.d, {n}.b)" if kind == "addmm" else f"{n} = {M} tanh({n}.d)")
            if kind == "addmm":
                body.insert(-1, f"{n}.b = {M} broadcast(%v), dimensions={{1}}")
        vals.append(n)
    outs = [vals[-1], *draw(st.lists(st.sampled_from(vals[2:]), max_size=2, unique=True))]
    outs = list(dict.fromkeys(outs))
    result = f"({', '.join([M] * len(outs))})"
    body.append(f"ROOT %out = {result} tuple({', '.join(outs)})")
    return module(["x: f32[3,4]", "y: f32[3,4]", "v: f32[4]", "mask: s32[3,4]", "w: f32[4,4]"], body, result,
                  reducers=True)


def _launches(mod) -> int:
    return sum(i.opcode not in fe.CHEAP_OPCODES | {"parameter", "tuple", "partition-id"} for i in mod.entry.instructions)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(), st.integers(1, 3))
def test_random_dags_compute_the_same(text, min_kernels):
    """Values equal with and without the pass (``fuse`` checks), never more kernels, valid fusions."""
    _, mod = fuse(text, min_kernels=min_kernels)
    assert _launches(mod) <= _launches(parse_module(text))
    for f in fusions(mod):
        body = f.attrs["calls"].instructions
        assert sum(fe.launches_kernel(i) for i in body if i.opcode != "parameter") >= min_kernels
        assert all(i.opcode == "parameter" or fe.is_fusible(i) for i in body)
        assert not any(i.opcode == "add" and "dot" in {o.opcode for o in i.operands} for i in body)


# --------------------------------------------------------------------------- numerics through the pipeline
def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _jit(fn, n: int, in_specs, out_spec, fuse_elementwise: bool):
    mesh = spmd.Mesh.create({"tp": n}, f"cpu:{n}")
    return spmd.jit(fn, mesh=mesh, in_shardings=tuple(in_specs), out_shardings=out_spec,
                    options=spmd.CompileOptions(fuse_elementwise=fuse_elementwise, verify=True))


def _final_text(jitted, args) -> str:
    lowered = jitted.lower(*args)
    return lowered.as_text(lowered.stages[-1])


@pytest.mark.parametrize("n,fused", [(1, True), (2, True), (4, True), (2, False)])
@pytest.mark.parametrize("case", list(CASES))
def test_jitted_functions_match_float64_pytorch(case, n, fused):
    fn, make, in_specs, out_spec = CASES[case]
    args = make(torch.Generator().manual_seed(7 * n + len(case)))
    jitted = _jit(fn, n, in_specs, out_spec, fused)
    assert ("fusion(" in _final_text(jitted, args)) is fused
    want = fn(*[a.double() if a.is_floating_point() else a for a in args])
    assert _rel_err(jitted(*args).to_torch(), want) < 1e-5


@pytest.mark.parametrize("n", [1, 2, 4])
def test_transformer_block_workload(n):
    wl = WORKLOADS["block"]
    xs = make_inputs(wl, "cpu", 5 * n)
    specs = [P(*s) for s in wl.specs]
    fused, plain = (_jit(wl.fn, n, specs, P(), f) for f in (True, False))
    text = _final_text(fused, xs)
    # fused: scale + softmax; after an all-reduce also the residual adds and the second LayerNorm (on one
    # device the residual adds go to addmm, and the first LayerNorm reads x alone)
    assert text.count(" fusion(") >= (3 if n > 1 else 1)
    assert text.split("ENTRY", 1)[1].count('"layer-norm"') == (1 if n > 1 else 2)
    want = wl.fn(*[x.double() for x in xs])
    got = fused(*xs).to_torch()
    assert _rel_err(got, want) < 1e-5
    if n == 2:
        assert _rel_err(plain(*xs).to_torch(), want) < 1e-5


def test_two_layer_bert_with_random_weights():
    cfg = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=16)
    model = init_random_(BertSentenceEncoder(cfg), seed=3).eval()
    gen = torch.Generator().manual_seed(11)
    ids, mask = torch.randint(0, 97, (2, 8), generator=gen), _mask(2, 8, gen)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(ids, mask)
    for n, fused in ((1, True), (2, True), (4, True), (2, False)):
        mesh = spmd.Mesh.create({"tp": n}, f"cpu:{n}")
        pm = parallelize(model, mesh, bert_plan(), options=spmd.CompileOptions(fuse_elementwise=fused, verify=True))
        got = pm(ids, mask).to_torch()
        count = pm.lowered.as_text("fuse-elementwise").count(" fusion(")
        assert count >= 2 * cfg.num_hidden_layers if fused else count == 0
        assert _rel_err(got, want) < 1e-5, (n, fused)


def test_equal_chains_become_one_fusion():
    """Two layers' equal position arithmetic (the same chain on the same operands, with constants
    broadcast separately) is outlined once: the fusions merge after outlining."""
    text = """HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

ENTRY %main (s: s64[1], x: f32[1,8], y: f32[1,8]) -> (s64[1], s64[1]) {
  %s = s64[1] parameter(0)
  %x = f32[1,8] parameter(1)
  %y = f32[1,8] parameter(2)
  %c = s64[] constant(4)
  %b1 = s64[1] broadcast(%c), dimensions={}
  %a1 = s64[1] add(%s, %b1)
  %m1 = s64[1] multiply(%a1, %a1)
  %b2 = s64[1] broadcast(%c), dimensions={}
  %a2 = s64[1] add(%s, %b2)
  %m2 = s64[1] multiply(%a2, %a2)
  ROOT %out = (s64[1], s64[1]) tuple(%m1, %m2)
}
"""
    mod = FuseElementwise().run(parse_module(text))
    fusions = [i for i in mod.entry.instructions if i.opcode == "fusion"]
    assert len(fusions) == 1 and mod.entry.root.operands == [fusions[0], fusions[0]]
    assert len([c for c in mod.computations if c.name.startswith("fused")]) == 1


@pytest.mark.parametrize("n", [1, 2])
def test_llama_rotary_embedding_runs_no_concatenate_or_negate_of_its_own(n):
    """Two Llama layers: rotate-half's negate and concatenate are inside fusions (each layer had
    two of each, one kernel apiece); the output equals float64 eager."""
    from spmd.models.llama import llama_layers
    from spmd.models.plans import llama_plan

    model = llama_layers("llama2-7b", 2, small=True, seed=4)
    x = torch.randn(2, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    mesh = spmd.Mesh.create({"tp": n}, f"cpu:{n}")
    pm = parallelize(model, mesh, llama_plan("tp"))
    lowered = pm.lower(x)
    module = lowered.result.module
    entry_ops = [(i.opcode, i.shape.rank) for i in module.entry.instructions]
    bodies = [i.opcode for c in module.computations if c is not module.entry for i in c.instructions]
    # the [S, D] angle table's concatenate may stay (small inputs are folded on the host)
    assert ("concatenate", 4) not in entry_ops and "negate" not in {op for op, _ in entry_ops}
    assert bodies.count("concatenate") >= 2  # q's and k's rotate-half (equal layers share fusions)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    assert _rel_err(pm(x).to_torch(), want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bert_bias_adds_by_dtype_in_the_lowered_program(dtype):
    """One device: in float32 only the merged q/k/v projection keeps its bias in the GEMM (the other
    three linear layers per layer run plain GEMMs, their biases inside the residual / LayerNorm and
    GELU fusions); in bf16 all four are addmm. Same number of kernels either way; float32 numerics
    against float64 eager."""
    cfg = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=16)
    model = init_random_(BertSentenceEncoder(cfg), seed=3).eval().to(dtype)
    gen = torch.Generator().manual_seed(12)
    ids, mask = torch.randint(0, 97, (2, 8), generator=gen), _mask(2, 8, gen)
    pm = parallelize(model, spmd.Mesh.create({"tp": 1}, "cpu:1"), bert_plan())
    got = pm(ids, mask).to_torch()
    program = pm.compiled.executable.program
    module = pm.compiled.module
    opcode = {i.name: i.opcode for i in module.entry.instructions}
    kernels = [t for t in program.thunks if hasattr(t, "fn") and t.out not in program.view_slots]
    addmms = [t for t in kernels if opcode.get(t.name) == "add"]
    dots = [t for t in kernels if opcode.get(t.name) == "dot"]
    layers = cfg.num_hidden_layers
    assert (len(addmms), len(dots)) == ((layers, 3 * layers) if dtype == torch.float32 else (4 * layers, 0))
    if dtype == torch.float32:
        with torch.no_grad():
            want = copy.deepcopy(model).double()(ids, mask)
        assert _rel_err(got, want) < 1e-5
