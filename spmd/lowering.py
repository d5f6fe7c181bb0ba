"""Lowering a ``Jitted`` function for concrete arguments: flatten, resolve shardings, import, run passes.

The imported program takes the flattened tensor leaves of the arguments as
its parameters, in ``torch.utils._pytree`` order; non-tensor leaves are static: compiled in as
constants, so they must be immutable values (``check_static``; ``static_key`` keys the caches).
Tracing uses uninitialised CPU tensors of the arguments' shapes (``torch.export`` sees
them as fake tensors, so no data is read and no device memory is touched).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import sys
import types
from enum import Enum
from typing import Any

import torch
import torch.utils._pytree as pytree

from spmd.array import ShardedArray
from spmd.ir.hlo import Instruction, Module, SourceLocation
from spmd.ir.text import print_module
from spmd.passes.pipeline import run_pipeline
from spmd.sharding import NamedSharding, PartitionSpec


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding))


def leaf_specs(spec_tree: Any, values: tuple, what: str, single: bool = False) -> list:
    """Per-leaf sharding specs of ``values`` from a spec tree given per top-level value.

    ``spec_tree`` is None, one spec for everything, or a sequence with one entry
    per value, each a spec (for all leaves of that value) or a pytree matching it.
    Raises ValueError when the structure does not match, naming the argument (``what`` is
    "in_shardings") or output and the spec entry (``what`` itself when ``single``: the one
    output of a function that returns no tuple, ``spec_tree`` wrapping ``out_shardings``).
    """
    if _is_spec_leaf(spec_tree):
        return [spec_tree] * len(pytree.tree_leaves(values))
    if not isinstance(spec_tree, (tuple, list)):
        raise TypeError(f"{what}: expected a PartitionSpec, NamedSharding, None or one entry per argument, "
                        f"got {type(spec_tree).__name__}")
    if len(spec_tree) != len(values):
        raise ValueError(f"{what} has {len(spec_tree)} entries (one per argument), but the function was called "
                         f"with {len(values)} arguments")
    out: list = []
    for i, (spec, value) in enumerate(zip(spec_tree, values)):
        n_leaves = len(pytree.tree_leaves(value))
        if _is_spec_leaf(spec):
            out.extend([spec] * n_leaves)
            continue
        specs, spec_def = pytree.tree_flatten(_align(spec, value), is_leaf=_is_spec_leaf)
        value_def = pytree.tree_structure(value)
        if spec_def != value_def:
            name = f"args[{i}]: the sharding tree does not match the argument: the argument" \
                if what == "in_shardings" else f"output {i}: the sharding tree does not match the output: the output"
            raise ValueError(f"{name} is {_describe(value_def)}, but {what if single else f'{what}[{i}]'} is "
                             f"{_describe(spec_def)}")
        out.extend(specs)
    return out


_TENSORS = (torch.Tensor, ShardedArray)
EXPECTED_TENSOR = "expected a torch.Tensor or spmd.ShardedArray (or a pytree of them)"


def check_tensor_arguments(spec_tree: Any, args: tuple, fn_name: str) -> None:
    """TypeError for a positional argument given its own sharding that is not a tensor (pytree).

    ``spec_tree`` is ``in_shardings`` (already matched to ``args`` by ``leaf_specs``). Only
    per-argument entries are checked: an argument whose entry (or a spec inside it) is not
    None must have tensor / ``ShardedArray`` leaves there, and at least one leaf. With one spec
    for every argument, or a None entry, non-tensor leaves stay static values.
    Raises TypeError naming the argument position, e.g. ``argument 1: ... got list``.
    """
    if _is_spec_leaf(spec_tree) or not isinstance(spec_tree, (tuple, list)):
        return
    for i, (spec, value) in enumerate(zip(spec_tree, args)):
        if spec is None:
            continue
        leaves = pytree.tree_flatten_with_path(value)[0]
        specs = leaf_specs((spec,), (value,), "in_shardings")
        bad = [(path, x) for (path, x), s in zip(leaves, specs) if s is not None and not isinstance(x, _TENSORS)]
        if not leaves or bad:
            raise TypeError(f"{fn_name}: argument {i}: {EXPECTED_TENSOR}, got {_describe_value(value, i, bad)}")


def _describe_value(value: Any, i: int, bad: list) -> str:
    """``list`` when no leaf (or every leaf) is wrong; else ``list with float at args[1][2]``."""
    name = type(value).__name__
    if not bad or not bad[0][0] or len(bad) == len(pytree.tree_leaves(value)):
        return name
    path, leaf = bad[0]
    return f"{name} with {type(leaf).__name__} at args[{i}]{pytree.keystr(path)}"


def _non_tensor_arguments(args: tuple) -> list[tuple[int, str]]:
    """(position, type name) of each positional argument that is None or holds a non-tensor leaf."""
    out = []
    for i, value in enumerate(args):
        leaves = pytree.tree_flatten_with_path(value)[0]
        bad = [(path, x) for path, x in leaves if not isinstance(x, _TENSORS)]
        if not leaves or bad:
            out.append((i, _describe_value(value, i, bad)))
    return out


def _traced_call(jitted, args: tuple, call_args: list):
    """``jitted.fn(*call_args)``; a TypeError it raises names the arguments that are not tensors.

    Non-tensor arguments reach the function as they are (static values); when one meets a
    tensor operation the TypeError would otherwise name only fake tensors.
    """
    try:
        return jitted.fn(*call_args)
    except TypeError as e:
        suspects = _non_tensor_arguments(args)
        msg = str(e).replace("FakeTensor", "Tensor")  # tracing runs on fake tensors
        if suspects:
            which = "; ".join(f"argument {i}: {EXPECTED_TENSOR}, got {what}" for i, what in suspects)
            raise TypeError(f"{jitted.__name__}: {which} (non-tensor arguments are passed to the function as "
                            f"static values; the function raised TypeError: {msg})") from e
        if msg != str(e):
            raise TypeError(f"{jitted.__name__}: the function raised TypeError while tracing: {msg}") from e
        raise


# functions are keyed by identity, as the jitted function itself is (what they capture is compiled in)
_STATIC_ATOMS = (type(None), bool, int, float, complex, str, bytes, Enum, torch.dtype, torch.device, torch.layout,
                 torch.memory_format, type(Ellipsis), types.FunctionType)
STATIC_VALUES = ("None, bool, int, float, complex, str, bytes, an enum member, torch.dtype, torch.device, a "
                 "function, or a tuple / frozenset / slice / frozen dataclass of those")


def _is_value_dataclass(value) -> bool:
    """A ``@dataclass(frozen=True)`` instance with field equality (eq=True, the default)."""
    params = getattr(type(value), "__dataclass_params__", None)
    return params is not None and params.frozen and params.eq


def _static_parts(value) -> tuple | None:
    """The parts of a static container value (a tuple, frozenset, slice or frozen dataclass), else None."""
    if isinstance(value, (tuple, frozenset)):
        return tuple(value)
    if isinstance(value, slice):
        return value.start, value.stop, value.step
    if _is_value_dataclass(value):
        return tuple(getattr(value, f.name) for f in dataclasses.fields(value))
    return None


def _is_numpy_scalar(value) -> bool:
    """A numpy bool / int / float / complex scalar (immutable, compared by value)."""
    np = sys.modules.get("numpy")  # not imported: no value is a numpy scalar
    return np is not None and isinstance(value, np.generic) and value.dtype.kind in "biufc"


def _static_problem(value) -> str | None:
    """None when ``value`` can be compiled in as a constant (``STATIC_VALUES``: its equality is its
    content and it can hold no tensor), else the type name of the (innermost) part that cannot."""
    if isinstance(value, _STATIC_ATOMS) or _is_numpy_scalar(value):
        return None
    if isinstance(value, types.BuiltinFunctionType):  # torch.relu, math.sqrt; not a bound method such as t.mul
        owner = value.__self__
        return None if owner is None or isinstance(owner, types.ModuleType) else type(owner).__name__
    parts = _static_parts(value)
    if parts is None:
        return type(value).__name__
    return next((p for p in map(_static_problem, parts) if p is not None), None)


def static_key(value):
    """A static value (one ``_static_problem`` accepts) as a hashable cache key: equal keys compile
    to the same program. Unlike ``==``, NaN matches NaN, and 0.0 and -0.0, 1, 1.0 and True differ."""
    if isinstance(value, float):
        return type(value), value.hex()
    if isinstance(value, complex):
        return type(value), value.real.hex(), value.imag.hex()
    if _is_numpy_scalar(value):
        return type(value), value.tobytes()
    parts = _static_parts(value)
    if parts is None:
        return type(value), value
    keys = map(static_key, parts)
    return type(value), frozenset(keys) if isinstance(value, frozenset) else tuple(keys)


def check_static(fn_name: str, in_shardings, args: tuple, index: int, leaf):
    """``static_key`` of flat leaf ``index`` of ``args``, a non-tensor leaf compiled in as a constant.

    Raises TypeError, naming the argument, for a value that cannot be: one whose equality does
    not follow its content, or that may hold a tensor (which would go stale in the program). An
    argument ``in_shardings`` gives a sharding gets ``check_tensor_arguments``' error instead.
    """
    got = type(leaf).__name__
    problem = _static_problem(leaf)
    if problem is None:
        key = static_key(leaf)
        try:
            hash(key)
            return key
        except TypeError:
            got = f"unhashable {got}"
    elif problem != got:
        got = f"{got} holding a {problem}"
    check_tensor_arguments(in_shardings, args, fn_name)
    path = pytree.keystr(pytree.tree_flatten_with_path(args)[0][index][0])
    if type(leaf).__module__ == "numpy":
        got += " (convert it with torch.from_numpy)"
    elif dataclasses.is_dataclass(leaf) and not _is_value_dataclass(leaf):
        got += " (a dataclass must be @dataclass(frozen=True) of such values)"
    raise TypeError(f"{fn_name}: argument args{path}: a non-tensor argument is compiled in as a constant, so it "
                    f"must be an immutable value ({STATIC_VALUES}); got {got}. Pass tensors as arguments "
                    "(alone or in a dict / list / tuple), not inside other objects")


def _align(spec, value):
    """``spec`` with its dicts reordered to ``value``'s key order (dict order is not meaningful)."""
    if isinstance(spec, dict) and isinstance(value, dict) and set(spec) == set(value):
        return {k: _align(spec[k], value[k]) for k in value}
    if isinstance(spec, (list, tuple)) and not _is_spec_leaf(spec) and isinstance(value, (list, tuple)) \
            and len(spec) == len(value):
        items = [_align(a, v) for a, v in zip(spec, value)]
        return type(spec)(*items) if hasattr(spec, "_fields") else type(spec)(items)  # a NamedTuple takes fields
    return spec


