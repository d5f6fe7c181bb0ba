"""Sharding rules and partitioner handlers of gather and scatter: golden HLO text, and numerics of
the partitioned program against the unpartitioned one (reference interpreter) on 1-d and 2-d meshes,
uneven dims, repeated and out-of-range indices."""

import pytest
import torch
from partition_programs import F32, check_numerics, collectives, mesh_of, new_module, spec

from spmd.ir.builder import Builder
from spmd.ir.hlo import Computation, Shape
from spmd.ir.text import parse_module, print_module
from spmd.passes.spmd_partition import SpmdPartition

VOCAB_EMBEDDING_IN = """\
HloModule emb, num_partitions=2, mesh={tp=2}

ENTRY %main (table: f32[10,4], ids: s64[3]) -> f32[3,4] {
  %table = f32[10,4] parameter(0), sharding={devices=[2,1]<=[2]}
  %ids = s64[3] parameter(1), sharding={replicated}
  ROOT %emb = f32[3,4] gather(%table, %ids), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, \
index_vector_dim=1, slice_sizes={1,4}, sharding={replicated}
}
"""

VOCAB_EMBEDDING_OUT = """\
HloModule emb, num_partitions=2, mesh={tp=2}, is_partitioned=true

%add.f32 (add.f32.lhs: f32[], add.f32.rhs: f32[]) -> f32[] {
  %add.f32.lhs = f32[] parameter(0)
  %add.f32.rhs = f32[] parameter(1)
  ROOT %add.f32.out = f32[] add(%add.f32.lhs, %add.f32.rhs)
}

ENTRY %main (table: f32[5,4], ids: s64[3]) -> f32[3,4] {
  %table = f32[5,4] parameter(0), sharding={devices=[2,1]<=[2]}
  %ids = s64[3] parameter(1), sharding={replicated}
  %constant = s64[] constant(0)
  %constant.1 = s64[] constant(9)
  %clamp = s64[3] clamp(%constant, %ids, %constant.1)
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant.2 = s32[] constant(5)
  %multiply = s32[] multiply(%pid, %constant.2)
  %convert = s64[] convert(%multiply)
  %broadcast = s64[3] broadcast(%convert), dimensions={}
  %subtract = s64[3] subtract(%clamp, %broadcast)
  %constant.3 = s64[] constant(5)
  %broadcast.1 = s64[3] broadcast(%constant.3), dimensions={}
  %compare = pred[3] compare(%subtract, %broadcast.1), direction=LT
  %broadcast.2 = s64[3] broadcast(%constant), dimensions={}
  %compare.1 = pred[3] compare(%subtract, %broadcast.2), direction=GE
  %and = pred[3] and(%compare, %compare.1)
  %emb = f32[3,4] gather(%table, %subtract), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, \
index_vector_dim=1, slice_sizes={1,4}, sharding={devices=[1,1,2]<=[2] last_tile_dims={partial}}
  %broadcast.3 = pred[3,4] broadcast(%and), dimensions={0}
  %constant.4 = f32[] constant(0.0)
  %broadcast.4 = f32[3,4] broadcast(%constant.4), dimensions={}
  %emb.masked = f32[3,4] select(%broadcast.3, %emb, %broadcast.4), \
sharding={devices=[1,1,2]<=[2] last_tile_dims={partial}}
  ROOT %all-reduce = f32[3,4] all-reduce(%emb.masked), to_apply=%add.f32, replica_groups={{0,1}}, \
sharding={replicated}
}
"""

TAKE_ALONG_VOCAB_IN = """\
HloModule take, num_partitions=2, mesh={tp=2}

ENTRY %main (logp: f32[4,10], t: s64[4,1]) -> f32[4,1] {
  %logp = f32[4,10] parameter(0), sharding={devices=[1,2]<=[2]}
  %t = s64[4,1] parameter(1), sharding={replicated}
  ROOT %picked = f32[4,1] gather(%logp, %t), offset_dims={}, collapsed_slice_dims={1}, start_index_map={1}, \
index_vector_dim=2, slice_sizes={1,1}, operand_batching_dims={0}, start_indices_batching_dims={0}, \
sharding={replicated}
}
"""

