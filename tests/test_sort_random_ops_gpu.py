"""argmax / topk / sort / cumsum / conv1d and random ops on one CUDA GPU (CUDA graphs on), against
PyTorch eager in float64 and against the same program on cpu:1 (random values)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P

pytestmark = pytest.mark.gpu


def _ops(x, w):
    v, i = torch.topk(x, 3, dim=-1)
    return (x.argmax(-1), *x.max(dim=0), v, i, *torch.sort(x, dim=1, descending=True, stable=True), x.cumsum(1),
            F.conv1d(x[None], w, padding=1))


def test_index_and_scan_ops_on_cuda_match_eager():
    x = (torch.randn(6, 40, dtype=torch.float64) * 2).round()  # ties
    x[2, 5] = float("nan")
    w = torch.randn(3, 6, 3, dtype=torch.float64)
    mesh = Mesh.create(("tp",), devices="cuda:1")
    f = spmd.jit(_ops, mesh=mesh)
    for _ in range(2):  # the second call replays the CUDA graph
        got = [o.to_torch().cpu() for o in f(x.cuda(), w.cuda())]
        for g, want in zip(got, _ops(x, w), strict=True):
            torch.testing.assert_close(g, want, equal_nan=True, rtol=1e-12, atol=1e-12)


def _random(x):
    return (torch.rand_like(x), torch.randn_like(x), torch.empty_like(x).exponential_(1),
            F.dropout(x, 0.3, training=True))


def test_random_values_equal_the_cpu_program_and_change_per_call():
    x = torch.randn(64, 33, dtype=torch.float64) + 3
    outs = {}
    for devices in ("cpu:1", "cuda:1"):
        f = spmd.jit(_random, mesh=Mesh.create(("tp",), devices=devices), in_shardings=P())
        torch.manual_seed(7)
        arg = x.cuda() if devices.startswith("cuda") else x
        outs[devices] = [[o.to_torch().cpu() for o in f(arg)] for _ in range(3)]
    for cpu_call, gpu_call in zip(outs["cpu:1"], outs["cuda:1"], strict=True):
        assert torch.equal(cpu_call[0], gpu_call[0]) and torch.equal(cpu_call[3] != 0, gpu_call[3] != 0)
        for a, b in zip(cpu_call, gpu_call, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    first, second = outs["cuda:1"][0], outs["cuda:1"][1]
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[3], second[3])
