"""spmd-partition: golden HLO text and numerics against the unpartitioned module."""

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from partition_programs import (
    F32,
    check_numerics,
    collectives,
    matmul,
    mesh_of,
    mlp,
    new_module,
    partition,
    random_args,
    reduction,
    spec,
    transformer_block,
)

from spmd.ir.hlo import Shape
from spmd.ir.sharding import TensorSharding
from spmd.ir.text import parse_module, print_module
from spmd.passes.spmd_partition import SpmdPartition

MLP_IN = """HloModule mlp, num_partitions=4, mesh={tp=4}

ENTRY %main (x: f32[8,16], w1: f32[16,32], w2: f32[32,16]) -> f32[8,16] {
  %x = f32[8,16] parameter(0), sharding={replicated}
  %w1 = f32[16,32] parameter(1), sharding={devices=[1,4]<=[4]}
  %w2 = f32[32,16] parameter(2), sharding={devices=[4,1]<=[4]}
  %h = f32[8,32] dot(%x, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %g = f32[8,32] custom-call(%h), custom_call_target="gelu"
  ROOT %y = f32[8,16] dot(%g, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={OUT}
}
"""

ADD_COMP = """HloModule mlp, num_partitions=4, mesh={tp=4}, is_partitioned=true

%add.f32 (add.f32.lhs: f32[], add.f32.rhs: f32[]) -> f32[] {
  %add.f32.lhs = f32[] parameter(0)
  %add.f32.rhs = f32[] parameter(1)
  ROOT %add.f32.out = f32[] add(%add.f32.lhs, %add.f32.rhs)
}
"""

MLP_BODY = """
ENTRY %main (x: f32[8,16], w1: f32[16,8], w2: f32[8,16]) -> f32[{OUT_DIMS}] {
  %x = f32[8,16] parameter(0), sharding={replicated}
  %w1 = f32[16,8] parameter(1), sharding={devices=[1,4]<=[4]}
  %w2 = f32[8,16] parameter(2), sharding={devices=[4,1]<=[4]}
  %h = f32[8,8] dot(%x, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,4]<=[4]}
  %g = f32[8,8] custom-call(%h), custom_call_target="gelu", sharding={devices=[1,4]<=[4]}
  %y = f32[8,16] dot(%g, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, \
sharding={devices=[1,1,4]<=[4] last_tile_dims={partial}}
"""

MLP_ALL_REDUCE = ADD_COMP + MLP_BODY.replace("{OUT_DIMS}", "8,16") + """\
  ROOT %all-reduce = f32[8,16] all-reduce(%y), to_apply=%add.f32, replica_groups={{0,1,2,3}}, sharding={replicated}
}
"""

MLP_REDUCE_SCATTER = ADD_COMP + MLP_BODY.replace("{OUT_DIMS}", "2,16") + """\
  ROOT %reduce-scatter = f32[2,16] reduce-scatter(%y), dimensions={0}, to_apply=%add.f32, \
replica_groups={{0,1,2,3}}, sharding={devices=[4,1]<=[4]}
}
"""


@pytest.mark.parametrize("out, golden", [
    ("{replicated}", MLP_ALL_REDUCE),
    ("{devices=[4,1]<=[4]}", MLP_REDUCE_SCATTER),
])
def test_megatron_mlp_golden(out, golden):
    m = parse_module(MLP_IN.replace("{OUT}", out))
    pm = SpmdPartition().run(m)
    assert print_module(pm) == golden
    assert print_module(parse_module(golden)) == golden


def test_uneven_gather_slices_padding_golden():
    m = matmul(mesh_of(x=2), 5, 4, 3, spec("x", None), spec(None, None), spec(None, None))
    got = print_module(partition(m))
    assert got.endswith("""\
  %y = f32[3,3] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[2,1]<=[2]}
  %all-gather = f32[6,3] all-gather(%y), dimensions={0}, replica_groups={{0,1}}, sharding={replicated}
  ROOT %slice = f32[5,3] slice(%all-gather), slice={[0:5:1], [0:3:1]}, sharding={replicated}
}
""")


