"""``Compiled``: a lowered program bound to an executable, run on ``ShardedArray``s.

Input and output shardings are fixed at compile time (the output shardings are
read once from the partitioned module's root, as PyTorch/XLA caches
``GetOutputShardings`` per compilation rather than per execution). Everything
a call needs that does not depend on the arguments (argument names, expected
layouts, the donated set, the output wrappers' metadata, the metrics objects)
is built once in ``Compiled.__init__``; a call only checks the arguments
against them, binds their per-device buffers, enqueues the executable and wraps
the output buffers (asynchronously on GPU: the outputs carry per-device ready
events and a consumer waits for them on the device, never on the host).
"""

from __future__ import annotations

import operator
import threading
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat

import torch
import torch.utils._pytree as pytree

from spmd import metrics
from spmd.array import ShardedArray, device_put
from spmd.distributed import state as run_state
from spmd.ir.hlo import Module
from spmd.ir.random import draw_key
from spmd.lowering import static_key
from spmd.sharding import NamedSharding, PartitionSpec

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_EXECUTE = metrics.timer("execute")
_META = operator.attrgetter("_dtype", "_sharding", "_shape", "_deleted_reason")
_BUFFERS = operator.attrgetter("_buffers")
_READY = operator.attrgetter("_ready_events")
_DONATIONS = metrics.counter("donations")
_DONATION_LOCK = threading.Lock()
_CLAIMED = "donated to a call still running in another thread"
_OUTPUT_SHARDINGS = metrics.counter("output_shardings.computed")


