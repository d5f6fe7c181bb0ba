"""rematerialize: golden HLO text, what it must not recompute, numerics against the module, options."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.text import parse_module
from spmd.passes.pipeline import CompileOptions
from spmd.passes.rematerialize import Rematerialize, _Remat
from tests.passes.pass_checks import run_pass_checked


def _module(params: list[str], body: list[str], result: str) -> str:
    lines = [f"%{n} = {s} parameter({k})" for k, (n, s) in enumerate(x.split(": ") for x in params)]
    text = "\n".join(f"  {ln}" for ln in [*lines, *body])
    return (f"HloModule m, num_partitions=1, mesh={{tp=1}}, is_partitioned=true\n\n"
            f"ENTRY %main ({', '.join(params)}) -> {result} {{\n{text}\n}}\n")


# A forward (a, b = exp(x) * w, c) whose values the "backward" (g) reads again after the peak at e.
FWD_BWD = _module(
    ["x: f32[64]", "w: f32[64]"],
    ["%a = f32[64] exponential(%x)",
     "%b = f32[64] multiply(%a, %w)",
     "%c = f32[64] tanh(%b)",
     "%d = f32[64] sine(%c)",
     "%e = f32[64] cosine(%d)",
     "%f = f32[64] add(%e, %c)",
     "%g = f32[64] multiply(%f, %a)",
     "ROOT %h = f32[64] add(%g, %b)"],
    "f32[64]")

# A product (dot) the selective policy keeps; the full policy recomputes it from x and w.
DOT = _module(
    ["x: f32[8,16]", "w: f32[16,16]"],
    ["%m = f32[8,16] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
     "%r = f32[8,16] tanh(%m)",
     "%s = f32[8,16] sine(%r)",
     "%t = f32[8,16] cosine(%s)",
     "%u = f32[8,16] exponential(%t)",
     "ROOT %v = f32[8,16] multiply(%u, %m)"],
    "f32[8,16]")


def _peak_bytes(text: str) -> int:
    mod = parse_module(text)
    r = _Remat(mod, Rematerialize(mode="full"))
    at, values = r.peak()
    return sum(b.shape.size_bytes for b, acc in values if acc[0] <= at <= acc[-1])


class TestGolden(TestCase):
    def test_recomputes_values_live_across_the_peak(self):
        text, _ = run_pass_checked(Rematerialize(mode="selective", min_gap=2, max_rounds=1, max_copies=2), FWD_BWD,
                                   exact=True)
        # Peak at %e: %a and %b are live across it and read again after it; %a is recomputed from
        # the parameter %x at %g, %b at %h (from a second copy of %a: the first is dead by then).
        # %c is read right after the peak (a gap of 2): kept.
        self.assertExpectedInline(text, """\
HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

ENTRY %main (x: f32[64], w: f32[64]) -> f32[64] {
  %x = f32[64] parameter(0)
  %w = f32[64] parameter(1)
  %a = f32[64] exponential(%x)
  %b = f32[64] multiply(%a, %w)
  %c = f32[64] tanh(%b)
  %d = f32[64] sine(%c)
  %e = f32[64] cosine(%d)
  %f = f32[64] add(%e, %c)
  %a.remat0 = f32[64] exponential(%x)
  %g = f32[64] multiply(%f, %a.remat0)
  %a.remat1 = f32[64] exponential(%x)
  %b.remat0 = f32[64] multiply(%a.remat1, %w)
  ROOT %h = f32[64] add(%g, %b.remat0)
}
""")

    def test_one_copy_per_instruction_by_default(self):
        # %a may be recomputed once: for %g; %b would need a second copy of %a, so it is kept.
        text, _ = run_pass_checked(Rematerialize(mode="selective", min_gap=2, max_rounds=1), FWD_BWD, exact=True)
        assert text.count("exponential(%x)") == 2 and "b.remat" not in text

    def test_selective_keeps_dots_full_recomputes_them(self):
        selective, _ = run_pass_checked(Rematerialize(mode="selective", min_gap=2), DOT, exact=True)
        assert ".remat" not in selective  # %m is a dot: kept live to %v
        full, _ = run_pass_checked(Rematerialize(mode="full", min_gap=2), DOT, exact=True)
        self.assertExpectedInline(full.split("\n\n", 1)[1], """\
