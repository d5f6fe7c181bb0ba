# ruff: noqa: E501  (golden HLO text lines are long)
"""conv1d sharding rule: plans per operand sharding, and the partitioned program (golden text)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spmd.ir.evaluate import evaluate, evaluate_sharded
from spmd.ir.sharding import MeshShape, TensorSharding
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module
from spmd.passes.rules_conv import plan_conv1d
from spmd.passes.spmd_partition import SpmdPartition

CONV_IN = """HloModule conv, num_partitions=2, mesh={tp=2}

ENTRY %main (x: f32[3,4,9], w: f32[6,4,3]) -> f32[3,6,7] {
  %x = f32[3,4,9] parameter(0), sharding={devices=[1,2,1]<=[2]}
  %w = f32[6,4,3] parameter(1), sharding={replicated}
  ROOT %y = f32[3,6,7] custom-call(%x, %w), custom_call_target="conv1d", backend_config={"stride":1,"padding":0,"dilation":1,"groups":1}, sharding={replicated}
}
"""

CONV_OUT = """HloModule conv, num_partitions=2, mesh={tp=2}, is_partitioned=true

%add.f32 (add.f32.lhs: f32[], add.f32.rhs: f32[]) -> f32[] {
  %add.f32.lhs = f32[] parameter(0)
  %add.f32.rhs = f32[] parameter(1)
  ROOT %add.f32.out = f32[] add(%add.f32.lhs, %add.f32.rhs)
}

ENTRY %main (x: f32[3,2,9], w: f32[6,4,3]) -> f32[3,6,7] {
  %x = f32[3,2,9] parameter(0), sharding={devices=[1,2,1]<=[2]}
  %w = f32[6,4,3] parameter(1), sharding={replicated}
  %constant = s32[] constant(0)
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant.1 = s32[] constant(2)
  %multiply = s32[] multiply(%pid, %constant.1)
  %dynamic-slice = f32[6,2,3] dynamic-slice(%w, %constant, %multiply, %constant), dynamic_slice_sizes={6,2,3}, sharding={devices=[1,2,1]<=[2]}
  %y = f32[3,6,7] custom-call(%x, %dynamic-slice), custom_call_target="conv1d", backend_config={"stride":1,"padding":0,"dilation":1,"groups":1}, sharding={devices=[1,1,1,2]<=[2] last_tile_dims={partial}}
  ROOT %all-reduce = f32[3,6,7] all-reduce(%y), to_apply=%add.f32, replica_groups={{0,1}}, sharding={replicated}
}
"""


def test_input_channels_sharded_give_partial_sums_then_all_reduce_golden():
    assert print_module(parse_module(CONV_IN)) == CONV_IN
    pm = SpmdPartition().run(parse_module(CONV_IN))
    verify_module(pm)
    assert print_module(pm) == CONV_OUT
    x, w = torch.randn(3, 4, 9), torch.randn(6, 4, 3)
    (want,) = evaluate(parse_module(CONV_IN), [x, w])
    (got,) = evaluate_sharded(pm, [x, w], [(3, 6, 7)])
    torch.testing.assert_close(want, F.conv1d(x, w))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


MESH_2D = MeshShape(("dp", "tp"), (2, 2))


def _plan(x, w, out=None, groups=1, c_in=4, mesh=MESH_2D):
    m = parse_module(CONV_IN.replace("f32[3,4,9]", f"f32[3,{c_in},9]").replace("f32[6,4,3]", f"f32[6,{c_in // groups},3]")
                     .replace('"groups":1', f'"groups":{groups}'))
    return plan_conv1d(m.entry.root, [x, w], out, mesh)


def test_plans():
    s = TensorSharding
    rep = s(((), (), ()))
    p = _plan(s((("dp",), (), ())), s((("tp",), (), ())))  # batch and output channels pass through
    assert p.operands == (s((("dp",), (), ())), s((("tp",), (), ()))) and p.result == s((("dp",), ("tp",), ()))
    p = _plan(s(((), ("tp",), ())), s(((), ("tp",), ())))  # input channels contracted per device
    assert p.result == s(((), (), ()), ("tp",)) and p.operands[1] == s(((), ("tp",), ()))
    p = _plan(s(((), ("tp",), ())), rep, c_in=6, mesh=MeshShape(("tp",), (4,)))  # uneven split: gathered
    assert p.result == rep and p.operands[0] == rep
    p = _plan(s((("dp",), ("tp",), ())), s((("tp",), (), ())), groups=2)  # grouped: channels unsharded
    assert p.operands == (s((("dp",), (), ())), rep) and p.result == s((("dp",), (), ()))
    p = _plan(s((("dp",), (), ("tp",))), rep)  # the length dim is never sharded
    assert p.operands[0] == s((("dp",), (), ()))
