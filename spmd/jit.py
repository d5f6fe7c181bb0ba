"""``spmd.jit``: stage a PyTorch function for a mesh, JAX-style: ``lower`` → ``compile`` → call.

    f = spmd.jit(fn, mesh=mesh, in_shardings=(P(), P(None, "tp")), out_shardings=P())
    y = f(x, w)                               # ShardedArray
    f.lower(x, w).as_text("spmd-partition")   # per-device HLO text

Arguments may be ``torch.Tensor``s (placed on the mesh with their in-sharding),
``ShardedArray``s, or pytrees (dict / list / tuple) of them; non-tensor leaves
are static (baked into the program and part of the cache key), so they must be
immutable values (``spmd.lowering.STATIC_VALUES``: numbers, strings, tuples and
frozen dataclasses of them, ...), never objects that may hold tensors. Compilations
are cached per ``Jitted`` by the arguments' shapes, dtypes and shardings, and
process-wide by the canonical imported module text, input shardings, mesh and
options. Output shardings are computed once per compilation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from spmd import metrics
from spmd.array import ShardedArray
from spmd.compile_lock import COMPILE_LOCK
from spmd.compiled import Compiled, CompiledTemplate, compile_module
from spmd.distributed import state as run_state
from spmd.mesh import Mesh
from spmd.passes.pipeline import CompileOptions, type_name
from spmd.sharding import NamedSharding, PartitionSpec

_GLOBAL_CACHE: dict[tuple, CompiledTemplate] = {}
_HIT = metrics.counter("compile_cache.hit")
_MISS = metrics.counter("compile_cache.miss")


def jit(
    fn: Callable,
    *,
    mesh: Mesh,
    in_shardings: Any = None,
    out_shardings: Any = None,
    donate_argnums: int | Sequence[int] = (),
    options: CompileOptions | None = None,
    reshard_inputs: bool = False,
    weight_argnums: int | Sequence[int] = (),
) -> Jitted:
    """Compile ``fn`` to run SPMD over ``mesh``.

    Args:
      fn: a PyTorch function (or ``nn.Module``) of tensors, traceable by
        ``torch.export``; it is called with positional arguments only. An ``nn.Module``'s
        parameters and buffers become constants of the compiled program when it is traced:
        later in-place updates are not seen (pass them as arguments, e.g. through
        ``torch.func.functional_call``, or use ``spmd.parallelize``), and a forward that updates its
        buffers itself (BatchNorm's running statistics in training mode) raises ValueError.
      mesh: the device mesh.
      in_shardings: one entry per positional argument — a ``PartitionSpec``,
        ``NamedSharding`` or None (keep a ``ShardedArray``'s own sharding;
        replicate a tensor), or a pytree matching that argument; a single
        spec applies to every argument.
      out_shardings: like ``in_shardings`` for the outputs; None lets
        propagation choose (never partial).
      donate_argnums: positional arguments whose buffers the call may reuse
        for outputs (an int, a tuple or list of ints, or None for none); the
        donated ``ShardedArray``s are dead afterwards.
      options: ``CompileOptions``.
      reshard_inputs: reshard a ``ShardedArray`` whose sharding differs from
        its in-sharding on device instead of raising ``ValueError``.
      weight_argnums: positional arguments that hold weights (an int, a tuple or list of ints):
        values computed only from them (merged weights, casts) are computed once per weight
        version and cached on the devices instead of on every call, when
        ``options.hoist_weights`` is on (``spmd.passes.hoist_weights``). A donated argument
        is never treated as weights. Pass the same (or in-place updated) arrays again to
        reuse the cache; ``spmd.parallelize`` names its parameters.
    Raises:
      TypeError: ``mesh`` is not a Mesh, ``fn`` is not callable, ``donate_argnums`` or
        ``weight_argnums`` is not ints, ``options`` is not a ``CompileOptions`` or ``reshard_inputs`` is not a bool.
        A call (or ``lower``) raises TypeError for a non-tensor argument that is not an immutable
        value (see the module docstring: it would be compiled in as a constant).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an spmd.Mesh, got {type(mesh).__name__}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    donate = _argnums(donate_argnums, "donate_argnums", "no donation")
    weights = _argnums(weight_argnums, "weight_argnums", "no weights")
    if options is not None and not isinstance(options, CompileOptions):
        raise TypeError(f"options must be an spmd.CompileOptions, got {type(options).__name__}")
    if not isinstance(reshard_inputs, bool):
        raise TypeError(f"reshard_inputs must be True or False, got {type_name(reshard_inputs)} "
                        f"{reshard_inputs!r}")
    return Jitted(fn, mesh, in_shardings, out_shardings, donate, options or CompileOptions(), reshard_inputs,
                  weights)


def _argnums(value, what: str, none_means: str) -> tuple[int, ...]:
    """``value`` (None, an int, a tuple or list of ints) as a tuple; TypeError naming ``what`` otherwise."""
    if value is None:
        return ()
    if not isinstance(value, (int, tuple, list)) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int or a tuple/list of ints (None = {none_means}), "
                        f"got {type(value).__name__} {value!r}")
    out = (value,) if isinstance(value, int) else tuple(value)
    if any(not isinstance(a, int) or isinstance(a, bool) or a < 0 for a in out):
        raise TypeError(f"{what} must be non-negative ints, got {value!r}")
    return out


