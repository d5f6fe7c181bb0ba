"""multi-output-fusion: golden HLO text (text in, text out), cycles that must not merge, limits, numerics."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spmd.ir.text import parse_module, print_module
from spmd.passes.assign_buffers import assign_buffers
from spmd.passes.assign_streams import AssignStreams
from spmd.passes.fuse_elementwise import FuseElementwise
from spmd.passes.multi_output_fusion import MultiOutputFusion
from spmd.passes.schedule import Schedule
from spmd.runtime.executor import Executable
from tests.passes.fuse_elementwise_programs import DOT, module, random_args
from tests.passes.multi_output_fusion_programs import ADAMW
from tests.passes.pass_checks import run_pass_checked
from tests.passes.test_fuse_elementwise import dags
from tests.runtime.hlo_helpers import FakeMesh

# Two rotary-style siblings reading the same cos / sin rows (a decode step's q and k).
SIBLINGS = module(
    ["q: f32[2,8]", "k: f32[2,8]", "cs: f32[2,8]"],
    ["%e = f32[2,8] exponential(%cs)",
     "%qa = f32[2,8] multiply(%q, %e)",
     "%qb = f32[2,8] add(%qa, %cs)",
     "%ka = f32[2,8] multiply(%k, %e)",
     "%kb = f32[2,8] subtract(%ka, %cs)",
     "ROOT %out = (f32[2,8], f32[2,8]) tuple(%qb, %kb)"],
    "(f32[2,8], f32[2,8])")

# Siblings of x with a dot between them: merging would need the dot both before and after the fusion.
CYCLE = module(
    ["x: f32[4,4]", "w: f32[4,4]"],
    ["%a = f32[4,4] tanh(%x)",
     "%a2 = f32[4,4] exponential(%a)",
     f"%d = f32[4,4] dot(%a2, %w), {DOT}",
     "%b = f32[4,4] multiply(%x, %d)",
     "%b2 = f32[4,4] sine(%b)",
     "ROOT %out = (f32[4,4], f32[4,4]) tuple(%a2, %b2)"],
    "(f32[4,4], f32[4,4])")


def _fused(text: str, min_kernels: int = 2) -> str:
    mod = parse_module(text)
    FuseElementwise(min_kernels=min_kernels).run(mod)
    return print_module(mod)


def _fusion_count(mod) -> int:
    return sum(i.opcode == "fusion" for i in mod.entry.instructions)


class TestGolden(TestCase):
    def test_adamw_update_becomes_one_fusion_with_three_outputs(self):
        out, mod = run_pass_checked(MultiOutputFusion(), ADAMW)
        assert _fusion_count(mod) == 1
        self.assertExpectedInline(out, """\
HloModule m, num_partitions=1, mesh={dp=1}, is_partitioned=true

%fused_computation (param_0: f32[8,4], param_1: f32[8,4], param_2: f32[8,4], param_3: f32[8,4]) -> (f32[8,4], f32[8,4], f32[8,4]) {
  %param_0 = f32[8,4] parameter(0)
  %param_1 = f32[8,4] parameter(1)
  %d0.1 = f32[8,4] subtract(%param_0, %param_1)
  %c0.1 = f32[] constant(0.10000000149011612)
  %b0.1 = f32[8,4] broadcast(%c0.1), dimensions={}
  %s0.1 = f32[8,4] multiply(%d0.1, %b0.1)
  %mn.1 = f32[8,4] add(%param_1, %s0.1)
  %param_2 = f32[8,4] parameter(2)
  %c1.1 = f32[] constant(0.9990000128746033)
  %b1.1 = f32[8,4] broadcast(%c1.1), dimensions={}
  %a1.1 = f32[8,4] multiply(%param_2, %b1.1)
  %q1.1 = f32[8,4] multiply(%param_0, %param_0)
  %vn.1 = f32[8,4] add(%a1.1, %q1.1)
  %param_3 = f32[8,4] parameter(3)
  %r2.1 = f32[8,4] exponential(%vn.1)
  %c2.1 = f32[] constant(9.99999993922529e-09)
  %b2.1 = f32[8,4] broadcast(%c2.1), dimensions={}
  %e2.1 = f32[8,4] add(%r2.1, %b2.1)
  %u2.1 = f32[8,4] divide(%mn.1, %e2.1)
  %pn.1 = f32[8,4] subtract(%param_3, %u2.1)
  ROOT %tuple = (f32[8,4], f32[8,4], f32[8,4]) tuple(%mn.1, %vn.1, %pn.1)
}