@dataclass(frozen=True)
class InputSpec:
    """What one flat tensor argument of a ``Compiled`` must look like.

    Fields:
      name: how errors name it, e.g. ``"mlp: argument args[1]['w']"``.
      shape: global shape (``torch.Size``).
      dtype: element type.
      sharding: the compiled input sharding.
      donated: whether the call takes the array's buffers (``donate_argnums``).
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype
    sharding: NamedSharding
    donated: bool


def _own_runner(executable):
    """A CUDA-graph runner with its own per-caller state (``GraphRunner.fork``); a plain executable as it is."""
    return executable.fork() if hasattr(type(executable), "fork") else executable


@dataclass(frozen=True)
class CompiledTemplate:
    """A compiled module as the process-wide compile cache (``spmd.jit``) keeps it: never called,
    and holding no caller (no ``Lowered``, so no ``jit`` and what its calls keep alive).

    ``rebind(lowered)`` gives each caller of an equal module text its own ``Compiled``: the
    executable and buffer assignment are shared; a CUDA-graph runner's state is the caller's
    own (``GraphRunner.fork()``: bindings, donated static buffers, graphs, output sets), so two
    callers passing their own weights each keep them adopted instead of staging every weight on
    every call and neither holds the other's donated buffers; so is its handle on the hoisted
    values (``WeightCache.fork()``: shared with other programs only while they pass the same
    weights; the ``Lowered`` programs of one ``jit`` share one handle, ``caches``, held while
    that ``jit`` lives). What a caller's calls hold on the devices is freed with that caller.
    Called under ``spmd.compile_lock.COMPILE_LOCK``.
    """

    executable: object
    weight_cache: object
    buffers: object
    caches: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    @property
    def mesh(self):
        """The mesh the program runs on."""
        return self.executable.mesh

    def rebind(self, lowered) -> Compiled:
        """A ``Compiled`` for ``lowered`` (a ``Lowered`` of this module text). The argument
        structure, names, donation, ``reshard_inputs`` and the output shardings come from
        ``lowered`` (equal module texts may name their shardings differently: ``P("tp", None)``
        and ``P(None, "tp")`` over a mesh axis of size 1 lay out alike)."""
        shardings, shapes, dtypes = output_layout(lowered)
        executable, cache = _own_runner(self.executable), None
        if self.weight_cache is not None:
            cache = self.caches.get(lowered.jitted)
            if cache is None:
                cache = self.caches[lowered.jitted] = self.weight_cache.fork()
        return Compiled(lowered, executable, shardings, shapes, dtypes, self.buffers, cache)


class Compiled:
    """An executable for fixed argument shapes, dtypes and shardings.

    Call it with the same argument structure ``lower`` saw, or use
    ``execute_sharded`` with the flat list of ``ShardedArray`` inputs.

    Attributes:
      input_shardings / output_shardings: one ``NamedSharding`` per flat
        tensor input / output, computed once at compile time.
      input_specs: one ``InputSpec`` per flat tensor input.
      module: the final (partitioned, scheduled) HLO-lite module.
    """

    def __init__(self, lowered, executable, output_shardings, output_shapes, output_dtypes, buffers,
                 weight_cache=None):
        self.lowered = lowered
        self.weight_cache = weight_cache  # spmd.runtime.weight_cache.WeightCache of the hoisted values, or None
        self.executable = executable
        self.module: Module = lowered.result.module
        self.mesh = lowered.jitted.mesh
        self.name = lowered.jitted.__name__
        self.input_shardings: list[NamedSharding] = [leaf.sharding for leaf in lowered.in_leaves]
        self.output_shardings: list[NamedSharding] = output_shardings
        self.buffers = buffers
        self._reshard_inputs = bool(lowered.jitted.reshard_inputs)
        self._donated = frozenset(self._donated_leaves())
        names = _leaf_names(lowered.arg_tree, lowered.static_leaves)
        self.input_specs: tuple[InputSpec, ...] = tuple(
            InputSpec(f"{self.name}: argument {names[i]}", torch.Size(leaf.shape), leaf.dtype, leaf.sharding,
                      i in self._donated)
            for i, leaf in enumerate(lowered.in_leaves))
        self._num_positional = lowered.arg_tree.num_children
        self._tensor_positions = tuple(i for i in range(lowered.arg_tree.num_leaves) if i not in lowered.static_leaves)
        self._static_keys = {i: static_key(v) for i, v in lowered.static_leaves.items()}
        self._outputs = tuple(zip(output_shardings, (torch.Size(s) for s in output_shapes), output_dtypes,
                                  strict=True))
        self._no_events = (None,) * len(self.mesh.local_pids)
        self._first_run = self.mesh.is_multi_process  # compare the program across ranks before running it
        # the run a multi-process program was compiled in (its communicators end with it), else None
        self._generation = run_state.generation() if self.mesh.is_multi_process else None
        self._out_leaf = lowered.out_tree.is_leaf()
        self._laid_out = [(spec.dtype, spec.sharding, spec.shape, None) for spec in self.input_specs]
        self._run_for, self._run = None, None  # see _execute
        self._memory = None  # memory_analysis(), computed on first request
        # A program that draws random numbers takes a fresh key as its last input (spmd.ir.random).
        self._rng_key_sharding = (NamedSharding(self.mesh, PartitionSpec())
                                  if getattr(lowered.program, "rng_key_parameter", None) is not None else None)

    def template(self) -> CompiledTemplate:
        """What the process-wide compile cache keeps of this program (``CompiledTemplate``)."""
        cache = self.weight_cache
        template = CompiledTemplate(_own_runner(self.executable), None if cache is None else cache.fork(), self.buffers)
        if cache is not None:
            template.caches[self.lowered.jitted] = cache
        return template

    def _donated_leaves(self) -> list[int]:
        """Flat tensor-input indices that belong to donated positional arguments."""
        lowered = self.lowered
        return donated_leaves(lowered.jitted.donate_argnums, lowered.arg_tree, lowered.static_leaves)

    # ------------------------------------------------------------------ calls
    def __call__(self, *args):
        """Run on ``args`` (the structure ``lower`` saw); returns the outputs' pytree of ShardedArrays.

        Raises ValueError for a wrong number of positional arguments, another
        pytree structure, a changed static argument, and everything
        ``execute_sharded`` raises.
        """
        if len(args) != self._num_positional:
            raise ValueError(f"{self.name}: expected {self._num_positional} positional arguments, got {len(args)}")
        leaves, tree = pytree.tree_flatten(args)
        if tree != self.lowered.arg_tree:
            raise ValueError(f"{self.name}: arguments have structure {tree}, expected {self.lowered.arg_tree}")
        return self._call_flat(leaves)

    def _call_flat(self, leaves: list):
        """Run on the flattened leaves (static ones included); returns the outputs' pytree."""
        static = self._static_keys
        if static:
            for i, key in static.items():
                if static_key(leaves[i]) != key:  # NaN matches NaN; 0.0 and -0.0 differ (unlike ==)
                    raise ValueError(f"{self.name}: static argument leaf {i} is {leaves[i]!r}, compiled for "
                                     f"{self.lowered.static_leaves[i]!r}")
            leaves = [leaves[i] for i in self._tensor_positions]
        outs = self.execute_sharded(leaves)
        return outs[0] if self._out_leaf else pytree.tree_unflatten(outs, self.lowered.out_tree)

    def _call_laid_out(self, args: Sequence):
        """Run on positional ``ShardedArray``s that are exactly the flat inputs, live and laid out as
        compiled; returns the outputs' pytree, or None (nothing run) when any argument is not."""
        start = time.perf_counter()
        try:
            meta = list(map(_META, args))  # C-level: one tuple per argument, compared at once
        except AttributeError:
            return None
        if meta != self._laid_out or not all(map(operator.is_, map(type, args), repeat(ShardedArray))):
            if len(args) != len(self.input_specs):
                return None
            for spec, a in zip(self.input_specs, args):
                if type(a) is not ShardedArray or a._deleted_reason is not None or a._dtype is not spec.dtype \
                        or a._shape != spec.shape:
                    return None
                if a._sharding is not spec.sharding:
                    if a._sharding != spec.sharding:
                        return None
                    a._sharding = spec.sharding  # an equal value object: later calls match by identity
        outs = self._execute(args, args, start)
        return outs[0] if self._out_leaf else pytree.tree_unflatten(outs, self.lowered.out_tree)

    def execute_sharded(self, args: Sequence[ShardedArray | torch.Tensor]) -> list[ShardedArray]:
        """Run on the flat list of tensor inputs; returns the flat list of outputs.

        Args:
          args: one ``ShardedArray`` per flat tensor input, of the compiled
            global shape, dtype and sharding (``input_specs``). A
            ``torch.Tensor`` is placed with ``device_put`` first.
        Returns:
          One ``ShardedArray`` per output, laid out as ``output_shardings``;
          on GPU they are returned before the devices finish (each carries
          per-device ready events, or none when the work is ordered on the
          caller's current streams, as CUDA-graph replays are).
        Raises:
          ValueError: wrong number of arguments, or an argument whose shape,
            dtype, mesh or sharding differs from the compiled one (a sharding
            on the same mesh is resharded on device instead when the jit was
            made with ``reshard_inputs=True``), a donated array that is also
            passed in another position, or a multi-process program called
            after its run ended (``spmd.distributed.shutdown``).
          DeletedArrayError (a ValueError): a deleted or donated array.
          TypeError: an argument that is neither a ShardedArray nor a Tensor.
        """
        start = time.perf_counter()
        specs = self.input_specs
        if len(args) != len(specs):
            raise ValueError(f"{self.name}: expected {len(specs)} array arguments, got {len(args)}")
        arrays = list(args)
        for i, (spec, a) in enumerate(zip(specs, arrays, strict=True)):
            if (type(a) is not ShardedArray or a._deleted_reason is not None or a._dtype is not spec.dtype
                    or (a._sharding is not spec.sharding and a._sharding != spec.sharding) or a._shape != spec.shape):
                arrays[i] = self._bind_slow(spec, a)
            elif a._sharding is not spec.sharding:
                a._sharding = spec.sharding  # an equal value object: later calls match by identity
        return self._execute(args, arrays, start)

    def _execute(self, args: Sequence, arrays: Sequence[ShardedArray], start: float) -> list[ShardedArray]:
        """Run on ``arrays`` (checked, laid out as compiled; ``args`` as the caller passed them)."""
        if self._generation is not None and self._generation != run_state.generation():
            run_state.run_ended(self.name)
        if not self._donated:
            return self._execute_claimed(args, arrays, start)
        self._claim_donated(arrays)
        try:
            return self._execute_claimed(args, arrays, start)
        except BaseException:
            for i in self._donated:  # nothing was donated: the arrays stay usable
                if arrays[i]._deleted_reason is _CLAIMED:
                    arrays[i]._deleted_reason = None
            raise

    def _claim_donated(self, arrays: Sequence[ShardedArray]) -> None:
        """Mark the donated arrays as taken, atomically across threads: of two concurrent calls
        donating one array, the second raises DeletedArrayError instead of sharing its buffers."""
        with _DONATION_LOCK:
            for i in self._donated:
                arrays[i]._check_alive(self.input_specs[i].name)
            for i in self._donated:
                arrays[i]._deleted_reason = _CLAIMED

    def _execute_claimed(self, args: Sequence, arrays: Sequence[ShardedArray], start: float) -> list[ShardedArray]:
        """``_execute`` once the donated arrays are claimed."""
        buffers = list(map(_BUFFERS, arrays))
        events = None
        if any(map(_READY, arrays)):
            events = [a._ready_events or self._no_events for a in arrays]
        if self._rng_key_sharding is not None:
            buffers.append(device_put(draw_key(), self._rng_key_sharding)._buffers)
            if events is not None:
                events.append(self._no_events)
        if self._donated:
            self._check_donation(args, arrays)
        if self._first_run:
            self._check_program()
        ex = self.executable
        if ex is not self._run_for:  # a GraphRunner skips re-checking the buffers of arrays checked here
            # _run before _run_for: another thread that finds _run_for set must find its _run set too
            self._run = ex.run_checked if hasattr(type(ex), "run_checked") else ex.run
            if self.weight_cache is not None:  # a graph captured the cached tensors: refresh them in place
                self.weight_cache.copy_into = hasattr(type(ex), "run_checked")
            self._run_for = ex
        cache = self.weight_cache
        if cache is not None:  # the hoisted values of these weights (the prologue runs when they changed)
            hoisted = cache.values(args, buffers, events)
            buffers += hoisted
            if events is not None:
                events += [self._no_events] * len(hoisted)
        out_buffers, ready = self._run(buffers, events, self._donated)
        if cache is not None:  # a refresh in place by any program sharing the values waits for this call
            cache.note_call(ready)
        if self._donated:
            self._kill_donated(args, arrays)
        if ready[0] is None:
            ready = None
        outs = [ShardedArray._from_buffers(b, sharding, shape, dtype, ready)
                for b, (sharding, shape, dtype) in zip(out_buffers, self._outputs, strict=True)]
        _EXECUTE.record(time.perf_counter() - start)
        return outs

    def _check_program(self) -> None:
        """First run on a multi-process mesh: the same program on every rank (``spmd.distributed.fingerprint``)."""
        from spmd.distributed.fingerprint import check_same_program
        from spmd.distributed.state import require

        seq = check_same_program(require(self.name), self)
        comm = getattr(self.executable, "_comm", None)
        if hasattr(comm, "program"):  # name the program in errors; key arrival records by the agreed sequence
            comm.program, comm.comm_id = self.name, f"p{seq}"
        self._first_run = False

    def _bind_slow(self, spec: InputSpec, arg) -> ShardedArray:
        """Check an argument that is not already laid out as compiled; place or reshard it."""
        if isinstance(arg, torch.Tensor):
            _check_meta(spec, tuple(arg.shape), arg.dtype)
            return device_put(arg, spec.sharding)
        if not isinstance(arg, ShardedArray):
            raise TypeError(f"{spec.name}: expected a ShardedArray or torch.Tensor, got {type(arg).__name__}")
        arg._check_alive(spec.name)
        _check_meta(spec, tuple(arg.shape), arg.dtype)
        if arg.sharding.mesh != spec.sharding.mesh:
            raise ValueError(f"{spec.name}: expected an array on mesh {spec.sharding.mesh}, got one on mesh "
                             f"{arg.sharding.mesh} (move it with spmd.device_put(array.to_torch(), sharding))")
        if not self._reshard_inputs:
            raise ValueError(f"{spec.name}: expected sharding {spec.sharding}, got {arg.sharding} "
                             "(reshard it once with array.reshard(<expected sharding>), or pass reshard_inputs=True "
                             "to spmd.jit to reshard on device at every call)")
        return arg.reshard(spec.sharding)

    def _check_donation(self, args, arrays: list[ShardedArray]) -> None:
        """Raise when a donated array's buffers are also passed in another position."""
        donated = {}
        for i in self._donated:
            for b in arrays[i]._buffers:
                donated[b.untyped_storage().data_ptr()] = i
        for j, a in enumerate(arrays):
            for b in a._buffers:
                i = donated.get(b.untyped_storage().data_ptr(), j)
                if i != j:
                    raise ValueError(f"{self.input_specs[i].name}: is donated, but its buffers are also passed as "
                                     f"{self.input_specs[j].name.split(': ', 1)[1]}; expected a donated array to "
                                     "be passed once")

    def _kill_donated(self, args, arrays: list[ShardedArray]) -> None:
        """Delete the donated arrays (and the caller's original when it was resharded or placed)."""
        reason = f"donated to {self.name}"
        for i in self._donated:
            if arrays[i]._deleted_reason is _CLAIMED:
                arrays[i]._deleted_reason = None
            arrays[i].delete(reason=reason)
            original = args[i]
            if isinstance(original, ShardedArray) and original is not arrays[i]:
                original.delete(reason=reason)
            _DONATIONS.inc()

    # ------------------------------------------------------------ inspection
    def memory_analysis(self):
        """Per-device memory of this executable: a ``spmd.runtime.memory.MemoryAnalysis``.

        Argument, output, alias (outputs written into donated buffers), arena (the buffer
        assignment's temporaries), heap temporaries and the peak bytes live at once during a call,
        per device (JAX's ``compiled.memory_analysis()``). Computed once per compilation.
        """
        if self._memory is None:
            from spmd.runtime.memory import memory_analysis

            self._memory = memory_analysis(self)
        return self._memory

    def collectives(self) -> list[dict]:
        """Collectives of the final program: opcode, per-device bytes moved, replica group size and
        algorithm ("one-shot" for an all-reduce ``spmd.passes.select_all_reduce`` marked, else "ring")."""
        from spmd.passes.select_all_reduce import algorithm_of

        out = []
        for inst in self.module.entry.instructions:
            op = inst.opcode.removesuffix("-start")
            if op not in COLLECTIVES:
                continue
            shape = inst.operands[0].shape if inst.operands else inst.shape
            groups = inst.attrs.get("replica_groups") or ((),)
            n = len(groups[0]) or self.module.num_partitions
            algorithm = algorithm_of(inst)
            sent = shape.size_bytes * (n - 1) if algorithm == "one-shot" else _bytes_moved(op, shape.size_bytes, n)
            out.append({"name": inst.name, "opcode": op, "bytes_per_device": sent, "group_size": n,
                        "algorithm": algorithm})
        return out

    def collectives_summary(self) -> str:
        """One line per collective kind: count and bytes each device sends."""
        counts: Counter = Counter()
        nbytes: Counter = Counter()
        for c in self.collectives():
            counts[c["opcode"]] += 1
            nbytes[c["opcode"]] += c["bytes_per_device"]
        if not counts:
            return "no collectives"
        return "\n".join(f"{op}: {counts[op]} x, {nbytes[op] / 2**20:.3f} MiB sent per device" for op in sorted(counts))


