"""One CUDA graph for the whole thunk sequence of an ``Executable`` over all its local GPUs.

Capture (``CudaGraphBackend.capture``): the capture starts on device 0's main stream (the
*launch* stream). An event recorded there is waited on by every other stream of every device,
which joins them all to the same capture (CUDA stream capture follows event dependencies,
across devices too); the thunks are then issued exactly as the eager executor issues them --
kernels on their streams, record/wait-event thunks, NCCL collectives (``torch.cuda.nccl``) and
peer copies (``Tensor.copy_`` across devices, which needs peer access enabled beforehand:
``CudaCommunicator`` does it) -- and every stream is joined back into the launch stream
before the capture ends. A replay is one ``cudaGraphLaunch`` on the launch stream; the graph
completes as a whole before later work of that stream starts.

Memory: nothing may be allocated by the ordinary caching allocator during capture, or the
graph would use blocks that later calls reuse. ``torch.cuda.CUDAGraph`` sends allocations of
the captured streams of device 0 to its private pool; for every other device the capture
sends this thread's allocations to the same pool id with
``torch._C._cuda_beginAllocateCurrentThreadToPool`` (``_cuda_beginAllocateToPool`` before
PyTorch 2.8) and stops with ``_cuda_endAllocateToPool`` (formerly
``_cuda_endAllocateCurrentStreamToPool``) -- the mechanism behind ``torch.cuda.use_mem_pool``.
Those pools stay referenced (never ``_cuda_releasePool``-d) until the backend is closed, so
blocks the graphs use are never handed to other tensors or returned to the driver. Static
inputs, the temp arena and persistent constants are allocated before capture and held.

Per call (``launch``): on each device, the executable's main stream waits for the caller's
current stream and the arguments' ready events, copies staged arguments into the static
inputs (after the previous replay is done with them), and the launch stream waits for it;
then one replay; then, in "clone" mode, each device's main stream waits for the replay and
copies the outputs into fresh tensors, and a ready event per device is recorded there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd.runtime import streams as st
from spmd.runtime.thunks import KernelThunk, Segment

Tensor = torch.Tensor


def _pool_begin_fn():
    return (getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
            or getattr(torch._C, "_cuda_beginAllocateToPool", None))


def _pool_end_fn():
    return getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(
        torch._C, "_cuda_endAllocateCurrentStreamToPool", None)


def api_available(num_devices: int) -> bool:
    """Whether this PyTorch can capture graphs over ``num_devices`` devices (see module doc)."""
    if not hasattr(torch.cuda, "CUDAGraph") or not hasattr(torch._C, "_graph_pool_handle"):
        return False
    return _pool_begin_fn() is not None and _pool_end_fn() is not None and hasattr(torch._C, "_cuda_releasePool")


@dataclass(eq=False)
class CudaCaptured:
    """A captured graph, its static outputs ``outputs[j][k]`` and the events used to build it."""

    graph: Any
    outputs: list[list[Tensor]]
    events: list[Any] = field(default_factory=list)

    def replay(self) -> None:
        """Launch the graph on the current stream of the capture device (the launch stream)."""
        self.graph.replay()

    def close(self) -> None:
        """Destroy the graph and drop the static outputs (their pool blocks become free)."""
        self.graph.reset()
        self.outputs = []
        self.events = []


@dataclass(eq=False)
class _CaptureCall:
    """The slot lists and arena views of the capture (what ``Executable`` calls a ``_Call``)."""

    vals: list[list[Any]]
    views: list[list[Tensor]]


class CudaGraphBackend:
    """Captures and replays an ``Executable`` on its local CUDA devices (see module doc).

    Args:
      executable: an ``Executable`` of a CUDA mesh (not distributed), already constructed:
        its streams, events, communicator and peer access exist.
      capture_error_mode: the ``cudaStreamCaptureMode`` ("thread_local", "global", "relaxed").
    Uses of the executable: ``_variant``, ``_bind``, ``_outputs``, ``_collective``,
    ``_arenas``, ``_envs`` and ``devices``.
    """

    def __init__(self, executable: Any, capture_error_mode: str = "thread_local") -> None:
        self.ex = executable
        self.envs = list(executable._envs)
        self.mode = capture_error_mode
        self.pool = torch.cuda.graph_pool_handle()
        self._pool_refs: list[int] = []
        self._held = False
        self._views: list[list[Tensor]] | None = None
        self._done = torch.cuda.Event()
        self._done_recorded = False

    def synchronize(self) -> None:
        """Wait for all work of every local device."""
        for env in self.envs:
            torch.cuda.synchronize(env.device)

    # ------------------------------------------------------------------ capture
    def capture(self, static_args: list[list[Tensor]]) -> CudaCaptured:
        """Capture the donation-free program variant reading ``static_args[i][k]``.

        Raises:
          RuntimeError (from PyTorch / CUDA / NCCL): an operation that cannot be captured.
        """
        ex = self.ex
        program, steps = ex._variant(frozenset())
        if self._views is None:
            self._views = ex._arenas.acquire()
        call = _CaptureCall(ex._bind(program, static_args), self._views)
        foreign = _foreign_storages(static_args, program.templates, self._views)
        self.synchronize()
        graph = torch.cuda.CUDAGraph()
        launch = self.envs[0].main
        device_index = torch.cuda.current_device()
        callers = [torch.cuda.current_stream(env.device) for env in self.envs]
        events: list[Any] = []
        began: list[int] = []
        try:
            torch.cuda.set_stream(launch)
            self._hold_pools()
            begin = _pool_begin_fn()
            for env in self.envs[1:]:
                begin(env.device.index, self.pool)
                began.append(env.device.index)
            graph.capture_begin(pool=self.pool, capture_error_mode=self.mode)
            try:
                outputs = self._issue(program, steps, call, foreign, events)
                torch.cuda.set_stream(launch)
            except BaseException:
                self._abort(graph, events)
                raise
            try:
                graph.capture_end()
            except BaseException:
                self._end_pool_quietly(self.envs[0].device.index)
                raise
        finally:
            end = _pool_end_fn()
            for d in began:
                end(d, self.pool)
            self._pool_refs.extend(began)
            st.restore(callers, device_index)
        return CudaCaptured(graph, outputs, events)

    def _hold_pools(self) -> None:
        """Take one reference to the pool on every device, kept until ``close``.

        A pool whose references all went (``_cuda_releasePool``) may not be captured into
        again, and its free blocks may be returned to the driver while a graph still uses
        them; device 0's graphs release their reference when they are reset (recapture).
        """
        if self._held:
            return
        begin, end = _pool_begin_fn(), _pool_end_fn()
        for env in self.envs:
            begin(env.device.index, self.pool)
            end(env.device.index, self.pool)
            self._pool_refs.append(env.device.index)
        self._held = True

    def _issue(self, program: Any, steps: list, call: _CaptureCall, foreign: set[int],
               events: list[Any]) -> list[list[Tensor]]:
        """Fork every stream from the launch stream, issue the thunks, join, return the outputs."""
        envs, ex = self.envs, self.ex
        launch = envs[0].main
        fork = torch.cuda.Event()
        fork.record(launch)
        events.append(fork)
        for env in envs:
            for s in env.streams.values():
                if s != launch:
                    s.wait_event(fork)
        for step in steps:
            if isinstance(step, Segment):
                for k, env in enumerate(envs):
                    _run_segment(step.thunks, call.vals[k], call.views[k], env)
            else:
                ex._collective(step, call)
        for env in envs:
            torch.cuda.set_stream(env.main)
        outputs = ex._outputs(program, call)
        for per in outputs:  # outputs must be graph-owned memory: copy any alias of held memory
            for k, t in enumerate(per):
                if t.untyped_storage().data_ptr() in foreign:
                    per[k] = t.clone()
        self._join_all(events)
        return outputs

    def _join_all(self, events: list[Any]) -> None:
        launch = self.envs[0].main
        for env in self.envs:
            for s in env.streams.values():
                if s != launch:
                    ev = torch.cuda.Event()
                    ev.record(s)
                    launch.wait_event(ev)
                    events.append(ev)

    def _abort(self, graph: Any, events: list[Any]) -> None:
        """End a capture that failed midway (best effort: the capture may be invalidated)."""
        with contextlib.suppress(Exception):  # an invalidated capture refuses new dependencies
            self._join_all(events)
        try:
            torch.cuda.set_stream(self.envs[0].main)
            graph.capture_end()
        except Exception:  # noqa: BLE001 - the original error is the one to report
            self._end_pool_quietly(self.envs[0].device.index)

    def _end_pool_quietly(self, device: int) -> None:
        with contextlib.suppress(Exception):  # not recording to the pool any more: nothing to end
            _pool_end_fn()(device, self.pool)

    # ------------------------------------------------------------------ replay
    def launch(self, captured: CudaCaptured, copies: list[list[tuple[Tensor, Tensor]]],
               ready: list[list[Any]], clone: bool) -> tuple[list[list[Tensor]], list[Any]]:
        """Order after the caller, copy staged arguments in, replay, hand out the outputs.

        Args:
          captured: the graph to replay.
          copies: per device, (static buffer, argument) pairs to copy before the replay.
          ready: per device, events the arguments wait for.
          clone: return fresh copies of the static outputs (else aliases of them).
        Returns:
          ``(outputs[j][k], ready_event per device)`` as ``Executable.run``.
        """
        envs = self.envs
        launch = envs[0].main
        device_index = torch.cuda.current_device()
        callers = [torch.cuda.current_stream(env.device) for env in envs]
        try:
            for k, env in enumerate(envs):
                stage = env.main
                env.caller.record(callers[k])
                stage.wait_event(env.caller)
                for ev in ready[k]:
                    stage.wait_event(ev)
                if copies[k]:
                    if k and self._done_recorded:
                        stage.wait_event(self._done)  # the last replay has read the static inputs
                    torch.cuda.set_stream(stage)
                    _copy_in(copies[k], stage)
                if k:
                    env.fork.record(stage)
                    launch.wait_event(env.fork)
            torch.cuda.set_stream(launch)
            captured.replay()
            self._done.record(launch)
            self._done_recorded = True
            if clone:
                return self._clone_out(captured.outputs)
            done = torch.cuda.Event()
            done.record(launch)
            return [[t.detach() for t in per] for per in captured.outputs], [done] * len(envs)
        finally:
            st.restore(callers, device_index)

    def _clone_out(self, outputs: list[list[Tensor]]) -> tuple[list[list[Tensor]], list[Any]]:
        """Fresh copies of the static outputs, made on each device's main stream after the replay."""
        out: list[list[Any]] = [[None] * len(self.envs) for _ in outputs]
        ready = []
        for k, env in enumerate(self.envs):
            stage = env.main
            if k:
                stage.wait_event(self._done)
            torch.cuda.set_stream(stage)
            for j, per in enumerate(outputs):
                out[j][k] = per[k].clone()
            ev = torch.cuda.Event()
            ev.record(stage)
            ready.append(ev)
        return out, ready

    def close(self) -> None:
        """Release the pool references, give the arena back; later captures use a new pool.

        A released pool id may not be captured into again (PyTorch asserts its use count),
        hence the new id.
        """
        try:
            for d in self._pool_refs:
                torch._C._cuda_releasePool(d, self.pool)
            self._pool_refs = []
            self._held = False
            self.pool = torch.cuda.graph_pool_handle()
            if self._views is not None:
                self.ex._arenas.release(self._views)
                self._views = None
        except Exception:  # noqa: BLE001 - may run from a finalizer at interpreter exit
            pass


