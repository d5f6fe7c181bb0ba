import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spmd.array import DeletedArrayError, Shard, ShardedArray, device_put
from spmd.mesh import Mesh
from spmd.sharding import NamedSharding, P

MESHES = [
    Mesh.create("x", devices="cpu:1"),
    Mesh.create("x", devices="cpu:2"),
    Mesh.create("x", devices="cpu:4"),
    Mesh.create("x", devices="cpu:8"),
    Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4"),
    Mesh.create({"dp": 2, "tp": 4}, devices="cpu:8"),
    Mesh.create({"a": 2, "b": 3}, devices="cpu:6"),
]


@st.composite
def sharded_case(draw):
    """(mesh, NamedSharding, global shape): each mesh axis unused, partial, or on a dim, uneven dims allowed."""
    mesh = draw(st.sampled_from(MESHES))
    rank = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=rank, max_size=rank)))
    axes = list(draw(st.permutations(mesh.axis_names)))
    dims: list[list[str]] = [[] for _ in range(rank)]
    partial = []
    for a in axes:
        place = draw(st.integers(-1, rank))
        if place == rank:
            partial.append(a)
        elif place >= 0:
            dims[place].append(a)
    n_entries = draw(st.integers(max((i + 1 for i, d in enumerate(dims) if d), default=0), rank))
    spec = P(*(tuple(d) or None for d in dims[:n_entries]))
    return mesh, NamedSharding(mesh, spec, tuple(partial)), shape


def _random(shape, dtype=torch.float32):
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(-100, 100, shape, dtype=dtype)


@settings(max_examples=300, deadline=None)
@given(sharded_case(), st.sampled_from([torch.float32, torch.float64, torch.int32]))
def test_device_put_to_torch_round_trip(case, dtype):
    mesh, sharding, shape = case
    x = _random(shape, dtype)
    a = device_put(x, sharding)
    assert a.shape == torch.Size(shape) and a.dtype == dtype and a.sharding is sharding
    padded = sharding.shard_shape(shape)
    assert len(a._buffers) == mesh.num_devices
    assert all(tuple(b.shape) == padded and b.dtype == dtype for b in a._buffers)
    y = a.to_torch()
    assert y.device.type == "cpu"
    assert torch.equal(y, x)
    # Shards cover the value: every device's view equals the global slice (for non-partial shardings).
    if not sharding.partial:
        for shard in a.shards:
            assert torch.equal(shard.data, x[shard.index])
    # Rebuilt from its unpadded shards, the array holds the same value.
    b = ShardedArray.from_shards([s.data.clone() for s in a.shards], sharding, shape)
    assert torch.equal(b.to_torch(), x)


def test_buffers_do_not_alias_the_input_or_each_other():
    mesh = Mesh.create("x", devices="cpu:4")
    x = torch.randn(8, 3)
    x0 = x.clone()
    a = device_put(x, NamedSharding(mesh, P("x")))
    r = device_put(x, NamedSharding(mesh, P()))
    x.add_(1.0)
    assert torch.equal(a.to_torch(), x0)
    r._buffers[0].zero_()
    assert torch.equal(r._buffers[1], x0)


def test_padding_is_zero_and_shards_are_unpadded_views():
    mesh = Mesh.create({"dp": 2, "tp": 4}, devices="cpu:8")
    x = torch.randn(6, 10)
    a = device_put(x, NamedSharding(mesh, P("tp", "dp")))
    assert a.sharding.shard_shape((6, 10)) == (2, 5)
    last = a.mesh.shape.partition_id({"dp": 1, "tp": 3})  # rows 6..8 of 6: empty, all padding
    assert a.shards[last].data.shape == (0, 5)
    assert torch.count_nonzero(a._buffers[last]) == 0
    s = a.shards[a.mesh.shape.partition_id({"dp": 1, "tp": 2})]
    assert isinstance(s, Shard) and s.index == (slice(4, 6), slice(5, 10)) and s.partition_id == 6
    assert s.data.data_ptr() == a._buffers[6].data_ptr()
    s.data.mul_(2)
    assert torch.equal(a.to_torch()[4:6, 5:10], 2 * x[4:6, 5:10])


def test_partial_puts_value_on_first_device_of_group():
    mesh = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")
    x = torch.randn(4, 6)
    a = device_put(x, NamedSharding(mesh, P(None, "tp"), partial=("dp",)))
    for pid in range(4):
        dp = mesh.shape.coords(pid)["dp"]
        assert (torch.count_nonzero(a._buffers[pid]) == 0) == (dp == 1)
    assert torch.allclose(a.to_torch(), x)


def test_metadata_and_repr():
    mesh = Mesh.create("tp", devices="cpu:4")
    a = device_put(torch.randn(8, 32), NamedSharding(mesh, P(None, "tp")))
    assert repr(a) == "ShardedArray(f32[8,32], NamedSharding(mesh={'tp': 4}, spec=P(None, 'tp')))"
    assert a.ndim == 2 and a.global_shape == torch.Size([8, 32])
    assert a.nbytes == 8 * 32 * 4
    assert a.addressable_devices == mesh.devices
    assert a.block_until_ready() is a
    b = device_put(torch.ones(3, dtype=torch.bfloat16), NamedSharding(mesh, P()))
    assert repr(b).startswith("ShardedArray(bf16[3],")


def test_device_put_errors_name_the_argument():
    mesh = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")
    with pytest.raises(ValueError, match=r"sharding: P\('dp', 'tp'\) has 2 entries but the array has 1 dims"):
        device_put(torch.randn(4), NamedSharding(mesh, P("dp", "tp")))
    with pytest.raises(TypeError, match="sharding: expected a NamedSharding"):
        device_put(torch.randn(4), P("dp"))
    with pytest.raises(TypeError, match="tensor: expected a torch.Tensor"):
        device_put([1.0, 2.0], NamedSharding(mesh, P()))