def donated_leaves(argnums, arg_tree, static_leaves) -> list[int]:
    """Flat tensor-input indices (parameter numbers) that belong to the positional arguments ``argnums``.

    (The donated ones for ``donate_argnums``; also used for ``weight_argnums``.)
    """
    if not argnums:
        return []
    args = pytree.tree_unflatten(list(range(arg_tree.num_leaves)), arg_tree)
    donated_leaf_ids = {i for a in argnums if a < len(args) for i in pytree.tree_leaves(args[a])}
    tensor_ids = [i for i in range(arg_tree.num_leaves) if i not in static_leaves]
    return [k for k, i in enumerate(tensor_ids) if i in donated_leaf_ids]


def _check_meta(spec: InputSpec, shape: tuple, dtype: torch.dtype) -> None:
    if shape != tuple(spec.shape) or dtype != spec.dtype:
        raise ValueError(f"{spec.name}: expected {spec.dtype}{list(spec.shape)}, got {dtype}{list(shape)}")


def _leaf_names(arg_tree, static_leaves) -> list[str]:
    """Per flat tensor input, its path in the positional arguments, e.g. ``args[1]['w']``."""
    marks = pytree.tree_unflatten(list(range(arg_tree.num_leaves)), arg_tree)
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(marks)[0]]
    return [f"args{paths[i]}" for i in range(arg_tree.num_leaves) if i not in static_leaves]


