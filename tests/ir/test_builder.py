"""Builder and shape-inference tests: shapes checked against torch on random shapes."""

import string
import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from spmd.ir.builder import Builder, clone_module, infer_shape
from spmd.ir.hlo import Computation, Instruction, Module, Shape
from spmd.ir.sharding import MeshShape, TensorSharding
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module

DIMS = st.lists(st.integers(1, 5), min_size=1, max_size=4)
FAST = settings(max_examples=40, deadline=None)


def S(*dims, dtype="f32"):
    return Shape(dtype, tuple(dims))


def _new(mesh: MeshShape | None = None) -> tuple[Module, Builder]:
    m = Module("m", Computation("main"), mesh=mesh or MeshShape(("x",), (4,)))
    return m, Builder(m)


@FAST
@given(st.data())
def test_dot_matches_einsum(data):
    nb, nl, nr, nc = (data.draw(st.integers(0, 2)) for _ in range(4))
    letters = iter(string.ascii_lowercase)
    batch, lfree, rfree, contr = ([next(letters) for _ in range(n)] for n in (nb, nl, nr, nc))
    size = {ch: data.draw(st.integers(1, 4)) for ch in batch + lfree + rfree + contr}
    lhs = data.draw(st.permutations(batch + lfree + contr))
    rhs = data.draw(st.permutations(batch + rfree + contr))
    a, b = torch.randn([size[c] for c in lhs]), torch.randn([size[c] for c in rhs])
    free = [c for c in lhs if c in lfree] + [c for c in rhs if c in rfree]  # XLA: free dims in operand order
    want = torch.einsum(f"{''.join(lhs)},{''.join(rhs)}->{''.join(batch + free)}", a, b)
    attrs = {"lhs_batch_dims": tuple(lhs.index(c) for c in batch), "rhs_batch_dims": tuple(rhs.index(c) for c in batch),
             "lhs_contracting_dims": tuple(lhs.index(c) for c in contr),
             "rhs_contracting_dims": tuple(rhs.index(c) for c in contr)}
    assert infer_shape("dot", [Shape.of(a), Shape.of(b)], attrs) == Shape.of(want)
    assert infer_shape("dot", [Shape.of(a), Shape.of(b)], attrs, shape=S(dtype="bf16")).dtype == "bf16"


@FAST
@given(DIMS, st.data())
def test_elementwise_shape_ops_match_torch(dims, data):
    x = torch.randn(dims)
    xs = Shape.of(x)
    rank = len(dims)
    perm = data.draw(st.permutations(range(rank)))
    assert infer_shape("transpose", [xs], {"dimensions": tuple(perm)}) == Shape.of(x.permute(perm))
    rdims = tuple(sorted(data.draw(st.sets(st.integers(0, rank - 1)))))
    assert infer_shape("reduce", [xs, S()], {"dimensions": rdims}) == Shape.of(x.sum(rdims) if rdims else x)
    sl = []
    for n in dims:
        a = data.draw(st.integers(0, n))
        sl.append((a, data.draw(st.integers(a, n)), data.draw(st.integers(1, 3))))
    want = x[tuple(slice(a, b, c) for a, b, c in sl)]
    assert infer_shape("slice", [xs], {"slice": tuple(sl)}) == Shape.of(want)
    d = data.draw(st.integers(0, rank - 1))
    y = torch.randn([n if i != d else data.draw(st.integers(1, 3)) for i, n in enumerate(dims)])
    assert infer_shape("concatenate", [xs, Shape.of(y), xs], {"dimensions": (d,)}) == Shape.of(torch.cat([x, y, x], d))
    for op in ("add", "maximum", "power"):
        assert infer_shape(op, [xs, xs], {}) == xs
    assert infer_shape("compare", [xs, xs], {"direction": "GE"}) == Shape.of(x >= x)
    assert infer_shape("select", [Shape.of(x > 0), xs, xs], {}) == xs
    assert infer_shape("clamp", [S(), xs, S()], {}) == Shape.of(x.clamp(-1, 1))
    assert infer_shape("convert", [xs], {}, shape=xs.with_dtype("bf16")) == Shape.of(x.bfloat16())


