"""In-place updates as torch.export functionalizes them: slice / select / index assignment, copy_,
index_copy_, index_put_ (the KV-cache update at a device position), against PyTorch eager in float64."""

import pytest
import torch

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P
from spmd.frontend.torch_export import UnsupportedOpError, import_program
from tests.frontend.helpers import assert_close_tree, run_imported

F64 = torch.float64


def _slice_assign(x, y):
    x = x.clone()
    x[:, 2:6] = y
    return x


def _slice_assign_input(x, y):
    x[:, :4] = y
    return x


def _select_assign(x, y):
    x = x.clone()
    x[:, -2] = y[:, 0]
    return x


def _copy_into_view(x, y):
    x = x.clone()
    x[1:3, :4].copy_(y[:2])
    return x


def _strided_assign(x, y):
    x = x.clone()
    x[:, 1:7:2] = y[:, :3]
    return x


def _mask_assign(x, y):
    x = x.clone()
    x[x > 0] = 3.0
    return x


def _mask_assign_inner(x, y):
    x = x.clone()
    x[:, x[0] > 0] = -1.0
    return x


def _zero_slice(x, y):
    x = x.clone()
    x[:, :2].zero_()
    return x


@pytest.mark.parametrize("fn", [_slice_assign, _slice_assign_input, _select_assign, _copy_into_view,
                                _strided_assign, _mask_assign, _mask_assign_inner, _zero_slice])
def test_slice_updates_match_eager(fn):
    x, y = torch.randn(4, 8, dtype=F64), torch.randn(4, 4, dtype=F64)
    want = fn(x.clone(), y)
    prog, got = run_imported(fn, (x.clone(), y))
    assert_close_tree(got, want)
    assert ("scatter" in {i.opcode for i in prog.module.entry.instructions}) == (fn is _strided_assign)


def _kv_index_put(cache, pos, k):
    cache = cache.clone()
    cache[:, :, pos.reshape(1)] = k.unsqueeze(2)
    return cache


def _kv_index_copy(cache, pos, k):
    cache.index_copy_(2, pos.reshape(1), k.unsqueeze(2))
    return cache


def _kv_aten_index_put(cache, pos, k):
    return torch.ops.aten.index_put_(cache, [None, None, pos], k)


@pytest.mark.parametrize("fn", [_kv_index_put, _kv_index_copy, _kv_aten_index_put])
@pytest.mark.parametrize("pos", [0, 4, 9, -1])
def test_kv_cache_update_is_one_dynamic_update_slice(fn, pos):
    if pos < 0 and fn is _kv_index_copy:
        pytest.skip("index_copy_ rejects negative positions in eager")
    cache, k = torch.randn(2, 3, 10, 5, dtype=F64), torch.randn(2, 3, 5, dtype=F64)
    p = torch.tensor(pos)
    want = fn(cache.clone(), p, k)
    prog, got = run_imported(fn, (cache.clone(), p, k))
    assert_close_tree(got, want)
    ops = [i.opcode for i in prog.module.entry.instructions]
    assert ops.count("dynamic-update-slice") == 1 and "scatter" not in ops, ops


MESHES = [({"tp": 1}, P(None, "tp")), ({"tp": 2}, P(None, "tp")), ({"tp": 4}, P(None, "tp")),
          ({"tp": 2}, P(None, None, "tp")), ({"dp": 2, "tp": 2}, P("dp", "tp"))]


@pytest.mark.parametrize("axes, spec", MESHES)
@pytest.mark.parametrize("donate", [False, True])
def test_kv_cache_update_on_meshes(axes, spec, donate):
    """Heads (3, uneven over 2 and 4), sequence or batch and heads sharded; the position is an input."""
    n = 1
    for v in axes.values():
        n *= v
    mesh = Mesh.create(axes, devices=f"cpu:{n}")
    f = spmd.jit(_kv_aten_index_put, mesh=mesh, in_shardings=(spec, P(), P()), out_shardings=spec,
                 donate_argnums=(0,) if donate else ())
    for pos in (3, 9):
        cache, k = torch.randn(2, 3, 10, 5, dtype=F64), torch.randn(2, 3, 5, dtype=F64)
        want = _kv_aten_index_put(cache.clone(), torch.tensor(pos), k)
        got = f(cache, torch.tensor(pos), k).to_torch()
        torch.testing.assert_close(got, want)


def test_unreturned_input_update_is_a_clear_error():
    def f(x, y):
        x[:, :4] = y
        return x * 2

    with pytest.raises(UnsupportedOpError, match=r"updated in place .*test_aten_update_ops.py:\d+.* not returned"):
        import_program(f, (torch.randn(4, 8), torch.randn(4, 4)))


def test_buffer_update_is_a_clear_error():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("steps", torch.zeros(3))

        def forward(self, x):
            self.steps.add_(1)
            return x + self.steps

    with pytest.raises(UnsupportedOpError, match="buffer steps is updated in place"):
        import_program(Counter(), (torch.randn(3),))


