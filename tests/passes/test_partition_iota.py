# ruff: noqa: E501  (golden HLO text lines are long)
"""Partitioned iota (local iota plus the shard offset) and the argmax reduction along a sharded,
uneven dim that uses it: golden text and numerics against the unpartitioned module."""

from __future__ import annotations

from pathlib import Path

import torch

from spmd.ir.evaluate import evaluate, evaluate_sharded
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module
from spmd.passes.spmd_partition import SpmdPartition

IOTA_IN = """HloModule iota, num_partitions=4, mesh={dp=2,tp=2}

ENTRY %main (x: s64[5,3]) -> s64[5,3] {
  %x = s64[5,3] parameter(0), sharding={devices=[2,2]<=[4]}
  %i0 = s64[5,3] iota(), iota_dimension=0
  %i1 = s64[5,3] iota(), iota_dimension=1
  %s = s64[5,3] add(%i0, %i1)
  ROOT %y = s64[5,3] add(%x, %s), sharding={devices=[2,2]<=[4]}
}
"""

IOTA_OUT = """HloModule iota, num_partitions=4, mesh={dp=2,tp=2}, is_partitioned=true

ENTRY %main (x: s64[3,2]) -> s64[3,2] {
  %x = s64[3,2] parameter(0), sharding={devices=[2,2]<=[4]}
  %i0 = s64[3,2] iota(), iota_dimension=0, sharding={devices=[2,2]<=[4]}
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant = s32[] constant(2)
  %divide = s32[] divide(%pid, %constant)
  %constant.1 = s32[] constant(3)
  %multiply = s32[] multiply(%divide, %constant.1)
  %convert = s64[] convert(%multiply)
  %broadcast = s64[3,2] broadcast(%convert), dimensions={}
  %add = s64[3,2] add(%i0, %broadcast), sharding={devices=[2,2]<=[4]}
  %i1 = s64[3,2] iota(), iota_dimension=1, sharding={devices=[2,2]<=[4]}
  %remainder = s32[] remainder(%pid, %constant)
  %multiply.1 = s32[] multiply(%remainder, %constant)
  %convert.1 = s64[] convert(%multiply.1)
  %broadcast.1 = s64[3,2] broadcast(%convert.1), dimensions={}
  %add.1 = s64[3,2] add(%i1, %broadcast.1), sharding={devices=[2,2]<=[4]}
  %s = s64[3,2] add(%add, %add.1), sharding={devices=[2,2]<=[4]}
  ROOT %y = s64[3,2] add(%x, %s), sharding={devices=[2,2]<=[4]}
}
"""


def _check(text_in: str, text_out: str, args: list[torch.Tensor]):
    assert print_module(parse_module(text_in)) == text_in
    pm = SpmdPartition().run(parse_module(text_in))
    verify_module(pm)
    assert print_module(pm) == text_out
    want = evaluate(parse_module(text_in), args)
    got = evaluate_sharded(pm, args, [w.shape for w in want])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    return want


def test_iota_shards_are_built_locally_golden():
    x = torch.randint(-9, 9, (5, 3), dtype=torch.int64)
    (y,) = _check(IOTA_IN, IOTA_OUT, [x])
    assert torch.equal(y, x + torch.arange(5)[:, None] + torch.arange(3)[None, :])


ARGMAX_IN = (Path(__file__).parent / "golden" / "argmax_in.hlo").read_text()
ARGMAX_OUT = (Path(__file__).parent / "golden" / "argmax_out.hlo").read_text()


def test_argmax_along_a_sharded_uneven_dim_golden_with_ties_and_nan():
    """max then min of matching global indices: all-reduce(max) of values, all-reduce(min) of indices."""
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0], [5.0, 1.0, 1.0, 1.0, 5.0], [0.0, float("nan"), 9.0, float("nan"), 9.0]])
    (idx,) = _check(ARGMAX_IN, ARGMAX_OUT, [x])
    assert idx.tolist() == [1, 0, 1] == x.argmax(1).tolist()