TAKE_ALONG_VOCAB_OUT = """\
HloModule take, num_partitions=2, mesh={tp=2}, is_partitioned=true

%add.f32 (add.f32.lhs: f32[], add.f32.rhs: f32[]) -> f32[] {
  %add.f32.lhs = f32[] parameter(0)
  %add.f32.rhs = f32[] parameter(1)
  ROOT %add.f32.out = f32[] add(%add.f32.lhs, %add.f32.rhs)
}

ENTRY %main (logp: f32[4,5], t: s64[4,1]) -> f32[4,1] {
  %logp = f32[4,5] parameter(0), sharding={devices=[1,2]<=[2]}
  %t = s64[4,1] parameter(1), sharding={replicated}
  %constant = s64[] constant(0)
  %constant.1 = s64[] constant(9)
  %clamp = s64[4,1] clamp(%constant, %t, %constant.1)
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant.2 = s32[] constant(5)
  %multiply = s32[] multiply(%pid, %constant.2)
  %convert = s64[] convert(%multiply)
  %broadcast = s64[4,1] broadcast(%convert), dimensions={}
  %subtract = s64[4,1] subtract(%clamp, %broadcast)
  %constant.3 = s64[] constant(5)
  %broadcast.1 = s64[4,1] broadcast(%constant.3), dimensions={}
  %compare = pred[4,1] compare(%subtract, %broadcast.1), direction=LT
  %broadcast.2 = s64[4,1] broadcast(%constant), dimensions={}
  %compare.1 = pred[4,1] compare(%subtract, %broadcast.2), direction=GE
  %and = pred[4,1] and(%compare, %compare.1)
  %picked = f32[4,1] gather(%logp, %subtract), offset_dims={}, collapsed_slice_dims={1}, start_index_map={1}, \
index_vector_dim=2, slice_sizes={1,1}, operand_batching_dims={0}, start_indices_batching_dims={0}, \
sharding={devices=[1,1,2]<=[2] last_tile_dims={partial}}
  %constant.4 = f32[] constant(0.0)
  %broadcast.3 = f32[4,1] broadcast(%constant.4), dimensions={}
  %picked.masked = f32[4,1] select(%and, %picked, %broadcast.3), \
sharding={devices=[1,1,2]<=[2] last_tile_dims={partial}}
  ROOT %all-reduce = f32[4,1] all-reduce(%picked.masked), to_apply=%add.f32, replica_groups={{0,1}}, \
sharding={replicated}
}
"""

SCATTER_ADD_TOKENS_IN = """\
HloModule embbwd, num_partitions=2, mesh={dp=2}

%add.f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (zeros: f32[10,4], ids: s64[6], g: f32[6,4]) -> f32[10,4] {
  %zeros = f32[10,4] parameter(0), sharding={replicated}
  %ids = s64[6] parameter(1), sharding={devices=[2]<=[2]}
  %g = f32[6,4] parameter(2), sharding={devices=[2,1]<=[2]}
  ROOT %grad = f32[10,4] scatter(%zeros, %ids, %g), to_apply=%add.f32, index_vector_dim=1, update_window_dims={1}, \
inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, sharding={replicated}
}
"""