@FAST
@given(DIMS, st.data())
def test_broadcast_pad_reshape_match_torch(dims, data):
    x = torch.randn(dims)
    xs, rank = Shape.of(x), len(dims)
    out_rank = rank + data.draw(st.integers(0, 2))
    where = sorted(data.draw(st.permutations(range(out_rank)))[:rank])
    out = [data.draw(st.integers(1, 3)) for _ in range(out_rank)]
    view = [1] * out_rank
    for i, o in enumerate(where):
        out[o] = view[o] = dims[i]
    want = x.reshape(view).expand(out)
    assert infer_shape("broadcast", [xs], {"dimensions": tuple(where)}, shape=Shape.of(want)) == Shape.of(want)
    pad = tuple((data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2)))
                for _ in dims)
    y = x
    for d, (lo, hi, it) in enumerate(pad):  # interior padding by strided assignment, then edges by F.pad
        n = y.shape[d]
        z = torch.zeros([*y.shape[:d], n + (n - 1) * it, *y.shape[d + 1:]])
        z.narrow(d, 0, z.shape[d])[(slice(None),) * d + (slice(None, None, it + 1),)] = y
        y = F.pad(z.movedim(d, -1), (lo, hi)).movedim(-1, d)
    assert infer_shape("pad", [xs, S()], {"padding": pad}) == Shape.of(y)
    flat = S(x.numel())
    assert infer_shape("reshape", [xs], {}, shape=flat) == Shape.of(x.reshape(-1))
    with pytest.raises(ValueError, match="reshape: an explicit f32 result with"):
        infer_shape("reshape", [xs], {}, shape=S(x.numel() + 1))


@FAST
@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 4), st.integers(1, 3))
def test_gather_embedding_and_dynamic_slices_match_torch(vocab, dim, b, s):
    table, idx = torch.randn(vocab, dim), torch.randint(0, vocab, (b, s), dtype=torch.int32)
    attrs = {"offset_dims": (2,), "collapsed_slice_dims": (0,), "start_index_map": (0,), "index_vector_dim": 2,
             "slice_sizes": (1, dim)}
    assert infer_shape("gather", [Shape.of(table), Shape.of(idx)], attrs) == Shape.of(F.embedding(idx, table))
    col = idx.reshape(-1, 1)  # XLA's index-vector form
    attrs = {**attrs, "offset_dims": (1,), "index_vector_dim": 1}
    assert infer_shape("gather", [Shape.of(table), Shape.of(col)], attrs) == Shape.of(table[col[:, 0]])
    sizes = (min(b, vocab), dim)
    want = table[0:sizes[0], 0:dim]
    assert infer_shape("dynamic-slice", [Shape.of(table), S(dtype="s32"), S(dtype="s32")],
                       {"dynamic_slice_sizes": sizes}) == Shape.of(want)
    assert infer_shape("dynamic-update-slice", [Shape.of(table), Shape.of(want), S(dtype="s32"), S(dtype="s32")],
                       {}) == Shape.of(table)


@FAST
@given(DIMS, st.sampled_from([1, 2, 4]), st.data())
def test_collectives_match_a_simulation(dims, g, data):
    d = data.draw(st.integers(0, len(dims) - 1))
    dims = [n * g if i == d else n for i, n in enumerate(dims)]
    shards = [torch.randn(dims) for _ in range(g)]
    xs, groups = Shape.of(shards[0]), tuple(tuple(range(k * g, (k + 1) * g)) for k in range(2))
    assert infer_shape("all-gather", [xs], {"dimensions": (d,), "replica_groups": groups}) == \
        Shape.of(torch.cat(shards, d))
    assert infer_shape("reduce-scatter", [xs], {"dimensions": (d,), "replica_groups": groups}) == \
        Shape.of(sum(shards).chunk(g, d)[0])
    c = data.draw(st.integers(0, len(dims) - 1))
    got = torch.cat(shards[0].chunk(g, d), c)  # what one device ends with (chunks from its peers)
    assert infer_shape("all-to-all", [xs], {"split_dimension": d, "concat_dimension": c, "replica_groups": groups}) \
        == Shape.of(got)
    assert infer_shape("all-gather", [xs], {"dimensions": (d,), "replica_groups": ()}, num_partitions=g) == \
        Shape.of(torch.cat(shards, d))
    assert infer_shape("all-reduce", [xs], {"replica_groups": groups}) == xs
    pairs = {"source_target_pairs": ((0, 1),)}
    assert infer_shape("collective-permute-start", [xs], pairs) == Shape.tuple([xs, xs])
    assert infer_shape("all-gather-start", [xs], {"dimensions": (d,), "replica_groups": groups}) == \
        Shape.tuple([xs, Shape.of(torch.cat(shards, d))])