def _bytes_moved(op: str, operand_bytes: int, n: int) -> int:
    """Bytes one device sends for a ring implementation of ``op`` on an operand of ``operand_bytes``."""
    if n <= 1:
        return 0
    if op == "all-gather":
        return operand_bytes * (n - 1)
    if op == "reduce-scatter":
        return operand_bytes * (n - 1) // n
    if op == "all-reduce":
        return 2 * operand_bytes * (n - 1) // n
    if op == "all-to-all":
        return operand_bytes * (n - 1) // n
    return operand_bytes


def compile_module(lowered) -> Compiled:
    """Build the executable of a ``Lowered`` program and fix its output shardings.

    Raises ValueError for a bad ``SPMD_FUSION_COMPILER``, ``SPMD_P2P_ALL_REDUCE_MAX_BYTES``,
    ``SPMD_EPILOGUE_CHOICE``, ``SPMD_ATTENTION_CHOICE`` or ``SPMD_PDL`` (checked here on every mesh, before any
    kernel or communicator reads them: the kernels read the choices only on CUDA, mid-program).
    """
    from spmd.passes.assign_buffers import assign_buffers
    from spmd.runtime import kernels_attention, kernels_epilogue
    from spmd.runtime.comm.cuda import p2p_all_reduce_max_bytes
    from spmd.runtime.kernels_fusion import fusion_compiler
    from spmd.runtime.pdl_env import pdl_mode

    fusion_compiler(torch.device("cpu"))
    p2p_all_reduce_max_bytes()
    kernels_epilogue.choice_mode()
    kernels_attention.choice_mode()
    pdl_mode()
    from spmd.runtime.executor import Executable
    from spmd.runtime.graphs import maybe_graph

    module = lowered.result.module
    buffers = assign_buffers(module)
    lowered.result.buffers = buffers
    mesh = lowered.jitted.mesh
    executable = maybe_graph(Executable(module, mesh, buffers), lowered.jitted.options)
    cache = None
    prologue = lowered.result.prologue
    if prologue is not None:
        cache = _weight_cache(lowered.result, mesh)
    shardings, shapes, dtypes = output_layout(lowered)
    return Compiled(lowered, executable, shardings, shapes, dtypes, buffers, cache)


