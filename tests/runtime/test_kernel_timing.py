"""Candidate timing as CUDA-graph replays with a cold L2 (``spmd.runtime.kernel_timing``): a call
that cannot be captured is dropped (None) and leaves the caller's stream current; the others get
a time. GPU only (the module times CUDA graphs)."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_uncapturable_calls_are_dropped_and_the_rest_timed():
    from spmd.runtime.kernel_timing import capture_each, cold_replay_us

    device = torch.device("cuda", 0)
    x = torch.randn(1024, 1024, device=device)
    out = torch.empty_like(x)

    def sync_inside():  # a call that fails during its capture
        raise RuntimeError("not capturable")

    caller = torch.cuda.current_stream(device)
    graphs = capture_each([lambda: torch.mul(x, 2, out=out), sync_inside, lambda: torch.add(x, 1, out=out)], device)
    assert graphs[0] is not None and graphs[1] is None and graphs[2] is not None
    assert torch.cuda.current_stream(device) == caller
    times = cold_replay_us(graphs, device, timed_rounds=3)
    assert times[1] is None and all(t is not None and 0 < t < math.inf for t in (times[0], times[2]))
    graphs[2].replay()
    torch.cuda.synchronize(device)
    assert torch.equal(out, x + 1)
