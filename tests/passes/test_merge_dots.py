"""merge-dots: golden HLO text, the rules that keep dots apart, and numerics against PyTorch."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import re
import sys

import pytest
import torch
from expecttest import TestCase
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spmd
from benchmarks.workloads import WORKLOADS, make_inputs
from spmd.ir.text import parse_module, print_module
from spmd.passes import pipeline
from spmd.passes.merge_dots import MergeDots
from spmd.passes.windowed_einsum import WindowedEinsum
from tests.passes.block_program import BLOCK_2DEV_PARTITIONED
from tests.passes.pass_checks import run_pass_checked
from tests.passes.test_windowed_einsum import ag_module

P = spmd.PartitionSpec
DOT = "lhs_contracting_dims={1}, rhs_contracting_dims={0}"


def _module(params: list[str], body: list[str], result: str, p: int = 1) -> str:
    """A partitioned module text: ``params`` are 'name: shape', ``body`` the lines after the parameters."""
    lines = [f"%{n} = {s} parameter({k})" for k, (n, s) in enumerate(x.split(": ") for x in params)]
    text = "\n".join(f"  {ln}" for ln in [*lines, *body])
    return (f"HloModule m, num_partitions={p}, mesh={{tp={p}}}, is_partitioned=true\n\n"
            f"ENTRY %main ({', '.join(params)}) -> {result} {{\n{text}\n}}\n")


def _run(text: str, **options) -> tuple[str, object]:
    """Merge ``text``; verify it and check it computes what ``text`` did on fresh random inputs."""
    return run_pass_checked(MergeDots(**options), text)


def _dots(mod) -> int:
    return sum(i.opcode == "dot" for i in mod.entry.instructions)


def _strip_metadata(text: str) -> str:
    return re.sub(r", metadata=\{[^}]*\}", "", text)


# --------------------------------------------------------------------------- pipeline helpers
def _with_merge(options, *args):
    """The pipeline's passes with merge-dots right after windowed-einsum."""
    passes = ORIGINAL_BUILD_PASSES(options, *args)
    k = next(i for i, p in enumerate(passes) if isinstance(p, WindowedEinsum))
    return [*passes[:k + 1], MergeDots(), *passes[k + 1:]]


ORIGINAL_BUILD_PASSES = pipeline.build_passes
OPTIONS = pipeline.CompileOptions(verify=True)


@pytest.fixture
def merging(monkeypatch):
    """spmd.jit compiles with merge-dots in the pipeline (and no executable cached without it)."""
    monkeypatch.setattr(pipeline, "build_passes", _with_merge)
    monkeypatch.setattr(sys.modules["spmd.jit"], "_GLOBAL_CACHE", {})


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


# --------------------------------------------------------------------------- programs
THREE_DOTS = _module(
    ["x: f32[4,8]", "wq: f32[8,6]", "wk: f32[8,6]", "wv: f32[8,5]"],
    [f"%q = f32[4,6] dot(%x, %wq), {DOT}",
     "%eq = f32[4,6] exponential(%q)",
     "%nv = f32[8,5] negate(%wv)",
     f"%k = f32[4,6] dot(%x, %wk), {DOT}",
     f"%v = f32[4,5] dot(%x, %nv), {DOT}",
     "ROOT %out = (f32[4,6], f32[4,6], f32[4,5]) tuple(%eq, %k, %v)"],
    "(f32[4,6], f32[4,6], f32[4,5])")

SHARED_RHS = _module(
    ["a: f32[4,8]", "b: f32[3,8]", "w: f32[8,5]"],
    [f"%da = f32[4,5] dot(%a, %w), {DOT}",
     f"%db = f32[3,5] dot(%b, %w), {DOT}",
     "ROOT %out = (f32[4,5], f32[3,5]) tuple(%da, %db)"],
    "(f32[4,5], f32[3,5])")

BIASED = _module(
    ["x: f32[4,8]", "wq: f32[8,6]", "bq: f32[6]", "wk: f32[8,6]", "bk: f32[6]"],
    [f"%q = f32[4,6] dot(%x, %wq), {DOT}",
     "%q.b = f32[4,6] broadcast(%bq), dimensions={1}",
     "%q.add = f32[4,6] add(%q, %q.b)",
     f"%k = f32[4,6] dot(%x, %wk), {DOT}",
     "%k.b = f32[4,6] broadcast(%bk), dimensions={1}",
     "%k.add = f32[4,6] add(%k.b, %k)",
     "ROOT %out = (f32[4,6], f32[4,6]) tuple(%q.add, %k.add)"],
    "(f32[4,6], f32[4,6])")