def _weight_cache(result, mesh):
    """The ``WeightCache`` of a pipeline result's prologue, shared with the programs of equal prologues.

    A prologue of weight values and constant-only values (a prefill's mask and rotary tables,
    which depend on its shapes) is split in two, so that its weight values are shared with
    programs whose constants differ (the decode): the cache of the weight values holds the cache
    of the constants (``WeightCache.constants``).
    """
    from spmd.passes.assign_buffers import assign_buffers
    from spmd.passes.hoist_weights import select_outputs
    from spmd.runtime.executor import Executable
    from spmd.runtime.prologue_registry import shared_prologue
    from spmd.runtime.weight_cache import WeightCache

    def cache(module, inputs):
        shared = shared_prologue(module, mesh, lambda m: Executable(m, mesh, assign_buffers(m)))
        return WeightCache(shared, inputs)

    prologue, inputs, k = result.prologue, result.prologue_inputs, result.prologue_weight_values
    n = len(prologue.entry.root.operands)
    if not 0 < k < n:
        return cache(prologue, inputs)
    weights, used = select_outputs(prologue, range(k))
    constants, _ = select_outputs(prologue, range(k, n))
    out = cache(weights, tuple(inputs[i] for i in used))
    out.constants = cache(constants, ())
    return out


def output_layout(lowered):
    """Output NamedShardings (from the partitioned module's root), global shapes and dtypes.

    Runs once per compilation (counted by the ``output_shardings.computed``
    metrics counter); every call reuses the result.
    """
    _OUTPUT_SHARDINGS.inc()
    mesh = lowered.jitted.mesh
    root = lowered.result.module.entry.root
    outputs = root.operands if root.opcode == "tuple" else [root]
    shardings = []
    for out in outputs:
        ts = out.sharding
        assert ts is not None and not ts.partial, f"output {out.name} has no final sharding: {ts}"
        shardings.append(NamedSharding.from_tensor_sharding(mesh, ts))
    shapes = [shape for shape, _ in lowered.out_avals]
    dtypes = [dtype for _, dtype in lowered.out_avals]
    return shardings, shapes, dtypes