def test_async_tuple_and_leaf_shapes():
    m, b = _new()
    body = Builder.new_computation(m, "body")
    p = body.param(S(2, 3))
    body.set_root(body.unary("negate", p))
    calls = {"calls": body.computation}
    start = infer_shape("async-start", [S(2, 3)], calls)
    assert start == Shape.tuple([Shape.tuple([S(2, 3)]), S(2, 3)])
    assert infer_shape("async-done", [start], {}) == S(2, 3)
    assert infer_shape("all-reduce-done", [S(4)], {}) == S(4)
    assert infer_shape("tuple", [S(1), S(dtype="s32")], {}) == Shape.tuple([S(1), S(dtype="s32")])
    assert infer_shape("get-tuple-element", [Shape.tuple([S(1), S(2)])], {"index": 1}) == S(2)
    assert infer_shape("partition-id", [], {}) == S(dtype="u32")
    assert infer_shape("constant", [], {"literal": torch.zeros(2, 5, dtype=torch.int8)}) == S(2, 5, dtype="s8")
    assert infer_shape("iota", [], {"iota_dimension": 1}, shape=S(3, 4)) == S(3, 4)


@pytest.mark.parametrize(("opcode", "ops", "attrs", "kw", "match"), [
    ("add", [S(2), S(3)], {}, {}, "add: operands must have equal shapes"),
    ("dot", [S(2, 3), S(4, 5)], {"lhs_contracting_dims": (1,), "rhs_contracting_dims": (0,)}, {},
     "dot: contracting dims differ"),
    ("transpose", [S(2, 3)], {"dimensions": (0, 0)}, {}, "permutation"),
    ("reduce", [S(2, 3), S()], {"dimensions": (2,)}, {}, r"distinct dims in \[0, 2\)"),
    ("reduce", [S(2, 3), S()], {}, {}, "reduce: missing attribute 'dimensions'"),
    ("slice", [S(4)], {"slice": ((0, 5, 1),)}, {}, "out of range"),
    ("all-gather", [S(4)], {"dimensions": (0,)}, {}, "num_partitions is unknown"),
    ("reduce-scatter", [S(5)], {"dimensions": (0,), "replica_groups": ((0, 1),)}, {}, "not divisible"),
    ("custom-call", [S(4)], {"custom_call_target": "x"}, {}, "must be given explicitly"),
    ("broadcast", [S(3)], {"dimensions": (0,)}, {"shape": S(4, 2)}, "does not map onto"),
    ("negate", [S(3), S(3)], {}, {}, "expected 1 operand"),
    ("get-tuple-element", [Shape.tuple([S(1)])], {"index": 1}, {}, "out of range"),
    ("dynamic-slice", [S(4)], {"dynamic_slice_sizes": (2,)}, {}, "integer scalar start"),
    ("all-gather-done", [S(4)], {}, {}, "tuple from a start"),
])
def test_infer_shape_errors(opcode, ops, attrs, kw, match):
    with pytest.raises(ValueError, match=match):
        infer_shape(opcode, ops, attrs, **kw)


def test_builder_builds_a_verified_module_with_unique_names():
    m, b = _new(MeshShape(("dp", "tp"), (2, 2)))
    x = b.param(S(8, 4), name="x", sharding=TensorSharding((("dp",), ())))
    w = b.param(S(4, 6), name="w")
    y = b.dot(x, w, (1,), (0,), dtype="bf16")
    assert y.shape == S(8, 6, dtype="bf16") and "lhs_batch_dims" not in y.attrs
    z = b.convert(y, torch.float32)
    r = b.reduce(z, [1], "maximum")
    s = b.reduce(z, [0])
    s2 = b.reduce(z, [0, 1])
    ag = b.all_gather(b.reduce_scatter(z, 0, [[0, 1], [2, 3]]), 0, [[0, 1], [2, 3]])
    ar = b.all_reduce(ag, [[0, 2], [1, 3]])
    cp = b.collective_permute(ar, [(0, 1), (1, 0)])
    a2a = b.all_to_all(cp, 0, 1, [[0, 1], [2, 3]])
    pid = b.convert(b.partition_id(), "s32")
    ds = b.dynamic_slice(a2a, [pid, b.constant(0, "s32")], [2, 3])
    upd = b.dynamic_update_slice(a2a, ds, [pid, pid])
    sm = b.custom_call("softmax", [upd], upd.shape, {"dim": 1})
    t = b.tuple([r, s, s2, sm])
    b.set_root(b.get_tuple_element(t, 3))
    verify_module(m)
    names = [i.name for c in m.all_computations() for i in c.instructions]
    assert len(names) == len(set(names))
    assert [c.name for c in m.computations] == ["maximum.f32", "add.f32"]
    assert r.attrs["to_apply"] is m.computations[0] and s.attrs["to_apply"] is s2.attrs["to_apply"]
    inits = [i.operands[1].attrs["literal"].item() for i in (r, s)]
    assert inits == [float("-inf"), 0.0]
    assert [p.attrs["parameter_number"] for p in m.entry.parameters] == [0, 1]
    assert print_module(parse_module(print_module(m))) == print_module(m)