def _describe(tree) -> str:
    """A short description of a pytree structure for error messages."""
    if tree.is_leaf():
        return "a single value"
    if tree.type is dict:
        return f"a dict with keys {list(tree.context)}"
    return f"a {getattr(tree.type, '__name__', tree.type)} of {tree.num_children}"


def _resolve_leaf(leaf, spec, mesh, name: str):
    """The NamedSharding one tensor leaf enters the program with."""
    from spmd.jit import _as_named, _Leaf

    named = _as_named(spec, mesh, name)
    if isinstance(leaf, ShardedArray):
        leaf._check_alive(name) if hasattr(leaf, "_check_alive") else None
        if leaf.sharding.mesh != mesh:
            raise ValueError(f"{name}: array lives on mesh {leaf.sharding.mesh}, expected the jit mesh {mesh}")
        named = named or leaf.sharding
    elif named is None:
        named = NamedSharding(mesh, PartitionSpec())
    named.validate(tuple(leaf.shape), name)
    return _Leaf(tuple(leaf.shape), leaf.dtype, named)


def lower_function(jitted, args: tuple):
    """Lower ``jitted`` for ``args``; returns a ``spmd.jit.Lowered``."""
    from spmd.frontend.torch_export import import_program
    from spmd.jit import Lowered

    mesh = jitted.mesh
    leaves, arg_tree = pytree.tree_flatten(args)
    specs = leaf_specs(jitted.in_shardings, args, "in_shardings")
    check_tensor_arguments(jitted.in_shardings, args, jitted.__name__)
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(args)[0]]
    tensor_idx = [i for i, x in enumerate(leaves) if isinstance(x, (torch.Tensor, ShardedArray))]
    in_leaves = [_resolve_leaf(leaves[i], specs[i], mesh, f"argument args{paths[i]}") for i in tensor_idx]
    static = {i: leaves[i] for i in range(len(leaves)) if i not in set(tensor_idx)}
    static_keys = tuple((i, check_static(jitted.__name__, jitted.in_shardings, args, i, v)) for i, v in static.items())
    holder: dict[str, Any] = {}

    def flat_fn(*tensors):
        full = list(leaves)
        for i, t in zip(tensor_idx, tensors):
            full[i] = t
        out = _traced_call(jitted, args, list(pytree.tree_unflatten(full, arg_tree)))
        out_leaves, holder["out_tree"] = pytree.tree_flatten(out)
        bad = [type(x).__name__ for x in out_leaves if not isinstance(x, torch.Tensor)]
        if bad or not out_leaves:
            raise TypeError(f"{jitted.__name__}: a jitted function must return tensors (or a tuple / list / dict "
                            f"of tensors), got {bad[0] if bad else 'no tensor'}")
        return tuple(out_leaves)

    _keep_user_frames(jitted.fn)
    for what, argnums in (("donate_argnums", jitted.donate_argnums), ("weight_argnums", jitted.weight_argnums)):
        for a in argnums:
            if a >= len(args):
                raise ValueError(f"{what}: argument {a} does not exist; the function was called with "
                                 f"{len(args)} arguments")
    # Example inputs on the CPU: export traces them as fake tensors (no data is read), and
    # tensors the function captures or creates on the CPU meet inputs on the same device.
    examples = [torch.empty(leaf.shape, dtype=leaf.dtype) for leaf in in_leaves]
    program = _import(import_program, flat_fn, examples, jitted, paths, tensor_idx)
    module = program.module
    out_tree = holder["out_tree"]
    _name_parameters(module, jitted.fn, [paths[i] for i in tensor_idx])
    _annotate(module, mesh, in_leaves + _rng_key_leaves(program, mesh), jitted.out_shardings, out_tree)
    root = module.entry.root
    # The text drops axes of size 1 from shardings (P("tp") and P() print alike on {tp=1}); the
    # shardings themselves keep the names, so two layouts the text confuses get separate entries.
    layouts = tuple(p.sharding for p in module.entry.parameters) + tuple(
        o.sharding for o in (root.operands if root.opcode == "tuple" else [root]))
    key = (print_module(module), layouts, mesh, jitted.options, jitted.donate_argnums, jitted.weight_argnums,
           static_keys)
    out_avals = [(torch.Size(o.shape.dims), o.shape.torch_dtype)
                 for o in (root.operands if root.opcode == "tuple" else [root])]
    from spmd.compiled import donated_leaves

    donated = donated_leaves(jitted.donate_argnums, arg_tree, static)
    weights = frozenset(donated_leaves(jitted.weight_argnums, arg_tree, static)) - frozenset(donated)
    result = run_pipeline(module, jitted.options, weights=weights, process_ids=tuple(mesh.process_ids))
    lowered = Lowered(jitted, program, result, in_leaves, arg_tree, out_tree, static, key)
    lowered.out_avals = out_avals
    return lowered


