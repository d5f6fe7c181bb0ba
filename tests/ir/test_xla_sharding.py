import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spmd.ir.sharding import MeshShape, TensorSharding
from spmd.ir.xla_sharding import XlaSharding, from_xla_text, to_xla_text

MESH_4 = MeshShape(("tp",), (4,))
MESH_2x2 = MeshShape(("dp", "tp"), (2, 2))
MESH_2x4 = MeshShape(("dp", "tp"), (2, 4))


@pytest.mark.parametrize(
    "text, kind, tile_dims, devices, last",
    [
        ("{replicated}", "replicated", (), (), ()),
        ("{maximal device=3}", "maximal", (), (), ()),
        ("{devices=[2,1]1,0}", "tiled", (2, 1), (1, 0), ()),
        ("{devices=[2,2]0,3,1,2}", "tiled", (2, 2), (0, 3, 1, 2), ()),
        ("{devices=[2,1,2]3,1,2,0 last_tile_dim_replicate}", "tiled", (2, 1, 2), (3, 1, 2, 0), ("replicated",)),
        ("{devices=[4,2]<=[8]}", "tiled", (4, 2), tuple(range(8)), ()),
        ("{devices=[2,4]<=[4,2]T(1,0)}", "tiled", (2, 4), (0, 2, 4, 6, 1, 3, 5, 7), ()),
        ("{devices=[2,2,2]<=[2,2,2]T(2,1,0)}", "tiled", (2, 2, 2), (0, 4, 2, 6, 1, 5, 3, 7), ()),
        ("{devices=[1,1,4]<=[4] last_tile_dims={partial}}", "tiled", (1, 1, 4), (0, 1, 2, 3), ("partial",)),
        (
            "{devices=[1,2,2]<=[2,2]T(1,0) last_tile_dims={partial, replicated}}",
            "tiled", (1, 2, 2), (0, 2, 1, 3), ("partial", "replicated"),
        ),
    ],
)
def test_parse_and_print_round_trip(text, kind, tile_dims, devices, last):
    xs = XlaSharding.parse(text)
    assert (xs.kind, xs.tile_dims, xs.devices, xs.last_tile_dims) == (kind, tile_dims, devices, last)
    assert str(xs) == text
    assert XlaSharding.parse(str(xs)) == xs


@pytest.mark.parametrize(
    "explicit, printed",
    [
        ("{devices=[2,1]0,1}", "{devices=[2,1]<=[2]}"),
        ("{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}", "{devices=[2,1,2]<=[4] last_tile_dim_replicate}"),
        ("{devices=[2,4]0,2,4,6,1,3,5,7}", "{devices=[2,4]<=[4,2]T(1,0)}"),
        # Dims adjacent through the transpose merge, as XLA canonicalizes iota tile assignments.
        ("{devices=[2,2,2]<=[2,2,2]T(2,0,1)}", "{devices=[2,2,2]<=[4,2]T(1,0)}"),
        ("{devices=[2,2,2]<=[2,2,2]T(0,1,2)}", "{devices=[2,2,2]<=[8]}"),
        ("{devices=[3,2]0,3,1,4,2,5}", "{devices=[3,2]<=[2,3]T(1,0)}"),
        ("{devices=[1,1]0}", "{devices=[1,1]<=[1]}"),
    ],
)
def test_explicit_iota_lists_print_as_iota(explicit, printed):
    assert str(XlaSharding.parse(explicit)) == printed
    assert XlaSharding.parse(printed).devices == XlaSharding.parse(explicit).devices


def test_parse_tolerates_spaces_and_metadata():
    xs = XlaSharding.parse(" {devices=[2, 2]0, 1, 2, 3 metadata={op_name=\"x\"}} ")
    assert xs.tile_dims == (2, 2) and xs.devices == (0, 1, 2, 3)


@pytest.mark.parametrize(
    "bad, match",
    [
        ("replicated", "expected '{...}'"),
        ("{manual}", "expected {replicated}"),
        ("{devices=[2,2]0,1,2}", "need 4 devices, got 3"),
        ("{devices=[2]0,0}", "permutation"),
        ("{devices=[2,2]<=[4] last_tile_dims={manual}}", "unsupported suffix"),
        ("{devices=[4]<=[2,2]T(0,0)}", "not a permutation"),
        ("{devices=[2,2]<=[4] last_tile_dims={replicated, partial}}", "subsequence"),
    ],
)
def test_parse_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        XlaSharding.parse(bad)


def test_value_checks():
    assert XlaSharding.maximal(2).device == 2
    assert XlaSharding.tiled((2, 2), (0, 1, 2, 3), ("replicated",)).last_tile_dim_replicate
    assert XlaSharding.tiled((2, 2), (0, 1, 2, 3), ("replicated",)).tensor_rank == 1
    with pytest.raises(ValueError, match="kind"):
        XlaSharding("sharded")
    with pytest.raises(ValueError, match="no tile assignment"):
        XlaSharding("replicated", tile_dims=(2,), devices=(0, 1))