@pytest.mark.parametrize("out", [spec(None, None), spec("tp", None), spec(None, "tp")])
@pytest.mark.parametrize("B", [8, 5])
def test_megatron_mlp_numerics(out, B):
    m = mlp(mesh_of(tp=4), B, 16, 32, spec(None, None), spec(None, "tp"), spec("tp", None), out)
    pm = check_numerics(m, random_args(m))
    assert len(collectives(pm)) == 1


# --------------------------------------------------------------------------- matmul sweep
def _shardings(mesh, rank):
    """Every non-partial sharding of a rank-``rank`` tensor over ``mesh`` (all axis orders)."""
    out = []
    for assign in itertools.product([None, *range(rank)], repeat=len(mesh.axis_names)):
        dims = [[a for a, c in zip(mesh.axis_names, assign, strict=False) if c == d] for d in range(rank)]
        for perms in itertools.product(*[itertools.permutations(d) for d in dims]):
            out.append(TensorSharding(tuple(tuple(p) for p in perms)))
    return out


@pytest.mark.parametrize("mesh, dims", [
    (mesh_of(tp=4), (8, 12, 16)),
    (mesh_of(tp=4), (5, 6, 7)),
    (mesh_of(dp=2, tp=2), (4, 6, 8)),
    (mesh_of(dp=2, tp=2), (3, 5, 7)),
])
def test_matmul_every_operand_sharding(mesh, dims):
    M, K, N = dims
    shardings = _shardings(mesh, 2)
    outs = [None, spec(None, None), shardings[len(shardings) // 2]]
    for sa, sb in itertools.product(shardings, shardings):
        for so in outs:
            check_numerics(matmul(mesh, M, K, N, sa, sb, so), [torch.randn(M, K), torch.randn(K, N)])


@pytest.mark.slow
@pytest.mark.parametrize("mesh, dims", [(mesh_of(tp=4), (5, 6, 7)), (mesh_of(dp=2, tp=2), (3, 5, 7))])
def test_matmul_every_operand_and_result_sharding(mesh, dims):
    M, K, N = dims
    shardings = _shardings(mesh, 2)
    for sa, sb, so in itertools.product(shardings, shardings, shardings):
        check_numerics(matmul(mesh, M, K, N, sa, sb, so), [torch.randn(M, K), torch.randn(K, N)])


def test_contracting_over_two_axes_is_one_all_reduce():
    mesh = mesh_of(dp=2, tp=2)
    k2 = spec(None, ("dp", "tp"))
    m = matmul(mesh, 4, 8, 6, k2, spec(("dp", "tp"), None), spec(None, None))
    pm = check_numerics(m, random_args(m))
    assert collectives(pm) == ["all-reduce"]
    ar = [i for i in pm.entry.instructions if i.opcode == "all-reduce"][0]
    assert ar.attrs["replica_groups"] == ((0, 1, 2, 3),)
    # Operands disagreeing on the axis order: still correct (one operand is resharded).
    m = matmul(mesh, 4, 8, 6, k2, spec(("tp", "dp"), None), spec(None, None))
    check_numerics(m, random_args(m))


def test_batch_over_dp_and_model_over_tp():
    mesh = mesh_of(dp=2, tp=4)
    m = mlp(mesh, 6, 8, 16, spec("dp", None), spec(None, "tp"), spec("tp", None), spec("dp", None))
    pm = check_numerics(m, random_args(m))
    ar = [i for i in pm.entry.instructions if i.opcode == "all-reduce"]
    assert [i.attrs["replica_groups"] for i in ar] == [((0, 1, 2, 3), (4, 5, 6, 7))]


# --------------------------------------------------------------------------- transformer block
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("axes", [{"tp": 1}, {"tp": 2}, {"tp": 4}])
def test_transformer_block_heads_over_tp(fused, axes):
    m = transformer_block(mesh_of(**axes), 2, 6, 16, 4, 32, spec(None, None, None), fused_attention=fused)
    pm = check_numerics(m, random_args(m))
    assert collectives(pm) == ([] if axes["tp"] == 1 else ["all-reduce", "all-reduce"])


@pytest.mark.parametrize("B, S", [(4, 6), (3, 5)])
def test_transformer_block_dp_tp_mesh(B, S):
    sx = spec("dp", None, None)
    m = transformer_block(mesh_of(dp=2, tp=4), B, S, 16, 4, 32, sx, fused_attention=False, so=sx)
    pm = check_numerics(m, random_args(m))
    assert collectives(pm) == ["all-reduce", "all-reduce"]


# --------------------------------------------------------------------------- reductions
@pytest.mark.parametrize("kind, mean", [("add", False), ("add", True), ("maximum", False), ("minimum", False)])
@pytest.mark.parametrize("mesh", [mesh_of(x=2), mesh_of(x=4), mesh_of(x=2, y=4)])
@pytest.mark.parametrize("dims", [(8, 4, 6), (5, 3, 7)])
def test_reduce_over_sharded_dims(kind, mean, mesh, dims):
    axes = mesh.axis_names
    for sx, rdims in [(spec(axes, None, None), [0]), (spec(None, axes[0], axes[-1] if len(axes) > 1 else None), [1, 2]),
                      (spec(axes[0], None, axes[-1] if len(axes) > 1 else None), [2])]:
        m = reduction(mesh, dims, sx, kind, rdims, mean=mean)
        check_numerics(m, random_args(m))


def test_sum_over_sharded_dim_stays_partial_until_root():
    m = reduction(mesh_of(x=4), (8, 6), spec("x", None), "add", [0], mean=True)
    pm = check_numerics(m, random_args(m))
    assert collectives(pm) == ["all-reduce"]
    assert pm.entry.root.opcode == "all-reduce"


# --------------------------------------------------------------------------- other ops
def _reshape_module(mesh, src, dst, s):
    m, b = new_module("reshape", mesh)
    x = b.param(Shape(F32, src), "x", sharding=s)
    r = b.reshape(b.unary("tanh", x), dst, name="r")
    b.set_root(b.unary("negate", r))
    return m


@pytest.mark.parametrize("src, dst, s, moves", [
    ((2, 6, 16), (2, 6, 4, 4), spec(None, None, "x"), True),
    ((2, 6, 4, 4), (2, 6, 16), spec(None, None, "x", None), True),
    ((8, 3), (24,), spec("x", None), True),
    ((6, 4), (24,), spec("x", None), False),
    ((2, 6, 6), (2, 36), spec(None, "x", None), False),
    ((5, 3), (5, 3, 1), spec("x", None), True),
])
def test_reshape_keeps_divisible_major_split(src, dst, s, moves):
    m = _reshape_module(mesh_of(x=4), src, dst, s)
    pm = check_numerics(m, random_args(m))
    assert (collectives(pm) == []) if moves else ("all-gather" in collectives(pm))
    r = [i for i in pm.entry.instructions if i.name == "r"][0]
    assert any(r.sharding.dims) == moves


def test_embedding_gather_slice_concat_pad_dynamic_slice():
    mesh = mesh_of(dp=2, tp=2)
    m, b = new_module("ops", mesh)
    table = b.param(Shape(F32, (10, 8)), "table", sharding=spec(None, "tp"))
    ids = b.param(Shape("s32", (5, 3)), "ids", sharding=spec("dp", None))
    emb = b.gather(table, ids, offset_dims=[2], collapsed_slice_dims=[0], start_index_map=[0],
                   index_vector_dim=2, slice_sizes=[1, 8], name="emb")
    sl = b.slice(emb, [0, 1, 0], [5, 3, 8], name="sl")
    cat = b.concatenate([sl, sl], 1, name="cat")
    zero = b.constant(0.0, F32)
    pad = b.pad(cat, zero, [(0, 0, 0), (1, 2, 0), (0, 0, 0)], name="pad")
    one = b.constant(1, "s32")
    ds = b.dynamic_slice(pad, [one, one, b.constant(0, "s32")], [3, 4, 8], name="ds")
    upd = b.unary("exponential", ds, name="upd")
    dus = b.dynamic_update_slice(pad, upd, [one, b.constant(2, "s32"), b.constant(0, "s32")], name="dus")
    b.set_root(b.tuple([dus, emb]))
    args = [torch.randn(10, 8), torch.randint(0, 10, (5, 3), dtype=torch.int32)]
    check_numerics(m, args)


def test_sharding_constraint_reshards_and_disappears():
    mesh = mesh_of(x=4)
    m, b = new_module("constraint", mesh)
    x = b.param(Shape(F32, (8, 12)), "x", sharding=spec("x", None))
    y = b.unary("tanh", x)
    c = b.custom_call("Sharding", [y], y.shape, name="c")
    c.sharding = spec(None, "x")
    b.set_root(b.unary("negate", c))
    pm = check_numerics(m, random_args(m))
    assert "custom-call" not in [i.opcode for i in pm.entry.instructions]
    assert collectives(pm) == ["all-to-all"]


def test_iota_and_constants_follow_their_users():
    m, b = new_module("iota", mesh_of(x=4))
    x = b.param(Shape(F32, (7, 5)), "x", sharding=spec("x", None))
    io = b.convert(b.iota(Shape("s32", (7, 5)), 0), F32)
    b.set_root(b.binary("multiply", x, io))
    check_numerics(m, random_args(m))


def test_rejects_partitioned_input():
    m = matmul(mesh_of(x=2), 4, 4, 4, spec(None, None), spec(None, None))
    pm = partition(m)
    with pytest.raises(ValueError, match="unpartitioned"):
        SpmdPartition().run(pm)


# --------------------------------------------------------------------------- random shapes
_MESHES = [mesh_of(x=1), mesh_of(x=2), mesh_of(x=4), mesh_of(x=8), mesh_of(a=2, b=2), mesh_of(a=2, b=4)]


@st.composite
def _sharding(draw, mesh, rank):
    dims = [[] for _ in range(rank)]
    for a in mesh.axis_names:
        d = draw(st.integers(-1, rank - 1))
        if d >= 0:
            dims[d].append(a)
    return TensorSharding(tuple(tuple(d) for d in dims))


@st.composite
def _matmul_case(draw):
    mesh = draw(st.sampled_from(_MESHES))
    M, K, N = (draw(st.integers(1, 9)) for _ in range(3))
    out = draw(st.one_of(st.none(), _sharding(mesh, 2)))
    return mesh, (M, K, N), draw(_sharding(mesh, 2)), draw(_sharding(mesh, 2)), out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_matmul_case())
def test_matmul_random_shapes(case):
    mesh, (M, K, N), sa, sb, so = case
    check_numerics(matmul(mesh, M, K, N, sa, sb, so), [torch.randn(M, K), torch.randn(K, N)])


@st.composite
def _reduce_case(draw):
    mesh = draw(st.sampled_from(_MESHES))
    dims = tuple(draw(st.integers(1, 9)) for _ in range(3))
    rdims = sorted(draw(st.sets(st.integers(0, 2), min_size=1, max_size=3)))
    kind = draw(st.sampled_from(["add", "maximum", "minimum"]))
    return mesh, dims, draw(_sharding(mesh, 3)), kind, rdims, draw(st.booleans())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_reduce_case())
def test_reduce_random_shapes(case):
    mesh, dims, sx, kind, rdims, mean = case
    m = reduction(mesh, dims, sx, kind, rdims, mean=mean and kind == "add")
    check_numerics(m, random_args(m))


def test_sequence_parallel_block_uses_all_gather_and_reduce_scatter():
    """Megatron sequence parallelism: one all-gather before the column-parallel linears and one
    reduce-scatter after each row-parallel linear, with the bias added on the sequence shard."""
    import torch

    import spmd
    from spmd.models import gpt, plans

    model = gpt.gpt3_layers(small=True, seed=0)
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    pm = spmd.parallelize(model, mesh, plans.gpt_plan(sequence_parallel=True),
                          options=spmd.CompileOptions(windowed_einsum="off"))
    x = torch.randn(2, 16, 64)
    out = pm(x).to_torch()
    ref = model(x)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    ops = [c["opcode"] for c in pm.compiled.collectives()]
    assert ops == ["all-gather", "reduce-scatter"] * 2, ops