ENTRY %main (x: f32[8,16], w: f32[16,16]) -> f32[8,16] {
  %x = f32[8,16] parameter(0)
  %w = f32[16,16] parameter(1)
  %m = f32[8,16] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %r = f32[8,16] tanh(%m)
  %s = f32[8,16] sine(%r)
  %t = f32[8,16] cosine(%s)
  %u = f32[8,16] exponential(%t)
  %m.remat0 = f32[8,16] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %v = f32[8,16] multiply(%u, %m.remat0)
}
""")


def test_lowers_the_live_bytes_peak_to_a_fixpoint():
    text, _ = run_pass_checked(Rematerialize(mode="selective", min_gap=2), FWD_BWD, exact=True)
    assert _peak_bytes(text) < _peak_bytes(FWD_BWD)


def test_never_recomputes_communication_outputs_or_short_gaps():
    ar = _module(
        ["x: f32[64]"],
        ["%a = f32[64] all-reduce(%x), to_apply=%add, replica_groups={{0}}",
         "%b = f32[64] tanh(%a)", "%c = f32[64] sine(%b)", "%d = f32[64] cosine(%c)", "%e = f32[64] exponential(%d)",
         "%f = f32[64] multiply(%e, %a)", "ROOT %o = (f32[64], f32[64]) tuple(%f, %b)"],
        "(f32[64], f32[64])")
    ar = ar.replace("\nENTRY", "%add (p: f32[], q: f32[]) -> f32[] {\n  %p = f32[] parameter(0)\n  %q = f32[] parameter(1)\n"
                    "  ROOT %s = f32[] add(%p, %q)\n}\n\nENTRY")
    text, _ = run_pass_checked(Rematerialize(mode="full", min_gap=1), ar, exact=True)
    assert ".remat" not in text  # %a: an all-reduce; %b: an output
    text, _ = run_pass_checked(Rematerialize(mode="full", min_gap=100), FWD_BWD, exact=True)
    assert ".remat" not in text


def test_random_values_are_recomputed_bit_for_bit():
    prog = _module(
        ["x: f32[4,8]", "k0: s64[]", "k1: s64[]"],
        ["%i = s64[4,8] iota(), iota_dimension=1",
         '%u = f32[4,8] custom-call(%i, %k0, %k1), custom_call_target="random", backend_config={"distribution":"uniform","dtype":"f32","stream":0}',
         "%m = f32[4,8] multiply(%x, %u)", "%b = f32[4,8] tanh(%m)", "%c = f32[4,8] sine(%b)", "%d = f32[4,8] cosine(%c)",
         "%e = f32[4,8] add(%d, %b)", "%g = f32[4,8] exponential(%e)", "ROOT %f = f32[4,8] multiply(%g, %u)"],
        "f32[4,8]")
    mod = parse_module(prog)
    Rematerialize(mode="selective", min_gap=2).run(mod)
    assert any(i.name.startswith("u.remat") for i in mod.entry.instructions)
    args = [torch.randn(4, 8) + 0.1, torch.tensor(7), torch.tensor(9)]
    want, got = evaluate_spmd(parse_module(prog), [args])[0][0], evaluate_spmd(mod, [args])[0][0]
    assert torch.equal(want, got) and torch.count_nonzero(got) == got.numel()


def test_none_leaves_the_module_alone_and_options_are_checked():
    mod = parse_module(FWD_BWD)
    before = [i.name for i in mod.entry.instructions]
    Rematerialize(mode="none", min_gap=0).run(mod)
    assert [i.name for i in mod.entry.instructions] == before
    with pytest.raises(ValueError, match="remat"):
        Rematerialize(mode="some")
    with pytest.raises(ValueError, match="min_gap"):
        Rematerialize(mode="full", min_gap=-1)
    with pytest.raises(ValueError, match="remat must be"):
        CompileOptions(remat="layers")
    with pytest.raises(ValueError, match="remat_max_copies"):
        CompileOptions(remat="full", remat_max_copies=0)
