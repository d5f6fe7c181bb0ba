# ruff: noqa: E501  (golden HLO text lines are long)
"""Sharding rule of the fused training attention calls (``attention-forward`` / ``attention-backward``,
rule ``"attention"``): leading (batch, head) dims shard like q, the last two dims stay whole; the
packed results ``[n, B, S, H, D]`` carry the batch and head shardings at their own dims.
Golden propagated + partitioned text, and the partitioned program's numbers against one device
and against PyTorch autograd.
"""

import torch
import torch.nn.functional as F

from spmd.ir.evaluate import evaluate, evaluate_sharded
from spmd.ir.sharding import MeshShape, TensorSharding
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module
from spmd.passes.propagate_sharding import PropagateSharding
from spmd.passes.sharding_rules import plan
from spmd.passes.spmd_partition import SpmdPartition

BATCH_IN = """HloModule attn_grad, num_partitions=2, mesh={dp=2}

ENTRY %main (q: f32[4,2,6,4], k: f32[4,2,6,4], v: f32[4,2,6,4], dout: f32[4,2,6,4]) -> f32[3,4,6,2,4] {
  %q = f32[4,2,6,4] parameter(0), sharding={devices=[2,1,1,1]<=[2]}
  %k = f32[4,2,6,4] parameter(1), sharding={replicated}
  %v = f32[4,2,6,4] parameter(2), sharding={devices=[2,1,1,1]<=[2]}
  %dout = f32[4,2,6,4] parameter(3), sharding={devices=[2,1,1,1]<=[2]}
  %fwd = f32[2,4,6,2,4] custom-call(%q, %k, %v), custom_call_target="attention-forward", backend_config={"is_causal":true,"has_mask":false}
  ROOT %bwd = f32[3,4,6,2,4] custom-call(%q, %k, %v, %fwd, %dout), custom_call_target="attention-backward", backend_config={"is_causal":true,"has_mask":false}
}
"""

# k (replicated) is sliced to the batch shard once; the slice feeds both calls
BATCH_OUT = """HloModule attn_grad, num_partitions=2, mesh={dp=2}, is_partitioned=true

ENTRY %main (q: f32[2,2,6,4], k: f32[4,2,6,4], v: f32[2,2,6,4], dout: f32[2,2,6,4]) -> f32[3,2,6,2,4] {
  %q = f32[2,2,6,4] parameter(0), sharding={devices=[2,1,1,1]<=[2]}
  %k = f32[4,2,6,4] parameter(1), sharding={replicated}
  %v = f32[2,2,6,4] parameter(2), sharding={devices=[2,1,1,1]<=[2]}
  %dout = f32[2,2,6,4] parameter(3), sharding={devices=[2,1,1,1]<=[2]}
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant = s32[] constant(2)
  %multiply = s32[] multiply(%pid, %constant)
  %constant.1 = s32[] constant(0)
  %dynamic-slice = f32[2,2,6,4] dynamic-slice(%k, %multiply, %constant.1, %constant.1, %constant.1), dynamic_slice_sizes={2,2,6,4}, sharding={devices=[2,1,1,1]<=[2]}
  %fwd = f32[2,2,6,2,4] custom-call(%q, %dynamic-slice, %v), custom_call_target="attention-forward", backend_config={"is_causal":true,"has_mask":false}, sharding={devices=[1,2,1,1,1]<=[2]}
  ROOT %bwd = f32[3,2,6,2,4] custom-call(%q, %dynamic-slice, %v, %fwd, %dout), custom_call_target="attention-backward", backend_config={"is_causal":true,"has_mask":false}, sharding={devices=[1,2,1,1,1]<=[2]}
}
"""

HEADS_SEQ_IN = """HloModule attn_grad_2d, num_partitions=4, mesh={dp=2,tp=2}

ENTRY %main (q: f32[2,4,6,4], k: f32[2,4,6,4], v: f32[2,4,6,4], dout: f32[2,4,6,4], mask: pred[2,4,6,6]) -> f32[3,2,6,4,4] {
  %q = f32[2,4,6,4] parameter(0), sharding={devices=[2,2,1,1]<=[4]}
  %k = f32[2,4,6,4] parameter(1), sharding={devices=[2,2,1,1]<=[4]}
  %v = f32[2,4,6,4] parameter(2), sharding={devices=[2,2,1,1]<=[4]}
  %dout = f32[2,4,6,4] parameter(3), sharding={devices=[2,1,2,1]<=[4]}
  %mask = pred[2,4,6,6] parameter(4), sharding={replicated}
  %fwd = f32[2,2,6,4,4] custom-call(%q, %k, %v, %mask), custom_call_target="attention-forward", backend_config={"is_causal":false,"has_mask":true}
  ROOT %bwd = f32[3,2,6,4,4] custom-call(%q, %k, %v, %fwd, %dout, %mask), custom_call_target="attention-backward", backend_config={"is_causal":false,"has_mask":true}
}
"""