def _rng_key_leaves(program, mesh) -> list:
    """The replicated ``s64[2]`` random-key input a program that draws random numbers takes last
    (``spmd.frontend.aten_random_ops``); ``Compiled`` passes a fresh key at every call."""
    from spmd.jit import _Leaf

    if program.rng_key_parameter is None:
        return []
    return [_Leaf((2,), torch.int64, NamedSharding(mesh, PartitionSpec()))]


_SHAPES_SHOWN = 6  # argument shapes quoted at each end in a tracing error


def _import(import_program, flat_fn, examples, jitted, paths, tensor_idx):
    """Trace and import; a shape error inside the user's function becomes a ValueError naming the shapes,
    an in-place update of a module buffer or captured tensor one saying so (``_mutated_state_message``)."""
    from spmd.frontend.constraint import TRACING_MESH
    from spmd.frontend.joint_attention import FUSED_ATTENTION_GRAD
    from spmd.frontend.torch_export import UnsupportedOpError

    token = TRACING_MESH.set(jitted.mesh)
    fused_token = FUSED_ATTENTION_GRAD.set(jitted.options.fused_attention_grad)
    quiet = [(log, log.level) for log in map(logging.getLogger, _TRACE_LOGGERS)]
    for log, _ in quiet:  # their tracebacks and graph dumps repeat the error raised below
        log.setLevel(logging.CRITICAL)
    try:
        return import_program(flat_fn, tuple(examples), name=_module_name(jitted.__name__))
    except (UnsupportedOpError, ValueError, TypeError):
        raise
    except (RuntimeError, ArithmeticError) as e:  # ArithmeticError: e.g. a decomposition dividing by a
        # zero numel (mse_loss's backward on an empty batch)
        if _MUTATED_CONSTANT.match(str(e)):
            raise ValueError(_mutated_state_message(jitted)) from e
        shapes = [f"args{paths[i]}: {tuple(x.shape)}" for i, x in zip(tensor_idx, examples)]
        if len(shapes) > 2 * _SHAPES_SHOWN:  # a train step of a real model has hundreds of leaves: the first
            # ones (usually weights) and the last ones (usually the batch) are kept
            shapes = [*shapes[:_SHAPES_SHOWN], f"... {len(shapes) - 2 * _SHAPES_SHOWN} more ...",
                      *shapes[-_SHAPES_SHOWN:]]
        shapes = ", ".join(shapes)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{jitted.__name__}: tracing failed: {first} (argument shapes {shapes})") from e
    finally:
        TRACING_MESH.reset(token)
        FUSED_ATTENTION_GRAD.reset(fused_token)
        for log, level in quiet:
            log.setLevel(level)