def _block_jit(n: int):
    wl = WORKLOADS["block"]
    mesh = spmd.Mesh.create({"tp": n}, f"cpu:{n}")
    return wl, spmd.jit(wl.fn, mesh=mesh, in_shardings=tuple(P(*s) for s in wl.specs), out_shardings=P(),
                        options=OPTIONS)


# --------------------------------------------------------------------------- golden
class GoldenTest(TestCase):
    def test_block_before_is_what_the_pipeline_produces(self):
        wl, f = _block_jit(2)
        text = f.lower(*make_inputs(wl, "cpu", 0)).as_text("windowed-einsum")
        self.assertEqual(_strip_metadata(text), BLOCK_2DEV_PARTITIONED)

    def test_block_two_devices(self):
        text, mod = _run(BLOCK_2DEV_PARTITIONED)
        assert _dots(mod) == 6
        assert text.split("%transpose_3", 1)[1] == BLOCK_2DEV_PARTITIONED.split("%transpose_3", 1)[1]  # the rest is untouched
        self.assertExpectedInline(text.split("ENTRY", 1)[1].split("%transpose_3", 1)[0], """\
 %main (x: f32[128,512], wq: f32[512,256], wk: f32[512,256], wv: f32[512,256], wo: f32[256,512], w1: f32[512,1024], w2: f32[1024,512]) -> f32[128,512] {
  %x = f32[128,512] parameter(0), sharding={replicated}
  %wq = f32[512,256] parameter(1), sharding={devices=[1,2]<=[2]}
  %wk = f32[512,256] parameter(2), sharding={devices=[1,2]<=[2]}
  %wv = f32[512,256] parameter(3), sharding={devices=[1,2]<=[2]}
  %wo = f32[256,512] parameter(4), sharding={devices=[2,1]<=[2]}
  %w1 = f32[512,1024] parameter(5), sharding={devices=[1,2]<=[2]}
  %w2 = f32[1024,512] parameter(6), sharding={devices=[2,1]<=[2]}
  %layer_norm = f32[128,512] custom-call(%x), custom_call_target="layer-norm", backend_config={"normalized_ndim":1,"eps":1e-05}, sharding={replicated}
  %matmul.concat = f32[512,768] concatenate(%wq, %wk, %wv), dimensions={1}, sharding={devices=[1,2]<=[2]}
  %matmul.merged = f32[128,768] dot(%layer_norm, %matmul.concat), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,2]<=[2]}
  %matmul = f32[128,256] slice(%matmul.merged), slice={[0:128:1], [0:256:1]}, sharding={devices=[1,2]<=[2]}
  %matmul_1 = f32[128,256] slice(%matmul.merged), slice={[0:128:1], [256:512:1]}, sharding={devices=[1,2]<=[2]}
  %matmul_2 = f32[128,256] slice(%matmul.merged), slice={[0:128:1], [512:768:1]}, sharding={devices=[1,2]<=[2]}
  %reshape = f32[128,4,64] reshape(%matmul), sharding={devices=[1,2,1]<=[2]}
  %transpose = f32[4,128,64] transpose(%reshape), dimensions={1,0,2}, sharding={devices=[2,1,1]<=[2]}
  %reshape_1 = f32[128,4,64] reshape(%matmul_1), sharding={devices=[1,2,1]<=[2]}
  %reshape_2 = f32[128,4,64] reshape(%matmul_2), sharding={devices=[1,2,1]<=[2]}
  %transpose_2 = f32[4,128,64] transpose(%reshape_2), dimensions={1,0,2}, sharding={devices=[2,1,1]<=[2]}
  """)

    def test_three_dots_one_device(self):
        text, mod = _run(THREE_DOTS)
        assert _dots(mod) == 1
        self.assertExpectedInline(text, """\
HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

ENTRY %main (x: f32[4,8], wq: f32[8,6], wk: f32[8,6], wv: f32[8,5]) -> (f32[4,6], f32[4,6], f32[4,5]) {
  %x = f32[4,8] parameter(0)
  %wq = f32[8,6] parameter(1)
  %wk = f32[8,6] parameter(2)
  %wv = f32[8,5] parameter(3)
  %nv = f32[8,5] negate(%wv)
  %q.concat = f32[8,17] concatenate(%wq, %wk, %nv), dimensions={1}
  %q.merged = f32[4,17] dot(%x, %q.concat), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %q = f32[4,6] slice(%q.merged), slice={[0:4:1], [0:6:1]}
  %eq = f32[4,6] exponential(%q)
  %k = f32[4,6] slice(%q.merged), slice={[0:4:1], [6:12:1]}
  %v = f32[4,5] slice(%q.merged), slice={[0:4:1], [12:17:1]}
  ROOT %out = (f32[4,6], f32[4,6], f32[4,5]) tuple(%eq, %k, %v)
}
""")

    def test_bias_adds(self):
        text, mod = _run(BIASED)
        assert _dots(mod) == 1
        self.assertExpectedInline(text, """\
HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

ENTRY %main (x: f32[4,8], wq: f32[8,6], bq: f32[6], wk: f32[8,6], bk: f32[6]) -> (f32[4,6], f32[4,6]) {
  %x = f32[4,8] parameter(0)
  %wq = f32[8,6] parameter(1)
  %bq = f32[6] parameter(2)
  %wk = f32[8,6] parameter(3)
  %bk = f32[6] parameter(4)
  %q.concat = f32[8,12] concatenate(%wq, %wk), dimensions={1}
  %q.merged = f32[4,12] dot(%x, %q.concat), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %q.add.concat = f32[12] concatenate(%bq, %bk), dimensions={0}
  %q.add.bcast = f32[4,12] broadcast(%q.add.concat), dimensions={1}
  %q.add.merged = f32[4,12] add(%q.merged, %q.add.bcast)
  %q.add = f32[4,6] slice(%q.add.merged), slice={[0:4:1], [0:6:1]}
  %k.add = f32[4,6] slice(%q.add.merged), slice={[0:4:1], [6:12:1]}
  ROOT %out = (f32[4,6], f32[4,6]) tuple(%q.add, %k.add)
}
""")

    def test_shared_rhs(self):
        text, mod = _run(SHARED_RHS)
        assert _dots(mod) == 1
        self.assertExpectedInline(text, """\
HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

ENTRY %main (a: f32[4,8], b: f32[3,8], w: f32[8,5]) -> (f32[4,5], f32[3,5]) {
  %a = f32[4,8] parameter(0)
  %b = f32[3,8] parameter(1)
  %w = f32[8,5] parameter(2)
  %da.concat = f32[7,8] concatenate(%a, %b), dimensions={0}
  %da.merged = f32[7,5] dot(%da.concat, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %da = f32[4,5] slice(%da.merged), slice={[0:4:1], [0:5:1]}
  %db = f32[3,5] slice(%da.merged), slice={[4:7:1], [0:5:1]}
  ROOT %out = (f32[4,5], f32[3,5]) tuple(%da, %db)
}
""")


