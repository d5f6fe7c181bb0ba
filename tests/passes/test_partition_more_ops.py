# ruff: noqa: E501  (golden HLO text lines are long)
"""Partitioning the programs of prod / log1p / flip / F.pad along sharded, uneven dims (golden text, numerics).

A product reduce over a sharded dim gathers that dim (multiply is not a splittable reducer in
``spmd.passes.sharding_rules``); flip is a rows-form gather, partitioned as a masked per-shard
gather plus an all-reduce; pad along a sharded dim replicates the padded dim; cummax along a
sharded dim gathers it (the sort rule).
"""

from __future__ import annotations

import pytest
import torch

from spmd.ir.evaluate import evaluate, evaluate_sharded
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module
from spmd.passes.spmd_partition import SpmdPartition

PROD_IN = """HloModule prod, num_partitions=2, mesh={tp=2}

%multiply.f32 (multiply.f32.x: f32[], multiply.f32.y: f32[]) -> f32[] {
  %multiply.f32.x = f32[] parameter(0)
  %multiply.f32.y = f32[] parameter(1)
  ROOT %multiply.f32.r = f32[] multiply(%multiply.f32.x, %multiply.f32.y)
}

ENTRY %main (x: f32[3,5]) -> f32[3] {
  %x = f32[3,5] parameter(0), sharding={devices=[1,2]<=[2]}
  %one = f32[] constant(1.0)
  %l = f32[3,5] log-plus-one(%x), sharding={devices=[1,2]<=[2]}
  ROOT %r = f32[3] reduce(%l, %one), dimensions={1}, to_apply=%multiply.f32, sharding={devices=[2]<=[2]}
}
"""

PROD_OUT = """HloModule prod, num_partitions=2, mesh={tp=2}, is_partitioned=true

%multiply.f32 (multiply.f32.x: f32[], multiply.f32.y: f32[]) -> f32[] {
  %multiply.f32.x = f32[] parameter(0)
  %multiply.f32.y = f32[] parameter(1)
  ROOT %multiply.f32.r = f32[] multiply(%multiply.f32.x, %multiply.f32.y)
}

ENTRY %main (x: f32[3,3]) -> f32[2] {
  %x = f32[3,3] parameter(0), sharding={devices=[1,2]<=[2]}
  %one = f32[] constant(1.0), sharding={replicated}
  %l = f32[3,3] log-plus-one(%x), sharding={devices=[1,2]<=[2]}
  %all-gather = f32[3,6] all-gather(%l), dimensions={1}, replica_groups={{0,1}}, sharding={replicated}
  %slice = f32[3,5] slice(%all-gather), slice={[0:3:1], [0:5:1]}, sharding={replicated}
  %constant = f32[] constant(0.0)
  %pad = f32[4,5] pad(%slice, %constant), padding=0_1_0x0_0_0, sharding={replicated}
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant.1 = s32[] constant(2)
  %multiply = s32[] multiply(%pid, %constant.1)
  %constant.2 = s32[] constant(0)
  %dynamic-slice = f32[2,5] dynamic-slice(%pad, %multiply, %constant.2), dynamic_slice_sizes={2,5}, sharding={devices=[2,1]<=[2]}
  ROOT %r = f32[2] reduce(%dynamic-slice, %one), dimensions={1}, to_apply=%multiply.f32, sharding={devices=[2]<=[2]}
}
"""

FLIP_PAD_IN = """HloModule flip, num_partitions=2, mesh={tp=2}

ENTRY %main (x: f32[5,2]) -> f32[6,2] {
  %x = f32[5,2] parameter(0), sharding={devices=[2,1]<=[2]}
  %idx = s64[5] constant({4, 3, 2, 1, 0})
  %f = f32[5,2] gather(%x, %idx), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,2}, sharding={devices=[2,1]<=[2]}
  %zero = f32[] constant(0.0)
  ROOT %p = f32[6,2] pad(%f, %zero), padding=1_0_0x0_0_0, sharding={devices=[2,1]<=[2]}
}
"""

FLIP_PAD_OUT = """HloModule flip, num_partitions=2, mesh={tp=2}, is_partitioned=true

%add.f32 (add.f32.lhs: f32[], add.f32.rhs: f32[]) -> f32[] {
  %add.f32.lhs = f32[] parameter(0)
  %add.f32.rhs = f32[] parameter(1)
  ROOT %add.f32.out = f32[] add(%add.f32.lhs, %add.f32.rhs)
}

ENTRY %main (x: f32[3,2]) -> f32[3,2] {
  %x = f32[3,2] parameter(0), sharding={devices=[2,1]<=[2]}
  %idx = s64[5] constant({4, 3, 2, 1, 0}), sharding={replicated}
  %constant = s64[] constant(0)
  %constant.1 = s64[] constant(4)
  %clamp = s64[5] clamp(%constant, %idx, %constant.1)
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant.2 = s32[] constant(3)
  %multiply = s32[] multiply(%pid, %constant.2)
  %convert = s64[] convert(%multiply)
  %broadcast = s64[5] broadcast(%convert), dimensions={}
  %subtract = s64[5] subtract(%clamp, %broadcast)
  %constant.3 = s64[] constant(3)
  %broadcast.1 = s64[5] broadcast(%constant.3), dimensions={}
  %compare = pred[5] compare(%subtract, %broadcast.1), direction=LT
  %broadcast.2 = s64[5] broadcast(%constant), dimensions={}
  %compare.1 = pred[5] compare(%subtract, %broadcast.2), direction=GE
  %and = pred[5] and(%compare, %compare.1)
  %f = f32[5,2] gather(%x, %subtract), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,2}, sharding={devices=[1,1,2]<=[2] last_tile_dims={partial}}
  %broadcast.3 = pred[5,2] broadcast(%and), dimensions={0}
  %constant.4 = f32[] constant(0.0)
  %broadcast.4 = f32[5,2] broadcast(%constant.4), dimensions={}
  %f.masked = f32[5,2] select(%broadcast.3, %f, %broadcast.4), sharding={devices=[1,1,2]<=[2] last_tile_dims={partial}}
  %all-reduce = f32[5,2] all-reduce(%f.masked), to_apply=%add.f32, replica_groups={{0,1}}, sharding={replicated}
  %pad = f32[6,2] pad(%all-reduce, %constant.4), padding=0_1_0x0_0_0, sharding={replicated}
  %multiply.1 = s32[] multiply(%pid, %constant.2)
  %constant.5 = s32[] constant(0)
  %dynamic-slice = f32[3,2] dynamic-slice(%pad, %multiply.1, %constant.5), dynamic_slice_sizes={3,2}, sharding={devices=[2,1]<=[2]}
  %zero = f32[] constant(0.0), sharding={replicated}
  %all-gather = f32[6,2] all-gather(%dynamic-slice), dimensions={0}, replica_groups={{0,1}}, sharding={replicated}
  %slice = f32[5,2] slice(%all-gather), slice={[0:5:1], [0:2:1]}, sharding={replicated}
  %p = f32[6,2] pad(%slice, %zero), padding=1_0_0x0_0_0, sharding={replicated}
  %multiply.2 = s32[] multiply(%pid, %constant.2)
  ROOT %dynamic-slice.1 = f32[3,2] dynamic-slice(%p, %multiply.2, %constant.5), dynamic_slice_sizes={3,2}, sharding={devices=[2,1]<=[2]}
}
"""


