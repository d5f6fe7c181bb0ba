"""torch.export -> HLO-lite: import a PyTorch function or nn.Module as an unpartitioned Module.

``import_program(fn_or_module, args, kwargs)`` traces with ``torch.export.export(strict=False)``
and converts the ATen graph node by node with the table in ``spmd.frontend.aten_ops`` /
``aten_shape_ops``. The graph is first taken as export produces it (high-level ops such as
linear, softmax, layer_norm, scaled_dot_product_attention, gelu and silu are kept and map to
one dot or one custom call); only when it holds ops without a converter is it run through
``run_decompositions`` with a table that keeps every op that has one.

Entry parameters are numbered: the user's tensor inputs (flattened ``(args, kwargs)``), then,
for an nn.Module, its parameters and buffers by fully qualified name. Tensor constants
captured by the program become ``constant`` instructions. Shapes are global; no shardings
and an empty mesh. An input updated in place must also be returned (the program is functional:
``spmd.frontend.mutations``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import sys
import traceback
import types
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

import spmd.frontend.aten_conv_ops  # noqa: F401  (registers converters)
import spmd.frontend.aten_index_ops  # noqa: F401  (registers converters)
import spmd.frontend.aten_more_ops  # noqa: F401  (registers converters)
import spmd.frontend.aten_nn_ops  # noqa: F401  (registers converters)
import spmd.frontend.aten_ops  # noqa: F401  (registers converters)
import spmd.frontend.aten_random_ops  # noqa: F401  (registers converters)
import spmd.frontend.aten_sdpa_ops  # noqa: F401  (registers converters)
import spmd.frontend.aten_shape_ops  # noqa: F401  (registers converters)
import spmd.frontend.aten_sort_ops  # noqa: F401  (registers converters)
import spmd.frontend.aten_update_ops  # noqa: F401  (registers converters)
from spmd.frontend.aten_common import ATEN_OPS, InvalidArgumentError, Missing, UnsupportedOpError, bind_args
from spmd.frontend.aten_random_ops import rng_key_parameter
from spmd.frontend.emitter import Emitter, dtype_of
from spmd.frontend.joint import GradDetector, import_joint
from spmd.frontend.mutations import data_dependent_hint, user_output_nodes
from spmd.ir.hlo import Computation, Instruction, Module, Shape, SourceLocation

__all__ = ["ImportedProgram", "UnsupportedOpError", "import_program", "export_program"]


@dataclass(frozen=True)
class ImportedProgram:
    """The result of ``import_program``.

    Fields:
      module: the HLO-lite Module (global shapes, no shardings, empty mesh).
      input_names: one name per entry parameter, in parameter_number order: the user's tensor
        inputs (export's placeholder names), then parameter and buffer FQNs.
      param_names: the FQNs of the module's parameters and buffers (a suffix of input_names).
      param_values: their tensors, in ``param_names`` order.
      in_tree: pytree spec of ``(args, kwargs)``.
      user_leaf_indices: for each user tensor parameter, its index among the flattened leaves
        of ``(args, kwargs)`` (non-tensor leaves are baked into the program).
      out_tree: pytree spec to unflatten the outputs (the root's elements when it is a tuple).
      rng_key_parameter: parameter_number of the ``s64[2]`` random key (``rng_key``, the last
        parameter, not in input_names) when the program draws random numbers, else None; the
        caller passes a fresh ``spmd.ir.random.draw_key()`` there (``spmd.frontend.aten_random_ops``).
    """

    module: Module
    input_names: tuple[str, ...]
    param_names: tuple[str, ...]
    param_values: tuple[torch.Tensor, ...]
    in_tree: Any
    user_leaf_indices: tuple[int, ...]
    out_tree: Any
    rng_key_parameter: int | None = None

    @property
    def num_user_inputs(self) -> int:
        return len(self.input_names) - len(self.param_names)


class _FnModule(torch.nn.Module):
    """Wraps a function as a module for torch.export."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = _traceable(fn)

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _traceable(fn):
    """``fn`` with its code object named ``forward``.

    torch.export records a node's stack trace only through frames named ``forward``; renaming
    the code of a plain Python function keeps its frames (and so its file:line) in the trace.
    Other callables are returned unchanged.
    """
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None:
        return fn
    renamed = types.FunctionType(code.replace(co_name="forward"), fn.__globals__, fn.__name__,
                                 fn.__defaults__, fn.__closure__)
    renamed.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(renamed, fn)


class TracedProgramError(RuntimeError):
    """An IndexError that PyTorch raised inside the traced program (a dim or index out of range,
    as eager raises it), re-raised as a RuntimeError so that ``spmd.jit`` reports it as the
    ValueError "tracing failed: ..." it gives for PyTorch's other errors in the user's program."""


def export_program(fn_or_module, args: tuple, kwargs: dict | None = None) -> ExportedProgram:
    """``torch.export.export(strict=False)`` of a function or module, decomposed only if needed.

    Thread-safe: export uses process-global dispatch modes, so traces run one at a time
    (``spmd.compile_lock``).
    """
    from spmd.compile_lock import COMPILE_LOCK

    with COMPILE_LOCK:
        return _export(fn_or_module, args, kwargs)


def _quiet_export(mod: torch.nn.Module, args: tuple, kwargs: dict) -> ExportedProgram:
    """``torch.export.export(strict=False)`` with what it writes to stderr held back: torch prints
    the partial FX graph of a failed trace to stderr before raising, which spmd turns into its own
    error (the graph stays on the exception as ``partial_fx_graph``). The held text is written
    out unless the trace failed on a data-dependent value."""
    held = io.StringIO()
    dropped = False
    try:
        with contextlib.redirect_stderr(held):
            return torch.export.export(mod, args, kwargs, strict=False)
    except GuardOnDataDependentSymNode:
        dropped = True
        raise
    finally:
        text = held.getvalue()
        if text and not dropped:
            sys.stderr.write(text)


def _export(fn_or_module, args: tuple, kwargs: dict | None) -> ExportedProgram:
    mod = fn_or_module if isinstance(fn_or_module, torch.nn.Module) else _FnModule(fn_or_module)
    try:
        ep = _quiet_export(mod, tuple(args), kwargs or {})
    except GuardOnDataDependentSymNode as e:
        frames = [(f.filename, f.lineno) for f in traceback.extract_tb(e.__traceback__)]
        frames = [f for f in frames + _FRAME.findall(str(e)) if not f[0].startswith(_LIBRARY_DIRS)]
        at = f" at {frames[-1][0]}:{frames[-1][1]}" if frames else ""
        raise ValueError(f"{data_dependent_hint()}{at}: {str(e).strip().splitlines()[0]}") from e
    except IndexError as e:  # the program's own bad dim / index, as eager raises it ("Dimension out of range"):
        raise TracedProgramError(str(e)) from e  # reported like torch's RuntimeErrors (a ValueError, see lowering)
    if any(n.op == "call_function" and n.target not in ATEN_OPS for n in ep.graph.nodes):
        table = torch.export.default_decompositions()
        for op in ATEN_OPS:
            if isinstance(op, torch._ops.OpOverload) and op in table:
                del table[op]
        with warnings.catch_warnings():  # torch's own pytree deprecation, raised inside run_decompositions
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            ep = ep.run_decompositions(table)
    return ep


def import_program(fn_or_module, args, kwargs: dict | None = None, name: str | None = None) -> ImportedProgram:
    """Trace ``fn_or_module(*args, **kwargs)`` and convert it to HLO-lite.

    Args:
      fn_or_module: a callable or an ``nn.Module`` (put it in eval mode for inference: dropout
        in training mode is unsupported).
      args, kwargs: example inputs; tensors become parameters with their shapes and dtypes.
      name: module name (default: the function or class name).
    Raises:
      UnsupportedOpError (a TypeError): an op without conversion, or with side effects (an effect
        token, e.g. torch.linalg's error checks); the message names the ATen op and the user's file:line.
      InvalidArgumentError (a TypeError): an op given an argument PyTorch rejects (an index tensor
        of a non-integer dtype), named with the op and the user's file:line.
    """
    if name is None:
        name = getattr(fn_or_module, "__name__", type(fn_or_module).__name__)
    name = re.sub(r"\W", "_", name)
    if isinstance(fn_or_module, torch.nn.Module) or kwargs:
        # export itself sets requires_grad on a module's fake parameters: only explicit requests count
        det = GradDetector(count_setter=False)
        try:
            with det:
                ep = export_program(fn_or_module, tuple(args), kwargs)
        except Exception:
            if not det.seen:
                raise
        if det.seen:
            raise UnsupportedOpError(
                f"{name}: gradients taken inside an nn.Module's forward (or with keyword arguments) cannot be "
                "traced; take them in a function of positional tensors, e.g. torch.func.grad_and_value over "
                "torch.func.functional_call(module, params, inputs)")
        return _convert(ep, name)
    det = GradDetector()
    user_fn = _traceable(fn_or_module)  # keeps the user's frames in node stack traces

    @functools.wraps(fn_or_module)
    def detecting(*xs):
        with det:
            return user_fn(*xs)

    try:
        ep = export_program(detecting, tuple(args))
    except Exception:
        if not det.seen:
            raise
    if det.seen:  # the program takes gradients: trace forward + backward as one joint graph
        return import_joint(fn_or_module, tuple(args), name)
    return _convert(ep, name)


# --------------------------------------------------------------------------- conversion
def _inputs(ep: ExportedProgram, em: Emitter, env: dict) -> tuple[list[str], list[str], list[torch.Tensor]]:
    specs = ep.graph_signature.input_specs
    user = [s for s in specs if s.kind == InputKind.USER_INPUT]
    state = [s for s in specs if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)]
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    names, params, values = [], [], []
    for spec in user + state:
        node = placeholders.get(spec.arg.name) if hasattr(spec.arg, "name") else None
        if node is None or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        val = node.meta["val"]
        label = node.name if spec.kind == InputKind.USER_INPUT else spec.target
        env[node.name] = em.parameter(len(names), Shape(dtype_of(val), tuple(int(d) for d in val.shape)),
                                      node.name, label)
        names.append(label)
        if spec.kind != InputKind.USER_INPUT:
            params.append(spec.target)
            source = ep.state_dict if spec.target in ep.state_dict else ep.constants
            values.append(source[spec.target])
    for spec in specs:
        if spec.kind == InputKind.CONSTANT_TENSOR:
            em.base_name = spec.arg.name
            env[spec.arg.name] = em.constant(ep.constants[spec.target])
        elif getattr(spec.arg, "class_fqn", None) == "torch._C.Generator":
            raise UnsupportedOpError("random ops with an explicit generator= are not supported (spmd draws a "
                                     "fresh key from the default generator at every call; seed it with "
                                     "torch.manual_seed and drop generator=)")
        elif spec.kind == InputKind.TOKEN:
            raise UnsupportedOpError(f"unsupported operation {_effect_of(ep, spec.arg.name)}: an operation with side "
                                     "effects (torch.export threads an effect token through it, as through the error "
                                     "checks of torch.linalg functions such as inv, or print / assert ops), which spmd "
                                     "cannot compile")
        elif spec.kind not in (InputKind.USER_INPUT, InputKind.PARAMETER, InputKind.BUFFER):
            raise UnsupportedOpError(f"unsupported program input {spec.arg} of kind {spec.kind.name}")
    return names, params, values


def _effect_of(ep: ExportedProgram, token: str) -> str:
    """The effectful op (and its file:line) of the first node consuming the effect ``token`` placeholder."""
    for node in ep.graph.nodes:
        if node.op == "call_function" and any(getattr(a, "name", None) == token for a in node.args):
            if node.target is not torch.ops.higher_order.with_effects:
                return f"{node.target} at {_where(location_of(node))}"
            of = "".join(f" (of {a})" for a in node.args[2:] if isinstance(a, str))  # linalg checks name the API
            return f"{node.args[1]}{of} at {_where(location_of(node))}"
    return "<unknown>"


def _user_leaf_indices(ep: ExportedProgram, names: list[str], n_params: int) -> tuple[int, ...]:
    user_specs = [s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    tensor_names = set(names[: len(names) - n_params])
    return tuple(i for i, s in enumerate(user_specs) if getattr(s.arg, "name", None) in tensor_names)


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep,
                 os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def location_of(node: torch.fx.Node) -> SourceLocation:
    """SourceLocation of an fx node: the ATen op and the innermost frame outside torch and spmd."""
    op = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    if isinstance(node.target, torch._ops.OpOverload):
        op = str(node.target)
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    user = [f for f in frames if not f[0].startswith(_LIBRARY_DIRS)]
    file, line = (user or frames or [("", "0")])[-1]
    return SourceLocation(op_name=op, source_file=file, source_line=int(line))


def _where(loc: SourceLocation) -> str:
    return f"{loc.source_file}:{loc.source_line}" if loc.source_file else "<unknown location>"


def _lookup(env: dict, loc: SourceLocation):
    def get(x):
        if isinstance(x, torch.fx.Node):
            v = env[x.name]
            if isinstance(v, Missing):
                raise UnsupportedOpError(f"unsupported use of {v.what} (computed at {v.where}) "
                                         f"by {loc.op_name} at {_where(loc)}")
            return v
        return x
    return get


#: ATen ops that read a tensor's value into a Python number (``.item()``, ``int(t)``).
_HOST_READS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default})