def test_bias_epilogue_variants():
    _, mod = _run(BIASED, merge_bias_adds=False)
    assert _dots(mod) == 1 and sum(i.opcode == "add" for i in mod.entry.instructions) == 2
    rows = BIASED.replace("f32[6] parameter", "f32[4] parameter").replace("dimensions={1}", "dimensions={0}")
    _, mod = _run(rows)  # a bias along the rows does not follow the merged columns: only the dots merge
    assert _dots(mod) == 1 and sum(i.opcode == "add" for i in mod.entry.instructions) == 2
    used = BIASED.replace("tuple(%q.add, %k.add)", "tuple(%q.add, %k)").replace(
        "ROOT %out = (f32[4,6], f32[4,6])", "%k2 = f32[4,6] negate(%k.add)\n  ROOT %out = (f32[4,6], f32[4,6])")
    _, mod = _run(used)  # k is read twice: no epilogue
    assert _dots(mod) == 1 and sum(i.opcode == "add" for i in mod.entry.instructions) == 2
    shared = BIASED.replace("broadcast(%bk)", "broadcast(%bq)")
    got, mod = _run(shared)  # both adds read one broadcast: it goes with them
    assert sum(i.opcode == "add" for i in mod.entry.instructions) == 1 and "%k.b" not in got