CUMMAX_IN = """HloModule cummax, num_partitions=2, mesh={tp=2}

ENTRY %main (x: f32[3,5]) -> s64[3,5] {
  %x = f32[3,5] parameter(0), sharding={devices=[1,2]<=[2]}
  ROOT %c = s64[3,5] custom-call(%x), custom_call_target="cummax", backend_config={"dim":1,"output":"indices"}, sharding={devices=[1,2]<=[2]}
}
"""

CUMMAX_OUT = """HloModule cummax, num_partitions=2, mesh={tp=2}, is_partitioned=true

ENTRY %main (x: f32[3,3]) -> s64[3,3] {
  %x = f32[3,3] parameter(0), sharding={devices=[1,2]<=[2]}
  %all-gather = f32[3,6] all-gather(%x), dimensions={1}, replica_groups={{0,1}}, sharding={replicated}
  %slice = f32[3,5] slice(%all-gather), slice={[0:3:1], [0:5:1]}, sharding={replicated}
  %c = s64[3,5] custom-call(%slice), custom_call_target="cummax", backend_config={"dim":1,"output":"indices"}, sharding={replicated}
  %constant = s64[] constant(0)
  %pad = s64[3,6] pad(%c, %constant), padding=0_0_0x0_1_0, sharding={replicated}
  %constant.1 = s32[] constant(0)
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant.2 = s32[] constant(3)
  %multiply = s32[] multiply(%pid, %constant.2)
  ROOT %dynamic-slice = s64[3,3] dynamic-slice(%pad, %constant.1, %multiply), dynamic_slice_sizes={3,3}, sharding={devices=[1,2]<=[2]}
}
"""


def _x(shape):
    return torch.rand(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float() + 0.5


@pytest.mark.parametrize("text,out,shape,ref", [
    (PROD_IN, PROD_OUT, (3, 5), lambda x: torch.log1p(x).prod(1)),
    (FLIP_PAD_IN, FLIP_PAD_OUT, (5, 2), lambda x: torch.nn.functional.pad(x.flip(0), (0, 0, 1, 0))),
    (CUMMAX_IN, CUMMAX_OUT, (3, 5), lambda x: x.cummax(1).indices),
], ids=["prod_log1p", "flip_pad", "cummax_gathers_the_scanned_dim"])
def test_golden_partitioned_text_and_numerics(text, out, shape, ref):
    assert print_module(parse_module(text)) == text
    pm = SpmdPartition().run(parse_module(text))
    verify_module(pm)
    assert print_module(pm) == out
    x = _x(shape)
    want = ref(x)
    (single,) = evaluate(parse_module(text), [x])
    (got,) = evaluate_sharded(pm, [x], [tuple(want.shape)])
    torch.testing.assert_close(single, want)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mesh,sharding", [
    ("{tp=4}", "{devices=[4,1]<=[4]}"),
    ("{a=2,b=2}", "{devices=[2,2]<=[4]}"),
    ("{a=2,b=2}", "{devices=[2,1,2]<=[2,2]T(1,0) last_tile_dim_replicate}"),
])
def test_flip_pad_on_four_devices_and_2d_meshes(mesh, sharding):
    text = FLIP_PAD_IN.replace("{tp=2}", mesh).replace("num_partitions=2", "num_partitions=4").replace(
        "f32[5,2]", "f64[7,3]").replace("f32[6,2]", "f64[8,3]").replace("{4, 3, 2, 1, 0}", "{6, 5, 4, 3, 2, 1, 0}").replace(
        "s64[5]", "s64[7]").replace("slice_sizes={1,2}", "slice_sizes={1,3}").replace("{devices=[2,1]<=[2]}", sharding).replace(
        "f32[] constant", "f64[] constant")
    pm = SpmdPartition().run(parse_module(text))
    verify_module(pm)
    x = torch.randn(7, 3, dtype=torch.float64)
    (got,) = evaluate_sharded(pm, [x], [(8, 3)])
    torch.testing.assert_close(got, torch.nn.functional.pad(x.flip(0), (0, 0, 1, 0)), rtol=0, atol=0)