def test_from_shards_padded_buffers_are_taken_as_is():
    mesh = Mesh.create("x", devices="cpu:2")
    s = NamedSharding(mesh, P("x"))
    pieces = [torch.randn(3, 2), torch.randn(3, 2)]  # padded shape of a 5-row array
    a = ShardedArray.from_shards(pieces, s, (5, 2))
    assert a._buffers[0] is pieces[0]
    assert torch.equal(a.to_torch(), torch.cat([pieces[0], pieces[1][:2]]))


def test_from_shards_errors():
    mesh = Mesh.create("x", devices="cpu:2")
    s = NamedSharding(mesh, P("x"))
    good = [torch.randn(3, 2), torch.randn(2, 2)]
    with pytest.raises(ValueError, match=r"shards: expected 2 shards .* got 1"):
        ShardedArray.from_shards(good[:1], s, (5, 2))
    with pytest.raises(ValueError, match=r"shards\[1\]: expected shape \[2, 2\] \(unpadded\) or \[3, 2\] \(padded\), "
                                         r"got \[4, 2\]"):
        ShardedArray.from_shards([good[0], torch.randn(4, 2)], s, (5, 2))
    with pytest.raises(ValueError, match=r"shards\[1\]: expected dtype torch.float32 .* got torch.float64"):
        ShardedArray.from_shards([good[0], good[1].double()], s, (5, 2))
    with pytest.raises(ValueError, match=r"shards\[0\]: expected a tensor on cpu, got one on meta"):
        ShardedArray.from_shards([torch.empty(3, 2, device="meta"), good[1]], s, (5, 2))
    with pytest.raises(TypeError, match=r"shards\[1\]: expected a torch.Tensor"):
        ShardedArray.from_shards([good[0], [1.0]], s, (5, 2))
    with pytest.raises(ValueError, match="global_shape: expected a sequence of non-negative ints"):
        ShardedArray.from_shards(good, s, (5, -2))
    with pytest.raises(ValueError, match=r"sharding: P\('x'\) has 1 entries but the array has 0 dims"):
        ShardedArray.from_shards(good, s, ())


def test_deleted_and_donated_arrays_raise():
    mesh = Mesh.create("x", devices="cpu:2")
    a = device_put(torch.randn(4), NamedSharding(mesh, P("x")))
    a.delete(reason="donated to mlp_step")
    assert a.is_deleted and a._buffers is None
    for use in (a.to_torch, lambda: a.shards, a.block_until_ready, lambda: a.reshard(a.sharding)):
        with pytest.raises(DeletedArrayError, match=r"f32\[4\] was donated to mlp_step and can no longer be used"):
            use()
    assert isinstance(DeletedArrayError("x"), ValueError)
    assert "donated to mlp_step" in repr(a)
    a.delete()  # the first reason stays
    with pytest.raises(DeletedArrayError, match="donated to mlp_step"):
        a._check_alive("argument 0")
    b = device_put(torch.randn(4), NamedSharding(mesh, P()))
    b.delete()
    with pytest.raises(DeletedArrayError, match="to_torch: the ShardedArray f32\\[4\\] was deleted"):
        b.to_torch()


def test_from_buffers_is_unchecked_and_cheap():
    mesh = Mesh.create("x", devices="cpu:2")
    s = NamedSharding(mesh, P("x"))
    bufs = [torch.randn(2), torch.randn(2)]
    a = ShardedArray._from_buffers(bufs, s, (4,), torch.float32)
    assert a._buffers is bufs and a.shape == torch.Size([4]) and a._ready_events is None
    assert torch.equal(a.to_torch(), torch.cat(bufs))


class _Event:
    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_block_until_ready_waits_on_events():
    mesh = Mesh.create("x", devices="cpu:2")
    events = [_Event(), None]
    a = ShardedArray._from_buffers([torch.randn(2), torch.randn(2)], NamedSharding(mesh, P("x")), (4,),
                                   torch.float32, events)
    a.to_torch()
    assert events[0].waited == 1


def test_scalar_and_empty_arrays():
    mesh = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")
    x = torch.tensor(3.5)
    assert torch.equal(device_put(x, NamedSharding(mesh, P())).to_torch(), x)
    e = torch.randn(0, 5)
    a = device_put(e, NamedSharding(mesh, P("dp", "tp")))
    assert a.to_torch().shape == (0, 5) and a.nbytes == 0
    assert math.prod(a._buffers[0].shape) == 0


@pytest.mark.gpu(count=2)
def test_cuda_round_trip():
    mesh = Mesh.create({"dp": 1, "tp": 2}, devices="cuda:2")
    x = torch.randn(5, 7)
    a = device_put(x, NamedSharding(mesh, P(None, "tp")))
    assert a._buffers[1].device == torch.device("cuda", 1)
    assert torch.equal(a.to_torch(), x)
    b = ShardedArray.from_shards([s.data for s in a.shards], a.sharding, (5, 7))
    assert torch.equal(b.block_until_ready().to_torch(), x)
    with pytest.raises(ValueError, match="expected a tensor on cuda:1"):
        ShardedArray.from_shards([a.shards[0].data, a.shards[0].data], a.sharding, (5, 7))


def test_device_put_of_a_sparse_tensor_is_a_type_error():
    """It was a NotImplementedError ("Cannot access storage of SparseTensorImpl") from the placement."""
    s = NamedSharding(MESHES[1], P("x"))
    for t in (torch.eye(4).to_sparse(), torch.eye(4).to_sparse_csr()):
        with pytest.raises(TypeError, match=r"tensor: expected a dense \(torch.strided\) tensor, got layout"):
            device_put(t, s)
