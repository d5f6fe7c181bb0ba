import pytest

from spmd.ir.sharding import TensorSharding
from spmd.mesh import Mesh
from spmd.sharding import NamedSharding, P, PartitionSpec, check_spec

MESH = Mesh.create({"dp": 2, "tp": 4}, devices="cpu:8")


def test_partition_spec_normalizes_entries():
    assert P(None, ("tp",), ()) == (None, "tp", None)
    assert P(("dp", "tp")) == (("dp", "tp"),)
    assert P(["dp", "tp"])[0] == ("dp", "tp")
    assert repr(P(None, "tp")) == "P(None, 'tp')"
    assert repr(P()) == "P()"
    assert PartitionSpec is P
    with pytest.raises(TypeError, match="PartitionSpec entry"):
        P(3)
    with pytest.raises(TypeError, match="PartitionSpec entry"):
        P(("tp", 1))


def test_repr_matches_docs():
    s = NamedSharding(MESH, P(None, "tp"))
    assert repr(s) == "NamedSharding(mesh={'dp': 2, 'tp': 4}, spec=P(None, 'tp'))"
    s = NamedSharding(MESH, P("tp"), partial=("dp",))
    assert repr(s) == "NamedSharding(mesh={'dp': 2, 'tp': 4}, spec=P('tp'), partial=('dp',))"


def test_plain_tuple_spec_is_converted_and_frozen():
    s = NamedSharding(MESH, (None, "tp"), partial="dp")
    assert isinstance(s.spec, PartitionSpec) and s.partial == ("dp",)
    assert s == NamedSharding(MESH, P(None, "tp"), ("dp",))
    assert hash(s) == hash(NamedSharding(MESH, P(None, "tp"), ("dp",)))
    with pytest.raises(AttributeError):
        s.spec = P()


def test_unknown_axis():
    with pytest.raises(ValueError, match=r"spec: unknown mesh axis 'x' in P\('x'\); mesh axes are \('dp', 'tp'\)"):
        NamedSharding(MESH, P("x"))
    with pytest.raises(ValueError, match="w1: unknown mesh axis 'x'"):
        check_spec(MESH, P(None, ("dp", "x")), shape=(4, 4), argname="w1")
    with pytest.raises(ValueError, match="unknown mesh axis 'pp' in P\\(\\) with partial=\\('pp',\\)"):
        NamedSharding(MESH, P(), partial=("pp",))


def test_axis_used_twice():
    with pytest.raises(ValueError, match=r"spec: mesh axis 'tp' is used 2 times in P\('tp', \('dp', 'tp'\)\)"):
        NamedSharding(MESH, P("tp", ("dp", "tp")))
    with pytest.raises(ValueError, match="mesh axis 'dp' is used 2 times"):
        NamedSharding(MESH, P("dp"), partial=("dp",))


def test_more_entries_than_dims():
    s = NamedSharding(MESH, P(None, "tp", None))
    with pytest.raises(ValueError, match=r"x: P\(None, 'tp', None\) has 3 entries but the array has 2 dims "
                                         r"\(shape \(4, 8\)\); expected at most 2"):
        s.validate((4, 8), "x")
    s.validate((4, 8, 2), "x")
    with pytest.raises(ValueError, match="rank"):
        s.to_tensor_sharding(2)


def test_bad_mesh_and_spec_types():
    with pytest.raises(TypeError, match="mesh: expected a spmd.Mesh"):
        NamedSharding("mesh", P())
    with pytest.raises(TypeError, match="spec: expected a PartitionSpec"):
        NamedSharding(MESH, "tp")


def test_to_tensor_sharding_pads_trailing_dims():
    s = NamedSharding(MESH, P(("dp", "tp")), partial=())
    assert s.to_tensor_sharding(3) == TensorSharding((("dp", "tp"), (), ()))
    s = NamedSharding(MESH, P(None, "tp"), partial=("dp",))
    assert s.to_tensor_sharding(2) == TensorSharding(((), ("tp",)), ("dp",))


@pytest.mark.parametrize(
    "ts",
    [
        TensorSharding(((), ())),
        TensorSharding((("tp",), ())),
        TensorSharding(((), ("tp", "dp"))),
        TensorSharding((("dp",), ("tp",))),
        TensorSharding((("dp",), ()), ("tp",)),
        TensorSharding((), ("tp", "dp")),
    ],
)
def test_tensor_sharding_round_trip(ts):
    named = NamedSharding.from_tensor_sharding(MESH, ts)
    assert named.to_tensor_sharding(ts.rank) == ts
    assert NamedSharding.from_tensor_sharding(MESH, named.to_tensor_sharding(ts.rank)) == named


def test_equality_ignores_trailing_none():
    a, b = NamedSharding(MESH, P("tp")), NamedSharding(MESH, P("tp", None, None))
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert NamedSharding(MESH, P()) == NamedSharding(MESH, P(None))
    assert a != NamedSharding(MESH, P(None, "tp"))
    assert a != NamedSharding(MESH, P("tp"), partial=("dp",))
    assert a != NamedSharding(Mesh.create({"dp": 2, "tp": 4}, devices="cpu:8"), P("dp"))
    assert a != P("tp")


def test_pickle_rebuilds_instead_of_copying_cached_hashes():
    import pickle

    s = NamedSharding(MESH, P(None, ("dp", "tp")), partial=())
    data = pickle.dumps(s)
    assert b"_hash" not in data and b"_key" not in data  # str hashes differ between processes
    assert pickle.loads(data) == s and hash(pickle.loads(data)) == hash(s)


def test_from_tensor_sharding_drops_trailing_none():
    ts = TensorSharding((("tp",), (), ()))
    assert NamedSharding.from_tensor_sharding(MESH, ts).spec == P("tp")
    with pytest.raises(ValueError, match="unknown mesh axis 'pp'"):
        NamedSharding.from_tensor_sharding(MESH, TensorSharding((("pp",),)))


def test_shard_shape_uneven():
    s = NamedSharding(MESH, P("tp", "dp"))
    assert s.shard_shape((10, 17, 3)) == (3, 9, 3)
    assert s.shard_index((10, 17, 3), 7) == (slice(9, 10), slice(9, 17), slice(0, 3))
    with pytest.raises(ValueError, match="global_shape: P\\('tp', 'dp'\\) has 2 entries"):
        s.shard_shape((10,))


def test_is_replicated():
    assert NamedSharding(MESH, P()).is_replicated
    assert NamedSharding.replicated(MESH).is_replicated
    assert NamedSharding(MESH, P(None, None)).is_replicated
    assert not NamedSharding(MESH, P(None, "tp")).is_replicated
    assert not NamedSharding(MESH, P(), partial=("dp",)).is_replicated
    one = Mesh.create({"a": 1, "b": 2}, devices="cpu:2")
    assert NamedSharding(one, P("a")).is_replicated
