"""The single-controller executor of a lowered SPMD program (in the manner of PjRt / XLA GPU).

``Executable(module, mesh, buffers, options)`` lowers once (thunks, streams, events, closures,
persistent per-device constants); ``run(args)`` issues the thunk sequence on every local
device. Local thunks between two collectives form a segment that each device runs on its own;
collectives run on all devices at once. On GPU, the call is asynchronous: it returns per-device
ready events recorded on the main streams after every stream has been joined back.

Virtual CPU devices: with ``RuntimeOptions.cpu_parallel`` each segment runs as one task per
device on a persistent thread pool (PyTorch releases the GIL inside kernels), and the
controller thread runs the collectives. Per-call state lives in a local ``_Call`` object, so
one executable may be called from several threads at once (on GPU, calls are serialised by a
lock because they share streams and events; the work itself stays asynchronous).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from spmd.ir.hlo import Module
from spmd.runtime.donation import reusable
from spmd.runtime.lower import ArenaView, Program, lower
from spmd.runtime.thunks import CollectiveThunk, KernelThunk, Segment, segments

Tensor = torch.Tensor


@dataclass(frozen=True)
class RuntimeOptions:
    """Options of an ``Executable``.

    Fields:
      cpu_parallel: run per-device work of virtual CPU devices on a persistent thread pool.
      cpu_parallel_min_work: segments whose kernels' rough cost (result elements, times the
        contracted size for dots) is below this run serially: a thread hand-off costs more.
      use_nccl: on CUDA, run all-gather / reduce-scatter / all-reduce through NCCL
        (``torch.cuda.nccl``); None = when available, False = peer copies.
      distributed: one process per device (``torch.distributed`` initialised, rank = partition
        id); the executable drives ``mesh.devices[rank]`` only.
    """

    cpu_parallel: bool = True
    cpu_parallel_min_work: int = 1 << 16
    use_nccl: bool | None = None
    distributed: bool = False
    fuse: bool = True


class _ArenaPool:
    """Per-device temp arenas with their views built, reused across calls (thread-safe)."""

    def __init__(self, devices: Sequence[torch.device], size_bytes: int, views: Sequence[ArenaView]) -> None:
        self._devices, self._size, self._views = list(devices), size_bytes, list(views)
        self._free: list[list[list[Tensor]]] = []
        self.streams: list | None = None  # per device main CUDA stream, set by the executable
        self._lock = threading.Lock()

    def acquire(self) -> list[list[Tensor]]:
        """Per device, the list of views (one per ``ArenaView``)."""
        if not self._views:
            return [[] for _ in self._devices]
        with self._lock:
            if self._free:
                return self._free.pop()
        return [self._make(k) for k in range(len(self._devices))]

    def release(self, views: list[list[Tensor]]) -> None:
        if self._views:
            with self._lock:
                self._free.append(views)

    def _make(self, k: int) -> list[Tensor]:
        dev = self._devices[k]
        if self.streams is not None:  # allocated on the executable's main stream, which uses it
            with torch.cuda.stream(self.streams[k]):
                arena = torch.empty(self._size, dtype=torch.uint8, device=dev)
        else:
            arena = torch.empty(self._size, dtype=torch.uint8, device=dev)
        out = []
        for v in self._views:
            n = 1
            for d in v.dims:
                n *= d
            nbytes = n * torch.empty((), dtype=v.dtype).element_size()
            out.append(arena[v.offset_bytes:v.offset_bytes + nbytes].view(v.dtype).view(v.dims))
        return out


class _Call:
    """Per-call state: slot lists and arena views of every local device."""

    __slots__ = ("vals", "views")

    def __init__(self, vals: list[list[Any]], views: list[list[Tensor]]) -> None:
        self.vals, self.views = vals, views


class Executable:
    """A partitioned module lowered for a mesh, ready to run.

    Args:
      module: partitioned (``is_partitioned``) and scheduled HLO-lite module.
      mesh: an ``spmd.mesh.Mesh`` (``devices`` in partition-id order, ``shape``, ``platform``).
      buffers: an optional ``BufferAssignment``; kernels then write into views of one
        per-device arena.
      options: ``RuntimeOptions``.
    Raises:
      ValueError: the module is not partitioned, or its partition count differs from the mesh.
    """

    def __init__(self, module: Module, mesh: Any, buffers: Any = None,
                 options: RuntimeOptions = RuntimeOptions()) -> None:
        devices = tuple(mesh.devices)
        if module.num_partitions != len(devices):
            raise ValueError(f"mesh: expected {module.num_partitions} devices (module num_partitions), "
                             f"got {len(devices)}")
        self.module, self.mesh, self.options = module, mesh, options
        self.gpu = mesh.platform == "cuda"
        self.multi_process = bool(getattr(mesh, "process_ids", ()))
        if self.multi_process:
            self.pids, self.devices = tuple(mesh.local_pids), tuple(mesh.local_devices)
        elif options.distributed:
            import torch.distributed as dist

            rank = dist.get_rank()
            self.pids, self.devices = (rank,), (devices[rank],)
        else:
            self.pids, self.devices = tuple(range(len(devices))), devices
        self._buffers = buffers
        self.program: Program = lower(module, self.devices, self.pids, buffers, gpu=self.gpu, fuse=options.fuse)
        self._variants = {frozenset(): (self.program, segments(self.program.thunks))}
        self._arenas = _ArenaPool(self.devices, self.program.arena_size_bytes, self.program.arena_views)
        self._variant_arenas: dict[frozenset[int], _ArenaPool] = {frozenset(): self._arenas}
        self._param_meta = [(tuple(p.shape.dims), p.shape.torch_dtype) for p in module.entry.parameters]
        self._comm = self._make_comm()
        self._pool = None
        self._lock = threading.Lock()
        self._envs: list = []
        if self.gpu:
            from spmd.runtime.streams import create_envs

            self._envs = create_envs(self.devices, self.pids, self.program.stream_ids, self.program.num_events)
            self._arenas.streams = [env.main for env in self._envs]
        elif options.cpu_parallel and len(self.devices) > 1:
            self._pool = ThreadPoolExecutor(max_workers=len(self.devices) - 1, thread_name_prefix="spmd-cpu")

    def _make_comm(self):
        if self.multi_process:
            from spmd.distributed.state import require
            from spmd.runtime.comm.multiprocess import MultiProcessCommunicator

            return MultiProcessCommunicator(self.pids, self.mesh.process_ids, self._local_comm(), require("mesh"))
        if self.options.distributed:
            from spmd.runtime.comm.distributed import DistributedCommunicator

            groups = [t.spec for t in self.program.thunks if isinstance(t, CollectiveThunk)]
            return DistributedCommunicator(self.pids[0], self.module.num_partitions, groups, self.devices[0])
        return self._local_comm()

    def _local_comm(self):
        """The communicator of this process's devices (local index k == position in ``pids``)."""
        if self.gpu:
            from spmd.runtime.comm.cuda import CudaCommunicator

            return CudaCommunicator(self.devices, use_nccl=self.options.use_nccl)
        from spmd.runtime.comm.cpu import CpuCommunicator

        return CpuCommunicator(len(self.devices))

    # ------------------------------------------------------------------ run
    def run(self, args: Sequence[Sequence[Tensor]], arg_ready: Sequence[Sequence[Any]] | None = None,
            donated: frozenset[int] = frozenset(), trace: Any = None) -> tuple[list[list[Tensor]], list[Any]]:
        """Execute once.

        Args:
          args: ``args[i][k]``: parameter ``i`` on local device ``k`` (partition id
            ``pids[k]``), a tensor of the parameter's padded shard shape and dtype on that device.
          arg_ready: optional ``arg_ready[i][k]`` CUDA events the call waits for before reading.
          donated: parameter indices whose buffers the caller gives up: outputs of equal
            shard shape and dtype may be written into them (``spmd.runtime.donation``; the
            program variant is lowered once per distinct set).
          trace: an optional ``spmd.runtime.trace_events.TraceRecorder``.
        Returns:
          ``(outputs, ready)``: ``outputs[j][k]`` output ``j`` on local device ``k``, and one
          ready event per local device (None on CPU). On GPU the call returns after enqueueing.
        Raises:
          ValueError / TypeError: ``args`` does not match the parameters.
        """
        self._check_args(args)
        if donated:
            donated = reusable(frozenset(donated), args)
        program, steps = self._variant(donated)
        pool = self._variant_arenas[frozenset(donated)]
        arenas = pool.acquire()
        views = arenas
        if program.donated_params:
            views = [a + [args[i][k] for i in program.donated_params] for k, a in enumerate(arenas)]
        call = _Call(self._bind(program, args), views)
        try:
            if self.gpu:
                with self._lock:
                    return self._run_gpu(program, steps, call, args, arg_ready, trace)
            self._run_cpu(steps, call, trace)
            return self._outputs(program, call), [None] * len(self.devices)
        finally:
            pool.release(arenas)

    def _variant(self, donated: frozenset[int]) -> tuple[Program, list]:
        """The program lowered for this donation set (lowered on first use, then cached)."""
        variant = self._variants.get(donated)
        if variant is not None:
            return variant
        donated = frozenset(donated)
        bad = [i for i in donated if not (isinstance(i, int) and 0 <= i < len(self._param_meta))]
        if bad:
            raise ValueError(f"donated: expected parameter numbers in [0, {len(self._param_meta)}), got {sorted(bad)}")
        program = lower(self.module, self.devices, self.pids, self._buffers, gpu=self.gpu,
                        fuse=self.options.fuse, donated=donated)
        assert program.stream_ids == self.program.stream_ids and program.num_events == self.program.num_events
        variant = (program, segments(program.thunks))
        # a donated parameter's slices are not views (``aliasing.mark_parameter_views``), so the
        # variant may place more results in the (same size) arena: its views need their own pool
        pool = self._arenas
        if program.arena_views != self.program.arena_views:
            pool = _ArenaPool(self.devices, program.arena_size_bytes, program.arena_views)
            pool.streams = self._arenas.streams
        self._variant_arenas[donated] = pool
        self._variants[donated] = variant
        return variant

    def _check_args(self, args: Sequence[Sequence[Tensor]]) -> None:
        if len(args) != len(self._param_meta):
            raise ValueError(f"args: expected {len(self._param_meta)} parameters, got {len(args)}")
        n = len(self.devices)
        for i, (per_dev, (dims, dtype)) in enumerate(zip(args, self._param_meta, strict=False)):
            if len(per_dev) != n:
                raise ValueError(f"args[{i}]: expected one tensor per local device ({n}), got {len(per_dev)}")
            for k, t in enumerate(per_dev):
                if not isinstance(t, Tensor):
                    raise TypeError(f"args[{i}][{k}]: expected a torch.Tensor, got {type(t).__name__}")
                if t.dtype != dtype or tuple(t.shape) != dims:
                    raise ValueError(f"args[{i}][{k}]: expected {dtype}{list(dims)}, got {t.dtype}{list(t.shape)}")

    @staticmethod
    def _bind(program: Program, args: Sequence[Sequence[Tensor]]) -> list[list[Any]]:
        vals = [list(t) for t in program.templates]
        for slot, per_dev in zip(program.param_slots, args, strict=True):
            for k, t in enumerate(per_dev):
                vals[k][slot] = t
        return vals

    @staticmethod
    def _outputs(program: Program, call: _Call) -> list[list[Tensor]]:
        out = []
        for slot, clone in zip(program.output_slots, program.output_clone, strict=True):
            vals = [v[slot] for v in call.vals]
            out.append([v.clone() for v in vals] if clone else vals)
        return out

    # ------------------------------------------------------------------ CPU
    def _run_cpu(self, steps: list, call: _Call, trace: Any) -> None:
        run_seg = _run_segment if trace is None else _traced_segment(trace, self.pids)
        n = len(self.devices)
        for step in steps:
            if isinstance(step, Segment):
                if self._pool is None or step.work < self.options.cpu_parallel_min_work:
                    for k in range(n):
                        run_seg(step.thunks, call.vals[k], call.views[k], None, k)
                else:
                    futs = [self._pool.submit(run_seg, step.thunks, call.vals[k], call.views[k], None, k)
                            for k in range(1, n)]
                    run_seg(step.thunks, call.vals[0], call.views[0], None, 0)
                    for f in futs:
                        f.result()
            else:
                t0 = time.perf_counter() if trace is not None else 0.0
                self._collective(step, call)
                if trace is not None:
                    t1 = time.perf_counter()
                    for p in self.pids:
                        trace.add_cpu(p, step.stream_id, step.name, t0, t1)

    def _collective(self, th: CollectiveThunk, call: _Call) -> None:
        vals = call.vals
        outs = self._comm.run(th.spec, [v[th.in_] for v in vals], th.stream_id, self._envs)
        for v, o in zip(vals, outs, strict=False):
            v[th.out] = o
            for s in th.release:
                v[s] = None

    # ------------------------------------------------------------------ GPU
    def _run_gpu(self, program: Program, steps: list, call: _Call, args, arg_ready,
                 trace: Any) -> tuple[list[list[Tensor]], list[Any]]:
        from spmd.runtime import streams as st

        envs = self._envs
        device_index = torch.cuda.current_device()
        ready_per_dev = None
        if arg_ready is not None:
            ready_per_dev = [[arg_ready[i][k] for i in range(len(arg_ready))] for k in range(len(envs))]
        callers = st.begin(envs, ready_per_dev)
        try:
            bases = [_base_event(env) for env in envs] if trace is not None else None
            for step in steps:
                if isinstance(step, Segment):
                    for k, env in enumerate(envs):
                        if trace is None:
                            issue_segment_gpu(step.thunks, call.vals[k], call.views[k], env)
                        else:
                            _traced_segment_gpu(step.thunks, call.vals[k], call.views[k], env, trace, bases[k])
                elif trace is None:
                    self._collective(step, call)
                else:
                    _traced_collective_gpu(self, step, call, trace, bases)
            for env in envs:
                torch.cuda.set_stream(env.main)
            outputs = self._outputs(program, call)
            for per_dev in args:
                for t, env in zip(per_dev, envs, strict=False):
                    t.record_stream(env.main)
            return outputs, st.end(envs)
        finally:
            st.restore(callers, device_index)


