"""CUDA-graph execution of an ``Executable``: capture the thunk sequence once, replay per call.

This is the "command buffer" lowering of XLA's GPU runtime (xla/service/gpu/runtime/
command_buffer_thunk), with a DAG instead of one stream: the whole thunk sequence of every
local GPU -- every compute and communication stream, the cross-stream and cross-device
event joins, NCCL collectives and peer copies -- is captured into one CUDA graph that a
single launch replays (``spmd.runtime.graphs_cuda``). Entry point: ``maybe_graph``.

Call protocol of a ``GraphRunner`` (same signature and results as ``Executable.run``):

1. The first call runs eagerly. It warms up everything capture must not create: NCCL
   communicators and their connections, cuBLAS handles and workspaces of every stream, peer
   access (``CudaCommunicator`` enables it), the caching allocator's blocks.
2. The second call captures, then replays; later calls replay. A capture from another
   thread than the first call's first runs eagerly once in that thread (cuBLAS handles are
   per thread).

Argument binding (no allocation during capture: inputs are bound before it):

- *adopted*: a parameter whose tensors had the same addresses and strides on the first two
  calls, and that is not donated (weights, caches passed again and again), is captured
  reading the caller's own tensors: no copy per call. The runner keeps a reference, so the
  memory stays valid. Each call checks that the same tensor objects are passed (identity, in
  C-level loops; other objects at the same addresses also match); a tensor re-pointed in place
  (``set_``) is not noticed. If a later call passes other tensors for it, the parameter becomes
  staged and the graphs are captured again (counter ``cuda_graphs.recapture``).
- *staged*: every other parameter gets a private static buffer per device, allocated once
  outside capture; each call copies the argument into it (one ``torch._foreach_copy_`` per
  device), skipped when the argument already is that buffer (``input_buffers``). Copies are
  counted (``cuda_graphs.staged.copies`` / ``.bytes``, ``staged_copies`` / ``staged_bytes``).
- *donated and aliased*: a donated parameter whose buffer the donation plan writes an output
  into is staged, and that output IS its static buffer, updated in place by the replay and
  handed to the caller; passing it back as the donated argument stages nothing
  (``spmd.runtime.graphs_donation``, which also states the no-overwrite rule). Other donated
  parameters are staged; the runner never writes a caller's buffer. A call donating another
  set of parameters than the graphs were captured for captures again.

Outputs and the aliasing rule (``GraphOptions.outputs``). Replayed outputs are ordered on the
caller's current stream of each device, like the outputs of eager PyTorch ops, and carry no
ready events (``graphs_cuda`` says how):

- ``"rotate"`` (default): up to ``max_output_sets`` graphs are captured, each with its own
  static outputs; a call returns (aliases of) one set's static outputs without any copy. A set
  is replayed again only when no tensor or view of its outputs is alive outside the runner
  (storage use counts, a few hundred ns per output and device); when every set is held, the
  call replays a private set and returns clones (counter
  ``cuda_graphs.clone_call.outputs_held``). As with PyTorch's caching allocator, where freed
  memory is reused on its allocation stream, a reader of an output on a stream other than the
  caller's must be ordered before the caller's stream (or waited for) before the last
  reference is dropped: a later replay may then overwrite the memory. Every output that would
  alias an argument, a persistent constant or the arena is copied inside the graph, so outputs
  are always graph-owned memory -- or a donated static buffer (above), which never rotates.
- ``"clone"``: each call returns fresh tensors, copied from a private set's static outputs on
  the caller's streams right after the replay; static outputs never leave the runner.

Fallbacks: where capture is impossible (a CPU mesh, one process per device, a PyTorch
without the graph API, an op that cannot be captured), execution is eager; the reason is
counted in ``spmd.metrics`` as ``cuda_graphs.fallback.<reason>`` and logged once on the
``spmd`` logger.
"""

from __future__ import annotations