# --------------------------------------------------------------------------- what stays apart
SQ = ["x: f32[8,8]", "w: f32[8,8]"]
NEGATIVE = {
    "dependent": (SQ, [f"%d1 = f32[8,8] dot(%x, %w), {DOT}", "%e = f32[8,8] exponential(%d1)",
                       f"%d2 = f32[8,8] dot(%x, %e), {DOT}"]),
    "contracting_dims": (SQ, [f"%d1 = f32[8,8] dot(%x, %w), {DOT}",
                              "%d2 = f32[8,8] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}"]),
    "dtype": (SQ, [f"%d1 = f32[8,8] dot(%x, %w), {DOT}", f"%d2 = f64[8,8] dot(%x, %w), {DOT}"]),
    "different_sides": (SQ, [f"%d1 = f32[8,8] dot(%x, %w), {DOT}", f"%d2 = f32[8,8] dot(%w, %x), {DOT}"]),
    "two_free_dims_differ": (["x: f32[4,8]", "a: f32[8,2,3]", "b: f32[8,3,4]"],
                             [f"%d1 = f32[4,2,3] dot(%x, %a), {DOT}", f"%d2 = f32[4,3,4] dot(%x, %b), {DOT}"]),
    "sharding": (SQ, [f"%d1 = f32[8,8] dot(%x, %w), {DOT}, sharding={{replicated}}",
                      f"%d2 = f32[8,8] dot(%x, %w), {DOT}, sharding={{devices=[2,1]<=[2]}}"], 2),
    "backend_config": (SQ, [f"%d1 = f32[8,8] dot(%x, %w), {DOT}",
                            f'%d2 = f32[8,8] dot(%x, %w), {DOT}, backend_config={{"windowed_einsum":0}}']),
}


@pytest.mark.parametrize("case", sorted(NEGATIVE))
def test_not_merged(case):
    params, body, *p = NEGATIVE[case]
    outs = [line.split(" = ")[0].lstrip("%") for line in body if " dot(" in line]
    shapes = [line.split(" = ")[1].split(" ")[0] for line in body if " dot(" in line]
    result = f"({', '.join(shapes)})"
    text = _module(params, [*body, f"ROOT %out = {result} tuple({', '.join('%' + o for o in outs)})"], result, *p)
    got, mod = _run(text)
    assert got == print_module(parse_module(text)) and _dots(mod) == 2


def test_size_threshold():
    three = 4 * (6 + 6 + 5) * 4  # bytes of the merged f32[4,17] output
    _, mod = _run(THREE_DOTS, max_merged_bytes=three - 1)
    assert _dots(mod) == 2  # q and k fit together (4*12*4 bytes), v does not join
    _, mod = _run(THREE_DOTS, max_merged_bytes=4 * 6 * 4)
    assert _dots(mod) == 3
    _, mod = _run(THREE_DOTS, max_merged_bytes=three)
    assert _dots(mod) == 1


def test_a_concatenation_of_hoisted_weights_has_no_size_threshold():
    """wq and wk are weights (parameters 1, 2): their concatenation is hoisted, so q and k merge
    past the threshold; v reads negate(wv), computed on every call, and stays under it."""
    _, mod = _run(THREE_DOTS, max_merged_bytes=4 * 6 * 4, weights=frozenset({1, 2, 3}))
    assert _dots(mod) == 2
    _, mod = _run(THREE_DOTS, max_merged_bytes=4 * 6 * 4, weights=frozenset({1}))
    assert _dots(mod) == 3  # wk is no weight here: the threshold holds
    plain = THREE_DOTS.replace("%v = f32[4,5] dot(%x, %nv)", "%v = f32[4,5] dot(%x, %wv)")
    _, mod = _run(plain, max_merged_bytes=0, weights=frozenset({1, 2, 3}))
    assert _dots(mod) == 1


def test_the_pipeline_hands_merge_dots_its_weights_only_where_they_are_hoisted():
    """MiniLM-shaped projections over the threshold: one merged dot where the weights are hoisted,
    two (Q and K merged, V apart) with ``hoist_weights=False``."""
    text = _module(["x: bf16[16384,384]", "wq: bf16[384,384]", "wk: bf16[384,384]", "wv: bf16[384,384]"],
                   [f"%q = bf16[16384,384] dot(%x, %wq), {DOT}", f"%k = bf16[16384,384] dot(%x, %wk), {DOT}",
                    f"%v = bf16[16384,384] dot(%x, %wv), {DOT}",
                    "ROOT %out = (bf16[16384,384], bf16[16384,384], bf16[16384,384]) tuple(%q, %k, %v)"],
                   "(bf16[16384,384], bf16[16384,384], bf16[16384,384])")
    merge = [MergeDots()]
    for hoist, dots in ((True, 1), (False, 2)):
        options = pipeline.CompileOptions(hoist_weights=hoist)
        result = pipeline.run_pipeline(parse_module(text), options, merge, weights=frozenset({1, 2, 3}))
        assert _dots(result.module) == dots, hoist