def test_jit_returns_the_update_and_leaves_the_argument():
    mesh = Mesh.create(("tp",), devices="cpu:2")
    f = spmd.jit(_slice_assign_input, mesh=mesh, in_shardings=(P("tp"), P()), out_shardings=P("tp"))
    x, y = torch.randn(4, 8, dtype=F64), torch.randn(4, 4, dtype=F64)
    before = x.clone()
    got = f(x, y).to_torch()
    torch.testing.assert_close(got, _slice_assign_input(x.clone(), y))
    torch.testing.assert_close(x, before)


def test_zero_d_tensor_index_names_the_device_friendly_spellings():
    def f(cache, pos, k):
        cache = cache.clone()
        cache[:, :, pos] = k
        return cache

    mesh = Mesh.create(("tp",), devices="cpu:1")
    g = spmd.jit(f, mesh=mesh, in_shardings=(P(), P(), P()), out_shardings=P())
    with pytest.raises(ValueError, match=r"pos.reshape\(1\).* at .*test_aten_update_ops.py:\d+"):
        g(torch.randn(2, 3, 10, 5), torch.tensor(4), torch.randn(2, 3, 5))


@pytest.mark.gpu
def test_kv_cache_decode_loop_on_gpus():
    """A donated KV cache sharded over heads, updated at a device position each step (CUDA graphs)."""
    mesh = Mesh.create(("tp",), devices="cuda")
    n = torch.cuda.device_count()
    f = spmd.jit(_kv_aten_index_put, mesh=mesh, in_shardings=(P(None, "tp"), P(), P(None, "tp")),
                 out_shardings=P(None, "tp"), donate_argnums=(0,))
    ref = torch.randn(2, 2 * n, 16, 8, dtype=F64)
    cache = spmd.device_put(ref.cuda(), spmd.NamedSharding(mesh, P(None, "tp")))
    for pos in range(5):
        k = torch.randn(2, 2 * n, 8, dtype=F64)
        ref[:, :, pos] = k
        cache = f(cache, torch.tensor(pos).cuda(), k.cuda())
    torch.testing.assert_close(cache.to_torch().cpu(), ref)


def test_kv_cache_sharded_over_the_sequence_needs_no_collective():
    mesh = Mesh.create(("tp",), devices="cpu:4")
    spec = P(None, None, "tp")
    f = spmd.jit(_kv_aten_index_put, mesh=mesh, in_shardings=(spec, P(), P()), out_shardings=spec,
                 donate_argnums=(0,))
    cache, k = torch.randn(2, 3, 10, 5, dtype=F64), torch.randn(2, 3, 5, dtype=F64)
    assert f.lower(cache, torch.tensor(7), k).compile().collectives() == []


def test_slice_assignment_into_one_row_shards():
    """Regression (random-program sweep): ``v[:, 0:1] = 1.5`` with v [6, 2, 1] split over 2 devices on dim 1."""
    def f(x):
        v = x.clone()
        v[:, 0:1] = 1.5
        return v

    mesh = Mesh.create(("tp",), devices="cpu:2")
    x = torch.randn(6, 2, 1, dtype=F64)
    g = spmd.jit(f, mesh=mesh, in_shardings=(P(None, "tp"),), out_shardings=P())
    torch.testing.assert_close(g(x).to_torch(), f(x))


def test_a_float_or_byte_index_is_rejected_as_eager_rejects_it():
    # the report: a float position 2.7 wrote slot 2, where eager raises "Expected a long tensor for index"
    mesh = Mesh.create({"tp": 2}, devices="cpu:2")
    h = spmd.jit(lambda c, p, k: c.index_copy_(1, p.reshape(1), k.unsqueeze(1)), mesh=mesh,
                 in_shardings=(P("tp"), P(), P("tp")), out_shardings=P("tp"))
    for pos, dtype in ((torch.tensor(2.7), "float32"), (torch.tensor(2, dtype=torch.int32), "int32")):
        with pytest.raises(TypeError, match=r"aten.index_copy.default at .*test_aten_update_ops.py:\d+: expected an "
                                            rf"integer \(int64\) index tensor, got {dtype}"):
            h(torch.zeros(2, 8), pos, torch.ones(2))
    out = h(torch.zeros(2, 8), torch.tensor(2), torch.ones(2)).to_torch()
    assert torch.equal(out, torch.zeros(2, 8).index_copy_(1, torch.tensor([2]), torch.ones(2, 1)))

    def put(x, i):
        x = x.clone()
        x[:, i] = 1.0
        return x

    for i in (torch.tensor([1.0, 2.0]), torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.uint8)):
        # (uint8 is a mask to eager; the converter read it as positions)
        with pytest.raises(TypeError, match=r"aten.index_put.default at .*: expected an integer "
                                            r"\(int64/int32/bool\) index tensor, got (float32|uint8)"):
            import_program(put, (torch.zeros(4, 8), i))
    x, i = torch.zeros(4, 8, dtype=torch.float64), torch.tensor([1, 6], dtype=torch.int32)
    assert_close_tree(run_imported(put, (x, i))[1], put(x, i))
