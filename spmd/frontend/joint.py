"""Joint forward + backward import: programs that take gradients inside themselves.

A function that calls ``torch.autograd.grad``, ``Tensor.backward`` or a ``torch.func`` transform
(``grad``, ``grad_and_value``, ``vjp``) cannot go through ``torch.export``'s pre-dispatch tracing
(backward kernels run outside its proxy: "fake tensor in the exported program constant's list",
"Cannot access storage of TensorWrapper"). Such a program is traced the way AOT autograd traces
a joint graph (``torch._functorch.aot_autograd``): ``make_fx`` below the autograd key, so the
autograd engine (or functorch) runs the backward on fake tensors and every forward and backward
ATen kernel lands in one graph; then a second ``make_fx`` pass over that graph functionalizes
it (the engine's in-place gradient accumulation, ``fill_``, ``sub_``) and decomposes every op
without a converter (the backward ops: ``_softmax_backward_data``, ``native_layer_norm_backward``,
``gelu_backward``, ``threshold_backward``, ...) with ``torch._decomp.core_aten_decompositions``
into ops the importer converts. The converter table is the one ``torch.export`` programs use.

``scaled_dot_product_attention`` is traced as two fused ops, a forward that keeps the softmax
statistics and its backward (``spmd.frontend.joint_attention``: custom calls ``attention-forward``
/ ``attention-backward``, run by flash / memory-efficient kernels); where those cannot take the
call (dropout, GQA broadcast, a mask that needs a gradient, ``CompileOptions.fused_attention_grad``
off) it is traced as its math definition (matmul, softmax, matmul; PyTorch's
``_scaled_dot_product_attention_math``) so its backward is plain dots and softmax backward.
Under saved-tensor hooks (``torch.utils.checkpoint(use_reentrant=False)``) SDPA is left to ATen,
whose fused op and backward convert (``spmd.frontend.aten_sdpa_ops``): the checkpoint recomputes
the region where this module's mode does not see it, so the forward must run the same op.

``GradDetector`` is the switch: a ``TorchFunctionMode`` active while ``torch.export`` traces that
stops the export at the first gradient request (``requires_grad_``, ``autograd.grad``, ...).
"""

from __future__ import annotations

import inspect
import math
import re
import traceback
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from spmd.frontend.aten_common import ATEN_OPS, UnsupportedOpError
from spmd.frontend.emitter import Emitter, dtype_of
from spmd.frontend.joint_attention import check_sdpa_args, fused_sdpa, repeat_heads, use_fused
from spmd.frontend.joint_checkpoint import (
    RANDOM_FUNCS,
    RandomAtenInCheckpoint,
    random_in_checkpoint,
    reentrant_checkpoints,
    saved_tensors_hooked,
)
from spmd.ir.hlo import Computation, Module, Shape, SourceLocation

__all__ = ["GradDetector", "NeedsJoint", "import_joint", "trace_joint"]

_GRAD_FUNCS = frozenset({
    torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward, torch.Tensor.requires_grad_,
    torch.Tensor.requires_grad.__set__,
})


def _asks_for_grad(func, args: tuple, kwargs: dict) -> bool:
    """Whether a call of one of ``_GRAD_FUNCS`` requests gradients (export itself resets
    ``requires_grad`` to False on its fake inputs: not a request)."""
    if func is torch.Tensor.requires_grad.__set__:
        return bool(args[1]) if len(args) > 1 else False
    if func is torch.Tensor.requires_grad_:
        return bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
    return True


def _check_differentiable(x) -> None:
    """TypeError for a gradient requested of an integer / bool tensor, naming the user's line."""
    if not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.dtype.is_complex:
        return
    from spmd.frontend.torch_export import _LIBRARY_DIRS

    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(_LIBRARY_DIRS)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    raise TypeError(f"gradients requested for a tensor of dtype {x.dtype} and shape {tuple(x.shape)}{where}: "
                    "only floating-point tensors have gradients (differentiate with respect to float inputs)")


class NeedsJoint(Exception):
    """Raised inside ``torch.export`` tracing when the program asks for gradients."""