def test_equal_free_dims_of_a_rank3_operand_concatenate_on_the_first():
    text = _module(["x: f32[4,8]", "a: f32[8,2,3]", "b: f32[8,2,3]", "c: f32[8,5,3]"],
                   [f"%d1 = f32[4,2,3] dot(%x, %a), {DOT}", f"%d2 = f32[4,2,3] dot(%x, %b), {DOT}",
                    f"%d3 = f32[4,5,3] dot(%x, %c), {DOT}",
                    "ROOT %out = (f32[4,2,3], f32[4,2,3], f32[4,5,3]) tuple(%d1, %d2, %d3)"],
                   "(f32[4,2,3], f32[4,2,3], f32[4,5,3])")
    got, mod = _run(text)
    assert _dots(mod) == 1 and "f32[8,9,3] concatenate(%a, %b, %c), dimensions={1}" in got


def test_batched_dots_on_the_shared_rhs():
    bdot = "lhs_batch_dims={0}, rhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_contracting_dims={1}"
    text = _module(["a: f32[2,3,8]", "b: f32[2,5,8]", "w: f32[2,8,4]"],
                   [f"%da = f32[2,3,4] dot(%a, %w), {bdot}", f"%db = f32[2,5,4] dot(%b, %w), {bdot}",
                    "ROOT %out = (f32[2,3,4], f32[2,5,4]) tuple(%da, %db)"], "(f32[2,3,4], f32[2,5,4])")
    got, mod = _run(text)
    assert _dots(mod) == 1 and "f32[2,8,4] dot(%da.concat, %w)" in got


def test_a_merge_that_would_close_a_cycle_is_skipped():
    # Merging {a1, a2} (shared x) makes c depend on d, so {d, c} (shared y) must then stay apart.
    text = _module(["x: f32[4,8]", "y: f32[8,8]", "w1: f32[8,8]", "v: f32[8,8]"],
                   [f"%a1 = f32[4,8] dot(%x, %w1), {DOT}", f"%d = f32[8,8] dot(%y, %v), {DOT}",
                    "%w2 = f32[8,8] exponential(%d)", f"%a2 = f32[4,8] dot(%x, %w2), {DOT}",
                    "%u = f32[8,8] concatenate(%a1, %a1), dimensions={0}", f"%c = f32[8,8] dot(%y, %u), {DOT}",
                    "ROOT %out = (f32[4,8], f32[8,8]) tuple(%a2, %c)"], "(f32[4,8], f32[8,8])")
    got, mod = _run(text)
    assert _dots(mod) == 3 and "%a1.merged" in got


def test_a_dot_in_two_groups_merges_once():
    text = _module(["x: f32[4,8]", "y: f32[3,8]", "w: f32[8,5]", "w2: f32[8,6]"],
                   [f"%d1 = f32[4,5] dot(%x, %w), {DOT}", f"%d2 = f32[4,6] dot(%x, %w2), {DOT}",
                    f"%d3 = f32[3,5] dot(%y, %w), {DOT}",
                    "ROOT %out = (f32[4,5], f32[4,6], f32[3,5]) tuple(%d1, %d2, %d3)"],
                   "(f32[4,5], f32[4,6], f32[3,5])")
    got, mod = _run(text)
    assert _dots(mod) == 2 and "dot(%x, %d1.concat)" in got


@st.composite
def _dot_dags(draw):
    """Random f64 programs of [6,6] values: dots (either side shared), tanh, adds, biased dots."""
    names, body = ["p0", "p1", "p2"], []
    for k in range(draw(st.integers(2, 14))):
        kind = draw(st.sampled_from(["dot", "dot", "dot", "tanh", "add", "biased"]))
        a, b = draw(st.sampled_from(names)), draw(st.sampled_from(names))
        if kind == "dot":
            body.append(f"%n{k} = f64[6,6] dot(%{a}, %{b}), {DOT}")
        elif kind == "tanh":
            body.append(f"%n{k} = f64[6,6] tanh(%{a})")
        elif kind == "add":
            body.append(f"%n{k} = f64[6,6] add(%{a}, %{b})")
        else:
            body += [f"%n{k}.d = f64[6,6] dot(%{a}, %{b}), {DOT}", f"%n{k}.b = f64[6,6] broadcast(%v), dimensions={{1}}",
                     f"%n{k} = f64[6,6] add(%n{k}.d, %n{k}.b)"]
        names.append(f"n{k}")
    outs = names[3:]
    result = "(" + ", ".join(["f64[6,6]"] * len(outs)) + ")"
    body.append(f"ROOT %out = {result} tuple({', '.join('%' + o for o in outs)})")
    return _module(["p0: f64[6,6]", "p1: f64[6,6]", "p2: f64[6,6]", "v: f64[6]"], body, result)


