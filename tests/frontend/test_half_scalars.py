"""Python-float multipliers and divisors of 16-bit tensors act unrounded, as in PyTorch eager."""

import math

import pytest
import torch

import spmd
from spmd import PartitionSpec as P

FNS = {
    "mul": lambda a: a * 1.7,
    "rmul": lambda a: 1.1 * a,
    "scale": lambda a: a * (1 / math.sqrt(96)),
    "div": lambda a: a / 3.3,
    "exact": lambda a: a * 0.5 + 2.0,  # representable: no float32 round trip needed
    "add": lambda a: a + 0.1,
    "rsub": lambda a: 1.3 - a,
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(FNS))
def test_bit_equal_to_eager(name, dtype):
    fn = FNS[name]
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = spmd.jit(fn, mesh=mesh, in_shardings=P("tp"), out_shardings=P("tp"))(x).to_torch()
    assert got.dtype == dtype and torch.equal(got, fn(x))


def test_the_scale_is_computed_in_float32():
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    low = spmd.jit(FNS["mul"], mesh=mesh, in_shardings=P("tp"), out_shardings=P("tp")).lower(
        torch.randn(4, 8, dtype=torch.bfloat16))
    text = low.as_text("import")
    assert "f32[] constant(1.7" in text and "bf16[4,8] convert(" in text