class GradDetector(TorchFunctionMode):
    """Raises ``NeedsJoint`` (and sets ``seen``) at the first gradient request of the traced program.

    ``count_setter=False`` ignores ``tensor.requires_grad = True`` (export sets it on a module's
    fake parameters itself).
    """

    def __init__(self, count_setter: bool = True) -> None:
        super().__init__()
        self.seen = False
        self.funcs = _GRAD_FUNCS if count_setter else _GRAD_FUNCS - {torch.Tensor.requires_grad.__set__}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.funcs and _asks_for_grad(func, args, kwargs or {}):
            _check_differentiable(args[0] if args else None)
            self.seen = True
            raise NeedsJoint(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` as PyTorch documents it (softmax(q kᵀ · scale + bias) v).

    Shapes: query ``[..., L, E]``, key ``[..., S, E]``, value ``[..., S, Ev]`` -> ``[..., L, Ev]``.
    ``enable_gqa`` repeats the key / value heads per query-head group first.
    Raises NotImplementedError for ``dropout_p > 0``.
    """
    if dropout_p:
        raise NotImplementedError("scaled_dot_product_attention with dropout_p > 0")
    if enable_gqa and min(query.dim(), key.dim(), value.dim()) >= 3:
        key, value = repeat_heads(key, query.shape[-3]), repeat_heads(value, query.shape[-3])
    n_q, n_k = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    return torch.matmul(torch.softmax(scores, dim=-1), value)


def _dropout_p(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs) -> float:
    return dropout_p


class _JointMode(TorchFunctionMode):
    """Traces SDPA as fused ops (else its math) and tags the nodes of each torch call with the caller's stack.

    Backward kernels run inside ``torch.autograd.grad`` (or the ``torch.func`` transform), so
    they are tagged with the line that asked for the gradient.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        fx_traceback.set_stack_trace(traceback.format_stack()[:-1])
        if func is torch.nn.functional.scaled_dot_product_attention:
            check_sdpa_args(*args, **(kwargs or {}))
            if saved_tensors_hooked() and not _dropout_p(*args, **(kwargs or {})):
                return func(*args, **(kwargs or {}))
            if use_fused(*args, **(kwargs or {})):
                return fused_sdpa(*args, **(kwargs or {}))
            return _sdpa_math(*args, **(kwargs or {}))
        if func in RANDOM_FUNCS:
            random_in_checkpoint(func, args, kwargs or {})
        if func is torch.nn.functional.multi_head_attention_forward:
            if saved_tensors_hooked():  # as SDPA above: the recomputation runs it unchanged
                return func(*args, **(kwargs or {}))
            return _mha_with_weights(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


def _mha_with_weights(func, args, kwargs):
    """``F.multi_head_attention_forward`` (``nn.MultiheadAttention``) with ``need_weights=True``.

    Torch calls made inside a function this mode handles are not seen by the mode, so the SDPA that
    ``need_weights=False`` calls would reach ATen's own fused kernel (``spmd.frontend.aten_sdpa_ops``
    converts it, but without this mode's choice between the fused ops and the math definition).
    With ``need_weights=True`` PyTorch writes the attention out (bmm, softmax, bmm); the output is
    the same and the unused weights are dead code. Returns (output, None) then.
    """
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    if bound.arguments["need_weights"]:
        return func(*args, **kwargs)
    bound.arguments["need_weights"] = True
    return func(*bound.args, **bound.kwargs)[0], None


def _decompositions() -> dict:
    """torch's core ATen decompositions of every op the importer has no converter for."""
    from torch._decomp import core_aten_decompositions

    return {op: fn for op, fn in core_aten_decompositions().items() if op not in ATEN_OPS}


def _make_fx(fn, **kwargs):
    # Tensors the function captures (a closure's tensor, a module buffer that functional_call
    # does not replace) are real tensors among the fake ones: the fake mode converts them and the
    # tracer records them as constants of the graph (get_attr nodes), as torch.export lifts them.
    return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True, **kwargs)


def trace_joint(flat_fn, examples: tuple) -> torch.fx.GraphModule:
    """The functional, decomposed ATen graph of ``flat_fn(*examples)`` including its backward.

    ``flat_fn`` takes tensors positionally and returns a tuple of tensors.
    """
    # The program's gradients do not depend on the caller's grad mode (a jitted step called under
    # torch.no_grad() still trains); grad-mode changes inside flat_fn are traced as written.
    def guarded(*xs):
        with RandomAtenInCheckpoint():
            return flat_fn(*xs)

    with fx_traceback.preserve_node_meta(), reentrant_checkpoints(), _JointMode(), torch.enable_grad():
        graph = _make_fx(guarded)(*examples)

    def replay(*xs):
        with fx_traceback.preserve_node_meta():
            return torch.fx.Interpreter(graph).run(*xs)

    functional = torch.func.functionalize(replay, remove="mutations")
    return _make_fx(functional, decomposition_table=_decompositions())(*examples)


def import_joint(flat_fn, examples: tuple, name: str):
    """Trace ``flat_fn`` with ``trace_joint`` and convert it; returns an ``ImportedProgram``."""
    from spmd.frontend.aten_random_ops import rng_key_parameter
    from spmd.frontend.torch_export import ImportedProgram, _convert_node, _lookup, _where, location_of

    gm = trace_joint(flat_fn, examples)
    em = Emitter()
    env: dict[str, Any] = {}
    names: list[str] = []
    root = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            env[node.name] = em.parameter(len(names), Shape(dtype_of(val), tuple(int(d) for d in val.shape)),
                                          node.name, node.name)
            names.append(node.name)
        elif node.op == "get_attr":
            em.base_name = node.name
            env[node.name] = em.constant(getattr(gm, node.target))
        elif node.op == "call_function":
            env[node.name] = _convert_node(em, node, env)
        elif node.op == "output":
            em.location = SourceLocation(op_name="output")
            em.base_name = "output"
            outs = []
            for x in pytree.tree_leaves(node.args[0]):
                if not isinstance(x, torch.fx.Node):
                    raise UnsupportedOpError(f"unsupported non-tensor program output {x!r}")
                outs.append(_lookup(env, em.location)(x))
            root = outs[0] if len(outs) == 1 else em.tuple(outs)
        else:
            raise UnsupportedOpError(f"unsupported graph node {node.op} {node.target} at {_where(location_of(node))}")
    rng = rng_key_parameter(em)
    entry = Computation("main", em.instructions, root)
    entry.remove_dead()
    used = {id(i.attrs["to_apply"]) for i in entry.instructions if "to_apply" in i.attrs}
    module = Module(re.sub(r"\W", "_", name), entry, [c for c in em.computations if id(c) in used])
    n_out = len(root.operands) if root.opcode == "tuple" else 1
    return ImportedProgram(
        module=module, input_names=tuple(names), param_names=(), param_values=(),
        in_tree=pytree.tree_structure((tuple(examples), {})), user_leaf_indices=tuple(range(len(names))),
        out_tree=pytree.tree_structure(tuple(range(n_out))),
        rng_key_parameter=None if rng is None else rng.attrs["parameter_number"])