import logging
import operator
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from spmd import metrics
from spmd.runtime import graphs_donation as gd
from spmd.runtime.graphs_binding import (  # noqa: F401  (_ready_per_device: tests)
    _Binding,
    _OutputSet,
    _ptrs,
    _ready_per_device,
    _same,
    _staged_binding,
    _use_count,
)
from spmd.runtime.graphs_host import HostReplayBackend  # noqa: F401  (re-exported: tests, CPU debugging)
from spmd.runtime.kernels_fusion import graph_warmup

Tensor = torch.Tensor
logger = logging.getLogger("spmd")

MIN_THUNKS = 1  # with cuda_graphs=None, programs with fewer thunks per device stay eager
OUTPUT_MODES = ("clone", "rotate")
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
_logged: set[str] = set()
_logged_lock = threading.Lock()


@dataclass(frozen=True)
class GraphOptions:
    """How a ``GraphRunner`` hands out outputs and captures.

    Fields:
      outputs: "rotate" (static output sets handed out, the default) or "clone" (fresh output
        tensors per call); see the module docstring for the aliasing rule.
      max_output_sets: most graphs captured for "rotate" (>= 1), besides the private set that
        "clone" (and "rotate" when every set is held) replays.
      capture_error_mode: ``cudaStreamCaptureMode`` of the capture: "thread_local" (default:
        unsafe CUDA calls of this thread invalidate the capture, other threads are free),
        "global" or "relaxed".
      split_devices: capture one graph per device when the devices meet only in NCCL
        kernels (``spmd.runtime.graphs_cuda_split``); False: one graph over all devices.
    Raises:
      ValueError: an unknown ``outputs`` or ``capture_error_mode``, or ``max_output_sets`` < 1.
      TypeError: ``split_devices`` not a bool, ``max_output_sets`` not an int.
    """

    outputs: str = "rotate"
    max_output_sets: int = 3
    capture_error_mode: str = "thread_local"
    split_devices: bool = True

    def __post_init__(self) -> None:
        if self.outputs not in OUTPUT_MODES:
            raise ValueError(f"outputs: expected one of {OUTPUT_MODES}, got {self.outputs!r}")
        if not isinstance(self.max_output_sets, int) or isinstance(self.max_output_sets, bool):
            raise TypeError(f"max_output_sets: expected an int >= 1, got {self.max_output_sets!r}")
        if self.max_output_sets < 1:
            raise ValueError(f"max_output_sets: expected an int >= 1, got {self.max_output_sets!r}")
        if not isinstance(self.split_devices, bool):
            raise TypeError(f"split_devices: expected True or False, got {self.split_devices!r}")
        if self.capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(f"capture_error_mode: expected one of {CAPTURE_ERROR_MODES}, "
                             f"got {self.capture_error_mode!r}")


class CaptureError(RuntimeError):
    """Capturing the thunk sequence into a CUDA graph failed (the cause is chained)."""


# ---------------------------------------------------------------------------- entry point
def maybe_graph(executable: Any, options: Any = None, graph_options: GraphOptions | None = None) -> Any:
    """``executable`` wrapped in a ``GraphRunner`` where CUDA graphs are on, else itself.

    Args:
      executable: an ``spmd.runtime.executor.Executable``.
      options: a ``CompileOptions`` (its ``cuda_graphs`` field is read), or the mode itself:
        None = on for GPU meshes whose program has at least ``MIN_THUNKS`` thunks per
        device, True = on for every GPU mesh, False = off.
      graph_options: ``GraphOptions`` of the runner.
    Returns:
      A ``GraphRunner`` or ``executable``; both have ``run(args, arg_ready, donated, trace)``.
    Raises:
      TypeError: ``options`` is neither None, a bool, nor has a ``cuda_graphs`` field.
    """
    mode = _mode(options)
    if mode is False:
        return executable
    reason = fallback_reason(executable)
    if reason is not None:
        if mode is True or reason != "cpu_mesh":
            record_fallback(reason, "cuda_graphs requested" if mode else "on by default for GPU meshes")
        return executable
    if mode is None and not graph_helps(executable.program):
        logger.debug("cuda graphs: program of %d thunks per device stays eager", len(executable.program.thunks))
        return executable
    return GraphRunner(executable, graph_options or GraphOptions())