@pytest.mark.parametrize(
    "ts, mesh, text",
    [
        (TensorSharding(((), ())), MESH_4, "{replicated}"),
        (TensorSharding(((), ("tp",))), MESH_4, "{devices=[1,4]<=[4]}"),
        (TensorSharding((("dp",), ("tp",))), MESH_2x4, "{devices=[2,4]<=[8]}"),
        (TensorSharding((("tp",), ("dp",))), MESH_2x4, "{devices=[4,2]<=[2,4]T(1,0)}"),
        (TensorSharding((("tp",), ())), MESH_2x4, "{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}"),
        (TensorSharding((("dp",), ())), MESH_2x4, "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"),
        (TensorSharding((("tp", "dp"),)), MESH_2x4, "{devices=[8]<=[2,4]T(1,0)}"),
        (TensorSharding(((), ()), ("tp",)), MESH_4, "{devices=[1,1,4]<=[4] last_tile_dims={partial}}"),
        (
            TensorSharding((("dp",), ()), ("tp",)),
            MESH_2x4,
            "{devices=[2,1,4]<=[8] last_tile_dims={partial}}",
        ),
        (
            TensorSharding(((), ()), ("tp",)),
            MESH_2x2,
            "{devices=[1,1,2,2]<=[2,2]T(1,0) last_tile_dims={partial, replicated}}",
        ),
    ],
)
def test_to_and_from_xla_text(ts, mesh, text):
    assert to_xla_text(ts, mesh) == text
    assert from_xla_text(text, mesh, ts.rank) == ts


def test_from_xla_text_explicit_list_and_rank():
    assert from_xla_text("{devices=[1,2,2]0,2,1,3}", MESH_2x2) == TensorSharding(((), ("tp",), ("dp",)))
    assert from_xla_text("{replicated}", MESH_2x2, rank=3) == TensorSharding.replicated(3)


def test_from_xla_text_errors():
    with pytest.raises(ValueError, match="maximal"):
        from_xla_text("{maximal device=0}", MESH_4, 2)
    with pytest.raises(ValueError, match="rank is needed"):
        from_xla_text("{replicated}", MESH_4)
    with pytest.raises(ValueError, match="covers 2 tensor dims, expected rank 3"):
        from_xla_text("{devices=[1,4]<=[4]}", MESH_4, 3)
    with pytest.raises(ValueError, match="uses 2 devices, expected the mesh's 4"):
        from_xla_text("{devices=[2,1]0,1}", MESH_4)
    with pytest.raises(ValueError, match="matches no assignment"):
        from_xla_text("{devices=[2,2]0,3,1,2}", MESH_2x2)
    with pytest.raises(ValueError, match="matches no assignment"):
        from_xla_text("{devices=[4]1,0,2,3}", MESH_4)
    with pytest.raises(ValueError, match="unknown mesh axis 'pp'"):
        to_xla_text(TensorSharding((("pp",),)), MESH_4)


def test_size_one_axes_are_not_named():
    mesh = MeshShape(("pp", "tp"), (1, 4))
    text = to_xla_text(TensorSharding((("pp",), ("tp",))), mesh)
    assert text == "{devices=[1,4]<=[4]}"
    assert from_xla_text(text, mesh) == TensorSharding(((), ("tp",)))


def _tensor_shardings(mesh: MeshShape, rank: int):
    """Every TensorSharding of ``rank`` dims on ``mesh`` (each axis: unused, partial, or on a dim, in any order)."""
    axes = mesh.axis_names
    for places in itertools.product(range(rank + 2), repeat=len(axes)):
        for order in itertools.permutations(axes):
            dims = [tuple(a for a in order if places[axes.index(a)] == d) for d in range(rank)]
            partial = tuple(a for a in order if places[axes.index(a)] == rank)
            yield TensorSharding(tuple(dims), partial)


@pytest.mark.parametrize("mesh", [MESH_4, MESH_2x2, MESH_2x4, MeshShape(("a", "b", "c"), (2, 3, 2))])
def test_round_trip_every_sharding(mesh):
    seen = set()
    for rank in (1, 2):
        for ts in _tensor_shardings(mesh, rank):
            text = to_xla_text(ts, mesh)
            assert from_xla_text(text, mesh, rank) == ts, text
            assert str(XlaSharding.parse(text)) == text
            seen.add(text)
    assert len(seen) > 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(2, 4), min_size=1, max_size=4), st.data())
def test_iota_detection_matches_transpose(reshape, data):
    perm = tuple(data.draw(st.permutations(range(len(reshape)))))
    n = len(list(itertools.product(*map(range, reshape))))
    xs = XlaSharding.parse(f"{{devices=[{n}]<=[{','.join(map(str, reshape))}]T({','.join(map(str, perm))})}}")
    printed = str(xs)
    assert "<=" in printed
    assert XlaSharding.parse(printed).devices == xs.devices
