"""CUDA-graph runner with donated arguments, on CPU meshes (``HostReplayBackend``).

A decode-shaped step donates its cache and position: the graph's static input buffers ARE the
outputs, so a replay updates them in place and the caller's next call stages nothing
(``spmd.runtime.graphs_donation``). GPU versions: ``test_graphs_donation_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from graph_programs import DECODE_SHAPES, compile_decode, counter, decode_step, under_graph_runner, unwrap

import spmd
from spmd import metrics
from spmd.array import DeletedArrayError, ShardedArray
from spmd.compiled import Compiled
from spmd.runtime import graphs
from spmd.runtime.graphs import GraphRunner, HostReplayBackend
from spmd.runtime.graphs_donation import aliased_outputs

STEPS = 7


@pytest.fixture(autouse=True)
def _fresh_metrics():
    metrics.reset()
    graphs._logged.clear()
    yield
    metrics.reset()


def _counter(name: str) -> int:
    return counter(name)


@pytest.fixture(scope="module", params=["cpu:1", "cpu:2"])
def decode_prog(request):
    return compile_decode(request.param)


def _graph(compiled, **opts) -> tuple[Compiled, GraphRunner]:
    return under_graph_runner(compiled, HostReplayBackend, **opts)


def _inputs(compiled, seed: int):
    g = torch.Generator().manual_seed(seed)
    s = DECODE_SHAPES
    tensors = [torch.randn(s["cache"], generator=g), torch.tensor(1), torch.randn(s["x"], generator=g),
               torch.randn(s["w"], generator=g)]
    arrays = [spmd.device_put(t, sh) for t, sh in zip(tensors, compiled.input_shardings, strict=True)]
    return tensors, arrays


def _reference(cache, pos, x, w):
    """``decode_step`` in float64 eager PyTorch."""
    out, pos, cache = decode_step(cache.double(), pos, x.double(), w.double())
    return out, pos, cache


def _check(got, want, what: str) -> None:
    for name, g, r in zip(("readout", "pos", "cache"), got, want, strict=True):
        torch.testing.assert_close(g.to_torch().double(), r.double(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


def test_program_records_which_outputs_are_written_into_donated_buffers(decode_prog):
    ex = unwrap(decode_prog.executable)
    assert aliased_outputs(ex._variant(frozenset({0, 1}))[0]) == {1: 1, 2: 0}
    assert aliased_outputs(ex._variant(frozenset({0}))[0]) == {2: 0}
    assert aliased_outputs(ex.program) == {}


@pytest.mark.parametrize("outputs", ["rotate", "clone"])
def test_decode_steps_update_the_static_buffers_in_place(decode_prog, outputs):
    c, runner = _graph(decode_prog, outputs=outputs)
    (cache_t, pos_t, x_t, w_t), (cache, pos, x, w) = _inputs(decode_prog, 0)
    ref = (None, pos_t, cache_t)
    staged = []
    for step in range(STEPS):
        before = runner.staged_copies
        out, new_pos, new_cache = c(cache, pos, x, w)
        staged.append(runner.staged_copies - before)
        ref = _reference(ref[2], ref[1], x_t, w_t)
        _check((out, new_pos, new_cache), ref, f"step {step}")
        for dead in (cache, pos):  # donated: dead, with a clear error
            with pytest.raises(DeletedArrayError, match="donated to decode_step"):
                dead.to_torch()
        cache, pos = new_cache, new_pos
        del out  # a held readout would keep its output set busy (a second set is captured then)
        if step:  # graph calls: the outputs are the donated static buffers
            bufs = runner.input_buffers()
            assert [t.data_ptr() for t in cache._buffers] == [t.data_ptr() for t in bufs[0]]
            assert [t.data_ptr() for t in pos._buffers] == [t.data_ptr() for t in bufs[1]]
    n = len(decode_prog.mesh.local_pids)
    # warm-up (eager), first graph call: cache and pos copied in once per device; then nothing
    assert staged == [0, 2 * n] + [0] * (STEPS - 2)
    assert _counter("cuda_graphs.staged.copies") == 2 * n
    bufs = runner.input_buffers()
    assert _counter("cuda_graphs.staged.bytes") == sum(t.nbytes for t in bufs[0] + bufs[1])
    assert _counter("cuda_graphs.replay") == STEPS - 1 and runner.num_captures == 1
    assert _counter("cuda_graphs.eager_call.donated_buffer_held") == 0
    assert x.to_torch().equal(x_t) and w.to_torch().equal(w_t)  # undonated inputs untouched


def test_fresh_undonated_inputs_are_still_staged(decode_prog):
    c, runner = _graph(decode_prog)
    (cache_t, pos_t, _, w_t), (cache, pos, _, w) = _inputs(decode_prog, 1)
    x_bytes = 0
    for step in range(STEPS):
        x_t = torch.randn(DECODE_SHAPES["x"])
        x = spmd.device_put(x_t, decode_prog.input_shardings[2])
        bytes_before = runner.staged_bytes
        out, new_pos, new_cache = c(cache, pos, x, w)
        want = _reference(cache_t, pos_t, x_t, w_t)
        _check((out, new_pos, new_cache), want, f"step {step}")
        cache_t, pos_t = want[2], want[1]
        cache, pos = new_cache, new_pos
        if step >= 2:  # steady state: only x is copied, never the cache
            x_bytes = sum(t.nbytes for t in x._buffers)
            assert runner.staged_bytes - bytes_before == x_bytes
    assert x_bytes > 0


def test_another_donated_tensor_is_copied_in_once(decode_prog):
    c, runner = _graph(decode_prog)
    (cache_t, pos_t, x_t, w_t), (cache, pos, x, w) = _inputs(decode_prog, 2)
    for _ in range(3):
        _, pos, cache = c(cache, pos, x, w)
    # the caller drops the cache output and donates a fresh one: copied into the static buffer
    other_t = torch.randn(DECODE_SHAPES["cache"])
    del cache
    cache = spmd.device_put(other_t, decode_prog.input_shardings[0])
    before = runner.staged_copies
    pos_now = pos.to_torch()
    out, pos, cache = c(cache, pos, x, w)
    _check((out, pos, cache), _reference(other_t, pos_now, x_t, w_t), "another cache")
    assert runner.staged_copies - before == len(decode_prog.mesh.local_pids)
    assert _counter("cuda_graphs.eager_call.donated_buffer_held") == 0
    before = runner.staged_copies
    c(cache, pos, x, w)
    assert runner.staged_copies == before


def test_held_output_is_never_overwritten(decode_prog):
    """Donating another tensor while the previous cache output is alive runs eagerly."""
    c, runner = _graph(decode_prog)
    (cache_t, pos_t, x_t, w_t), (cache, pos, x, w) = _inputs(decode_prog, 3)
    for _ in range(3):
        _, pos, cache = c(cache, pos, x, w)
    kept, cache = cache, None        # alive: holds the graph's static cache buffer
    kept_value = kept.to_torch().clone()
    view = kept._buffers[0][:, :1]   # a view keeps it held too
    other_t = torch.randn(DECODE_SHAPES["cache"])
    pos_now = pos.to_torch()
    replays = _counter("cuda_graphs.replay")
    out, pos, new = c(spmd.device_put(other_t, decode_prog.input_shardings[0]), pos, x, w)
    _check((out, pos, new), _reference(other_t, pos_now, x_t, w_t), "eager call")
    assert _counter("cuda_graphs.eager_call.donated_buffer_held") == 1
    assert _counter("cuda_graphs.replay") == replays
    assert kept.to_torch().equal(kept_value) and view.data_ptr() == kept._buffers[0].data_ptr()
    # the eager call's output is another tensor: donating it copies into the (now free) static buffer
    del kept, view
    pos_now, cache_now = pos.to_torch(), new.to_torch()
    out, pos, cache = c(new, pos, x, w)
    _check((out, pos, cache), _reference(cache_now, pos_now, x_t, w_t), "after the eager call")
    assert _counter("cuda_graphs.replay") == replays + 1
    assert _counter("cuda_graphs.eager_call.donated_buffer_held") == 1


def test_rotating_sets_share_the_donated_buffers(decode_prog):
    """Every readout is held: sets rotate, then the private set clones; the cache is never copied."""
    c, runner = _graph(decode_prog, max_output_sets=2)
    (cache_t, pos_t, x_t, w_t), (cache, pos, x, w) = _inputs(decode_prog, 4)
    held = []
    for step in range(STEPS):
        out, new_pos, new_cache = c(cache, pos, x, w)
        want = _reference(cache_t, pos_t, x_t, w_t)
        _check((out, new_pos, new_cache), want, f"step {step}")
        held.append((out, want[0]))
        cache_t, pos_t, cache, pos = want[2], want[1], new_cache, new_pos
    for got, want in held:  # no later replay overwrote a held readout
        torch.testing.assert_close(got.to_torch().double(), want, rtol=1e-5, atol=1e-5)
    assert runner.num_captures == 3  # two rotating sets and the private one
    assert _counter("cuda_graphs.clone_call.outputs_held") == STEPS - 3
    assert _counter("cuda_graphs.staged.copies") == 2 * len(decode_prog.mesh.local_pids)


def test_undonated_calls_never_write_the_arguments(decode_prog):
    c, runner = _graph(decode_prog)
    (cache_t, pos_t, x_t, w_t), arrays = _inputs(decode_prog, 5)
    args = [a._buffers for a in arrays]
    for step in range(4):
        outs, _ = runner.run(args)
        want = _reference(cache_t, pos_t, x_t, w_t)
        assert arrays[0].to_torch().equal(cache_t) and arrays[1].to_torch().equal(pos_t)
        got = [ShardedArray._from_buffers(b, sh, r.shape, d) for b, sh, r, d in
               zip(outs, decode_prog.output_shardings, want, (torch.float32, torch.int64, torch.float32), strict=True)]
        _check(got, want, f"step {step}")
        del got, outs  # held outputs would keep the set busy
    assert runner.num_captures == 1 and _counter("cuda_graphs.replay") == 3
    # the same runner called with donation afterwards captures the donated variant once
    (cache_t, pos_t, _, _), (cache, pos, _, _) = _inputs(decode_prog, 6)
    for step in range(3):
        out, pos, cache = c(cache, pos, arrays[2], arrays[3])
        want = _reference(cache_t, pos_t, x_t, w_t)
        _check((out, pos, cache), want, f"donated step {step}")
        cache_t, pos_t = want[2], want[1]
        del out
    assert _counter("cuda_graphs.recapture") == 1 and _counter("cuda_graphs.capture") == 2


def test_jit_dispatch_with_runner_matches_eager_jit(decode_prog):
    """The graph-run Compiled gives bitwise the eager executable's results on the same inputs."""
    c, _ = _graph(decode_prog)
    _, (cache_g, pos_g, x, w) = _inputs(decode_prog, 7)
    _, (cache_e, pos_e, _, _) = _inputs(decode_prog, 7)
    for step in range(4):
        out_g, pos_g, cache_g = c(cache_g, pos_g, x, w)
        out_e, pos_e, cache_e = decode_prog(cache_e, pos_e, x, w)
        for g, e in ((out_g, out_e), (pos_g, pos_e), (cache_g, cache_e)):
            assert g.to_torch().equal(e.to_torch()), f"step {step}"
