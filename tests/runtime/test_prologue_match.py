"""Which fusions a skinny product computes in its prologue: the RMS norm and SwiGLU forms that
fuse-elementwise produces from HLO text (golden text of the fused computation), and the near
misses that must not match."""
# ruff: noqa: E501  (HLO text lines are long)

from __future__ import annotations

import pytest
from expecttest import assert_expected_inline

from spmd.ir.text import parse_module, print_instruction
from spmd.passes.fuse_elementwise import FuseElementwise
from spmd.runtime.prologue_match import Prologue, match_prologue
from tests.passes.fuse_elementwise_programs import module

RMS_BODY = [
    "%x32 = f32[1,1,64] convert(%x)",
    "%sq = f32[1,1,64] multiply(%x32, %x32)",
    "%zero = f32[] constant(0)",
    "%ssq = f32[1,1] reduce(%sq, %zero), dimensions={2}, to_apply=%add.f32",
    "%n = f32[] constant(DIVISOR)",
    "%nb = f32[1,1] broadcast(%n), dimensions={}",
    "%mean = f32[1,1] divide(%ssq, %nb)",
    "%mean3 = f32[1,1,1] reshape(%mean)",
    "%eps = f32[] constant(1e-05)",
    "%epsb = f32[1,1,1] broadcast(%eps), dimensions={}",
    "%v = f32[1,1,1] add(%mean3, %epsb)",
    "%r = f32[1,1,1] rsqrt(%v)",
    "%r2 = f32[1,1] reshape(%r)",
    "%rb = f32[1,1,64] broadcast(%r2), dimensions={0,1}",
    "%h = f32[1,1,64] multiply(%x32, %rb)",
    "%h16 = bf16[1,1,64] convert(%h)",
    "%gb = bf16[1,1,64] broadcast(%g), dimensions={2}",
    "%normed = bf16[1,1,64] multiply(ORDER)",
    "ROOT %y = bf16[1,1,96] dot(%normed, %w), lhs_contracting_dims={2}, rhs_contracting_dims={1}",
]
RMS_PARAMS = ["x: bf16[1,1,64]", "g: bf16[64]", "w: bf16[96,64]"]


def _fusion(params: list[str], body: list[str], result: str):
    mod = parse_module(module(params, body, result, reducers=True))
    FuseElementwise().run(mod)
    fusions = [i for i in mod.entry.instructions if i.opcode == "fusion"]
    assert len(fusions) == 1, [print_instruction(i) for i in fusions]
    return fusions[0]


def _rms(divisor: str = "64", order: str = "%gb, %h16", body=None):
    lines = [ln.replace("DIVISOR", divisor).replace("ORDER", order) for ln in (body or RMS_BODY)]
    return _fusion(RMS_PARAMS, lines, "bf16[1,1,96]")


def test_rms_norm_golden():
    f = _rms()
    text = "\n".join(print_instruction(i) for i in f.attrs["calls"].instructions)
    assert_expected_inline(text, """\
%param_0 = bf16[64] parameter(0)
%param_1 = bf16[1,1,64] parameter(1)
%param_2 = f32[] parameter(2)
%param_3 = f32[1,1] parameter(3)
%param_4 = f32[1,1,1] parameter(4)
%gb.1 = bf16[1,1,64] broadcast(%param_0), dimensions={2}
%x32.1 = f32[1,1,64] convert(%param_1)
%sq.1 = f32[1,1,64] multiply(%x32.1, %x32.1)
%ssq.1 = f32[1,1] reduce(%sq.1, %param_2), dimensions={2}, to_apply=%add.f32
%mean.1 = f32[1,1] divide(%ssq.1, %param_3)
%mean3.1 = f32[1,1,1] reshape(%mean.1)
%v.1 = f32[1,1,1] add(%mean3.1, %param_4)
%r.1 = f32[1,1,1] rsqrt(%v.1)
%r2.1 = f32[1,1] reshape(%r.1)
%rb.1 = f32[1,1,64] broadcast(%r2.1), dimensions={0,1}
%h.1 = f32[1,1,64] multiply(%x32.1, %rb.1)
%h16.1 = bf16[1,1,64] convert(%h.1)
%normed.1 = bf16[1,1,64] multiply(%gb.1, %h16.1)""")
    assert match_prologue(f) == Prologue("rms-norm", x=1, g=0, eps=pytest.approx(1e-5), divisor=64.0, width=64)


def test_rms_norm_with_the_weight_on_the_right_and_another_divisor():
    pro = match_prologue(_rms(divisor="32", order="%h16, %gb"))
    assert pro is not None and pro.kind == "rms-norm" and pro.divisor == 32.0


@pytest.mark.parametrize("change", [
    ("%sq = f32[1,1,64] multiply(%x32, %x32)", "%sq = f32[1,1,64] add(%x32, %x32)"),  # not a square
    ("%r = f32[1,1,1] rsqrt(%v)", "%r = f32[1,1,1] sqrt(%v)"),  # not rsqrt
    ("%h = f32[1,1,64] multiply(%x32, %rb)", "%h = f32[1,1,64] add(%x32, %rb)"),  # not a scale
    ("%zero = f32[] constant(0)", "%zero = f32[] constant(1)"),  # the sum does not start at 0
])
def test_near_misses_of_the_rms_norm_do_not_match(change):
    body = [ln.replace(*change) for ln in RMS_BODY]
    assert match_prologue(_rms(body=body)) is None


