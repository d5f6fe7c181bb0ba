"""``spmd.parallelize``: shard an ``nn.Module``'s parameters by a plan and compile its forward.

    mesh = Mesh.create(("tp",), devices="cpu:4")
    pm = parallelize(model, mesh, bert_plan())
    y = pm(input_ids, attention_mask)          # ShardedArray (or a pytree of them)
    print(pm.lowered.as_text("spmd-partition"))
    print(summarize_collectives(pm.lowered.as_text("spmd-partition")))

The forward is ``torch.func.functional_call(module, params, inputs)`` staged with
``spmd.jit``: ``params`` is the dict FQN -> ``ShardedArray`` laid out by the plan
(``spmd.models.plans.resolve_plan``), the inputs are replicated unless
``input_shardings`` says otherwise. The module itself is not modified.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from spmd.array import ShardedArray, device_put
from spmd.distributed import state as run_state
from spmd.frontend.constraint import with_sharding_constraint
from spmd.jit import jit
from spmd.mesh import Mesh
from spmd.models.plans import Plan, activation_layouts, resolve_plan
from spmd.passes.pipeline import CompileOptions
from spmd.sharding import NamedSharding, PartitionSpec


class ParallelModule:
    """A module whose parameters live on a mesh as ``ShardedArray``s, with a compiled forward.

    Attributes:
      module: the original module (its CPU parameters are not changed).
      mesh, plan, options: as passed to ``parallelize``.
      param_specs: {parameter FQN: PartitionSpec}.
      params: {parameter FQN: ShardedArray}.
      lowered / compiled: of the most recent input signature (None before the first call or
        ``lower``); ``compile_s`` is the wall time that lowering + compiling took, in seconds.
    """

    def __init__(self, module, mesh, plan, param_specs, params, input_shardings, options):
        self.module = module
        self.mesh = mesh
        self.plan = plan
        self.param_specs = param_specs
        self.params = params
        self.input_shardings = input_shardings
        self.options = options
        self.lowered = None
        self.compiled = None
        self.compile_s = 0.0
        self._compiled_by_key: dict[tuple, tuple] = {}
        self._jitted: dict[int, object] = {}
        self._generation = run_state.generation()  # of the run the compiled forwards belong to

    def _jit_for(self, n_inputs: int):
        if n_inputs not in self._jitted:
            specs = self.input_shardings
            if specs is None:
                specs = (PartitionSpec(),) * n_inputs
            elif len(specs) != n_inputs:
                raise ValueError(f"inputs: expected {len(specs)} (one per entry of input_shardings), got {n_inputs}")
            module = self.module
            fn = lambda params, *inputs: torch.func.functional_call(module, params, inputs)
            fn.__name__ = type(module).__name__
            self._jitted[n_inputs] = jit(fn, mesh=self.mesh, in_shardings=(None, *specs), options=self.options,
                                         weight_argnums=0)
        return self._jitted[n_inputs]

    def _key(self, inputs) -> tuple:
        """Per input its shape, dtype and the sharding it enters with (a tensor and an array laid out
        alike share a key; an array of another sharding keeps its own and is reported at the call)."""
        specs = self.input_shardings or (PartitionSpec(),) * len(inputs)
        named = [s if isinstance(s, NamedSharding) else NamedSharding(self.mesh, s) if isinstance(s, PartitionSpec)
                 else None for s in specs] if len(specs) == len(inputs) else [None] * len(inputs)
        return tuple(_input_key(x, n) for x, n in zip(inputs, named))

    def place_inputs(self, *inputs) -> list[ShardedArray]:
        """Put forward inputs (CPU or device tensors) on the mesh with their input shardings."""
        specs = self.input_shardings or (PartitionSpec(),) * len(inputs)
        if len(specs) != len(inputs):
            raise ValueError(f"inputs: expected {len(specs)} (one per input sharding), got {len(inputs)}")
        named = [s if isinstance(s, NamedSharding) else NamedSharding(self.mesh, s) for s in specs]
        return [device_put(x, s) for x, s in zip(inputs, named, strict=True)]

    def lower(self, *inputs):
        """Lower and compile the forward for these inputs (no execution); returns the ``Lowered``.

        Raises ValueError when ``params`` lacks a parameter of the module or holds a name that is
        none of them (a missing one would silently fall back to the module's own tensor), and on a
        multi-process mesh after ``spmd.distributed.shutdown`` (in a later run it compiles again).
        """
        if self.mesh.is_multi_process and self._generation != run_state.generation():
            run_state.require(type(self.module).__name__)
            self._compiled_by_key.clear()
            self._jitted.clear()
            self._generation = run_state.generation()
        self._check_param_names()
        key = self._key(inputs)
        if key not in self._compiled_by_key:
            start = time.perf_counter()
            with _activation_hooks(self.module, self.plan):
                lowered = self._jit_for(len(inputs)).lower(self.params, *inputs)
            compiled = lowered.compile()
            self.compile_s = time.perf_counter() - start
            self._compiled_by_key[key] = (lowered, compiled)
        self.lowered, self.compiled = self._compiled_by_key[key]
        return self.lowered

    def __call__(self, *inputs):
        """Run the forward on ``inputs`` (torch.Tensors or ShardedArrays); returns ShardedArray(s).

        Raises what ``lower`` and the compiled forward raise."""
        self.lower(*inputs)
        return self.compiled(self.params, *inputs)

    def _check_param_names(self) -> None:
        if not isinstance(self.params, dict):
            raise TypeError(f"params: expected a dict {{parameter name: ShardedArray}}, "
                            f"got {type(self.params).__name__}")
        if self.params.keys() != self.param_specs.keys():
            missing = sorted(self.param_specs.keys() - self.params.keys())
            extra = sorted(self.params.keys() - self.param_specs.keys())
            raise ValueError(f"params: expected exactly the module's parameters; missing {missing[:5]}, "
                             f"unexpected {extra[:5]} (replace an entry with an array of the same sharding "
                             f"instead of removing or adding one)")

    def __repr__(self) -> str:
        split = sum(1 for s in self.param_specs.values() if any(e is not None for e in s))
        return (f"ParallelModule({type(self.module).__name__}, {self.mesh!r}, "
                f"{split}/{len(self.param_specs)} parameters sharded over {self.plan.tp_axis!r})")


def _input_key(x, named: NamedSharding | None) -> tuple:
    """The compile-cache key of one forward input: shape, dtype and sharding of a tensor or array;
    of a pytree (a list or dict of tensors), its structure and its leaves' keys, so that an
    unhashable container reaches ``spmd.jit``'s argument checks instead of failing here."""
    if isinstance(x, (torch.Tensor, ShardedArray)):
        return tuple(x.shape), x.dtype, getattr(x, "sharding", None) or named
    leaves, spec = torch.utils._pytree.tree_flatten(x)
    if len(leaves) == 1 and leaves[0] is x:
        try:
            hash(x)
        except TypeError:
            return "static", type(x).__name__, id(x)
        return "static", type(x).__name__, x
    return "tree", str(spec), tuple(_input_key(leaf, named) for leaf in leaves)


def _split(t, dim: int | None, axis: str):
    """``t`` constrained to be split on ``dim`` over ``axis`` (other dims unsplit); non-tensors pass through."""
    if dim is None or not isinstance(t, torch.Tensor) or not -t.dim() <= dim < t.dim():
        return t
    dim %= t.dim()
    return with_sharding_constraint(t, [axis if d == dim else None for d in range(t.dim())])


@contextlib.contextmanager
def _activation_hooks(module: nn.Module, plan: Plan):
    """While tracing, pin the activation layouts the plan asks for (see ``plans.activation_layouts``)."""
    handles = []
    axis = plan.tp_axis
    for name, in_dim, out_dim in activation_layouts(module, plan):
        sub = module.get_submodule(name)
        if in_dim is not None:
            handles.append(sub.register_forward_pre_hook(
                lambda _m, args, d=in_dim: tuple(_split(a, d, axis) for a in args)))
        if out_dim is not None:
            handles.append(sub.register_forward_hook(lambda _m, _args, out, d=out_dim: _split(out, d, axis)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def parallelize(
    module: nn.Module,
    mesh: Mesh,
    plan: Plan,
    input_shardings=None,
    options: CompileOptions | None = None,
) -> ParallelModule:
    """Place ``module``'s parameters on ``mesh`` per ``plan`` and stage its forward with ``spmd.jit``.

    Args:
      module: an ``nn.Module`` whose forward ``torch.export`` can trace (buffers, if any, are
        baked into the program as constants).
      mesh: the device mesh; it must hold ``plan.tp_axis``.
      plan: a ``spmd.models.plans.Plan``.
      input_shardings: a tuple of one ``PartitionSpec`` / ``NamedSharding`` per forward input
        (also for a single input: ``(P("dp"),)``); None replicates every input. An input may be a
        tensor, a ``ShardedArray`` or a pytree (list, dict) of them.
      options: ``CompileOptions`` of the compilation.
    Returns:
      A ``ParallelModule``; the first call lowers and compiles.
    Raises:
      TypeError: ``module`` is not an nn.Module, ``mesh`` not a Mesh, ``plan`` not a Plan,
        ``input_shardings`` not a tuple (one bare spec included).
      ValueError: the plan does not fit the module or the mesh (see ``resolve_plan``).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a spmd.Mesh, got {type(mesh).__name__}")
    if isinstance(input_shardings, (PartitionSpec, NamedSharding)):
        raise TypeError(f"input_shardings: expected a tuple of specs (one per input), got one "
                        f"{type(input_shardings).__name__}; write ({input_shardings!r},) for a single input")
    if input_shardings is not None and not isinstance(input_shardings, tuple):
        got = type(input_shardings).__name__
        shown = f"; write {tuple(input_shardings)!r}" if isinstance(input_shardings, list) else ""
        raise TypeError(f"input_shardings: expected a tuple of specs (one per input), got {got}{shown}")
    specs = resolve_plan(module, mesh, plan)
    named = dict(module.named_parameters())
    with torch.no_grad():
        params = {fqn: device_put(named[fqn].detach(), NamedSharding(mesh, spec)) for fqn, spec in specs.items()}
    return ParallelModule(module, mesh, plan, specs, params, input_shardings, options or CompileOptions())


# ----------------------------------------------------------------- collectives summary

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\([^=]*?\)|[a-z0-9]+\[[\d,]*\])\s+([a-z\-]+)\(([^)]*)\)(.*)$")
_ARRAY = re.compile(r"([a-z0-9]+)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "f64": 8}


@dataclass(frozen=True)
class CollectiveStat:
    """All collectives of one kind in a program: count and bytes one device sends, summed."""

    opcode: str
    count: int
    bytes_per_device: int


def _array_bytes(shape_text: str) -> int:
    """Bytes of the first array shape in ``shape_text`` (for a tuple: its first element)."""
    m = _ARRAY.search(shape_text)
    if m is None:
        return 0
    n = 1
    for d in filter(None, m.group(2).split(",")):
        n *= int(d)
    return n * _ITEMSIZE.get(m.group(1), 4)


def _group_size(attrs: str, num_partitions: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)  # iota form [groups,size]<=[n]
    return int(m.group(2)) if m else num_partitions


def ring_bytes_per_device(opcode: str, operand_bytes: int, group_size: int) -> int:
    """Bytes one device sends for ``opcode`` on a per-device operand of ``operand_bytes``.

    Ring algorithms (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms", 2009):
    all-gather sends (n-1) shards; reduce-scatter and all-to-all (n-1)/n of the operand;
    all-reduce 2 (n-1)/n; collective-permute the whole operand.
    """
    n = group_size
    if n <= 1 and opcode != "collective-permute":
        return 0
    return {
        "all-gather": operand_bytes * (n - 1),
        "reduce-scatter": operand_bytes * (n - 1) // max(n, 1),
        "all-to-all": operand_bytes * (n - 1) // max(n, 1),
        "all-reduce": 2 * operand_bytes * (n - 1) // max(n, 1),
    }.get(opcode, operand_bytes)


def summarize_collectives(hlo_text: str) -> list[CollectiveStat]:
    """Collectives of a partitioned HLO text program (entry and called computations), by kind.

    Async ``*-start`` forms count as their collective; ``*-done`` is not counted. The operand's
    per-device shape gives the bytes (see ``ring_bytes_per_device``). Returns one
    ``CollectiveStat`` per kind present, in ``COLLECTIVE_KINDS`` order.
    """
    m = re.search(r"num_partitions=(\d+)", hlo_text)
    num_partitions = int(m.group(1)) if m else 1
    shapes: dict[str, str] = {}
    counts: Counter = Counter()
    nbytes: Counter = Counter()
    for line in hlo_text.splitlines():
        d = _DEF.match(line)
        if d is None:
            continue
        name, shape, opcode, operands, attrs = d.groups()
        shapes[name] = shape
        kind = opcode.removesuffix("-start")
        if kind not in COLLECTIVE_KINDS:
            continue
        first = operands.split(",")[0].strip().lstrip("%")
        operand_bytes = _array_bytes(shapes.get(first, shape))
        counts[kind] += 1
        nbytes[kind] += ring_bytes_per_device(kind, operand_bytes, _group_size(attrs, num_partitions))
    return [CollectiveStat(k, counts[k], nbytes[k]) for k in COLLECTIVE_KINDS if counts[k]]