def _convert_node(em: Emitter, node: torch.fx.Node, env: dict) -> Any:
    loc = location_of(node)
    conv = ATEN_OPS.get(node.target)
    if conv is None and node.target in _HOST_READS:
        raise ValueError(f"{data_dependent_hint()}; `.item()` (or a Python int/float/bool of a tensor) at "
                         f"{_where(loc)} reads a value a compiled program cannot return to Python while tracing")
    if conv is None:
        raise UnsupportedOpError(f"unsupported operation {loc.op_name} at {_where(loc)}: "
                                 "no conversion to HLO-lite")
    get = _lookup(env, loc)
    args = pytree.tree_map(get, node.args)
    kwargs = pytree.tree_map(get, node.kwargs)
    if isinstance(node.target, torch._ops.OpOverload):
        bound = bind_args(node.target, args, kwargs)
    else:
        bound = {"self": args[0], "index": args[1]}
    em.location = loc
    em.base_name = node.name
    try:
        out = conv(em, bound, node.meta.get("val"))
    except UnsupportedOpError:
        raise
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{loc.op_name} at {_where(loc)}: {e}") from None
    except (NotImplementedError, TypeError) as e:
        raise UnsupportedOpError(f"unsupported operation {loc.op_name} at {_where(loc)}: {e}") from e
    for v in out if isinstance(out, tuple) else ():
        if isinstance(v, Missing):
            v.where = _where(loc)
    return out


