"""The generated dynamic-update-slice kernel: values, clamping, in-place writes, the compile policy."""

from __future__ import annotations

import shutil

import pytest
import torch

from spmd.runtime import kernels_dus as kd
from spmd.runtime import kernels_fusion as kf


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(kd, "_cache", {})


def _reference(x, dim, start, update):
    n, size = x.shape[dim], update.shape[dim]
    s = min(max(int(start), 0), n - size)
    r = x.clone()
    r.narrow(dim, s, size).copy_(update)
    return r


def test_eager_policy_leaves_the_write_to_the_caller(monkeypatch, fresh_cache):
    monkeypatch.setenv(kf.COMPILER_ENV, "eager")
    x = torch.randn(2, 4, 10, 8)
    assert not kd.write_rows(x, 2, torch.tensor(3), torch.randn(2, 4, 1, 8)) and kd._cache == {}


def test_graphs_policy_compiles_only_for_captured_calls(monkeypatch, fresh_cache):
    monkeypatch.setattr(kf, "fusion_compiler", lambda device: "graphs")
    monkeypatch.setattr(kd, "_compile", lambda *a: pytest.fail("compiled outside a graph warm-up"))
    assert not kd.write_rows(torch.randn(3, 10), 1, torch.tensor(2), torch.randn(3, 1))


def test_a_failed_compile_is_remembered_and_falls_back(monkeypatch, fresh_cache):
    monkeypatch.setenv(kf.COMPILER_ENV, "inductor")
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(torch._inductor, "compile", failing)
    x, upd, s = torch.randn(3, 10), torch.randn(3, 1), torch.tensor(2)
    before = x.clone()
    assert not kd.write_rows(x, 1, s, upd) and not kd.write_rows(x, 1, s, upd)
    assert calls == [1] and torch.equal(x, before)


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("g++"), reason="Inductor on CPU needs a C++ compiler")
@pytest.mark.parametrize("start", [3, -4, 99])
@pytest.mark.parametrize("size", [1, 3])
def test_inductor_writes_clamped_rows_in_place(monkeypatch, fresh_cache, start, size):
    monkeypatch.setenv(kf.COMPILER_ENV, "inductor")
    x = torch.randn(2, 4, 10, 8)
    update = torch.randn(2, 4, 8, size).transpose(2, 3)  # a strided update, as a transposed projection
    want = _reference(x, 2, torch.tensor(start), update)
    ptr = x.data_ptr()
    assert kd.write_rows(x, 2, torch.tensor(start), update)
    assert x.data_ptr() == ptr and torch.equal(x, want)
