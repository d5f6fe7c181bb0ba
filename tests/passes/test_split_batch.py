"""split-batch: golden HLO text, async all-reduces under the other half's dots, numerics, hazards."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import copy
import re

import pytest
import torch
from expecttest import TestCase

import spmd
import spmd.runtime.lower as lower_mod
from spmd.ir.text import parse_module, print_module
from spmd.models.bert import BertConfig, BertSentenceEncoder
from spmd.models.common import init_random_
from spmd.models.llama import llama_layers
from spmd.models.plans import bert_plan, llama_plan
from spmd.parallelize import parallelize
from spmd.passes.assign_buffers import assign_buffers
from spmd.passes.assign_streams import AssignStreams
from spmd.passes.schedule import Schedule
from spmd.passes.split_batch import SplitBatch
from spmd.runtime.hazards import find_hazards
from spmd.runtime.thunks import CollectiveThunk, KernelThunk
from tests.passes.pass_checks import run_pass_checked
from tests.passes.test_merge_dots import DOT, _module

P = spmd.PartitionSpec

ROW_PARALLEL = _module(
    ["x: f32[4,8]", "w1: f32[8,8]", "w2: f32[8,8]", "b: f32[8]"],
    [f"%h = f32[4,8] dot(%x, %w1), {DOT}",
     "%bb = f32[4,8] broadcast(%b), dimensions={1}",
     "%hb = f32[4,8] add(%h, %bb)",
     f"%y = f32[4,8] dot(%hb, %w2), {DOT}",
     "%r = f32[4,8] all-reduce(%y), replica_groups={{0,1}}, to_apply=%add",
     "%o = f32[4,8] add(%r, %x)",
     f"%z = f32[4,8] dot(%o, %w1), {DOT}",
     "%r2 = f32[4,8] all-reduce(%z), replica_groups={{0,1}}, to_apply=%add",
     "ROOT %out = f32[4,8] add(%r2, %o)"],
    "f32[4,8]", p=2).replace("\nENTRY", """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b.1)
}

