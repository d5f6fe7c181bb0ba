"""``ShardedArray.reshard``: every pair of shardings of a 2-d mesh on device, partial sources,
programs made only of collectives and local slicing, errors, ownership, a reduce-scatter stress."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

import spmd
from spmd import Mesh, NamedSharding, ShardedArray, metrics
from spmd import PartitionSpec as P
from spmd.reshard import resharder

MESH2D = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")
_ENTRIES = [None, "dp", "tp", ("dp", "tp"), ("tp", "dp")]


def _all_specs_2d() -> list[P]:
    """Every spec of a 2-d array over (dp, tp): each axis at most once, both axes on one dim included."""
    out = []
    for a, b in itertools.product(_ENTRIES, _ENTRIES):
        used = [x for e in (a, b) if e for x in ((e,) if isinstance(e, str) else e)]
        if len(used) == len(set(used)):
            out.append(P(a, b))
    return out


SPECS = _all_specs_2d()
# Data movement allowed in a reshard program: collectives, local slicing and padding.
# Anything else must be scalar index arithmetic (partition-id -> offsets).
_MOVES = {"parameter", "all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute",
          "all-gather-start", "all-gather-done", "all-reduce-start", "all-reduce-done", "collective-permute-start",
          "collective-permute-done", "slice", "dynamic-slice", "pad", "reshape", "transpose", "copy", "bitcast",
          "concatenate", "tuple", "get-tuple-element"}


def _only_collectives_and_slicing(compiled) -> None:
    for inst in compiled.module.entry.instructions:
        if inst.opcode in _MOVES:
            continue
        assert not inst.shape.is_tuple and inst.shape.rank == 0, f"{inst.opcode} moves data: {inst}"


def test_there_are_eleven_specs():
    assert len(SPECS) == 11 and P(("dp", "tp"), None) in SPECS and P("tp", "dp") in SPECS


@pytest.mark.parametrize("shape", [(4, 8), (5, 3)], ids=["even", "uneven"])
def test_reshard_every_pair_of_shardings(shape):
    x = torch.randn(shape)
    before = metrics.counter("reshards").value
    moved = 0
    for src, dst in itertools.product(SPECS, SPECS):
        a = spmd.device_put(x, NamedSharding(MESH2D, src))
        r = a.reshard(NamedSharding(MESH2D, dst))
        assert r.sharding == NamedSharding(MESH2D, dst) and r.shape == shape
        assert torch.equal(r.to_torch(), x), (src, dst)
        assert torch.equal(a.to_torch(), x), (src, dst)  # the source is unchanged
        if src != dst:
            moved += 1
            _only_collectives_and_slicing(resharder(a.sharding, r.sharding, shape, x.dtype))
    assert metrics.counter("reshards").value - before == moved == 110


@pytest.mark.parametrize("partial", [("dp",), ("tp",), ("dp", "tp")])
def test_reshard_from_partial_sums_on_device(partial):
    src = NamedSharding(MESH2D, P(), partial)
    base = [torch.randn(6, 5) for _ in range(4)]
    # Replicas (devices that differ only in non-partial axes) hold equal addends.
    addends = [base[MESH2D.shape.axis_index(pid, partial)] for pid in range(4)]
    want = sum(base[: MESH2D.shape.axes_size(partial)])
    a = ShardedArray.from_shards(addends, src, (6, 5))
    torch.testing.assert_close(a.to_torch(), want)
    for dst in (P(), P("dp"), P(None, "tp"), P(("tp", "dp"))):
        r = a.reshard(NamedSharding(MESH2D, dst))
        torch.testing.assert_close(r.to_torch(), want, rtol=1e-6, atol=1e-6)
        c = resharder(src, r.sharding, (6, 5), torch.float32)
        _only_collectives_and_slicing(c)
        assert {k["opcode"] for k in c.collectives()} & {"all-reduce", "reduce-scatter"}


def test_same_sharding_returns_the_array_itself():
    a = spmd.device_put(torch.randn(4, 4), NamedSharding(MESH2D, P("dp")))
    assert a.reshard(NamedSharding(MESH2D, P("dp", None))) is a


def test_reshard_programs_are_compiled_once():
    x = torch.randn(4, 6)
    a = spmd.device_put(x, NamedSharding(MESH2D, P("dp", "tp")))
    a.reshard(NamedSharding(MESH2D, P(None, "dp")))
    misses = metrics.counter("compile_cache.miss").value
    c1 = resharder(a.sharding, NamedSharding(MESH2D, P(None, "dp")), (4, 6), torch.float32)
    for _ in range(3):
        r = spmd.device_put(torch.randn(4, 6), a.sharding).reshard(NamedSharding(MESH2D, P(None, "dp")))
    assert metrics.counter("compile_cache.miss").value == misses
    assert resharder(a.sharding, r.sharding, (4, 6), torch.float32) is c1


def test_reshard_errors():
    a = spmd.device_put(torch.randn(4, 4), NamedSharding(MESH2D, P("dp")))
    other = Mesh.create(("x",), devices="cpu:4")
    with pytest.raises(ValueError, match=r"sharding: expected a sharding on the array's mesh .*'dp': 2.*, got "
                                         r"Mesh\(\{'x': 4\}.*spmd.device_put\(array.to_torch\(\), sharding\)"):
        a.reshard(NamedSharding(other, P("x")))
    with pytest.raises(TypeError, match=r"sharding: expected an spmd.NamedSharding, got PartitionSpec"):
        a.reshard(P("tp"))
    with pytest.raises(ValueError, match=r"sharding: P\(None, None, 'tp'\) has 3 entries but the array has 2 dims"):
        a.reshard(NamedSharding(MESH2D, P(None, None, "tp")))
    with pytest.raises(ValueError, match=r"sharding: expected a sharding without partial axes, got partial=\('tp',\)"):
        a.reshard(NamedSharding(MESH2D, P("dp"), ("tp",)))


def test_shards_alias_buffers_and_from_shards_takes_padded_buffers():
    """Ownership: ``shards`` are views of the array's buffers; ``from_shards`` adopts padded tensors."""
    x = torch.randn(5, 4)
    a = spmd.device_put(x, NamedSharding(MESH2D, P("dp")))
    shards = a.shards
    assert [s.data.data_ptr() for s in shards] == [b.data_ptr() for b in a._buffers]
    assert shards[2].index == (slice(3, 5), slice(0, 4)) and shards[2].data.shape == (2, 4)
    padded = [torch.randn(3, 4) for _ in range(4)]
    b = ShardedArray.from_shards(padded, NamedSharding(MESH2D, P("dp")), (5, 4))
    assert [t.data_ptr() for t in padded] == [t.data_ptr() for t in b._buffers]
    r = b.reshard(NamedSharding(MESH2D, P("tp")))
    assert set(t.data_ptr() for t in r._buffers).isdisjoint(t.data_ptr() for t in padded)


