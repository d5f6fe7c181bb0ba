"""propagate-sharding: golden text and the per-op rules' choices."""

import pytest
from partition_programs import F32, mesh_of, mlp, new_module, spec, transformer_block

from spmd.ir.hlo import Shape
from spmd.ir.text import parse_module, print_module
from spmd.passes.propagate_sharding import PropagateSharding

MLP_IN = """HloModule mlp, num_partitions=4, mesh={tp=4}

ENTRY %main (x: f32[8,16], w1: f32[16,32], w2: f32[32,16]) -> f32[8,16] {
  %x = f32[8,16] parameter(0), sharding={replicated}
  %w1 = f32[16,32] parameter(1), sharding={devices=[1,4]<=[4]}
  %w2 = f32[32,16] parameter(2), sharding={devices=[4,1]<=[4]}
  %h = f32[8,32] dot(%x, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %g = f32[8,32] custom-call(%h), custom_call_target="gelu"
  %y = f32[8,16] dot(%g, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %z = f32[8,16] add(%y, %y)
}
"""

MLP_OUT = """HloModule mlp, num_partitions=4, mesh={tp=4}

ENTRY %main (x: f32[8,16], w1: f32[16,32], w2: f32[32,16]) -> f32[8,16] {
  %x = f32[8,16] parameter(0), sharding={replicated}
  %w1 = f32[16,32] parameter(1), sharding={devices=[1,4]<=[4]}
  %w2 = f32[32,16] parameter(2), sharding={devices=[4,1]<=[4]}
  %h = f32[8,32] dot(%x, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,4]<=[4]}
  %g = f32[8,32] custom-call(%h), custom_call_target="gelu", sharding={devices=[1,4]<=[4]}
  %y = f32[8,16] dot(%g, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, \
sharding={devices=[1,1,4]<=[4] last_tile_dims={partial}}
  ROOT %z = f32[8,16] add(%y, %y), sharding={replicated}
}
"""


def _by_name(m):
    return {i.name: i for i in m.entry.instructions}


def test_megatron_mlp_golden():
    """Column-parallel then row-parallel: the second dot is partial; the unannotated root is not."""
    m = PropagateSharding().run(parse_module(MLP_IN))
    assert print_module(m) == MLP_OUT


def test_user_shardings_are_fixed():
    m = mlp(mesh_of(tp=4), 8, 16, 32, spec(None, None), spec(None, "tp"), spec("tp", None), spec("tp", None))
    PropagateSharding().run(m)
    i = _by_name(m)
    assert i["y"].sharding == spec("tp", None)
    assert i["w2"].sharding == spec("tp", None)


def test_attention_heads_follow_hidden_split():
    m = transformer_block(mesh_of(tp=4), 2, 6, 16, 4, 32, spec(None, None, None), fused_attention=False)
    PropagateSharding().run(m)
    i = _by_name(m)
    assert i["q"].sharding == spec(None, None, "tp")
    assert i["q.split"].sharding == spec(None, None, "tp", None)  # [B,S,H] -> [B,S,nh,hd]: nh split
    assert i["q.heads"].sharding == spec(None, "tp", None, None)
    assert i["scores"].sharding == spec(None, "tp", None, None)
    assert i["probs"].sharding == spec(None, "tp", None, None)
    assert i["attn.merged"].sharding == spec(None, None, "tp")
    assert i["attn.out"].sharding == spec(None, None, None, partial=("tp",))
    assert i["resid1"].sharding == spec(None, None, None)
    assert i["scale"].sharding == spec(None, "tp", None, None)  # a broadcast constant follows its user


def test_partial_flows_through_linear_ops_only():
    m, b = new_module("lin", mesh_of(tp=2))
    x = b.param(Shape(F32, (4, 8)), "x", sharding=spec(None, "tp"))
    w = b.param(Shape(F32, (8, 6)), "w", sharding=spec("tp", None))
    y = b.dot(x, w, [1], [0], name="y")
    s = b.binary("multiply", y, b.broadcast(b.constant(2.0, F32), (4, 6), (), name="two"), name="scaled")
    n = b.unary("negate", s, name="neg")
    a = b.binary("add", n, y, name="sum")
    t = b.unary("tanh", a, name="tanh")
    b.set_root(t)
    PropagateSharding().run(m)
    i = _by_name(m)
    for name in ("y", "scaled", "neg", "sum"):
        assert i[name].sharding == spec(None, None, partial=("tp",)), name
    assert i["two"].sharding == spec(None, None)
    assert i["tanh"].sharding == spec(None, None)


@pytest.mark.parametrize("kind, partial", [("add", ("x",)), ("maximum", ())])
def test_reduce_over_sharded_dim(kind, partial):
    m, b = new_module("red", mesh_of(x=4))
    x = b.param(Shape(F32, (8, 6)), "x", sharding=spec("x", None))
    r = b.reduce(x, [0], kind, name="r")
    b.set_root(b.unary("negate", r, name="out"))
    PropagateSharding().run(m)
    assert _by_name(m)["r"].sharding == spec(None, partial=partial)