def test_an_eps_that_is_not_a_constant_does_not_match():
    body = [ln for ln in RMS_BODY if not ln.startswith("%eps")]
    body = [ln.replace("add(%mean3, %epsb)", "add(%mean3, %e)") for ln in body]
    f = _fusion([*RMS_PARAMS, "e: f32[1,1,1]"], [ln.replace("DIVISOR", "64").replace("ORDER", "%gb, %h16") for ln in body],
                "bf16[1,1,96]")
    assert match_prologue(f) is None


SWIGLU_BODY = [
    "%gate = bf16[2,1,48] slice(%gu), slice={[0:2], [0:1], [0:48]}",
    "%act = bf16[2,1,48] custom-call(%gate), custom_call_target=\"silu\"",
    "%up = bf16[2,1,48] slice(%gu), slice={[0:2], [0:1], [48:96]}",
    "%h = bf16[2,1,48] multiply(%act, %up)",
    "ROOT %y = bf16[2,1,64] dot(%h, %w), lhs_contracting_dims={2}, rhs_contracting_dims={1}",
]


def test_swiglu_of_one_merged_projection():
    f = _fusion(["gu: bf16[2,1,96]", "w: bf16[64,48]"], SWIGLU_BODY, "bf16[2,1,64]")
    assert match_prologue(f) == Prologue("swiglu", x=0, g=0, x_start=0, g_start=48, width=48)


def test_swiglu_with_the_up_projection_first_and_of_two_operands():
    body = ["%act = bf16[2,1,48] custom-call(%a), custom_call_target=\"silu\"",
            "%h = bf16[2,1,48] multiply(%b, %act)",
            "ROOT %y = bf16[2,1,64] dot(%h, %w), lhs_contracting_dims={2}, rhs_contracting_dims={1}"]
    f = _fusion(["a: bf16[2,1,48]", "b: bf16[2,1,48]", "w: bf16[64,48]"], body, "bf16[2,1,64]")
    pro = match_prologue(f)
    assert pro is not None and pro.kind == "swiglu" and f.operands[pro.x].name == "a" and f.operands[pro.g].name == "b"


@pytest.mark.parametrize("change", [
    ('custom_call_target="silu"', 'custom_call_target="gelu"'),  # another activation
    ("slice={[0:2], [0:1], [0:48]}", "slice={[0:2], [0:1], [0:96:2]}"),  # a strided slice
])
def test_near_misses_of_swiglu_do_not_match(change):
    body = [ln.replace(*change) for ln in SWIGLU_BODY]
    f = _fusion(["gu: bf16[2,1,96]", "w: bf16[64,48]"], body, "bf16[2,1,64]")
    assert match_prologue(f) is None


def test_float32_fusions_are_not_prologues():
    body = [ln.replace("bf16", "f32") for ln in SWIGLU_BODY]
    f = _fusion(["gu: f32[2,1,96]", "w: f32[64,48]"], body, "f32[2,1,64]")
    assert match_prologue(f) is None


SQUARE_RMS_BODY = [
    "%x32 = f32[8,8] convert(%x)",
    "%sq = f32[8,8] multiply(%x32, %x32)",
    "%zero = f32[] constant(0)",
    "%ssq = f32[8] reduce(%sq, %zero), dimensions={1}, to_apply=%add.f32",
    "%n = f32[] constant(8)",
    "%nb = f32[8] broadcast(%n), dimensions={}",
    "%mean = f32[8] divide(%ssq, %nb)",
    "%eps = f32[] constant(1e-05)",
    "%epsb = f32[8] broadcast(%eps), dimensions={}",
    "%v = f32[8] add(%mean, %epsb)",
    "%r = f32[8] rsqrt(%v)",
    "%rb = f32[8,8] broadcast(%r), dimensions={RDIM}",
    "%h = f32[8,8] multiply(%x32, %rb)",
    "%h16 = bf16[8,8] convert(%h)",
    "%gb = bf16[8,8] broadcast(%g), dimensions={GDIM}",
    "%normed = bf16[8,8] multiply(%gb, %h16)",
    "ROOT %y = bf16[8,40] dot(%normed, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}",
]


def _square_rms(rdim: int, gdim: int):
    body = [ln.replace("RDIM", str(rdim)).replace("GDIM", str(gdim)) for ln in SQUARE_RMS_BODY]
    return _fusion(["x: bf16[8,8]", "g: bf16[8]", "w: bf16[40,8]"], body, "bf16[8,40]")


def test_square_rms_norm_with_the_weight_on_the_columns_and_the_scale_on_the_rows():
    pro = match_prologue(_square_rms(rdim=0, gdim=1))
    assert pro is not None and pro.kind == "rms-norm" and pro.divisor == 8.0


@pytest.mark.parametrize(("rdim", "gdim"), [(0, 0), (1, 1), (1, 0)])
def test_weight_or_row_scale_broadcast_along_the_wrong_dim_does_not_match(rdim, gdim):
    # g[i] * x[i, j] / rms(x[i]) (rows scaled by the weight) or x[i, j] / rms(x[j]): not an RMS norm of
    # the rows, though the dims agree when rows == K; the prologue kernel computes g[j] * x[i, j] / rms(x[i])
    assert match_prologue(_square_rms(rdim, gdim)) is None