def _run_segment(thunks, vals: list, views: list, env: Any, k: int) -> None:
    for th in thunks:
        th.run(vals, views, env)
        for s in th.release:
            vals[s] = None


def _traced_segment(trace: Any, pids: Sequence[int]):
    def run(thunks, vals: list, views: list, env: Any, k: int) -> None:
        for th in thunks:
            t0 = time.perf_counter()
            th.run(vals, views, env)
            trace.add_cpu(pids[k], th.stream_id, th.name, t0, time.perf_counter())
            for s in th.release:
                vals[s] = None
    return run


def issue_segment_gpu(thunks, vals: list, views: list, env: Any) -> None:
    """Issue one device's thunks of a segment on their streams (eager issue, or into a CUDA graph capture)."""
    cur = -1
    for th in thunks:
        if th.stream_id != cur and isinstance(th, KernelThunk):
            torch.cuda.set_stream(env.streams[th.stream_id])
            cur = th.stream_id
        th.run(vals, views, env)
        for s in th.release:
            vals[s] = None


def _base_event(env: Any):
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(env.main)
    return ev


def _traced_segment_gpu(thunks, vals: list, views: list, env: Any, trace: Any, base: Any) -> None:
    for th in thunks:
        stream = env.streams[th.stream_id]
        torch.cuda.set_stream(stream)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        th.run(vals, views, env)
        stop.record(stream)
        trace.add_gpu(env.pid, th.stream_id, th.name, base, start, stop)
        for s in th.release:
            vals[s] = None


def _traced_collective_gpu(ex: Executable, th: CollectiveThunk, call: _Call, trace: Any, bases: list) -> None:
    pairs = []
    for env in ex._envs:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(env.streams[th.stream_id])
        pairs.append((start, stop))
    ex._collective(th, call)
    for env, base, (start, stop) in zip(ex._envs, bases, pairs, strict=True):
        stop.record(env.streams[th.stream_id])
        trace.add_gpu(env.pid, th.stream_id, th.name, base, start, stop)
