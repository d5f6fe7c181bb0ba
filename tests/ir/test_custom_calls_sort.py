# ruff: noqa: E501  (golden HLO text lines are long)
"""sort / topk / cumsum / cumprod custom calls: kernels against torch, text round trip, and the
partitioned program (golden text: the sorted dim is all-gathered, other dims pass through)."""

from __future__ import annotations

import pytest
import torch

from spmd.ir.custom_calls import CUSTOM_CALLS
from spmd.ir.evaluate import evaluate, evaluate_sharded
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module
from spmd.passes.spmd_partition import SpmdPartition


def _run(target, x, **cfg):
    return CUSTOM_CALLS[target].fn([x], cfg)


def test_kernels_match_torch():
    x = (torch.randn(4, 6, dtype=torch.float64) * 2).round()
    s = torch.sort(x, dim=0, descending=True, stable=True)
    assert torch.equal(_run("sort", x, dim=0, descending=True, stable=True), s.values)
    assert torch.equal(_run("sort", x, dim=0, descending=True, stable=True, output="indices"), s.indices)
    t = torch.topk(x, 2, dim=1, largest=False)
    assert torch.equal(_run("topk", x, dim=1, k=2, largest=False, output="values"), t.values)
    assert torch.equal(_run("topk", x, dim=-1, k=2, largest=False, output="indices"), t.indices)
    assert torch.equal(_run("cumsum", x, dim=1), x.cumsum(1))
    assert torch.equal(_run("cumprod", x, dim=0), x.cumprod(0))
    with pytest.raises(ValueError, match="output"):
        _run("sort", x, dim=0, output="both")


def test_rules_keep_the_sorted_dim_unsharded_and_scans_any():
    for target in ("sort", "topk"):
        assert CUSTOM_CALLS[target].rule == "reduction-last-dims"
        assert CUSTOM_CALLS[target].unsharded_dims({"dim": 1}, 3) == (1,)
        assert CUSTOM_CALLS[target].unsharded_dims({"dim": -1}, 3) == (2,)
    for target in ("cumsum", "cumprod"):
        assert CUSTOM_CALLS[target].rule == "scan"
        assert CUSTOM_CALLS[target].unsharded_dims({"dim": 1}, 3) == ()


SORT_IN = """HloModule sort, num_partitions=2, mesh={tp=2}

ENTRY %main (x: f32[5,5]) -> (f32[5,5], s64[5,2]) {
  %x = f32[5,5] parameter(0), sharding={devices=[2,1]<=[2]}
  %v = f32[5,5] custom-call(%x), custom_call_target="sort", backend_config={"dim":0,"descending":true,"stable":true,"output":"values"}, sharding={devices=[1,2]<=[2]}
  %i = s64[5,2] custom-call(%x), custom_call_target="topk", backend_config={"dim":1,"k":2,"largest":true,"sorted":true,"output":"indices"}
  ROOT %out = (f32[5,5], s64[5,2]) tuple(%v, %i)
}
"""

SORT_OUT = """HloModule sort, num_partitions=2, mesh={tp=2}, is_partitioned=true

ENTRY %main (x: f32[3,5]) -> (f32[5,3], s64[3,2]) {
  %x = f32[3,5] parameter(0), sharding={devices=[2,1]<=[2]}
  %all-gather = f32[6,5] all-gather(%x), dimensions={0}, replica_groups={{0,1}}, sharding={replicated}
  %slice = f32[5,5] slice(%all-gather), slice={[0:5:1], [0:5:1]}, sharding={replicated}
  %constant = f32[] constant(0.0)
  %pad = f32[5,6] pad(%slice, %constant), padding=0_0_0x0_1_0, sharding={replicated}
  %constant.1 = s32[] constant(0)
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant.2 = s32[] constant(3)
  %multiply = s32[] multiply(%pid, %constant.2)
  %dynamic-slice = f32[5,3] dynamic-slice(%pad, %constant.1, %multiply), dynamic_slice_sizes={5,3}, sharding={devices=[1,2]<=[2]}
  %v = f32[5,3] custom-call(%dynamic-slice), custom_call_target="sort", backend_config={"dim":0,"descending":true,"stable":true,"output":"values"}, sharding={devices=[1,2]<=[2]}
  %i = s64[3,2] custom-call(%x), custom_call_target="topk", backend_config={"dim":1,"k":2,"largest":true,"sorted":true,"output":"indices"}, sharding={devices=[2,1]<=[2]}
  ROOT %out.1 = (f32[5,3], s64[3,2]) tuple(%v, %i)
}
"""


def test_text_round_trip():
    assert print_module(parse_module(SORT_IN)) == SORT_IN
    assert print_module(parse_module(SORT_OUT)) == SORT_OUT


def test_sort_along_a_sharded_dim_gathers_it_golden_and_numerics():
    pm = SpmdPartition().run(parse_module(SORT_IN))
    verify_module(pm)
    assert print_module(pm) == SORT_OUT
    x = (torch.randn(5, 5, dtype=torch.float64) * 2).round().float() + 0.25  # ties
    want = evaluate(parse_module(SORT_IN), [x])
    got = evaluate_sharded(pm, [x], [(5, 5), (5, 2)])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(want[0], torch.sort(x, dim=0, descending=True, stable=True).values)