def _run_segment(thunks: Sequence[Any], vals: list, views: list, env: Any) -> None:
    """Issue one device's thunks of a segment (as the eager executor does)."""
    cur = -1
    for th in thunks:
        if th.stream_id != cur and isinstance(th, KernelThunk):
            torch.cuda.set_stream(env.streams[th.stream_id])
            cur = th.stream_id
        th.run(vals, views, env)
        for s in th.release:
            vals[s] = None


def _copy_in(pairs: list[tuple[Tensor, Tensor]], stream: Any) -> None:
    """Copy each argument into its static buffer on ``stream`` (the current stream)."""
    dst = [d for d, _ in pairs]
    src = [s for _, s in pairs]
    torch._foreach_copy_(dst, src)
    for s in src:
        s.record_stream(stream)


def _foreign_storages(static_args: list[list[Tensor]], templates: list[list[Any]],
                      views: list[list[Tensor]]) -> set[int]:
    """Addresses of storages the graph reads but does not own: arguments, constants, arena."""
    out = {t.untyped_storage().data_ptr() for per in static_args for t in per}
    out |= {t.untyped_storage().data_ptr() for tmpl in templates for t in tmpl
            if isinstance(t, Tensor) and t.device.type == "cuda"}
    out |= {v.untyped_storage().data_ptr() for per in views for v in per}
    return out