ENTRY %main (p: f32[8,4], g: f32[8,4], m: f32[8,4], v: f32[8,4]) -> (f32[8,4], f32[8,4], f32[8,4]) {
  %p = f32[8,4] parameter(0)
  %g = f32[8,4] parameter(1)
  %m = f32[8,4] parameter(2)
  %v = f32[8,4] parameter(3)
  %fp.1 = (f32[8,4], f32[8,4], f32[8,4]) fusion(%g, %m, %v, %p), calls=%fused_computation, kind=kLoop
  %get-tuple-element = f32[8,4] get-tuple-element(%fp.1), index=0
  %get-tuple-element.1 = f32[8,4] get-tuple-element(%fp.1), index=1
  %get-tuple-element.2 = f32[8,4] get-tuple-element(%fp.1), index=2
  ROOT %out = (f32[8,4], f32[8,4], f32[8,4]) tuple(%get-tuple-element.2, %get-tuple-element, %get-tuple-element.1)
}
""")

    def test_siblings_sharing_an_operand_merge(self):
        fused = _fused(SIBLINGS)
        assert _fusion_count(parse_module(fused)) == 2
        out, mod = run_pass_checked(MultiOutputFusion(), fused)
        assert _fusion_count(mod) == 1
        self.assertExpectedInline(out[out.index("ENTRY"):], """\
ENTRY %main (q: f32[2,8], k: f32[2,8], cs: f32[2,8]) -> (f32[2,8], f32[2,8]) {
  %q = f32[2,8] parameter(0)
  %k = f32[2,8] parameter(1)
  %cs = f32[2,8] parameter(2)
  %e = f32[2,8] exponential(%cs)
  %fusion.2 = (f32[2,8], f32[2,8]) fusion(%q, %e, %cs, %k), calls=%fused_computation.2, kind=kLoop
  %get-tuple-element = f32[2,8] get-tuple-element(%fusion.2), index=0
  %get-tuple-element.1 = f32[2,8] get-tuple-element(%fusion.2), index=1
  ROOT %out = (f32[2,8], f32[2,8]) tuple(%get-tuple-element, %get-tuple-element.1)
}
""")


def test_a_merge_that_would_create_a_cycle_is_not_made():
    fused = _fused(CYCLE)
    assert _fusion_count(parse_module(fused)) == 2
    out, mod = run_pass_checked(MultiOutputFusion(), fused)
    assert out == fused and _fusion_count(mod) == 2


def test_producer_consumer_through_another_path_is_not_merged():
    # %b reads %a directly and through the dot: absorbing %a into %b would be a cycle too.
    text = CYCLE.replace("%b = f32[4,4] multiply(%x, %d)", "%b = f32[4,4] multiply(%a2, %d)")
    fused = _fused(text)
    out, mod = run_pass_checked(MultiOutputFusion(), fused)
    assert out == fused and _fusion_count(mod) == 2


def test_siblings_of_different_dims_stay_apart():
    text = module(
        ["x: f32[2,8]", "y: f32[3,2,8]"],
        ["%a = f32[2,8] tanh(%x)",
         "%a2 = f32[2,8] exponential(%a)",
         "%xb = f32[3,2,8] broadcast(%x), dimensions={1,2}",
         "%b = f32[3,2,8] multiply(%xb, %y)",
         "%b2 = f32[3,2,8] sine(%b)",
         "ROOT %out = (f32[2,8], f32[3,2,8]) tuple(%a2, %b2)"],
        "(f32[2,8], f32[3,2,8])")
    fused = _fused(text)
    assert _fusion_count(parse_module(fused)) == 2
    out, _ = run_pass_checked(MultiOutputFusion(), fused)
    assert out == fused


@pytest.mark.parametrize("options", [{"max_distance": 0}, {"max_members": 1}, {"enabled": False}])
def test_limits_and_disabled_pass_leave_siblings_apart(options):
    fused = _fused(SIBLINGS)
    out, _ = run_pass_checked(MultiOutputFusion(**options), fused)
    assert out == fused


def test_unpartitioned_module_is_refused():
    mod = parse_module(ADAMW.replace(", is_partitioned=true", ""))
    with pytest.raises(ValueError, match="not partitioned"):
        MultiOutputFusion().run(mod)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_dags_compute_the_same_through_the_runtime(data):
    """Random fused programs: the pass keeps every value (IR evaluator), leaves no cycle (the
    verifier checks def-before-use), and the executor (buffers, donation of every argument) gives
    the unmerged program's values bit for bit."""
    fused = _fused(data.draw(dags()), min_kernels=1)
    _, mod = run_pass_checked(MultiOutputFusion(), fused)
    plain = parse_module(fused)
    args = random_args(plain, seed=5)
    per_param = [[args[0][i]] for i in range(len(args[0]))]
    want, _ = Executable(plain, FakeMesh(plain.mesh)).run([[t.clone() for t in a] for a in per_param])
    AssignStreams().run(mod)
    Schedule().run(mod)
    ex = Executable(mod, FakeMesh(mod.mesh), assign_buffers(mod))
    got, _ = ex.run(per_param, donated=frozenset(range(len(per_param))))
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w[0].nan_to_num(), g[0].nan_to_num()) and torch.equal(w[0].isnan(), g[0].isnan())