# torch.export's error for a captured tensor (an nn.Module's buffer, under spmd.jit) updated in place
_MUTATED_CONSTANT = re.compile(r"Constant \S+ is mutated in the forward method")


def _mutated_state_message(jitted) -> str:
    """Why a function that updates a captured tensor (e.g. a module's buffer) in place cannot be compiled."""
    fn = jitted.fn
    norms = [f"{type(m).__name__} {name!r}" if name else type(m).__name__ for name, m in fn.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats] \
        if isinstance(fn, torch.nn.Module) else []
    which = (f"here {', '.join(norms)} updates its running statistics in training mode" if norms else
             "e.g. BatchNorm's running statistics in training mode")
    return (f"{jitted.__name__}: the function updates a module buffer (or another tensor it captures) in place "
            f"({which}); spmd.jit compiles a module's parameters and buffers, and tensors the function captures, "
            "in as constants, so it cannot compile that. Call module.eval() for inference, or pass the state as an "
            "argument and return its new value (torch.func.functional_call(module, state, inputs))")


# PyTorch loggers that print an error's traceback (fake-tensor meta failures) or the partial graph
# (data-dependent guards) while tracing; the error itself reaches the user as an exception.
_TRACE_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")


def _name_parameters(module: Module, fn, paths: list[str]) -> None:
    """Name entry parameters after the user's arguments (``x``, ``params.w1``) instead of ``args_0``."""
    try:
        arg_names = [p.name for p in inspect.signature(getattr(fn, "forward", fn)).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return
    for param, path in zip(module.entry.parameters, paths):
        m = re.match(r"\[(\d+)\](.*)", path)
        if m is None or int(m.group(1)) >= len(arg_names):
            continue
        rest = ".".join(re.findall(r"\w+", m.group(2)))
        base = _module_name(arg_names[int(m.group(1))] + ("." + rest if rest else ""))
        param.name = module.fresh_name(base)
        if param.location is not None:
            param.location = SourceLocation(op_name=param.name)


def _module_name(fn_name: str) -> str:
    """An HLO module name from a Python function name (``<lambda>`` becomes ``lambda``)."""
    name = re.sub(r"[^A-Za-z0-9_.]", "", fn_name)
    return name if name and not name[0].isdigit() else "main"


def _keep_user_frames(fn) -> None:
    """Ask torch.export to keep ``fn``'s frames in node stack traces (it keeps only ``forward`` frames).

    With them, an instruction's location (and an unsupported-op error) names the user's line.
    """
    import torch.fx.proxy as fx_proxy

    register = getattr(fx_proxy, "_register_stack_trace_anchor", None)
    target = getattr(fn, "forward", fn)
    if register is not None and hasattr(target, "__code__"):
        register(target)


def _annotate(module: Module, mesh, in_leaves, out_shardings, out_tree) -> None:
    """Set the mesh, parameter shardings, and output constraints on the imported module."""
    module.mesh = mesh.shape
    params = module.entry.parameters
    assert len(params) == len(in_leaves), (len(params), len(in_leaves))
    for param, leaf in zip(params, in_leaves):
        param.sharding = leaf.sharding.to_tensor_sharding(len(leaf.shape))
    if out_shardings is None:
        return
    n_out = out_tree.num_leaves
    outs = pytree.tree_unflatten([0] * n_out, out_tree)
    n_top = len(outs) if isinstance(outs, tuple) else 1
    if isinstance(outs, tuple) and not _is_spec_leaf(out_shardings) \
            and not isinstance(out_shardings, (tuple, list)):
        raise TypeError(f"out_shardings: expected a PartitionSpec, NamedSharding, None or a tuple / list with "
                        f"one entry per output (the function returns a tuple of {n_top}), got "
                        f"{type(out_shardings).__name__} {out_shardings!r}")
    if not _is_spec_leaf(out_shardings) and isinstance(out_shardings, (tuple, list)) \
            and len(out_shardings) != n_top:
        raise ValueError(f"out_shardings has {len(out_shardings)} entries, but the function returns "
                         f"{n_top} output(s)")
    if _is_spec_leaf(out_shardings):
        specs = [out_shardings] * n_out
    else:
        specs = leaf_specs(tuple(out_shardings) if isinstance(outs, tuple) else (out_shardings,),
                           outs if isinstance(outs, tuple) else (outs,), "out_shardings", not isinstance(outs, tuple))
    root = module.entry.root
    outputs = root.operands if root.opcode == "tuple" else [root]
    for k, (value, spec) in enumerate(zip(outputs, specs)):
        from spmd.jit import _as_named

        named = _as_named(spec, mesh, f"out_shardings[{k}]")
        if named is None:
            continue
        if named.partial:
            raise ValueError(f"out_shardings[{k}]: expected a sharded or replicated output, got partial "
                             f"sums over {named.partial}; outputs are always reduced (drop partial=)")
        named.validate(tuple(value.shape.dims), f"out_shardings[{k}]")
        constraint = Instruction(
            module.fresh_name(f"output.{k}.sharding"), "custom-call", value.shape, [value],
            {"custom_call_target": "Sharding"}, sharding=named.to_tensor_sharding(value.shape.rank))
        entry = module.entry
        entry.instructions.insert(entry.instructions.index(root) + (root.opcode != "tuple"), constraint)
        if root.opcode == "tuple":
            root.operands[k] = constraint
        else:
            entry.root = constraint
