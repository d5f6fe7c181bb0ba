"""One CUDA graph for the whole thunk sequence of an ``Executable`` over all its local GPUs.

Capture (``CudaGraphBackend.capture``): the capture starts on device 0's main stream (the
*launch* stream). An event recorded there is waited on by every other stream of every device,
which joins them all to the same capture (CUDA stream capture follows event dependencies,
across devices too); the thunks are then issued exactly as the eager executor issues them --
kernels on their streams, record/wait-event thunks, NCCL collectives (``torch.cuda.nccl``) and
peer copies (``Tensor.copy_`` across devices, which needs peer access enabled beforehand:
``CudaCommunicator`` does it) -- and every stream is joined back into the launch stream
before the capture ends. A replay is one ``cudaGraphLaunch`` on any stream of device 0 (the
caller's, see below); the graph completes as a whole before later work of that stream starts.

Memory: nothing may be allocated by the ordinary caching allocator during capture, or the
graph would use blocks that later calls reuse. Every capture gets a private pool of its own
(``torch.cuda.graph_pool_handle``): ``torch.cuda.CUDAGraph`` sends allocations of the captured
streams of device 0 to it; for every other device the capture sends this thread's allocations
to the same pool id with ``torch._C._cuda_beginAllocateCurrentThreadToPool``
(``_cuda_beginAllocateToPool`` before PyTorch 2.8) and stops with ``_cuda_endAllocateToPool``
(formerly ``_cuda_endAllocateCurrentStreamToPool``) -- the mechanism behind
``torch.cuda.use_mem_pool``. Pools are never shared between graphs: a block a graph frees during
its capture is still written by each of its replays, so a second graph placing its static
outputs there would see them overwritten by the first graph's next replay while a caller holds
them (the "rotate" output sets of ``spmd.runtime.graphs`` replay in any order). The pools stay
referenced (never ``_cuda_releasePool``-d) until the backend is closed, which the runner does
whenever it drops every graph (close, recapture, disable). Static inputs, the temp arena and
persistent constants are allocated before capture and held.

Per call (``launch``), on the caller's current stream of every device and nothing else (no
stream or device switch): each device waits for the arguments' ready events and copies staged
arguments into the static inputs; every device other than 0 records its *start* event, which
that device's part of the graph waits for at its root (an external event-wait node); device 0's
stream replays the graph; every other device's stream then waits for its *finish* event, which
the graph records when that device's part is done (an external event-record node). No device
waits for another outside the graph, so consecutive replays follow each other without a
cross-device round trip: a 2-GPU graph of two small kernels replays every 10.1 µs this way and
every 19.4 µs when device 0 waits for device 1's stream before each launch and device 1 for
device 0's after it (2xH200, ``benchmarks/probe/external_events.py``), which is what happens
where the driver's external-event calls are missing. "clone" mode then copies the outputs into
fresh tensors there. For 2 devices that is 1 event record, 1 same-device wait and 1 launch. The
outputs are thus ordered on the caller's streams like the outputs of eager PyTorch ops and
carry no ready events. Replays never overlap: they are issued in order on device 0's stream,
and when the caller's streams change the new ones first wait for everything issued on the
old ones.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd.compile_lock import CAPTURE_LOCK
from spmd.runtime import streams as st
from spmd.runtime.graphs_cuda_split import capture_split, issue_split, issue_steps, launch_split, splittable
from spmd.runtime.graphs_donation import call_views, donor_views

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
    """A captured graph, its static outputs ``outputs[j][k]`` and the events used to build it.

    ``aliased``: the outputs that are donated parameters' static input buffers, updated in
    place (``spmd.runtime.graphs_donation``); never cloned.
    """

    graph: Any
    outputs: list[list[Tensor]]
    events: list[Any] = field(default_factory=list)
    device_graphs: list[Any] = field(default_factory=list)  # one per device (graphs_cuda_split)
    aliased: frozenset[int] = frozenset()

    def replay(self) -> None:
        """Launch the graph(s), each on the current stream of its capture device."""
        for g in self.device_graphs or [self.graph]:
            g.replay()

    def close(self) -> None:
        """Destroy the graph(s) and drop the static outputs (their pool blocks become free)."""
        for g in self.device_graphs or [self.graph]:
            g.reset()
        self.outputs = []
        self.events = []


@dataclass(eq=False)
class _CaptureCall:
    """The slot lists and arena views of the capture (what ``Executable`` calls a ``_Call``)."""

    vals: list[list[Any]]
    views: list[list[Tensor]]
    donors: dict[int, list[Tensor]] = field(default_factory=dict)  # output -> donated static buffers


class CudaGraphBackend:
    """Captures and replays an ``Executable`` on its local CUDA devices (see module doc).

    Args:
      executable: an ``Executable`` of a CUDA mesh (not distributed), already constructed:
        its streams, events, communicator and peer access exist.
      capture_error_mode: the ``cudaStreamCaptureMode`` ("thread_local", "global", "relaxed").
      split: capture one graph per device where the program allows it
        (``spmd.runtime.graphs_cuda_split``); False always captures one graph over all devices.
    Uses of the executable: ``_variant``, ``_bind``, ``_outputs``, ``_collective``,
    ``_arenas``, ``_envs`` and ``devices``.
    """

    def __init__(self, executable: Any, capture_error_mode: str = "thread_local", split: bool = True) -> None:
        self.ex = executable
        self.split = split
        self.envs = list(executable._envs)
        self.mode = capture_error_mode
        self.pool = torch.cuda.graph_pool_handle()  # the pool of the latest capture (``_new_pool``)
        self._pool_refs: list[tuple[int, Any]] = []  # (device index, pool) references to release
        self._views: list[list[Tensor]] | None = None
        self._views_pool: Any = executable._arenas  # the arena pool of the captured variant
        self._indices = [env.device.index for env in self.envs]
        self._joins: list[Any] = []
        for env in self.envs:
            with torch.cuda.device(env.device):
                self._joins.append(torch.cuda.Event())
        self._done = self._joins[0]
        # External start / finish events of the devices other than the launch device (see the
        # module docstring); None where the driver entry points are missing (joins instead).
        self._starts: list[Any] | None = None
        self._finishes: list[Any] = []
        if len(self.envs) > 1 and external_events_available():
            self._starts, self._finishes = [None], [None]
            for env in self.envs[1:]:
                with torch.cuda.device(env.device):
                    start, finish = torch.cuda.Event(external=True), torch.cuda.Event(external=True)
                    start.record(env.main)  # creates the CUDA events
                    finish.record(env.main)
                self._starts.append(start)
                self._finishes.append(finish)
        self._no_ready = [None] * len(self.envs)
        self._key: tuple | None = None
        self._streams: list[Any] | None = None

    def fork(self) -> CudaGraphBackend:
        """A backend of the same executable, modes and streams, with no captures and its own pools."""
        return type(self)(self.ex, self.mode, self.split)

    def synchronize(self) -> None:
        """Wait for all work of every local device (never during another thread's capture)."""
        with CAPTURE_LOCK:
            for env in self.envs:
                torch.cuda.synchronize(env.device)

    # ------------------------------------------------------------------ capture
    def capture(self, static_args: list[list[Tensor]], donated: frozenset[int] = frozenset()) -> CudaCaptured:
        """Capture the program variant of ``donated`` reading ``static_args[i][k]``.

        With ``donated`` (parameters whose static buffers the runner gives up to the program),
        an output the donation plan writes into a donated buffer is that static buffer, updated
        in place by each replay (``CudaCaptured.aliased``; ``spmd.runtime.graphs_donation``).
        Raises:
          RuntimeError (from PyTorch / CUDA / NCCL): an operation that cannot be captured.
        """
        ex = self.ex
        program, steps = ex._variant(frozenset(donated))
        pool = ex._variant_arenas[frozenset(donated)]
        if self._views is not None and self._views_pool is not pool:  # the runner closes before a new variant
            raise RuntimeError("capture: graphs of another donation variant still hold the arena (close first)")
        if self._views is None:
            self._views, self._views_pool = pool.acquire(), pool
        donors = donor_views(program, static_args)
        call = _CaptureCall(ex._bind(program, static_args), call_views(program, self._views, static_args), donors)
        foreign = _foreign_storages(static_args, program.templates, self._views)
        captured = self._capture(program, steps, call, foreign)
        captured.aliased = frozenset(donors)
        return captured

    def _capture(self, program: Any, steps: list, call: _CaptureCall, foreign: set[int]) -> CudaCaptured:
        with CAPTURE_LOCK:  # no device-wide synchronisation from another thread meanwhile
            return self._capture_locked(program, steps, call, foreign)

    def _capture_locked(self, program: Any, steps: list, call: _CaptureCall, foreign: set[int]) -> CudaCaptured:
        ex = self.ex
        if self.split and splittable(ex, program):
            return capture_split(self, program, steps, call, foreign)
        self.synchronize()
        graph = torch.cuda.CUDAGraph()
        launch = self.envs[0].main
        device_index = torch.cuda.current_device()
        callers = [torch.cuda.current_stream(env.device) for env in self.envs]
        events: list[Any] = []
        began: list[int] = []
        pool = self._new_pool()
        try:
            torch.cuda.set_stream(launch)
            begin = _pool_begin_fn()
            for env in self.envs[1:]:
                begin(env.device.index, pool)
                began.append(env.device.index)
            graph.capture_begin(pool=pool, capture_error_mode=self.mode)
            try:
                outputs = self._issue(program, steps, call, foreign, events)
                torch.cuda.set_stream(launch)
            except BaseException:
                self._abort(graph, events, pool)
                raise
            try:
                graph.capture_end()
            except BaseException:
                self._end_pool_quietly(self.envs[0].device.index, pool)
                raise
        finally:
            end = _pool_end_fn()
            for d in began:
                end(d, pool)
            self._pool_refs.extend((d, pool) for d in began)
            st.restore(callers, device_index)
        return CudaCaptured(graph, outputs, events)

    def _new_pool(self) -> Any:
        """A fresh private memory pool for one capture, referenced on every device until ``close``.

        Every captured graph gets its own pool: blocks a graph allocates and frees during its
        capture (the temporaries of kernels that return fresh tensors) are reused by that graph on
        every replay, so another graph must never place its static outputs there -- with one pool
        shared by the output sets of "rotate", a replay of an earlier set overwrote the outputs of
        a later set that a caller still held (wrong values under concurrent callers). A pool whose
        references all went may not be captured into again, and its free blocks may be returned
        to the driver while a graph still uses them; hence the reference per device.
        """
        pool = torch.cuda.graph_pool_handle()
        begin, end = _pool_begin_fn(), _pool_end_fn()
        for env in self.envs:
            begin(env.device.index, pool)
            end(env.device.index, pool)
            self._pool_refs.append((env.device.index, pool))
        self.pool = pool
        return pool

    def _issue(self, program: Any, steps: list, call: _CaptureCall, foreign: set[int],
               events: list[Any]) -> list[list[Tensor]]:
        """Fork every stream from the launch stream, issue the thunks, join, return the outputs."""
        envs = self.envs
        launch = envs[0].main
        fork = torch.cuda.Event()
        fork.record(launch)
        events.append(fork)
        for k, env in enumerate(envs):
            for s in env.streams.values():
                if s != launch:
                    s.wait_event(fork)
                    if k and self._starts is not None:  # an event-wait node on the caller's stream
                        wait_external(s, self._starts[k])
        outputs = issue_steps(self, program, steps, call, foreign)
        self._join_all(events)
        return outputs

    def _issue_split(self, program: Any, steps: list, call: _CaptureCall, foreign: set[int],
                     events: list[Any]) -> list[list[Tensor]]:
        """Issue the program into one graph per device (``graphs_cuda_split.issue_split``)."""
        return issue_split(self, program, steps, call, foreign, events)

    def _join_all(self, events: list[Any]) -> None:
        """Join every stream into the launch stream; with external events, each other device's
        streams first join its main stream, which records the device's finish event."""
        launch = self.envs[0].main
        for k, env in enumerate(self.envs):
            external = k > 0 and self._starts is not None
            for s in env.streams.values():
                if s != launch and not (external and s == env.main):
                    ev = torch.cuda.Event()
                    ev.record(s)
                    (env.main if external else launch).wait_event(ev)
                    events.append(ev)
            if external:
                record_external(self._finishes[k], env.main)  # an event-record node
                ev = torch.cuda.Event()
                ev.record(env.main)
                launch.wait_event(ev)
                events.append(ev)

    def _abort(self, graph: Any, events: list[Any], pool: Any) -> None:
        """End a capture that failed midway (best effort: the capture may be invalidated)."""
        with contextlib.suppress(Exception):  # an invalidated capture refuses new dependencies
            self._join_all(events)
        try:
            torch.cuda.set_stream(self.envs[0].main)
            graph.capture_end()
        except Exception:  # noqa: BLE001 - the original error is the one to report
            self._end_pool_quietly(self.envs[0].device.index, pool)

    @staticmethod
    def _end_pool_quietly(device: int, pool: Any) -> None:
        with contextlib.suppress(Exception):  # not recording to the pool any more: nothing to end
            _pool_end_fn()(device, pool)

    # ------------------------------------------------------------------ replay
    def launch(self, captured: CudaCaptured, copies: list[list[tuple[Tensor, Tensor]]],
               ready: list[list[Any]], clone: bool) -> tuple[list[list[Tensor]], list[Any]]:
        """Order after the caller, copy staged arguments in, replay, hand out the outputs.

        Everything is issued on the caller's current stream of each device (no stream or
        device switch): device 0's stream launches the graph, every other device's stream is
        ordered before and after the replay through its external start / finish events (or,
        without them, joined to device 0's stream before and after the replay). The outputs
        are therefore ordered on the caller's current streams, exactly like the outputs of
        eager PyTorch ops, and need no ready events.

        Args:
          captured: the graph to replay.
          copies: per device, (static buffer, argument) pairs to copy before the replay.
          ready: per device, events the arguments wait for (their sources also get
            ``record_stream`` on the caller's stream, as they were made on another stream).
          clone: return fresh copies of the static outputs (else aliases of them).
        Returns:
          ``(outputs[j][k], [None] * devices)``.
        """
        streams = self._caller_streams()
        if captured.device_graphs:
            launch_split(streams, captured, copies, ready, _copy_in, _wait)
            return self._outputs(captured, clone), self._no_ready
        s0 = streams[0]
        joins = self._joins
        for k in range(len(streams)):
            sk = streams[k]
            for ev in ready[k]:
                _wait(ev, sk)
            if copies[k]:
                _copy_in(copies[k], sk if ready[k] else None)
            if k and self._starts is not None:
                _record(self._starts[k], sk)
            elif k:
                _record(joins[k], sk)
                _wait(joins[k], s0)
        captured.graph.replay()
        if self._starts is not None:
            for k in range(1, len(streams)):
                _wait(self._finishes[k], streams[k])
        elif len(streams) > 1:
            _record(self._done, s0)
            for sk in streams[1:]:
                _wait(self._done, sk)
        return self._outputs(captured, clone), self._no_ready

    @staticmethod
    def _outputs(captured: CudaCaptured, clone: bool) -> list[list[Tensor]]:
        if clone:
            keep = captured.aliased
            return [[t.detach() if j in keep else t.clone() for t in per] for j, per in enumerate(captured.outputs)]
        return [[t.detach() for t in per] for per in captured.outputs]

    def _caller_streams(self) -> list[Any]:
        """The caller's current stream per device; ordered after the streams of the last launch.

        A graph's replays must not overlap (they share static inputs, outputs and the
        arena): when the caller's streams change, the new streams wait for everything
        issued so far on the old ones (the first launch: on the executable's main streams).
        """
        key = tuple(_stream_key(i) for i in self._indices)
        if key == self._key:
            return self._streams
        new = [torch.cuda.current_stream(env.device) for env in self.envs]
        old = self._streams if self._streams is not None else [env.main for env in self.envs]
        for s in old:
            ev = torch.cuda.Event()
            _record(ev, s)
            for t in new:
                if t != s:
                    _wait(ev, t)
        self._key, self._streams = key, new
        return new

    def close(self) -> None:
        """Release every capture's pool references and give the arena back.

        Called whenever the runner has dropped every graph (``GraphRunner.close``, a
        recapture, a disable). A pool whose graphs are all reset may not be captured into
        again: ``CUDAGraph`` (PyTorch 2.11) also registers its pool with the pinned host allocator
        (``CachingHostAllocator``), whose entry for the pool id asserts ``use_count > 0`` when a
        capture reuses an id all of whose graphs were reset. Each capture therefore takes a new
        pool id (``_new_pool``), and releasing an old one may fail harmlessly.
        """
        try:
            for d, pool in self._pool_refs:
                with contextlib.suppress(Exception):  # may run from a finalizer at interpreter exit
                    torch._C._cuda_releasePool(d, pool)
        finally:
            self._pool_refs = []
            self._key, self._streams = None, None
            if self._views is not None:
                with contextlib.suppress(Exception):
                    self._views_pool.release(self._views)
                self._views = None



_CU_EVENT_WAIT_EXTERNAL = 1  # CUevent_wait_flags / CUevent_record_flags of the CUDA driver API
_CU_EVENT_RECORD_EXTERNAL = 1
_libcuda: Any = None


def _driver() -> Any:
    """The CUDA driver library (ctypes), or None where it cannot be loaded."""
    global _libcuda
    if _libcuda is None:
        try:
            _libcuda = ctypes.CDLL("libcuda.so.1")
            _ = _libcuda.cuStreamWaitEvent, _libcuda.cuEventRecordWithFlags
        except (OSError, AttributeError):
            _libcuda = False
    return _libcuda or None


def external_events_available() -> bool:
    """Whether external event nodes can be captured (the driver's wait / record with flags).

    ``torch.cuda.Event(external=True)`` makes the record an external node when captured, but
    in PyTorch 2.11 its wait still creates an internal dependency, which fails capture
    ("dependency created on uncaptured work in another stream"); so both go to the driver.
    """
    return _driver() is not None


def wait_external(stream: Any, event: Any) -> None:
    """``stream`` waits for ``event`` as an external event (a wait node when captured).

    Raises RuntimeError when the driver call fails.
    """
    rc = _driver().cuStreamWaitEvent(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(event.cuda_event),
                                     ctypes.c_uint(_CU_EVENT_WAIT_EXTERNAL))
    if rc:
        raise RuntimeError(f"cuStreamWaitEvent(external) failed: CUresult {rc}")


def record_external(event: Any, stream: Any) -> None:
    """``event`` recorded on ``stream`` as an external event (a record node when captured).

    Raises RuntimeError when the driver call fails.
    """
    rc = _driver().cuEventRecordWithFlags(ctypes.c_void_p(event.cuda_event), ctypes.c_void_p(stream.cuda_stream),
                                          ctypes.c_uint(_CU_EVENT_RECORD_EXTERNAL))
    if rc:
        raise RuntimeError(f"cuEventRecordWithFlags(external) failed: CUresult {rc}")


def _copy_in(pairs: list[tuple[Tensor, Tensor]], stream: Any) -> None:
    """Copy each argument into its static buffer on its device's current stream.

    With ``stream`` (arguments made on another stream, e.g. by an eager call), each source
    is also marked used on it (``record_stream``), so its memory is not reused before the copy.
    """
    dst = [d for d, _ in pairs]
    src = [s for _, s in pairs]
    torch._foreach_copy_(dst, src)
    if stream is not None:
        for s in src:
            s.record_stream(stream)


def _stream_key(index: int) -> Any:
    """A cheap identity of the current stream of device ``index``."""
    return _get_current_stream(index)


_get_current_stream = getattr(torch._C, "_cuda_getCurrentStream", None) or torch.cuda.current_stream
_EventBase = getattr(torch._C, "_CudaEventBase", None)  # the C methods skip a Python layer each
_record = getattr(_EventBase, "record", None) or (lambda ev, stream: ev.record(stream))
_wait = getattr(_EventBase, "wait", None) or (lambda ev, stream: ev.wait(stream))


def _foreign_storages(static_args: list[list[Tensor]], templates: list[list[Any]],
                      views: list[list[Tensor]]) -> set[int]:
    """Addresses of storages the graph reads but does not own: arguments, constants, arena."""
    out = {t.untyped_storage().data_ptr() for per in static_args for t in per}
    out |= {t.untyped_storage().data_ptr() for tmpl in templates for t in tmpl
            if isinstance(t, Tensor) and t.device.type == "cuda"}
    out |= {v.untyped_storage().data_ptr() for per in views for v in per}
    return out
