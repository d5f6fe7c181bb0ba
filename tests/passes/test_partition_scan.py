# ruff: noqa: E501  (golden HLO text lines are long)
"""cumsum / cumprod along a sharded, uneven dim: parallel prefix (golden text, numerics)."""

from __future__ import annotations

import pytest
import torch

from spmd.ir.evaluate import evaluate, evaluate_sharded
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module
from spmd.passes.spmd_partition import SpmdPartition

SCAN_IN = """HloModule scan, num_partitions=2, mesh={tp=2}

ENTRY %main (x: f32[3,5]) -> f32[3,5] {
  %x = f32[3,5] parameter(0), sharding={devices=[1,2]<=[2]}
  ROOT %c = f32[3,5] custom-call(%x), custom_call_target="cumsum", backend_config={"dim":1}, sharding={devices=[1,2]<=[2]}
}
"""

SCAN_OUT = """HloModule scan, num_partitions=2, mesh={tp=2}, is_partitioned=true

ENTRY %main (x: f32[3,3]) -> f32[3,3] {
  %x = f32[3,3] parameter(0), sharding={devices=[1,2]<=[2]}
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant = s32[] constant(3)
  %multiply = s32[] multiply(%pid, %constant)
  %constant.1 = s32[] constant(5)
  %subtract = s32[] subtract(%constant.1, %multiply)
  %iota = s32[3,3] iota(), iota_dimension=1
  %broadcast = s32[3,3] broadcast(%subtract), dimensions={}
  %compare = pred[3,3] compare(%iota, %broadcast), direction=LT
  %constant.2 = f32[] constant(0.0)
  %broadcast.1 = f32[3,3] broadcast(%constant.2), dimensions={}
  %x.masked = f32[3,3] select(%compare, %x, %broadcast.1), sharding={devices=[1,2]<=[2]}
  %c = f32[3,3] custom-call(%x.masked), custom_call_target="cumsum", backend_config={"dim":1}, sharding={devices=[1,2]<=[2]}
  %slice = f32[3,1] slice(%c), slice={[0:3:1], [2:3:1]}
  %all-gather = f32[3,2] all-gather(%slice), dimensions={1}, replica_groups={{0,1}}
  %broadcast.2 = f32[3,1] broadcast(%constant.2), dimensions={}
  %slice.1 = f32[3,1] slice(%all-gather), slice={[0:3:1], [0:1:1]}
  %concatenate = f32[3,2] concatenate(%broadcast.2, %slice.1), dimensions={1}
  %custom-call = f32[3,2] custom-call(%concatenate), custom_call_target="cumsum", backend_config={"dim":1}
  %constant.3 = s32[] constant(0)
  %dynamic-slice = f32[3,1] dynamic-slice(%custom-call, %constant.3, %pid), dynamic_slice_sizes={3,1}
  %reshape = f32[3] reshape(%dynamic-slice)
  %broadcast.3 = f32[3,3] broadcast(%reshape), dimensions={0}
  ROOT %add = f32[3,3] add(%c, %broadcast.3), sharding={devices=[1,2]<=[2]}
}
"""


def test_cumsum_along_a_sharded_uneven_dim_is_a_parallel_prefix_golden():
    assert print_module(parse_module(SCAN_IN)) == SCAN_IN
    pm = SpmdPartition().run(parse_module(SCAN_IN))
    verify_module(pm)
    assert print_module(pm) == SCAN_OUT
    x = torch.randn(3, 5) + 0.1
    got = evaluate_sharded(pm, [x], [(3, 5)])
    torch.testing.assert_close(got[0], x.cumsum(1))


@pytest.mark.parametrize("target,mesh,sharding,dim", [
    ("cumprod", "{tp=4}", "{devices=[4,1]<=[4]}", 0),
    ("cumsum", "{a=2,b=2}", "{devices=[2,2]<=[4]}", 0),
    ("cumsum", "{a=2,b=2}", "{devices=[1,4]<=[4]}", 1),
    ("cumprod", "{a=2,b=2}", "{devices=[2,2]<=[2,2]T(1,0)}", 1),
])
def test_scans_on_more_devices_and_2d_meshes(target, mesh, sharding, dim):
    text = SCAN_IN.replace("{tp=2}", mesh).replace("num_partitions=2", "num_partitions=4").replace(
        "f32[3,5]", "f64[7,9]").replace('"cumsum"', f'"{target}"').replace('"dim":1', f'"dim":{dim}').replace(
        "{devices=[1,2]<=[2]}", sharding)
    pm = SpmdPartition().run(parse_module(text))
    verify_module(pm)
    x = 1 + 0.1 * torch.randn(7, 9, dtype=torch.float64)
    (want,) = evaluate(parse_module(text), [x])
    (got,) = evaluate_sharded(pm, [x], [(7, 9)])
    torch.testing.assert_close(want, x.cumsum(dim) if target == "cumsum" else x.cumprod(dim))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert "all-gather" in print_module(pm) and "custom-call" in print_module(pm)


EMPTY_SCAN_OUT = """HloModule scan, num_partitions=2, mesh={tp=2}, is_partitioned=true

ENTRY %main (x: f32[3,0]) -> f32[3,0] {
  %x = f32[3,0] parameter(0), sharding={devices=[1,2]<=[2]}
  ROOT %c = f32[3,0] custom-call(%x), custom_call_target="cumsum", backend_config={"dim":1}, sharding={devices=[1,2]<=[2]}
}
"""


def test_scan_along_an_empty_sharded_dim_runs_locally_golden():
    """A scan along a sharded dim of size 0 has no totals: the prefix sliced the last row of an
    empty shard ([-1:0]) and the runtime failed ("output with shape [3, 1] doesn't match the
    broadcast shape [3, 0]")."""
    pm = SpmdPartition().run(parse_module(SCAN_IN.replace("f32[3,5]", "f32[3,0]")))
    verify_module(pm)
    assert print_module(pm) == EMPTY_SCAN_OUT
    (got,) = evaluate_sharded(pm, [torch.randn(3, 0)], [(3, 0)])
    assert got.shape == (3, 0)


@pytest.mark.parametrize("spec,dim", [(("a",), 0), ((None, "b"), 1), ((("a", "b"),), 0)])
def test_empty_scans_through_jit(spec, dim):
    import spmd
    from spmd import Mesh
    from spmd import PartitionSpec as P

    mesh = Mesh.create({"a": 2, "b": 2}, devices="cpu:4")
    for shape in ((0, 3), (3, 0), (0, 0)):
        x = torch.randn(*shape)
        for fn in (lambda t: t.cumsum(dim), lambda t: t.cumprod(dim) * 2):
            got = spmd.jit(fn, mesh=mesh, in_shardings=(P(*spec),), out_shardings=P(*spec))(x).to_torch()
            assert got.shape == fn(x).shape