def test_a_recomputed_copy_is_not_merged_with_its_original():
    """rematerialize leaves an equal fusion (same operands, same computation) at a far use on purpose."""
    fused = _fused(SIBLINGS)
    mod = parse_module(fused)
    first = next(i for i in mod.entry.instructions if i.opcode == "fusion")
    copy_line = next(ln for ln in fused.splitlines() if ln.startswith(f"  %{first.name} = "))
    text = fused.replace(copy_line, copy_line + "\n" + copy_line.replace(f"%{first.name} =", "%copy =")).replace(
        "ROOT %out = (f32[2,8], f32[2,8]) tuple(", "ROOT %out = (f32[2,8], f32[2,8], f32[2,8]) tuple(%copy, ").replace(
        "-> (f32[2,8], f32[2,8]) {\n  %q", "-> (f32[2,8], f32[2,8], f32[2,8]) {\n  %q")
    out, mod = run_pass_checked(MultiOutputFusion(), text)
    copies = [i for i in mod.entry.instructions if i.name == "copy"]
    assert len(copies) == 1 and not copies[0].shape.is_tuple
    assert _fusion_count(mod) == 2  # the copy stays; the two siblings merge


def test_compile_option_is_validated_and_places_the_pass_after_rematerialize():
    from spmd.passes.pipeline import STAGES, CompileOptions, build_passes

    with pytest.raises(TypeError, match="multi_output_fusion must be True or False"):
        CompileOptions(multi_output_fusion="yes")
    names = [p.name for p in build_passes(CompileOptions())]
    assert names == [s for s in STAGES if s != "import"]
    assert names.index("multi-output-fusion") == names.index("rematerialize") + 1
    by_name = {p.name: p for p in build_passes(CompileOptions(multi_output_fusion=False))}
    assert by_name["multi-output-fusion"].enabled is False
    assert by_name["fuse-elementwise"].enabled is True
    assert {p.name: p for p in build_passes(CompileOptions(fuse_elementwise=False))}["multi-output-fusion"].enabled is False