ENTRY""")


def _strip(text: str) -> str:
    return re.sub(r", metadata=\{[^}]*\}", "", text)


def _entry(text: str) -> str:
    return text.split("ENTRY", 1)[1]


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


class GoldenTest(TestCase):
    def test_two_halves_interleaved_by_segment(self):
        text, mod = run_pass_checked(SplitBatch(mode="on", weights=frozenset({1, 2, 3})), ROW_PARALLEL)
        self.assertExpectedInline(_entry(text), """\
 %main (x: f32[4,8], w1: f32[8,8], w2: f32[8,8], b: f32[8]) -> f32[4,8] {
  %x = f32[4,8] parameter(0)
  %w1 = f32[8,8] parameter(1)
  %w2 = f32[8,8] parameter(2)
  %b = f32[8] parameter(3)
  %bb = f32[4,8] broadcast(%b), dimensions={1}
  %x.h0 = f32[2,8] slice(%x), slice={[0:2:1], [0:8:1]}
  %x.h1 = f32[2,8] slice(%x), slice={[2:4:1], [0:8:1]}
  %h.h0 = f32[2,8] dot(%x.h0, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %bb.h0 = f32[2,8] slice(%bb), slice={[0:2:1], [0:8:1]}
  %hb.h0 = f32[2,8] add(%h.h0, %bb.h0)
  %y.h0 = f32[2,8] dot(%hb.h0, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %r.h0 = f32[2,8] all-reduce(%y.h0), to_apply=%add, backend_config={"split_batch":0}, replica_groups={{0,1}}
  %h.h1 = f32[2,8] dot(%x.h1, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %bb.h1 = f32[2,8] slice(%bb), slice={[2:4:1], [0:8:1]}
  %hb.h1 = f32[2,8] add(%h.h1, %bb.h1)
  %y.h1 = f32[2,8] dot(%hb.h1, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %r.h1 = f32[2,8] all-reduce(%y.h1), to_apply=%add, backend_config={"split_batch":1}, replica_groups={{0,1}}
  %o.h0 = f32[2,8] add(%r.h0, %x.h0)
  %z.h0 = f32[2,8] dot(%o.h0, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %r2.h0 = f32[2,8] all-reduce(%z.h0), to_apply=%add, backend_config={"split_batch":0}, replica_groups={{0,1}}
  %o.h1 = f32[2,8] add(%r.h1, %x.h1)
  %z.h1 = f32[2,8] dot(%o.h1, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %r2.h1 = f32[2,8] all-reduce(%z.h1), to_apply=%add, backend_config={"split_batch":1}, replica_groups={{0,1}}
  %out.h0 = f32[2,8] add(%r2.h0, %o.h0)
  %out.h1 = f32[2,8] add(%r2.h1, %o.h1)
  ROOT %out.joined = f32[4,8] concatenate(%out.h0, %out.h1), dimensions={0}
}
""")

    def test_async_all_reduce_of_one_half_runs_under_the_other_halfs_dots(self):
        mod = SplitBatch(mode="on", weights=frozenset({1, 2, 3})).run(parse_module(ROW_PARALLEL))
        mod = Schedule().run(AssignStreams(num_compute_streams=None).run(mod))
        order = [(i.name, i.opcode, i.stream_id) for i in mod.entry.instructions]
        names = [n for n, _, _ in order]
        starts = [n for n, op, _ in order if op == "all-reduce-start"]
        assert all(s == 2 for _, op, s in order if op.startswith("all-reduce")) and len(starts) == 4
        # half A's first all-reduce starts before half B's dots and is waited for after them
        assert names.index("r.h0-start") < names.index("h.h1") < names.index("y.h1") < names.index("r.h0")
        # half B's all-reduce runs under half A's next dot
        assert names.index("r.h1-start") < names.index("z.h0") < names.index("r.h1")


# --------------------------------------------------------------------------- rules
@pytest.mark.parametrize("body", [
    ["%s = f32[] reduce(%x, %zero), dimensions={0,1}, to_apply=%add", "ROOT %out = f32[] negate(%s)"],
    ["%t = f32[8,8] dot(%x, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}",
     "ROOT %out = f32[8,8] negate(%t)"],
    ["%s = f32[2,4] slice(%x), slice={[0:2:1], [0:4:1]}", "ROOT %out = f32[2,4] negate(%s)"],
], ids=["reduce", "contract", "slice"])
def test_programs_that_mix_rows_along_both_dims_stay(body):
    result = body[-1].split(" = ")[1].split(" ")[0]
    text = _module(["x: f32[4,8]"], ["%zero = f32[] constant(0)", *body], result).replace("\nENTRY", """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY""")
    assert SplitBatch(mode="on").plan(parse_module(text)) is None
    assert print_module(SplitBatch(mode="on").run(parse_module(text))) == print_module(parse_module(text))


def test_auto_leaves_small_programs_and_off_leaves_everything():
    for mode in ("auto", "off"):
        mod = SplitBatch(mode=mode, weights=frozenset({1, 2, 3})).run(parse_module(ROW_PARALLEL))
        assert print_module(mod) == print_module(parse_module(ROW_PARALLEL))
    with pytest.raises(ValueError, match="mode"):
        SplitBatch(mode="yes")


def test_auto_splits_where_the_all_reduces_are_large():
    big = ROW_PARALLEL.replace("f32[4,8]", "f32[8192,4096]").replace("f32[8,8]", "f32[4096,4096]").replace(
        "f32[8]", "f32[4096]")
    mod = SplitBatch(mode="auto", weights=frozenset({1, 2, 3})).run(parse_module(big))
    assert any(i.name == "r.h1" for i in mod.entry.instructions)


# --------------------------------------------------------------------------- numerics and hazards
def _bert():
    cfg = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=16)
    return init_random_(BertSentenceEncoder(cfg), seed=3).eval()


MESHES = [({"tp": 2}, "cpu:2"), ({"tp": 4}, "cpu:4"), ({"dp": 2, "tp": 2}, "cpu:4")]


@pytest.mark.parametrize("axes, devices", MESHES, ids=["tp2", "tp4", "dp2xtp2"])
def test_bert_numerics_and_no_hazards(axes, devices):
    model = _bert()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 97, (3, 8), generator=gen)  # an odd batch: halves of 2 and 1 rows
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        want = copy.deepcopy(model).double()(ids, mask)
    mesh = spmd.Mesh.create(axes, devices)
    pm = parallelize(model, mesh, bert_plan(), options=spmd.CompileOptions(split_batch_overlap="on", verify=True))
    assert _rel_err(pm(ids, mask).to_torch(), want) < 1e-5
    module = pm.lowered.result.module
    assert sum(i.opcode == "all-reduce-start" for i in module.entry.instructions) == 8  # 2 per layer and half
    n = mesh.num_devices
    program = lower_mod.lower(module, [torch.device("cpu")] * n, list(range(n)), assign_buffers(module), gpu=True)
    assert find_hazards(program) == []
    _assert_overlapped(program, module)


def _assert_overlapped(program, module) -> None:
    """Every async all-reduce (comm stream) is issued before dots that run until its first reader."""
    dots = {i.name for i in module.entry.instructions if i.opcode == "dot"}
    thunks = program.thunks
    collectives = [k for k, t in enumerate(thunks) if isinstance(t, CollectiveThunk) and t.stream_id != 0]
    assert collectives
    for k in collectives:
        first_reader = next(j for j in range(k + 1, len(thunks))
                            if isinstance(thunks[j], KernelThunk) and thunks[k].out in thunks[j].ins)
        between = [t.name for t in thunks[k + 1:first_reader] if isinstance(t, KernelThunk) and t.name in dots]
        last = k == collectives[-1]  # nothing is left to run under the last half's last all-reduce
        assert between or last, f"nothing runs under {thunks[k].name}"


def test_llama_numerics_on_two_devices():
    model = llama_layers(small=True, layers=2, seed=4)
    x = torch.randn(4, 5, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    mesh = spmd.Mesh.create({"tp": 2}, "cpu:2")
    pm = parallelize(model, mesh, llama_plan(), options=spmd.CompileOptions(split_batch_overlap="on", verify=True))
    assert _rel_err(pm(x).to_torch(), want) < 1e-5
    assert "all-reduce-start" in pm.lowered.as_text("schedule")


def test_sequence_dim_when_the_batch_is_one():
    def mlp(x, w1, w2):
        return torch.relu(x @ w1) @ w2 + x

    mesh = spmd.Mesh.create({"tp": 2}, "cpu:2")
    f = spmd.jit(mlp, mesh=mesh, in_shardings=(P(), P(None, "tp"), P("tp", None)), out_shardings=P(),
                 weight_argnums=(1, 2), options=spmd.CompileOptions(split_batch_overlap="on", verify=True))
    gen = torch.Generator().manual_seed(7)
    x, w1, w2 = torch.randn(1, 6, 8, generator=gen), torch.randn(8, 16, generator=gen), torch.randn(16, 8, generator=gen)
    assert _rel_err(f(x, w1, w2).to_torch(), mlp(x.double(), w1.double(), w2.double())) < 1e-5
    assert "slice={[0:1:1], [3:6:1]" in f.lower(x, w1, w2).as_text("split-batch")


def test_option_is_checked():
    with pytest.raises(ValueError, match="split_batch_overlap"):
        spmd.CompileOptions(split_batch_overlap="always")