def _mode(options: Any) -> bool | None:
    if options is None or isinstance(options, bool):
        return options
    if not hasattr(options, "cuda_graphs"):
        raise TypeError(f"options: expected CompileOptions, a bool or None, got {type(options).__name__}")
    value = options.cuda_graphs
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"options.cuda_graphs: expected None, True or False, got {value!r}")
    return value


def fallback_reason(executable: Any) -> str | None:
    """Why ``executable`` cannot run as a CUDA graph, or None when it can.

    Reasons: "cpu_mesh" (virtual CPU devices), "distributed" (one process per device),
    "no_cuda" (CUDA not available), "no_graph_api" (this PyTorch lacks ``CUDAGraph`` or the
    allocator pool functions needed for several devices).
    """
    if getattr(executable, "mesh", None) is None or executable.mesh.platform != "cuda":
        return "cpu_mesh"
    if getattr(executable.options, "distributed", False) or getattr(executable, "multi_process", False):
        return "distributed"
    if not torch.cuda.is_available():
        return "no_cuda"
    from spmd.runtime import graphs_cuda

    if not graphs_cuda.api_available(len(executable.devices)):
        return "no_graph_api"
    return None


def graph_helps(program: Any) -> bool:
    """Whether replaying ``program`` beats issuing it: at least ``MIN_THUNKS`` thunks per device.

    A replay costs a few event records and waits per device plus the output copies; each
    eager thunk costs one host-side issue (about 20 us for a kernel from Python).
    """
    return len(program.thunks) >= MIN_THUNKS


def record_fallback(reason: str, detail: str = "") -> None:
    """Count ``cuda_graphs.fallback.<reason>`` and log it once per process (``spmd`` logger)."""
    metrics.counter(f"cuda_graphs.fallback.{reason}").inc()
    _log_once(f"fallback.{reason}", "cuda graphs: running eagerly (%s)%s", reason, f": {detail}" if detail else "")


def _log_once(key: str, msg: str, *args: Any) -> None:
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    logger.warning(msg, *args)


# ---------------------------------------------------------------------------- runner
_REPLAY = metrics.counter("cuda_graphs.replay")
_HELD = metrics.counter("cuda_graphs.clone_call.outputs_held")


