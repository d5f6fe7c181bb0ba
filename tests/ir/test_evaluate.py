"""Tests of the reference interpreter: single-device evaluation and lockstep SPMD collectives."""

import pytest
import torch

from spmd.ir.evaluate import evaluate, evaluate_sharded, evaluate_spmd
from spmd.ir.text import parse_module

ADD = """
%add.f32 (add.f32.lhs: f32[], add.f32.rhs: f32[]) -> f32[] {
  %add.f32.lhs = f32[] parameter(0)
  %add.f32.rhs = f32[] parameter(1)
  ROOT %add.f32.out = f32[] add(%add.f32.lhs, %add.f32.rhs)
}

%maximum.f32 (maximum.f32.lhs: f32[], maximum.f32.rhs: f32[]) -> f32[] {
  %maximum.f32.lhs = f32[] parameter(0)
  %maximum.f32.rhs = f32[] parameter(1)
  ROOT %maximum.f32.out = f32[] maximum(%maximum.f32.lhs, %maximum.f32.rhs)
}
"""


def _module(body: str, header: str = "HloModule t, num_partitions=4, mesh={x=2,y=2}, is_partitioned=true"):
    return parse_module(header + "\n" + ADD + "\n" + body)


def _devices(shape, n=4):
    return [[torch.randn(shape)] for _ in range(n)]


def test_evaluate_unpartitioned_matches_torch():
    m = parse_module("""HloModule t, num_partitions=1, mesh={x=1}

ENTRY %main (a: f32[3,4], b: f32[4,5]) -> (f32[3,5], f32[3,4]) {
  %a = f32[3,4] parameter(0)
  %b = f32[4,5] parameter(1)
  %d = f32[3,5] dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %s = f32[3,4] custom-call(%a), custom_call_target="Sharding", sharding={replicated}
  %e = f32[3,4] exponential(%s)
  ROOT %t = (f32[3,5], f32[3,4]) tuple(%d, %e)
}
""")
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    d, e = evaluate(m, [a, b])
    torch.testing.assert_close(d, a @ b)
    torch.testing.assert_close(e, a.exp())


def test_evaluate_rejects_wrong_args_and_partitioned():
    m = _module("""ENTRY %main (a: f32[2]) -> f32[2] {
  ROOT %a = f32[2] parameter(0)
}""")
    with pytest.raises(ValueError, match="partitioned"):
        evaluate(m, [torch.randn(2)])
    with pytest.raises(ValueError, match="expected 4 devices"):
        evaluate_spmd(m, [[torch.randn(2)]])
    with pytest.raises(ValueError, match="expected shape"):
        evaluate_spmd(m, [[torch.randn(3)]] * 4)


def test_partition_id_per_device():
    m = _module("""ENTRY %main () -> u32[] {
  ROOT %p = u32[] partition-id()
}""")
    (out,) = evaluate_spmd(m, [[] for _ in range(4)])
    assert [int(v) for v in out] == [0, 1, 2, 3]


def test_all_gather_groups_in_order():
    m = _module("""ENTRY %main (a: f32[2,3]) -> f32[4,3] {
  %a = f32[2,3] parameter(0)
  ROOT %g = f32[4,3] all-gather(%a), dimensions={0}, replica_groups={{0,2},{1,3}}
}""")
    args = _devices((2, 3))
    (out,) = evaluate_spmd(m, args)
    for d, (first, second) in enumerate([(0, 2), (1, 3), (0, 2), (1, 3)]):
        torch.testing.assert_close(out[d], torch.cat([args[first][0], args[second][0]]))


def test_all_reduce_add_and_max():
    for kind, fn in (("add", lambda t: t.sum(0)), ("maximum", lambda t: t.amax(0))):
        m = _module(f"""ENTRY %main (a: f32[5]) -> f32[5] {{
  %a = f32[5] parameter(0)
  ROOT %r = f32[5] all-reduce(%a), replica_groups={{{{0,1}},{{2,3}}}}, to_apply=%{kind}.f32
}}""")
        args = _devices((5,))
        (out,) = evaluate_spmd(m, args)
        for d in range(4):
            g = (0, 1) if d < 2 else (2, 3)
            torch.testing.assert_close(out[d], fn(torch.stack([args[i][0] for i in g])))