SCATTER_ADD_TOKENS_OUT = """\
HloModule embbwd, num_partitions=2, mesh={dp=2}, is_partitioned=true

%add.f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (zeros: f32[10,4], ids: s64[3], g: f32[3,4]) -> f32[10,4] {
  %zeros = f32[10,4] parameter(0), sharding={replicated}
  %ids = s64[3] parameter(1), sharding={devices=[2]<=[2]}
  %g = f32[3,4] parameter(2), sharding={devices=[2,1]<=[2]}
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant = s32[] constant(0)
  %compare = pred[] compare(%pid, %constant), direction=EQ
  %broadcast = pred[10,4] broadcast(%compare), dimensions={}
  %constant.1 = f32[] constant(0.0)
  %broadcast.1 = f32[10,4] broadcast(%constant.1), dimensions={}
  %select = f32[10,4] select(%broadcast, %zeros, %broadcast.1), \
sharding={devices=[1,1,2]<=[2] last_tile_dims={partial}}
  %grad = f32[10,4] scatter(%select, %ids, %g), to_apply=%add.f32, index_vector_dim=1, update_window_dims={1}, \
inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, sharding={devices=[1,1,2]<=[2] last_tile_dims={partial}}
  ROOT %all-reduce = f32[10,4] all-reduce(%grad), to_apply=%add.f32, replica_groups={{0,1}}, sharding={replicated}
}
"""

SCATTER_INTO_VOCAB_IN = """\
HloModule put, num_partitions=2, mesh={tp=2}

%assign.f32 (old: f32[], new: f32[]) -> f32[] {
  %old = f32[] parameter(0)
  ROOT %new = f32[] parameter(1)
}

ENTRY %main (table: f32[10,4], ids: s64[3], rows: f32[3,4]) -> f32[10,4] {
  %table = f32[10,4] parameter(0), sharding={devices=[2,1]<=[2]}
  %ids = s64[3] parameter(1), sharding={replicated}
  %rows = f32[3,4] parameter(2), sharding={replicated}
  ROOT %put = f32[10,4] scatter(%table, %ids, %rows), to_apply=%assign.f32, index_vector_dim=1, \
update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, sharding={devices=[2,1]<=[2]}
}
"""

SCATTER_INTO_VOCAB_OUT = """\
HloModule put, num_partitions=2, mesh={tp=2}, is_partitioned=true

%assign.f32 (old: f32[], new: f32[]) -> f32[] {
  %old = f32[] parameter(0)
  ROOT %new = f32[] parameter(1)
}

ENTRY %main (table: f32[5,4], ids: s64[3], rows: f32[3,4]) -> f32[5,4] {
  %table = f32[5,4] parameter(0), sharding={devices=[2,1]<=[2]}
  %ids = s64[3] parameter(1), sharding={replicated}
  %rows = f32[3,4] parameter(2), sharding={replicated}
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant = s32[] constant(5)
  %multiply = s32[] multiply(%pid, %constant)
  %convert = s64[] convert(%multiply)
  %broadcast = s64[3] broadcast(%convert), dimensions={}
  %subtract = s64[3] subtract(%ids, %broadcast)
  ROOT %put = f32[5,4] scatter(%table, %subtract, %rows), to_apply=%assign.f32, index_vector_dim=1, \
update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, sharding={devices=[2,1]<=[2]}
}
"""



@pytest.mark.parametrize("text_in, golden", [
    (VOCAB_EMBEDDING_IN, VOCAB_EMBEDDING_OUT),
    (TAKE_ALONG_VOCAB_IN, TAKE_ALONG_VOCAB_OUT),
    (SCATTER_ADD_TOKENS_IN, SCATTER_ADD_TOKENS_OUT),
    (SCATTER_INTO_VOCAB_IN, SCATTER_INTO_VOCAB_OUT),
], ids=["vocab-embedding", "take-along-vocab", "scatter-add-tokens", "scatter-into-vocab"])
def test_golden(text_in, golden):
    assert print_module(SpmdPartition().run(parse_module(text_in))) == golden
    assert print_module(parse_module(golden)) == golden


# --------------------------------------------------------------------------- numerics
V, D = 11, 6  # 11 rows: uneven over 2 and 4 devices

MESHES = {"tp1": mesh_of(tp=1), "tp2": mesh_of(tp=2), "tp4": mesh_of(tp=4), "dp2tp2": mesh_of(dp=2, tp=2)}


def _combiner(m, b, kind: str) -> Computation:
    if kind != "replace":
        return b.scalar_computation(kind, F32)
    c = Builder.new_computation(m, "replace.f32")
    c.param(Shape(F32, ()), name="old")
    c.set_root(c.param(Shape(F32, ()), name="new"))
    return c.computation