class GraphRunner:
    """Runs an ``Executable`` by replaying CUDA graph(s) of its whole thunk sequence.

    Args:
      executable: the ``Executable`` (a GPU mesh for the default backend).
      options: ``GraphOptions``.
      backend: the capture/replay backend; default ``graphs_cuda.CudaGraphBackend``.
        ``HostReplayBackend`` gives the same binding and aliasing semantics on CPU meshes.
    Attributes of the executable (``program``, ``devices``, ...) are readable through the
    runner; ``disabled_reason`` / ``disabled_detail`` say why it went eager for good (e.g.
    "capture_error" and the exception). Calls are serialised by a lock. See the module
    docstring for the binding and output rules. ``staged_copies`` / ``staged_bytes``: argument
    copies into static buffers so far (the steady state of a donated cache makes none).
    """

    def __init__(self, executable: Any, options: GraphOptions = GraphOptions(), backend: Any = None) -> None:
        if not isinstance(options, GraphOptions):
            raise TypeError(f"options: expected GraphOptions, got {type(options).__name__}")
        self.executable = executable
        self.options = options
        if backend is None:
            from spmd.runtime.graphs_cuda import CudaGraphBackend

            backend = CudaGraphBackend(executable, options.capture_error_mode, options.split_devices)
        self.backend = backend
        self._rotate = options.outputs == "rotate" and _use_count is not None
        self._lock = threading.Lock()
        self._calls = 0
        self._warm_ptrs: list[tuple] = []
        self._warm_threads: set[int] = set()
        self._bound: list[_Binding] = []
        self._key: frozenset[int] = frozenset()      # the donated set the bindings were made for
        self._donors: gd.DonorBuffers | None = None     # donated static buffers that outputs are written into
        self.staged_copies = 0
        self.staged_bytes = 0
        self._adopted: list[tuple[int, _Binding]] = []
        self._staged: list[tuple[int, _Binding]] = []
        self._adopted_ids: list[int] = []
        self._adopted_flat: list[Tensor] = []
        self._sets: list[_OutputSet] = []
        self._private: _OutputSet | None = None
        self._next = 0
        n = len(executable.devices)
        self._no_ready: list[list[Any]] = [[] for _ in range(n)]
        self._no_copies: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(n)]
        self.disabled_reason: str | None = None
        self.disabled_detail = ""
        self._finalizer = weakref.finalize(self, backend.close)

    def fork(self) -> GraphRunner:
        """A runner of the same executable with its own bindings, static buffers, graphs and output sets.

        For another caller of one compiled program (``CompiledTemplate.rebind``): one shared runner fed two
        callers' weights staged (copied) every weight on every call, and one caller holding the
        donated static buffers made the other's calls eager. Calls of both runners take one lock
        (they share the executable's streams). A runner disabled for good stays disabled.
        """
        other = GraphRunner(self.executable, self.options, self.backend.fork())
        other._lock = self._lock
        other.disabled_reason, other.disabled_detail = self.disabled_reason, self.disabled_detail
        return other

    def __getattr__(self, name: str) -> Any:
        executable = self.__dict__.get("executable")
        if executable is None:
            raise AttributeError(name)
        return getattr(executable, name)

    @property
    def num_captures(self) -> int:
        """Graphs held now (one per output set, plus the private set of "clone")."""
        return len(self._sets) + (self._private is not None)

    def input_buffers(self) -> list[list[Tensor] | None]:
        """Per parameter, the static buffers (per device) a call copies into, or None if adopted.

        Writing an argument straight into these buffers and passing them saves the copy.
        Empty before the first capture.
        """
        return [None if b.adopted else list(b.tensors) for b in self._bound]

    # ------------------------------------------------------------------ run
    def run(self, args: Sequence[Sequence[Tensor]], arg_ready: Sequence[Any] | None = None,
            donated: frozenset[int] = frozenset(), trace: Any = None) -> tuple[list[list[Tensor]], list[Any]]:
        """Execute once; same arguments, results and errors as ``Executable.run``.

        A call with ``trace`` runs eagerly (per-thunk timing needs eager issue). Replayed
        outputs carry no ready events (``[None] * devices``): they are ordered on the caller's
        current stream of each device (see ``graphs_cuda``).
        """
        ex = self.executable
        if trace is not None or self.disabled_reason is not None:
            if trace is not None:
                metrics.counter("cuda_graphs.eager_call.trace").inc()
            return self._eager(args, arg_ready, donated, trace)
        ex._check_args(args)
        return self.run_checked(args, arg_ready, donated)

    def run_checked(self, args: Sequence[Sequence[Tensor]], arg_ready: Sequence[Any] | None = None,
                    donated: frozenset[int] = frozenset()) -> tuple[list[list[Tensor]], list[Any]]:
        """``run`` without checking ``args`` against the parameters (no trace).

        For callers that already guarantee one tensor per local device of each parameter's
        padded shard shape and dtype (``Compiled`` does, from its checked ``ShardedArray``s).
        """
        ex = self.executable
        with self._lock:
            if self.disabled_reason is not None:
                return ex.run(args, arg_ready, donated)
            self._calls += 1
            if self._calls == 1:
                self._warm_ptrs = [_ptrs(per) for per in args]
                self._warm_threads.add(threading.get_ident())
                metrics.counter("cuda_graphs.eager_call.warmup").inc()
                with graph_warmup():  # fusions compile their generated kernels now, not in the capture
                    return ex.run(args, arg_ready, donated)
            try:
                self._rebind(args, donated)
                copies = self._copies(args) if self._staged else self._no_copies
                if copies is None:  # another tensor donated while a live output holds the static buffer
                    gd.DONOR_HELD.inc()
                    return self._eager(args, arg_ready, donated)
                out_set, clone = self._select(args, arg_ready)
            except CaptureError as e:
                self._disable("capture_error", f"{type(e.__cause__).__name__}: {e.__cause__}")
                return ex.run(args, arg_ready, donated)
            _REPLAY.inc()
            ready = self._no_ready if arg_ready is None else _ready_per_device(arg_ready, len(self._no_ready))
            return self.backend.launch(out_set.captured, copies, ready, clone)

    def _eager(self, args: Sequence[Sequence[Tensor]], arg_ready: Any, donated: frozenset[int],
               trace: Any = None) -> tuple[list[list[Tensor]], list[Any]]:
        """``Executable.run`` while graphs are bound; it may write a donated static buffer (when
        passed one), so the caller's streams wait for it before a later copy into that buffer."""
        outs, ready = self.executable.run(args, arg_ready, donated, trace)
        if self._donors is not None:
            gd.order_after(ready, self.executable.devices)
        return outs, ready

    def close(self) -> None:
        """Wait for the devices, drop every graph and static buffer, release the memory pools.

        A later call binds and captures again (into a new pool).
        """
        with self._lock:
            self._unbind()

    # ------------------------------------------------------------------ binding
    def _unbind(self) -> None:
        """Drop every graph and binding (after the devices are done)."""
        self.backend.synchronize()
        self._drop_sets()
        # the next capture adopts a parameter again only if it was adopted so far (the first
        # call's addresses are stale: a staged argument may have been allocated there since)
        self._warm_ptrs = [b.ptrs if b.adopted else None for b in self._bound] or self._warm_ptrs
        self._set_bound([])
        self._donors = None

    def _bind_all(self, args: Sequence[Sequence[Tensor]], key: frozenset[int]) -> None:
        """Bind every parameter for a capture of the donated set ``key``."""
        bound = [self._initial(i, per, key) for i, per in enumerate(args)]
        self._set_bound(bound)
        self._key = key
        aliased = gd.aliased_outputs(self.executable._variant(key)[0]) if key else {}
        self._donors = gd.DonorBuffers(aliased, {i: bound[i].tensors for i in aliased.values()}) if aliased else None

    def _set_bound(self, bound: list[_Binding]) -> None:
        self._bound = bound
        self._adopted = [(i, b) for i, b in enumerate(bound) if b.adopted]
        self._staged = [(i, b) for i, b in enumerate(bound) if not b.adopted]
        self._adopted_ids = [i for i, _ in self._adopted]
        self._adopted_flat = [t for _, b in self._adopted for t in b.tensors]

    def _rebind(self, args: Sequence[Sequence[Tensor]], donated: frozenset[int]) -> None:
        if self._bound and frozenset(donated) != self._key:
            self._unbind()  # graphs of another donated set: capture the new variant
            metrics.counter("cuda_graphs.recapture").inc()
        if not self._bound:
            self._bind_all(args, frozenset(donated))
            return
        if all(map(operator.is_, chain.from_iterable(map(args.__getitem__, self._adopted_ids)), self._adopted_flat)):
            return  # the same tensor objects as captured (C-level loops: no Python per parameter)
        moved = [i for i, b in self._adopted if not _same(args[i], b)]
        if not moved:
            return
        self.backend.synchronize()
        self._drop_sets()
        bound = list(self._bound)
        for i in moved:
            bound[i] = _staged_binding(args[i])
        self._set_bound(bound)
        metrics.counter("cuda_graphs.recapture").inc()

    def _initial(self, i: int, per: Sequence[Tensor], donated: frozenset[int]) -> _Binding:
        ptrs = _ptrs(per)
        if i not in donated and ptrs == self._warm_ptrs[i]:
            return _Binding(True, list(per), ptrs)
        return _staged_binding(per)

    def _copies(self, args: Sequence[Sequence[Tensor]]) -> list[list[tuple[Tensor, Tensor]]] | None:
        """Per device, the (static buffer, argument) copies this call needs; counted.

        None when a donated static buffer that an output is written into would be overwritten
        while a live output still holds it (``spmd.runtime.graphs_donation``).
        """
        copies: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self._no_copies]
        donors = self._donors
        n = nbytes = 0
        for i, b in self._staged:
            check = donors is not None and i in donors.params
            for k, (dst, src) in enumerate(zip(b.tensors, args[i])):
                if src is not dst and (src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride()):
                    if check:
                        if not donors.free(i):
                            return None
                        check = False
                    copies[k].append((dst, src))
                    n += 1
                    nbytes += dst.nbytes
        if n:
            self.staged_copies += n
            self.staged_bytes += nbytes
            gd.STAGED_COPIES.inc(n)
            gd.STAGED_BYTES.inc(nbytes)
        return copies

    # ------------------------------------------------------------------ output sets
    def _select(self, args: Sequence[Sequence[Tensor]], arg_ready: Any) -> tuple[_OutputSet, bool]:
        """The set to replay, and whether its outputs are cloned (the private set) or handed out."""
        if self._rotate:
            sets = self._sets
            n = len(sets)
            for j in range(n):
                idx = (self._next + j) % n
                if sets[idx].free():
                    self._next = (idx + 1) % n
                    return sets[idx], False
            if n < self.options.max_output_sets:
                sets.append(self._capture(args, arg_ready))
                self._next = 0
                return sets[-1], False
            _HELD.inc()
            _log_once("outputs_held", "cuda graphs: every output set is still held by the caller; "
                                      "cloning outputs (raise GraphOptions.max_output_sets or drop outputs)")
        if self._private is None:
            self._private = self._capture(args, arg_ready)
        return self._private, True

    def _capture(self, args: Sequence[Sequence[Tensor]], arg_ready: Any) -> _OutputSet:
        if threading.get_ident() not in self._warm_threads:
            # cuBLAS handles and workspaces are per thread: warm this thread up on real arguments
            with graph_warmup():
                self.executable.run(args, arg_ready)
            self._warm_threads.add(threading.get_ident())
            metrics.counter("cuda_graphs.eager_call.thread_warmup").inc()
        static_args = [b.tensors for b in self._bound]
        donors = self._donors
        try:  # the donated variant only where an output is written into a donated static buffer
            captured = (self.backend.capture(static_args, self._key) if donors is not None
                        else self.backend.capture(static_args))
        except Exception as e:  # noqa: BLE001 - any failure of capture means eager execution
            raise CaptureError(str(e)) from e
        metrics.counter("cuda_graphs.capture").inc()
        return _OutputSet(captured, self._rotate, donors.outputs if donors is not None else frozenset())

    def _drop_sets(self) -> None:
        """Drop every graph (the caller has synchronized); the backend then takes a fresh pool."""
        for s in self._sets:
            s.captured.close()
        if self._private is not None:
            self._private.captured.close()
        self._sets, self._private, self._next = [], None, 0
        self.backend.close()

    def _disable(self, reason: str, detail: str) -> None:
        self.disabled_reason, self.disabled_detail = reason, detail
        try:
            self.backend.synchronize()
            self._drop_sets()
        finally:
            record_fallback(reason, detail)