def test_fresh_names_skip_existing_and_hand_added_names():
    m = parse_module("HloModule m\n\nENTRY %main {\n  %add = f32[] parameter(0)\n  %add.1 = f32[] add(%add, %add)\n}\n")
    b = Builder(m)
    a = b.binary("add", m.entry.instructions[0], m.entry.instructions[1])
    assert a.name == "add.2"
    m.entry.instructions.append(Instruction("add.3", "add", S(), [a, a]))  # added by hand
    assert Builder(m).binary("add", a, a).name == "add.4"
    assert b.binary("add", a, a, name="main").name == "main.1"  # computation names are taken too


def test_name_generation_is_fast():
    m, b = _new()
    x = b.param(S(2))
    t0 = time.process_time()
    for _ in range(20000):
        x = b.unary("negate", x)
    assert time.process_time() - t0 < 2.0
    assert x.name == "negate.19999" and len({i.name for i in m.entry.instructions}) == 20001


def test_insert_before_and_context_restores_append():
    m, b = _new()
    x = b.param(S(3), name="x")
    y = b.unary("negate", x, name="y")
    b.set_root(y)
    with b.insert_before(y):
        e = b.unary("exponential", x)
        f = b.unary("abs", e)
    tail = b.unary("copy", y)
    assert m.entry.instructions == [x, e, f, y, tail]
    b.insert_before(x)
    c = b.constant([1.0, 2.0, 3.0])
    m.entry.instructions.remove(f)  # edited under the builder: index found again
    g = b.unary("sine", c)
    assert m.entry.instructions == [c, g, x, e, y, tail]
    b.append_at_end()
    assert b.unary("tanh", x) is m.entry.instructions[-1]
    with pytest.raises(ValueError, match="anchor %nope is not in computation %main"):
        b.insert_before(Instruction("nope", "copy", S(3), [x]))


def test_builder_rejects_bad_input():
    m, b = _new()
    x = b.param(S(3))
    with pytest.raises(ValueError, match="op must be a unary opcode"):
        b.unary("add", x)
    with pytest.raises(ValueError, match="dtype must be one of"):
        b.convert(x, "f33")
    with pytest.raises(ValueError, match="shape f32\\[4\\] differs from the inferred f32\\[3\\]"):
        b.add("negate", [x], shape=S(4))
    with pytest.raises(ValueError, match="kind must be add"):
        b.reduce(x, [0], "mean")
    assert len(m.entry.instructions) == 1  # nothing half-added


def test_clone_module_is_deep():
    m, b = _new()
    x = b.param(S(4, 4), name="x", sharding=TensorSharding((("x",), ())))
    r = b.reduce(b.binary("add", x, b.constant(torch.ones(4, 4))), [1])
    cc = b.custom_call("softmax", [x], x.shape, {"dim": 1, "nested": [1, 2]})
    b.set_root(b.tuple([r, cc]))
    x.stream_id = 2
    c = clone_module(m)
    assert print_module(c) == print_module(m)
    verify_module(c)
    old = {id(i) for comp in m.all_computations() for i in comp.instructions}
    assert not old & {id(i) for comp in c.all_computations() for i in comp.instructions}
    cr = c.entry.root.operands[0]
    assert cr.attrs["to_apply"] is c.computations[0] and cr.attrs["to_apply"] is not m.computations[0]
    lit = c.entry.instructions[1].attrs["literal"]
    lit.add_(1)
    c.entry.instructions[-2].attrs["backend_config"]["nested"].append(3)
    assert m.entry.instructions[1].attrs["literal"].eq(1).all()
    assert cc.attrs["backend_config"] == {"dim": 1, "nested": [1, 2]}
    assert c.entry.parameters[0].stream_id == 2 and c.entry.parameters[0].sharding == x.sharding
