"""CUDA graphs with donated arguments on GPUs: the donated cache is updated in place by each replay.

The decode-shaped step of ``graph_programs.decode_step`` donates its cache and position; replays
must equal the eager executable (up to the rounding of the fused kernels graphs run), stage
nothing in the steady state (the outputs are the graph's static input buffers), and never
overwrite an output the caller still holds.
CPU versions: ``test_graphs_donation.py``. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from graph_programs import DECODE_SHAPES, compile_decode, counter, decode_step, under_graph_runner

import spmd
from spmd import metrics
from spmd.array import DeletedArrayError
from spmd.compiled import Compiled
from spmd.runtime.graphs import GraphRunner

STEPS = DECODE_SHAPES["cache"][2]  # positions 0 .. max_seq - 1 (index_copy needs them in range)


@pytest.fixture(autouse=True)
def _fresh_metrics():
    metrics.reset()
    torch.backends.cuda.matmul.allow_tf32 = False
    yield


def _counter(name: str) -> int:
    return counter(name)


def _graph(compiled, **opts) -> tuple[Compiled, GraphRunner]:
    return under_graph_runner(compiled, None, **opts)


def _inputs(compiled, seed: int):
    g = torch.Generator().manual_seed(seed)
    s = DECODE_SHAPES
    tensors = [torch.randn(s["cache"], generator=g), torch.tensor(0), torch.randn(s["x"], generator=g),
               torch.randn(s["w"], generator=g)]
    return tensors, [spmd.device_put(t, sh) for t, sh in zip(tensors, compiled.input_shardings, strict=True)]


def _run_decode(devices: str, steps: int, **opts):
    """``steps`` graph calls against eager calls on equal inputs; returns the runner, per-call staged copies."""
    compiled = compile_decode(devices)  # the plain executable (eager) ...
    c, runner = _graph(compiled, **opts)  # ... and the same one under a GraphRunner
    (cache_t, pos_t, x_t, w_t), (cache, pos, x, w) = _inputs(compiled, 0)
    _, (cache_e, pos_e, _, _) = _inputs(compiled, 0)
    staged = []
    for step in range(steps):
        before = runner.staged_copies
        out, new_pos, new_cache = c(cache, pos, x, w)
        staged.append(runner.staged_copies - before)
        out_e, pos_e, cache_e = compiled(cache_e, pos_e, x, w)
        with pytest.raises(DeletedArrayError):
            cache.to_torch()
        # graph replays run Inductor-generated fusions, eager calls the unfused kernels: equal up to rounding
        assert new_pos.to_torch().equal(pos_e.to_torch()), f"step {step}: pos differs from eager"
        for name, g, e in (("readout", out, out_e), ("cache", new_cache, cache_e)):
            torch.testing.assert_close(g.to_torch(), e.to_torch(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, k=step: f"step {k}: {n} differs from eager: {m}")
        cache, pos = new_cache, new_pos
        del out
        if step:
            bufs = runner.input_buffers()
            assert [t.data_ptr() for t in cache._buffers] == [t.data_ptr() for t in bufs[0]]
    ref = (None, pos_t, cache_t)
    for _ in range(steps):
        ref = decode_step(ref[2].double(), ref[1], x_t.double(), w_t.double())
    torch.testing.assert_close(cache.to_torch().double(), ref[2], rtol=1e-4, atol=1e-4)
    return runner, staged


@pytest.mark.gpu
@pytest.mark.parametrize("outputs", ["rotate", "clone"])
def test_decode_one_gpu_updates_the_cache_in_place(outputs):
    runner, staged = _run_decode("cuda:1", STEPS, outputs=outputs)
    assert runner.disabled_reason is None, runner.disabled_detail
    assert staged == [0, 2] + [0] * (STEPS - 2)  # cache and pos copied in once, at the first replay
    assert _counter("cuda_graphs.replay") == STEPS - 1 and _counter("cuda_graphs.eager_call.donated_buffer_held") == 0


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("split", [True, False])
def test_decode_two_gpus_updates_the_cache_in_place(split):
    runner, staged = _run_decode("cuda:2", STEPS, split_devices=split)
    assert runner.disabled_reason is None, runner.disabled_detail
    assert staged == [0, 4] + [0] * (STEPS - 2)
    assert _counter("cuda_graphs.replay") == STEPS - 1


@pytest.mark.gpu
def test_held_cache_output_is_never_overwritten():
    compiled = compile_decode("cuda:1")
    c, runner = _graph(compiled)
    _, (cache, pos, x, w) = _inputs(compiled, 1)
    for _ in range(3):
        _, pos, cache = c(cache, pos, x, w)
    kept, cache = cache, None
    kept_value = kept.to_torch().clone()
    other_t = torch.randn(DECODE_SHAPES["cache"])
    pos_now = pos.to_torch()
    out, pos, new = c(spmd.device_put(other_t, compiled.input_shardings[0]), pos, x, w)
    torch.cuda.synchronize()
    assert _counter("cuda_graphs.eager_call.donated_buffer_held") == 1
    assert kept.to_torch().equal(kept_value)
    want = decode_step(other_t, pos_now, x.to_torch(), w.to_torch())
    torch.testing.assert_close(new.to_torch(), want[2], rtol=1e-5, atol=1e-5)
    del kept
    replays = _counter("cuda_graphs.replay")
    cache_now, pos_now = new.to_torch(), pos.to_torch()
    out, pos, cache = c(new, pos, x, w)  # another tensor, the static buffer now free: copied in
    want = decode_step(cache_now, pos_now, x.to_torch(), w.to_torch())
    torch.testing.assert_close(cache.to_torch(), want[2], rtol=1e-5, atol=1e-5)
    assert _counter("cuda_graphs.replay") == replays + 1


@pytest.mark.gpu
def test_jit_default_runner_aliases_the_donated_cache():
    """``cuda_graphs=True`` through ``spmd.jit``: the compiled executable is a runner that stages nothing."""
    c = compile_decode("cuda:1", cuda_graphs=True)
    runner = c.executable
    assert isinstance(runner, GraphRunner)
    _, (cache, pos, x, w) = _inputs(c, 2)
    for _ in range(3):
        _, pos, cache = c(cache, pos, x, w)
    before = _counter("cuda_graphs.staged.bytes")
    for _ in range(4):
        _, pos, cache = c(cache, pos, x, w)
    assert _counter("cuda_graphs.staged.bytes") == before