def test_reduce_scatter_sums_then_splits():
    m = _module("""ENTRY %main (a: f32[4,2]) -> f32[1,2] {
  %a = f32[4,2] parameter(0)
  ROOT %r = f32[1,2] reduce-scatter(%a), dimensions={0}, replica_groups={{3,2,1,0}}, to_apply=%add.f32
}""")
    args = _devices((4, 2))
    (out,) = evaluate_spmd(m, args)
    total = sum(a[0] for a in args)
    for k, d in enumerate((3, 2, 1, 0)):
        torch.testing.assert_close(out[d], total[k:k + 1])


def test_all_to_all_exchanges_chunks():
    m = _module("""ENTRY %main (a: f32[4,3]) -> f32[2,6] {
  %a = f32[4,3] parameter(0)
  ROOT %r = f32[2,6] all-to-all(%a), replica_groups={{0,1},{2,3}}, split_dimension=0, concat_dimension=1
}""")
    args = _devices((4, 3))
    (out,) = evaluate_spmd(m, args)
    for d in range(4):
        g = (0, 1) if d < 2 else (2, 3)
        j = g.index(d)
        want = torch.cat([args[src][0][2 * j:2 * j + 2] for src in g], dim=1)
        torch.testing.assert_close(out[d], want)


def test_collective_permute_and_async_forms():
    m = _module("""%body (p0: f32[3], p1: f32[3]) -> f32[3] {
  %p0 = f32[3] parameter(0)
  %p1 = f32[3] parameter(1)
  ROOT %m = f32[3] multiply(%p0, %p1)
}

ENTRY %main (a: f32[3]) -> (f32[3], f32[3], f32[6], f32[3]) {
  %a = f32[3] parameter(0)
  %cp-start = (f32[3], f32[3]) collective-permute-start(%a), source_target_pairs={{0,1},{1,2},{2,3}}, stream_id=2
  %cp-done = f32[3] collective-permute-done(%cp-start), stream_id=2
  %ar-start = f32[3] all-reduce-start(%a), replica_groups={{0,1,2,3}}, to_apply=%add.f32
  %ar-done = f32[3] all-reduce-done(%ar-start)
  %ag-start = (f32[3], f32[6]) all-gather-start(%a), dimensions={0}, replica_groups={{0,1},{2,3}}
  %ag-done = f32[6] all-gather-done(%ag-start)
  %as = ((f32[3], f32[3]), f32[3]) async-start(%a, %cp-done), calls=%body, stream_id=1
  %ad = f32[3] async-done(%as), stream_id=1
  ROOT %t = (f32[3], f32[3], f32[6], f32[3]) tuple(%cp-done, %ar-done, %ag-done, %ad)
}""")
    args = _devices((3,))
    cp, ar, ag, ad = evaluate_spmd(m, args)
    torch.testing.assert_close(cp[0], torch.zeros(3))
    for d in (1, 2, 3):
        torch.testing.assert_close(cp[d], args[d - 1][0])
        torch.testing.assert_close(ad[d], args[d][0] * args[d - 1][0])
    total = sum(a[0] for a in args)
    for d in range(4):
        torch.testing.assert_close(ar[d], total)
        g = (0, 1) if d < 2 else (2, 3)
        torch.testing.assert_close(ag[d], torch.cat([args[i][0] for i in g]))


def test_evaluate_sharded_reassembles_uneven_shards():
    m = parse_module("""HloModule t, num_partitions=4, mesh={x=4}, is_partitioned=true

ENTRY %main (a: f32[2,3]) -> f32[2,3] {
  %a = f32[2,3] parameter(0), sharding={devices=[4,1]<=[4]}
  ROOT %n = f32[2,3] negate(%a), sharding={devices=[4,1]<=[4]}
}""")
    a = torch.randn(7, 3)
    (out,) = evaluate_sharded(m, [a], [(7, 3)])
    torch.testing.assert_close(out, -a)