@settings(max_examples=150, deadline=None)
@given(_dot_dags())
def test_random_programs_stay_valid_and_equal(text):
    _, mod = _run(text)  # verifies (def-before-use, no cycle) and compares with the original
    assert _dots(mod) <= _dots(parse_module(text))


def test_windowed_einsum_partial_dots_are_left_alone():
    mod = parse_module(ag_module("qkv", 2, 4))
    WindowedEinsum(mode="on", bidirectional=False).run(mod)
    before = print_module(mod)
    assert before.count(" dot(") == 6
    assert print_module(MergeDots().run(mod)) == before


def test_errors():
    with pytest.raises(ValueError, match="max_merged_bytes"):
        MergeDots(max_merged_bytes=-1)
    with pytest.raises(TypeError, match="max_merged_bytes"):
        MergeDots(max_merged_bytes=1.5)
    mod = parse_module(THREE_DOTS.replace(", is_partitioned=true", ""))
    with pytest.raises(ValueError, match="not partitioned"):
        MergeDots().run(mod)


# --------------------------------------------------------------------------- numerics through spmd.jit
DEVICES = [1, 2, 4]


@pytest.mark.parametrize("n", DEVICES)
def test_block_numerics(n, merging):
    wl, f = _block_jit(n)
    xs = make_inputs(wl, "cpu", 100 + n)
    lowered = f.lower(*xs)
    assert "merge-dots" in lowered.stages
    assert f"%matmul.merged = f32[128,{1536 // n}] dot(" in lowered.as_text("merge-dots")
    ref = wl.fn(*[x.double() for x in xs])
    assert _rel_err(f(*xs).to_torch(), ref) < 1e-5


def _qkv(x, wq, wk, wv, bq, bk, bv):
    """Q/K/V projections of x [B, S, D] with weights [D, D] and biases [D]; three outputs."""
    return x @ wq + bq, x @ wk + bk, x @ wv + bv


@pytest.mark.parametrize("n", DEVICES)
def test_qkv_projection_numerics(n, merging):
    mesh = spmd.Mesh.create({"tp": n}, f"cpu:{n}")
    g = torch.Generator().manual_seed(7 + n)
    args = [torch.randn(2, 16, 32, generator=g)] + [torch.randn(32, 32, generator=g) / 6 for _ in range(3)]
    args += [torch.randn(32, generator=g) for _ in range(3)]
    specs = (P(), P(None, "tp"), P(None, "tp"), P(None, "tp"), P("tp"), P("tp"), P("tp"))
    f = spmd.jit(_qkv, mesh=mesh, in_shardings=specs, out_shardings=(P(),) * 3, options=OPTIONS)
    merged = f.lower(*args).as_text("merge-dots")
    assert merged.count(" dot(") == 1 and f"f32[2,16,{96 // n}] dot(" in merged
    refs = _qkv(*[a.double() for a in args])
    for got, ref in zip(f(*args), refs, strict=True):
        assert _rel_err(got.to_torch(), ref) < 1e-5


class _Encoder(nn.Module):
    """One BERT encoder layer under the attribute names ``bert_plan`` matches."""

    def __init__(self, cfg) -> None:
        super().__init__()
        from spmd.models.bert import BertEncoder

        self.encoder = BertEncoder(cfg)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, mask_bias)


@pytest.mark.parametrize("n", DEVICES)
def test_bert_layer_numerics(n, merging):
    from spmd.models import plans
    from spmd.models.bert import BertConfig
    from spmd.parallelize import parallelize

    torch.manual_seed(20 + n)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128)
    model = _Encoder(cfg).eval()
    plan = plans.Plan(tuple(r for r in plans.bert_plan().rules if not r[0].startswith("embeddings")))
    pm = parallelize(model, spmd.Mesh.create({"tp": n}, f"cpu:{n}"), plan, options=OPTIONS)
    x = torch.randn(2, 8, 64)
    mask = torch.zeros(2, 1, 1, 8)
    mask[1, ..., 5:] = -1e9
    out = pm(x, mask).to_torch()
    text = pm.lowered.as_text("merge-dots")
    assert f"f32[2,8,{192 // n}] dot(" in text and text.count(" dot(") == 4
    with torch.no_grad():
        ref = model.double()(x.double(), mask.double())
    assert _rel_err(out, ref) < 1e-5