@dataclass(frozen=True)
class _Leaf:
    """How one flattened argument leaf enters the program."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    sharding: NamedSharding


class Jitted:
    """A function staged for a mesh; call it, or ``lower`` it. See ``jit``."""

    def __init__(self, fn, mesh, in_shardings, out_shardings, donate_argnums, options, reshard_inputs,
                 weight_argnums=()):
        self.fn = fn
        self.weight_argnums = tuple(weight_argnums)
        self.mesh = mesh
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self.donate_argnums = donate_argnums
        self.options = options
        self.reshard_inputs = reshard_inputs
        self._cache: dict[tuple, Compiled] = {}
        self._fast: tuple[int, Compiled] | None = None
        self._specs: dict = {}  # arguments' pytree structure -> per-leaf NamedSharding or None
        self._replicated = NamedSharding(mesh, PartitionSpec()) if isinstance(mesh, Mesh) else None
        self._multi_process = isinstance(mesh, Mesh) and mesh.is_multi_process
        self._generation = run_state.generation()  # of the run the cached programs were compiled in
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, *args, **kwargs):
        """Run on ``args`` (compiling at the first call of each argument signature).

        Raises TypeError for keyword arguments, and ValueError on a multi-process mesh after
        ``spmd.distributed.shutdown`` (no run to execute in); in a later run the programs are
        compiled again.
        """
        if kwargs:
            raise TypeError(f"{self.__name__}: spmd.jit functions take positional arguments only; "
                            f"got keyword argument(s) {', '.join(kwargs)}")
        if self._multi_process and self._generation != run_state.generation():
            self._new_run()
        fast = self._fast
        if fast is not None:
            leaves = _fast_leaves(args, fast[0])
            if leaves is not None:
                out = fast[1]._call_laid_out(leaves)
                if out is not None:
                    _HIT.inc()
                    return out
        leaves, tree = pytree.tree_flatten(args)
        key = self._key(args, leaves, tree)
        compiled = self._cache.get(key)
        if compiled is None:
            with COMPILE_LOCK:  # single flight: a thread that waited finds the program compiled
                compiled = self._cache.get(key)
                if compiled is None:
                    _MISS.inc()
                    compiled = self.lower(*args).compile()
                    self._cache[key] = compiled
                else:
                    _HIT.inc()
        else:
            _HIT.inc()
        template = _fast_template(args, leaves, compiled)
        if template is not None:
            self._fast = (template, compiled)
        return compiled._call_flat(leaves)

    def _new_run(self) -> None:
        """Drop the programs compiled in an earlier run (their communicators are gone); ValueError
        naming this function when no run is joined now."""
        run_state.require(self.__name__)
        with COMPILE_LOCK:
            self._cache.clear()
            self._fast = None
            self._generation = run_state.generation()

    def _key(self, args: tuple, leaves: list, tree) -> tuple:
        """The per-``Jitted`` cache key: structure, then per leaf its shape, dtype and sharding: an
        array's own, a tensor's from ``in_shardings`` (replicated by default), so a ``torch.Tensor``
        and a ``ShardedArray`` laid out alike share a key; a static leaf's ``lowering.static_key``.

        Raises TypeError, naming the argument, for a static leaf that is not an immutable value
        (``lowering.check_static``)."""
        specs = self._entry_shardings(args, tree)
        parts: list = [tree]
        for i, (leaf, spec) in enumerate(zip(leaves, specs)):
            if isinstance(leaf, ShardedArray):
                parts.append((tuple(leaf.shape), leaf.dtype, leaf.sharding))
            elif isinstance(leaf, torch.Tensor):
                parts.append((tuple(leaf.shape), leaf.dtype, spec or self._replicated))
            else:
                from spmd.lowering import check_static

                parts.append(("static", check_static(self.__name__, self.in_shardings, args, i, leaf)))
        return tuple(parts)

    def _entry_shardings(self, args: tuple, tree) -> list:
        """Per flat leaf, the ``NamedSharding`` of ``in_shardings`` for it (or None); cached per structure.

        When ``in_shardings`` does not fit the arguments, every entry is None (lowering then raises
        the error naming the argument).
        """
        specs = self._specs.get(tree)
        if specs is None:
            from spmd.lowering import leaf_specs

            try:
                specs = [_as_named(s, self.mesh, "in_shardings") for s in leaf_specs(self.in_shardings, args,
                                                                                       "in_shardings")]
            except (TypeError, ValueError):
                specs = [None] * tree.num_leaves
            self._specs[tree] = specs
        return specs

    def lower(self, *args) -> Lowered:
        """Import and run the compiler pipeline for these arguments (no execution).

        Thread-safe: traces run one at a time in the process (``spmd.compile_lock``).
        """
        from spmd.lowering import lower_function

        with COMPILE_LOCK:
            return lower_function(self, args)


class Lowered:
    """A program lowered for specific argument shapes and shardings.

    ``as_text(stage)`` gives the HLO text after a stage (see
    ``spmd.passes.pipeline.STAGES``); ``compile()`` builds the executable.
    """

    def __init__(self, jitted: Jitted, program, pipeline_result, in_leaves, arg_tree, out_tree, static_leaves,
                 cache_key):
        self.jitted = jitted
        self.program = program
        self.result = pipeline_result
        self.in_leaves: list[_Leaf] = in_leaves
        self.arg_tree = arg_tree
        self.out_tree = out_tree
        self.static_leaves = static_leaves
        self.cache_key = cache_key

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(self.result.stage_text)

    def as_text(self, stage: str = "spmd-partition") -> str:
        """HLO text after ``stage``. Raises TypeError for a non-str, ValueError for an unknown stage."""
        if not isinstance(stage, str):
            raise TypeError(f"stage must be a stage name (str), got {type(stage).__name__} {stage!r}")
        try:
            return self.result.stage_text[stage]
        except KeyError:
            raise ValueError(f"unknown stage {stage!r}; expected one of {list(self.result.stage_text)}") from None

    def compile(self) -> Compiled:
        """Build (or fetch from the process-wide cache) the executable.

        The process-wide cache keeps a ``CompiledTemplate`` per module text, which holds no caller;
        a hit gives this ``Lowered`` its own ``Compiled`` from it, so what a caller's calls hold on
        the devices (captured graphs, donated static buffers, hoisted weight values) is freed
        with that caller's ``jit``.

        Thread-safe: one thread compiles a module, others wait and share it (``spmd.compile_lock``).
        """
        with COMPILE_LOCK:
            template = _GLOBAL_CACHE.get(self.cache_key)
            if template is not None:
                metrics.counter("compile_cache.global_hit").inc()
                return template.rebind(self)
            start = time.perf_counter()
            compiled = compile_module(self)
            metrics.timer("compile").record(time.perf_counter() - start + self.result_time_s)
            _GLOBAL_CACHE[self.cache_key] = compiled.template()
            return compiled

    @property
    def result_time_s(self) -> float:
        return sum(self.result.pass_ms.values()) / 1e3


def _as_named(spec, mesh: Mesh, what: str) -> NamedSharding | None:
    if spec is None or isinstance(spec, NamedSharding):
        if isinstance(spec, NamedSharding) and spec.mesh != mesh:
            raise ValueError(f"{what}: sharding is on mesh {spec.mesh}, expected the jit mesh {mesh}")
        return spec
    if isinstance(spec, PartitionSpec):
        try:
            return NamedSharding(mesh, spec)
        except ValueError as e:  # name the argument instead of NamedSharding's ``spec``
            raise ValueError(f"{what}: {str(e).removeprefix('spec: ')}") from None
    raise TypeError(f"{what}: expected a PartitionSpec, NamedSharding or None, got {type(spec).__name__}")


def _fast_template(args: tuple, leaves: list, compiled: Compiled) -> tuple | None:
    """The argument structure of the call fast path, or None when ``args`` do not qualify.

    Per positional argument: None for one ``ShardedArray``, or the key tuple of a dict of
    ``ShardedArray``s (one level, the order ``pytree`` flattens it in). Qualifying calls have
    no static leaves and every array laid out as compiled, so a later call with the same
    template whose arrays match the compiled shapes, dtypes and shardings has the same cache
    key: it skips flattening, the key and the lookup (``_fast_leaves``).
    """
    if compiled.lowered.static_leaves:
        return None
    template: list = []
    for a in args:
        if type(a) is ShardedArray:
            template.append(None)
        elif type(a) is dict and all(type(v) is ShardedArray for v in a.values()):
            template.append(tuple(a))
        else:
            return None
    if len(leaves) != len(compiled.input_shardings) or any(
            a._sharding != s for a, s in zip(leaves, compiled.input_shardings)):
        return None
    return tuple(template)


def _fast_leaves(args: tuple, template: tuple) -> list | None:
    """The flat leaves of ``args`` when they have ``template``'s structure, else None.

    Leaves are not checked here (``Compiled._call_laid_out`` checks every one).
    """
    if len(args) != len(template):
        return None
    leaves: list = []
    for a, keys in zip(args, template):
        if keys is None:
            leaves.append(a)
        elif type(a) is dict and tuple(a) == keys:
            leaves.extend(a.values())
        else:
            return None
    return leaves
