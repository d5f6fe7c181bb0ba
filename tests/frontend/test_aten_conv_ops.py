"""conv1d imported from torch.export, one device and through spmd.jit on CPU meshes (batch,
output-channel and input-channel shardings, uneven dims), against PyTorch eager in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P

from .helpers import assert_close_tree, run_imported


def _convs(x, w, b, wg):
    return (F.conv1d(x, w, b), F.conv1d(x, w, b, stride=2, padding=1), F.conv1d(x, w, padding="same", dilation=2),
            F.conv1d(x, w, padding="valid"), F.conv1d(x, wg, groups=2, stride=3), F.conv1d(x[0], w, b))


def _args():
    gen = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return r(5, 4, 11), r(6, 4, 3), r(6), r(6, 2, 2)


def test_conv1d_forms_on_one_device():
    args = _args()
    _, got = run_imported(_convs, args)
    assert_close_tree(got, _convs(*args), rtol=1e-12, atol=1e-12)


def test_gpt2_conv1d_module_is_addmm():
    w, b = torch.randn(8, 12, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    fn = lambda x: torch.addmm(b, x.view(-1, 8), w).view(2, 3, 12)  # noqa: E731  (HF transformers Conv1D)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    _, got = run_imported(fn, (x,))
    assert_close_tree(got, fn(x), rtol=1e-12, atol=1e-12)


LAYOUTS = [
    ("cpu:1", {"tp": 1}, (P(), P(), P(), P())),
    ("cpu:2", {"tp": 2}, (P(None, "tp"), P(None, "tp"), P(), P())),  # input channels: partial sums
    ("cpu:4", {"tp": 4}, (P("tp"), P(), P(), P())),  # batch 5 over 4 (uneven)
    ("cpu:2", {"tp": 2}, (P(), P("tp"), P("tp"), P("tp"))),  # output channels
    ("cpu:4", {"dp": 2, "tp": 2}, (P("dp", "tp"), P("tp", None), P("tp"), P())),
    ("cpu:4", {"dp": 2, "tp": 2}, (P("tp", "dp"), P(None, "dp"), P(), P(None, "tp"))),
]


@pytest.mark.parametrize("devices,axes,specs", LAYOUTS)
def test_conv1d_sharded(devices, axes, specs):
    args = _args()
    got = spmd.jit(_convs, mesh=Mesh.create(axes, devices=devices), in_shardings=specs)(*args)
    assert_close_tree([g.to_torch() for g in got], list(_convs(*args)), rtol=1e-12, atol=1e-12)


def test_mixed_dtypes_are_a_user_error():
    with pytest.raises(TypeError, match="dtype"):
        run_imported(lambda x, w: F.conv1d(x, w), (torch.randn(2, 4, 5), torch.randn(3, 4, 2, dtype=torch.float64)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_float32_conv1d_on_cuda_keeps_float32_precision(cuda_graphs):
    """cuDNN may pick a TF32 algorithm for a float32 conv by shape and layout; the conv1d kernel
    runs without TF32 (random tester on an H200: a [2, 12, 1] conv1d differed from float64 by 3e-4)."""
    mesh = Mesh.create(("tp",), devices="cuda:1")
    g = torch.Generator().manual_seed(54)
    x, w = torch.randn(2, 12, 1, generator=g), torch.randn(2, 12, 1, generator=g)
    f = spmd.jit(lambda x, w: F.conv1d(x, w), mesh=mesh, in_shardings=(P(), P()),
                 options=spmd.CompileOptions(cuda_graphs=cuda_graphs))
    exact = F.conv1d(x.double(), w.double())
    for _ in range(3):
        got = f(x, w).to_torch().cpu()
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