def _convert(ep: ExportedProgram, name: str) -> ImportedProgram:
    em = Emitter()
    env: dict[str, Any] = {}
    names, params, values = _inputs(ep, em, env)
    root = None
    for node in ep.graph.nodes:
        if node.op == "call_function":
            env[node.name] = _convert_node(em, node, env)
        elif node.op == "output":
            root = _root(ep, em, node, env)
        elif node.op != "placeholder":
            loc = location_of(node)
            raise UnsupportedOpError(f"unsupported graph node {node.op} {node.target} at {_where(loc)}")
    rng = rng_key_parameter(em)
    entry = Computation("main", em.instructions, root)
    entry.remove_dead()
    used = {id(i.attrs["to_apply"]) for i in entry.instructions if "to_apply" in i.attrs}
    comps = [c for c in em.computations if id(c) in used]
    module = Module(name, entry, comps)
    return ImportedProgram(
        module=module,
        input_names=tuple(names),
        param_names=tuple(params),
        param_values=tuple(values),
        in_tree=ep.call_spec.in_spec,
        user_leaf_indices=_user_leaf_indices(ep, names, len(params)),
        out_tree=ep.call_spec.out_spec,
        rng_key_parameter=None if rng is None else rng.attrs["parameter_number"],
    )


def _root(ep: ExportedProgram, em: Emitter, node: torch.fx.Node, env: dict) -> Instruction:
    user = user_output_nodes(ep, node, lambda n: _where(location_of(n)))
    em.location = SourceLocation(op_name="output")
    em.base_name = "output"
    outs = []
    for x in user:
        if not isinstance(x, torch.fx.Node):
            raise UnsupportedOpError(f"unsupported non-tensor program output {x!r}")
        outs.append(_lookup(env, em.location)(x))
    if len(outs) == 1:
        return outs[0]
    return em.tuple(outs)
