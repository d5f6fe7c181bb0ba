"""softmax / log_softmax and scaled_dot_product_attention conversions on shapes at the edge, against PyTorch eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_and_log_softmax_of_a_0d_tensor(dtype):
    """Over the 0-d tensor itself (1 and 0, as eager): the softmax custom call's dim was taken
    modulo rank 0 (ZeroDivisionError) and log_softmax reduced dim 0 of a rank-0 operand."""
    mesh = Mesh.create(("x",), devices="cpu:2")
    x = torch.randn(()).to(dtype)
    fn = lambda t: (t.softmax(0), t.log_softmax(-1), torch.log_softmax(t, 0, dtype=torch.float32))  # noqa: E731
    got = spmd.jit(fn, mesh=mesh, in_shardings=(P(),), out_shardings=P())(x)
    for g, w in zip(got, fn(x), strict=True):
        g = g.to_torch()
        assert g.shape == () and g.dtype == w.dtype
        assert torch.equal(g, w)


def _r(*dims):
    return torch.randn(*dims, dtype=torch.float64)


SDPA_CASES = {
    # key / value with a batch (or head) dim of 1, or fewer dims: PyTorch broadcasts the leading dims
    "kv batch 1": ((_r(2, 4, 5, 8), _r(1, 4, 6, 8), _r(1, 4, 6, 8)), {}, (P("dp", "tp"), P(None, "tp"), P(None, "tp"))),
    "kv heads 1": ((_r(2, 4, 5, 8), _r(2, 1, 6, 8), _r(2, 1, 6, 8)), {}, (P("dp", "tp"), P("dp"), P("dp"))),
    "kv rank 3": ((_r(2, 4, 5, 8), _r(4, 6, 8), _r(4, 6, 8)), {"is_causal": True}, (P("dp", "tp"), P("tp"), P("tp"))),
    # grouped-query attention: 4 query heads over 2 kv heads
    "gqa": ((_r(2, 4, 5, 8), _r(2, 2, 6, 8), _r(2, 2, 6, 16)), {"enable_gqa": True}, (P("dp", "tp"),) * 3),
    "gqa causal": ((_r(3, 6, 5, 8), _r(3, 2, 5, 8), _r(3, 2, 5, 8)), {"enable_gqa": True, "is_causal": True},
                   (P("dp", "tp"),) * 3),
    "gqa kv batch 1, mask": ((_r(2, 4, 5, 8), _r(1, 2, 6, 8), _r(1, 2, 6, 8), _r(5, 6)), {"enable_gqa": True},
                             (P("dp", "tp"), P(), P(), P())),
}


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_broadcast_and_grouped_query_heads(case):
    """Leading dims broadcast and enable_gqa=True, on a dp x tp mesh (uneven: 3 batches, 6 heads
    over 2 x 2), equal to eager float64: broadcast k / v used to be read with q's leading dims
    (wrong values) and enable_gqa was an unsupported-op error."""
    args, kwargs, specs = SDPA_CASES[case]

    def fn(q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None, **kwargs)

    mesh = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")
    got = spmd.jit(fn, mesh=mesh, in_shardings=specs)(*args).to_torch()
    torch.testing.assert_close(got, fn(*args), rtol=1e-12, atol=1e-12)


def test_sdpa_key_and_value_of_different_lengths_are_a_clear_error():
    """Eager's CPU kernel does not check this (it reads past value's end); the converter refuses it."""
    q, k, v = _r(2, 2, 5, 8), _r(2, 2, 6, 8), _r(2, 2, 7, 8)
    with pytest.raises(ValueError, match="key and value must have the same sequence length"):
        spmd.jit(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                 mesh=Mesh.create(("dp",), devices="cpu:1"))(q, k, v)
