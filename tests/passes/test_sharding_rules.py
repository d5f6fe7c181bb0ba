"""sharding_rules: which ops a partial value passes through, checked end to end in 16-bit types."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P


def _bmm_rms_norm(a, b, w):
    v = torch.bmm(a, b)
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w


@pytest.mark.parametrize("devices", [2, 4, 8])
@pytest.mark.parametrize("last, bound", [(1, 2), (3, 4)])
def test_bf16_rms_norm_after_a_partial_bmm_is_as_accurate_as_eager(devices, last, bound):
    """The normalisation factor multiplies the all-reduced bmm, never the per-device partial
    products (in bf16 those round at the scale of each device's term: 26-440x eager's error
    over a last dim of size 1 before). The bound over eager's error leaves room for the bf16
    per-device partial sums of the bmm itself (each rounded once before the all-reduce)."""
    mesh = Mesh.create(("tp",), devices=f"cpu:{devices}")
    f = spmd.jit(_bmm_rms_norm, mesh=mesh, in_shardings=(P(None, None, "tp"), P(None, "tp", None), P()))
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(16, 16, 64, generator=g).bfloat16(), torch.randn(16, 64, last, generator=g).bfloat16(),
            torch.randn(last, generator=g).bfloat16()]
    reference = _bmm_rms_norm(*[t.double() for t in args])
    eager_error = (_bmm_rms_norm(*args).double() - reference).abs().max().item()
    got = f(*args).to_torch()
    assert got.dtype == torch.bfloat16
    assert (got.double() - reference).abs().max().item() <= bound * eager_error