def test_contracting_over_two_axes_gives_partial_over_both():
    m, b = new_module("k2", mesh_of(dp=2, tp=2))
    x = b.param(Shape(F32, (4, 8)), "x", sharding=spec(None, ("dp", "tp")))
    w = b.param(Shape(F32, (8, 6)), "w", sharding=spec(("dp", "tp"), None))
    y = b.dot(x, w, [1], [0], name="y")
    b.set_root(b.binary("add", y, y, name="out"))
    PropagateSharding().run(m)
    assert _by_name(m)["y"].sharding == spec(None, None, partial=("dp", "tp"))


def test_backward_from_constraint_reaches_constants():
    m, b = new_module("bw", mesh_of(x=2))
    io = b.iota(Shape("s32", (4, 6)), 1, name="io")
    f = b.convert(io, F32, name="f")
    c = b.custom_call("Sharding", [f], f.shape, name="c")
    c.sharding = spec(None, "x")
    b.set_root(c)
    PropagateSharding().run(m)
    i = _by_name(m)
    assert i["io"].sharding == spec(None, "x")
    assert i["f"].sharding == spec(None, "x")


def test_elementwise_merges_compatible_operand_shardings():
    m, b = new_module("merge", mesh_of(dp=2, tp=2))
    x = b.param(Shape(F32, (4, 6)), "x", sharding=spec("dp", None))
    y = b.param(Shape(F32, (4, 6)), "y", sharding=spec(None, "tp"))
    b.set_root(b.binary("add", x, y, name="s"))
    PropagateSharding().run(m)
    assert _by_name(m)["s"].sharding == spec("dp", "tp")


def test_reshape_not_divisible_is_not_split():
    m, b = new_module("rs", mesh_of(x=4))
    x = b.param(Shape(F32, (6, 4)), "x", sharding=spec("x", None))
    b.set_root(b.reshape(x, (24,), name="r"))
    PropagateSharding().run(m)
    assert _by_name(m)["r"].sharding == spec(None)


@pytest.mark.parametrize("bad, match", [(spec("zz", None), "axis 'zz'"), (spec("x"), "rank")])
def test_rejects_bad_user_shardings(bad, match):
    m, b = new_module("bad", mesh_of(x=2))
    x = b.param(Shape(F32, (4, 4)), "x", sharding=bad)
    b.set_root(b.unary("negate", x))
    with pytest.raises(ValueError, match=match):
        PropagateSharding().run(m)


@pytest.mark.parametrize("m, n, gathered", [(64, 256, "x"), (256, 64, "w")])
def test_contested_axis_gathers_the_smaller_operand(m, n, gathered):
    """x split on rows and w on columns over one axis: the cheaper operand is all-gathered."""
    text = f"""HloModule m, num_partitions=2, mesh={{tp=2}}

ENTRY %main (x: f32[{m},32], w: f32[32,{n}]) -> f32[{m},{n}] {{
  %x = f32[{m},32] parameter(0), sharding={{devices=[2,1]<=[2]}}
  %w = f32[32,{n}] parameter(1), sharding={{devices=[1,2]<=[2]}}
  ROOT %d = f32[{m},{n}] dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""
    module = PropagateSharding().run(parse_module(text))
    root = module.entry.root
    want = ((), ("tp",)) if gathered == "x" else (("tp",), ())
    assert root.sharding.dims == want


RMS_BF16 = """HloModule rms, num_partitions=2, mesh={tp=2}

ENTRY %main (a: {t}[4,8], b: {t}[8,1]) -> {t}[4,1] {
  %a = {t}[4,8] parameter(0), sharding={devices=[1,2]<=[2]}
  %b = {t}[8,1] parameter(1), sharding={devices=[2,1]<=[2]}
  %v = {t}[4,1] dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %sq = {t}[4,1] multiply(%v, %v)
  %r = {t}[4,1] rsqrt(%sq)
  %y = {t}[4,1] multiply(%v, %r)
  %half = {t}[4,1] convert(%v)
  ROOT %t = ({t}[4,1], {t}[4,1]) tuple(%y, %half)
}
"""


@pytest.mark.parametrize("dtype, kept", [("bf16", False), ("f16", False), ("f32", True)])
def test_a_partial_value_is_multiplied_only_in_32_and_64_bit_types(dtype, kept):
    """In 16-bit types each device's product would round at the scale of its own term: a 16-bit
    dot is not left partial (spmd-partition sums its float32 partial products at the dot), so
    nothing after it is; f32 keeps the partial through the multiply (one all-reduce fewer) and
    through a convert to the same type (exact)."""
    m = PropagateSharding().run(parse_module(RMS_BF16.replace("{t}", dtype)))
    lines = print_module(m).splitlines()
    for name in ("%v = ", "%y = ", "%half = "):
        line = next(line for line in lines if name in line)
        assert ("partial" in line) == kept, line


def test_a_partial_value_is_not_narrowed_before_its_sum():
    m = PropagateSharding().run(parse_module(RMS_BF16.replace("{t}", "f32").replace(
        "%half = f32[4,1] convert", "%half = bf16[4,1] convert").replace("(f32[4,1], f32[4,1])",
                                                                           "(f32[4,1], bf16[4,1])")))
    half = next(line for line in print_module(m).splitlines() if "%half = " in line)
    assert "partial" not in half, half
