"""Counters for kernels whose last program finishes the work (``spmd.runtime.semaphores``): fresh,
zeroed buffers per call inside a capture spmd opened, None inside anyone else's capture, one
zeroed buffer per stream outside captures (CUDA), and errors for a bad count."""

from __future__ import annotations

import pytest
import torch

from spmd.runtime import semaphores

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_count_below_one_is_a_value_error():
    with pytest.raises(ValueError, match="n: expected at least 1 counter, got 0"):
        semaphores.counters(torch.device("cpu"), 0)


def test_inside_a_scope_every_call_gets_its_own_buffer_zeroed_when_the_capture_ends(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with semaphores.capture_scope() as held:
        a = semaphores.counters(torch.device("cpu"), 3)
        b = semaphores.counters(torch.device("cpu"), 5)
        a.fill_(7)  # the capture's kernels would use them; they are zeroed only after it ends
        b.fill_(9)
        assert held == [a, b] and a.data_ptr() != b.data_ptr()
    assert a.shape == (3,) and a.dtype == torch.int32 and not a.any() and not b.any()
    assert semaphores._scopes() == []


def test_a_capture_without_a_scope_gets_none_and_a_failed_capture_zeroes_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert semaphores.counters(torch.device("cpu"), 4) is None
    with pytest.raises(RuntimeError, match="capture failed"), semaphores.capture_scope() as held:
        semaphores.counters(torch.device("cpu"), 2).fill_(1)
        raise RuntimeError("capture failed")
    assert held[0].tolist() == [1, 1] and semaphores._scopes() == []


@gpu
@needs_cuda
def test_outside_captures_one_zeroed_buffer_per_stream_grows_and_stays_zero():
    dev = torch.device("cuda", torch.cuda.current_device())
    a = semaphores.counters(dev, 4)
    assert a.is_cuda and a.shape == (4,) and not a.any()
    assert semaphores.counters(dev, 2).data_ptr() == a.data_ptr()  # the same stream: the same buffer
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        other = semaphores.counters(dev, 4)
    if side.cuda_stream != torch.cuda.current_stream(dev).cuda_stream:
        assert other.data_ptr() != a.data_ptr()
    big = semaphores.counters(dev, 10_000)
    assert big.numel() == 10_000 and not big.any()