def _ids(shape, n, unique=False, out_of_range=False):
    if unique:
        return torch.randperm(n)[:shape[0]]
    ids = torch.randint(0, n, shape)
    ids.view(-1)[0] = ids.view(-1)[-1]  # a repeated index
    if out_of_range:
        ids.view(-1)[1], ids.view(-1)[2] = -2, n + 3
    return ids


def _spec(entries):
    return spec(*entries)


ROWS_GATHER = [  # (mesh, table spec, ids spec, result spec)
    ("tp1", ("tp", None), (None, None), (None, None, None)),
    ("tp2", ("tp", None), (None, None), (None, None, None)),
    ("tp4", ("tp", None), ("tp", None), ("tp", None, None)),
    ("tp4", (None, "tp"), (None, None), (None, None, "tp")),
    ("dp2tp2", ("tp", None), ("dp", None), ("dp", None, None)),
    ("dp2tp2", (("dp", "tp"), None), (None, None), (None, None, None)),
    ("dp2tp2", ("tp", "dp"), (None, "dp"), (None, None, None)),
]


@pytest.mark.parametrize("mesh, ts, ids_s, out_s", ROWS_GATHER)
def test_rows_gather_numerics(mesh, ts, ids_s, out_s):
    m, b = new_module("emb", MESHES[mesh])
    table = b.param(Shape(F32, (V, D)), "table", sharding=_spec(ts))
    ids = b.param(Shape("s64", (3, 5)), "ids", sharding=_spec(ids_s))
    b.set_root(b.gather(table, ids, offset_dims=[2], collapsed_slice_dims=[0], start_index_map=[0],
                        index_vector_dim=2, slice_sizes=[1, D], name="emb"))
    b.computation.root.sharding = _spec(out_s)
    pm = check_numerics(m, [torch.randn(V, D), _ids((3, 5), V, out_of_range=True)])
    if ts[0] == "tp" and "tp" not in ids_s:  # vocab-parallel lookup: the table is never gathered
        tp = MESHES[mesh].size("tp")
        emb = next(i for i in pm.entry.instructions if i.name == "emb")
        assert emb.operands[0].shape.dims[0] == -(-V // tp)
        assert ("all-reduce" in collectives(pm)) == (tp > 1)


ALONG_GATHER = [  # (mesh, operand spec, index spec, result spec)
    ("tp2", (None, "tp"), (None, None), (None, None)),
    ("tp4", (None, "tp"), (None, None), (None, "tp")),
    ("tp4", ("tp", None), ("tp", None), ("tp", None)),
    ("dp2tp2", ("dp", "tp"), ("dp", None), (None, None)),
]


@pytest.mark.parametrize("mesh, xs, ixs, out_s", ALONG_GATHER)
def test_along_gather_numerics(mesh, xs, ixs, out_s):
    """torch.gather(x, 1, idx) with x [5, 11] and idx [5, 3] (cross-entropy's target pick)."""
    m, b = new_module("take", MESHES[mesh])
    x = b.param(Shape(F32, (5, V)), "x", sharding=_spec(xs))
    idx = b.param(Shape("s64", (5, 3)), "idx", sharding=_spec(ixs))
    b.set_root(b.add("gather", [x, idx], {
        "offset_dims": (), "collapsed_slice_dims": (1,), "start_index_map": (1,), "index_vector_dim": 2,
        "slice_sizes": (1, 1), "operand_batching_dims": (0,), "start_indices_batching_dims": (0,)},
        name="take", sharding=_spec(out_s)))
    check_numerics(m, [torch.randn(5, V), _ids((5, 3), V, out_of_range=True)])


ROWS_SCATTER = [  # (mesh, operand spec, ids spec, updates spec, result spec)
    ("tp1", ("tp", None), (None,), (None, None), ("tp", None)),
    ("tp2", ("tp", None), (None,), (None, None), ("tp", None)),
    ("tp4", ("tp", None), ("tp",), ("tp", None), (None, None)),
    ("tp4", (None, "tp"), (None,), (None, "tp"), (None, "tp")),
    ("dp2tp2", ("tp", None), ("dp",), ("dp", None), ("tp", None)),
    ("dp2tp2", (None, None), ("dp",), ("dp", "tp"), (None, "tp")),
]


@pytest.mark.parametrize("kind", ["add", "maximum", "replace"])
@pytest.mark.parametrize("mesh, xs, ids_s, us, out_s", ROWS_SCATTER)
def test_rows_scatter_numerics(mesh, xs, ids_s, us, out_s, kind):
    """Embedding backward / index_put: 7 rows of updates into an [11, 6] table (repeated ids except replace)."""
    m, b = new_module("put", MESHES[mesh])
    x = b.param(Shape(F32, (V, D)), "x", sharding=_spec(xs))
    ids = b.param(Shape("s64", (7,)), "ids", sharding=_spec(ids_s))
    upd = b.param(Shape(F32, (7, D)), "upd", sharding=_spec(us))
    b.set_root(b.add("scatter", [x, ids, upd], {
        "update_window_dims": (1,), "inserted_window_dims": (0,), "scatter_dims_to_operand_dims": (0,),
        "index_vector_dim": 1, "to_apply": _combiner(m, b, kind)}, name="put", sharding=_spec(out_s)))
    unique = kind == "replace"
    ids_value = _ids((7,), V, unique, out_of_range=not unique)
    pm = check_numerics(m, [torch.randn(V, D), ids_value, torch.randn(7, D)])
    if xs[0] == "tp" and MESHES[mesh].size("tp") > 1 and out_s[0] == "tp" and (kind == "add" or ids_s == (None,)):
        assert "all-gather" not in collectives(pm)  # each shard applies the updates in its range


ALONG_SCATTER = [  # (mesh, operand spec, index/updates spec, result spec)
    ("tp2", (None, "tp"), (None, None), (None, "tp")),
    ("tp4", ("tp", None), ("tp", None), ("tp", None)),
    ("tp4", (None, None), (None, "tp"), (None, None)),
    ("dp2tp2", ("dp", "tp"), ("dp", None), ("dp", "tp")),
    ("dp2tp2", (None, "tp"), ("dp", "tp"), (None, None)),
]


@pytest.mark.parametrize("kind", ["add", "minimum", "replace"])
@pytest.mark.parametrize("mesh, xs, ius, out_s", ALONG_SCATTER)
def test_along_scatter_numerics(mesh, xs, ius, out_s, kind):
    """x.scatter_add(1, idx, src) and friends with x [5, 11], idx and src [5, 7]."""
    m, b = new_module("scat", MESHES[mesh])
    x = b.param(Shape(F32, (5, V)), "x", sharding=_spec(xs))
    idx = b.param(Shape("s64", (5, 7)), "idx", sharding=_spec(ius))
    upd = b.param(Shape(F32, (5, 7)), "upd", sharding=_spec(ius))
    b.set_root(b.add("scatter", [x, idx, upd], {
        "update_window_dims": (), "inserted_window_dims": (1,), "scatter_dims_to_operand_dims": (1,),
        "index_vector_dim": 2, "input_batching_dims": (0,), "scatter_indices_batching_dims": (0,),
        "to_apply": _combiner(m, b, kind)}, name="scat", sharding=_spec(out_s)))
    if kind == "replace":
        ids = torch.stack([torch.randperm(V)[:7] for _ in range(5)])
    else:
        ids = _ids((5, 7), V, out_of_range=True)
    check_numerics(m, [torch.randn(5, V), ids, torch.randn(5, 7)])


KV_CACHE_SEQ_SHARDED_IN = """\
HloModule kv, num_partitions=2, mesh={tp=2}

ENTRY %main (cache: f32[2,10,4], k: f32[2,1,4], pos: s64[]) -> f32[2,10,4] {
  %cache = f32[2,10,4] parameter(0), sharding={devices=[1,2,1]<=[2]}
  %k = f32[2,1,4] parameter(1), sharding={replicated}
  %pos = s64[] parameter(2), sharding={replicated}
  %zero = s64[] constant(0)
  ROOT %new = f32[2,10,4] dynamic-update-slice(%cache, %k, %zero, %pos, %zero), sharding={devices=[1,2,1]<=[2]}
}
"""


def test_kv_cache_update_of_a_sequence_sharded_cache_golden():
    """The shard owning the position writes the row; the others write back what they hold: no collective."""
    got = print_module(SpmdPartition().run(parse_module(KV_CACHE_SEQ_SHARDED_IN)))
    assert got.endswith("""\
  %zero = s64[] constant(0), sharding={replicated}
  %constant = s64[] constant(0)
  %constant.1 = s64[] constant(4)
  %constant.2 = s64[] constant(9)
  %clamp = s64[] clamp(%constant, %pos, %constant.2)
  %partition-id = u32[] partition-id()
  %pid = s32[] convert(%partition-id)
  %constant.3 = s32[] constant(5)
  %multiply = s32[] multiply(%pid, %constant.3)
  %convert = s64[] convert(%multiply)
  %subtract = s64[] subtract(%clamp, %convert)
  %compare = pred[] compare(%subtract, %constant), direction=GE
  %compare.1 = pred[] compare(%subtract, %constant.1), direction=LE
  %and = pred[] and(%compare, %compare.1)
  %clamp.1 = s64[] clamp(%constant, %subtract, %constant.1)
  %dynamic-slice = f32[2,1,4] dynamic-slice(%cache, %zero, %clamp.1, %zero), dynamic_slice_sizes={2,1,4}
  %broadcast = pred[2,1,4] broadcast(%and), dimensions={}
  %select = f32[2,1,4] select(%broadcast, %k, %dynamic-slice)
  ROOT %new = f32[2,5,4] dynamic-update-slice(%cache, %select, %zero, %clamp.1, %zero), \
sharding={devices=[1,2,1]<=[2]}
}
""")


@pytest.mark.parametrize("mesh, cs", [("tp2", (None, "tp", None)), ("tp4", (None, "tp", None)),
                                      ("dp2tp2", ("dp", "tp", None)), ("dp2tp2", (None, ("dp", "tp"), None))])
def test_dynamic_update_slice_of_a_sharded_dim_numerics(mesh, cs):
    """One row written at every position of a [2, 10, 4] cache split unevenly, and past the end (clamped)."""
    for pos in [*range(10), 13, -4]:
        m, b = new_module("kv", MESHES[mesh])
        cache = b.param(Shape(F32, (2, 10, 4)), "cache", sharding=_spec(cs))
        k = b.param(Shape(F32, (2, 1, 4)), "k", sharding=_spec((None, None, None)))
        zero = b.constant(0, "s64")
        b.set_root(b.dynamic_update_slice(cache, k, [zero, b.constant(pos, "s64"), zero], name="new"))
        b.computation.root.sharding = _spec(cs)
        pm = check_numerics(m, [torch.randn(2, 10, 4), torch.randn(2, 1, 4)])
        assert collectives(pm) == []


@pytest.mark.parametrize("pos", [0, 1])
def test_dynamic_update_slice_of_one_row_shards_numerics(pos):
    """Regression (random-program sweep): a [6, 2, 1] value split over 2 devices along dim 1 has shards
    of one row, as large as the update; the row must still go to the shard that owns it only."""
    m, b = new_module("one_row", MESHES["tp2"])
    x = b.param(Shape(F32, (6, 2, 1)), "x", sharding=_spec((None, "tp", None)))
    u = b.param(Shape(F32, (6, 1, 1)), "u", sharding=_spec((None, None, None)))
    zero = b.constant(0, "s64")
    b.set_root(b.dynamic_update_slice(x, u, [zero, b.constant(pos, "s64"), zero], name="new"))
    b.computation.root.sharding = _spec((None, None, None))
    check_numerics(m, [torch.randn(6, 2, 1), torch.randn(6, 1, 1)])