# the sequence-sharded output gradient moves to the head sharding by one all-to-all; the
# replicated mask is sliced to the (batch, head) shard
HEADS_SEQ_OUT = """HloModule attn_grad_2d, num_partitions=4, mesh={dp=2,tp=2}, is_partitioned=true

ENTRY %main (q: f32[1,2,6,4], k: f32[1,2,6,4], v: f32[1,2,6,4], dout: f32[1,4,3,4], mask: pred[2,4,6,6]) -> f32[3,1,6,2,4] {
  %q = f32[1,2,6,4] parameter(0), sharding={devices=[2,2,1,1]<=[4]}
  %k = f32[1,2,6,4] parameter(1), sharding={devices=[2,2,1,1]<=[4]}
  %v = f32[1,2,6,4] parameter(2), sharding={devices=[2,2,1,1]<=[4]}
  %dout = f32[1,4,3,4] parameter(3), sharding={devices=[2,1,2,1]<=[4]}
  %mask = pred[2,4,6,6] parameter(4), sharding={replicated}
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant = s32[] constant(2)
  %divide = s32[] divide(%pid, %constant)
  %constant.1 = s32[] constant(1)
  %multiply = s32[] multiply(%divide, %constant.1)
  %remainder = s32[] remainder(%pid, %constant)
  %multiply.1 = s32[] multiply(%remainder, %constant)
  %constant.2 = s32[] constant(0)
  %dynamic-slice = pred[1,2,6,6] dynamic-slice(%mask, %multiply, %multiply.1, %constant.2, %constant.2), dynamic_slice_sizes={1,2,6,6}, sharding={devices=[2,2,1,1]<=[4]}
  %fwd = f32[2,1,6,2,4] custom-call(%q, %k, %v, %dynamic-slice), custom_call_target="attention-forward", backend_config={"is_causal":false,"has_mask":true}, sharding={devices=[1,2,1,2,1]<=[4]}
  %all-to-all = f32[1,2,6,4] all-to-all(%dout), replica_groups={{0,1},{2,3}}, split_dimension=1, concat_dimension=2, sharding={devices=[2,2,1,1]<=[4]}
  ROOT %bwd = f32[3,1,6,2,4] custom-call(%q, %k, %v, %fwd, %all-to-all, %dynamic-slice), custom_call_target="attention-backward", backend_config={"is_causal":false,"has_mask":true}, sharding={devices=[1,2,1,2,1]<=[4]}
}
"""


def _partition(text):
    assert print_module(parse_module(text)) == text
    pm = SpmdPartition().run(PropagateSharding().run(parse_module(text)))
    verify_module(pm)
    return pm


def _inputs(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    args = []
    for p in m.entry.parameters:
        dims = p.shape.dims
        args.append(torch.rand(*dims, generator=g) > 0.3 if p.shape.dtype == "pred" else torch.randn(*dims, generator=g))
    if args[-1].dtype == torch.bool:
        args[-1][..., 0] = True  # every row attends somewhere
    return args


def _check_numbers(text, pm):
    m = parse_module(text)
    args = _inputs(m)
    (want,) = evaluate(m, args)
    (got,) = evaluate_sharded(pm, args, [m.entry.root.shape.dims])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    q, k, v = (a.double().requires_grad_() for a in args[:3])
    mask = args[4] if len(args) > 4 else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    grads = torch.autograd.grad(out, (q, k, v), args[3].double())
    slabs = torch.stack([g.transpose(1, 2) for g in grads])  # [3, B, S, H, D]
    torch.testing.assert_close(want.double(), slabs, rtol=1e-5, atol=1e-5)


def test_batch_sharded_golden():
    pm = _partition(BATCH_IN)
    assert print_module(pm) == BATCH_OUT
    _check_numbers(BATCH_IN, pm)


def test_heads_and_sequence_sharded_golden():
    pm = _partition(HEADS_SEQ_IN)
    assert print_module(pm) == HEADS_SEQ_OUT
    _check_numbers(HEADS_SEQ_IN, pm)


def test_plan_of_the_backward_call():
    """Leading dims follow q (or the wanted result); a sharded sequence dim is gathered."""
    s = TensorSharding
    bwd = parse_module(HEADS_SEQ_IN).entry.root
    mesh = MeshShape(("dp", "tp"), (2, 2))
    rep, rep5 = s(((),) * 4), s(((),) * 5)
    p = plan(bwd, [s(((), (), ("tp",), ())), None, None, None, None, None], None, mesh)
    assert p.result == rep5 and p.operands[:5] == (rep, rep, rep, rep5, rep)
    lead, slabs = s((("dp",), ("tp",), (), ())), s(((), ("dp",), (), ("tp",), ()))  # slabs [3, B, S, H, D]
    p = plan(bwd, [None] * 6, slabs, mesh)
    assert p.operands == (lead, lead, lead, slabs, lead, lead) and p.result == slabs