def test_reduce_scatter_stress_4mib_chunks():
    """Partial over tp (4 devices) -> split over tp: a reduce-scatter of 4 MiB float64 chunks, 30 times."""
    mesh = Mesh.create(("tp",), devices="cpu:4")
    rows, cols = 4 * 512, 1024  # each device's chunk: 512 x 1024 float64 = 4 MiB
    src = NamedSharding(mesh, P(), ("tp",))
    dst = NamedSharding(mesh, P("tp"))
    c = resharder(src, dst, (rows, cols), torch.float64)
    assert [k["opcode"] for k in c.collectives()] == ["reduce-scatter"]
    chunk_bytes = rows // 4 * cols * 8
    assert chunk_bytes >= 4 * 2**20
    g = torch.Generator().manual_seed(1234)
    # Small integers: the sum is exact whatever the reduction order.
    base = [torch.randint(-1000, 1000, (rows, cols), generator=g).to(torch.float64) for _ in range(4)]
    want = base[0] + base[1] + base[2] + base[3]
    start = time.perf_counter()
    for rep in range(30):
        base[rep % 4].add_(rep + 1)  # fresh values every repetition
        want.add_(rep + 1)
        out = c.execute_sharded([ShardedArray.from_shards(base, src, (rows, cols))])[0]
        for pid, shard in enumerate(out.shards):
            assert torch.equal(shard.data, want[pid * (rows // 4):(pid + 1) * (rows // 4)]), rep
    assert time.perf_counter() - start < 60
