"""In-place updates of program inputs: which graph outputs are the user's, and when a mutation is an error.

torch.export functionalizes in-place ops: ``x[:, :4] = y`` on an input ``x`` becomes a
``slice_scatter`` whose result is an extra graph output of kind ``USER_INPUT_MUTATION``
(``BUFFER_MUTATION`` for a module buffer), listed before the user's outputs.

spmd programs are functional, as in JAX: a compiled call never writes into its arguments.
An input updated in place is therefore accepted only when the function also **returns** the
updated tensor (``cache.index_copy_(2, pos, k); return cache``): the returned value equals
PyTorch eager's, and the caller's argument keeps its old value (pass it in ``donate_argnums``
to let the call reuse its memory for the result, as ``jax.jit`` does). An update that is not
returned would be lost, so it is an error naming the input and the line of the update; so is
any update of a module buffer (buffers are constants of the compiled program).
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from spmd.frontend.aten_common import UnsupportedOpError

__all__ = ["data_dependent_hint", "user_output_nodes"]


def user_output_nodes(ep: ExportedProgram, output_node: torch.fx.Node, where) -> list:
    """The graph values of the user's outputs, in order, after checking the input mutations.

    ``where(node) -> str`` gives a node's user file:line for messages.
    Raises UnsupportedOpError (a TypeError) for a mutated input that is not returned, a
    mutated buffer, or any other non-user output kind.
    """
    specs = ep.graph_signature.output_specs
    values = list(output_node.args[0])
    user = [v for s, v in zip(specs, values, strict=True) if s.kind == OutputKind.USER_OUTPUT]
    returned = {v.name for v in user if isinstance(v, torch.fx.Node)}
    for s, v in zip(specs, values, strict=True):
        if s.kind == OutputKind.USER_OUTPUT:
            continue
        at = where(v) if isinstance(v, torch.fx.Node) else "<unknown location>"
        if s.kind == OutputKind.USER_INPUT_MUTATION:
            if isinstance(v, torch.fx.Node) and v.name in returned:
                continue
            raise UnsupportedOpError(
                f"input {s.target} is updated in place (at {at}) but the updated tensor is not returned: "
                "compiled programs never write into their arguments; return the updated tensor "
                "(and pass the argument in donate_argnums to reuse its memory)")
        if s.kind == OutputKind.BUFFER_MUTATION:
            raise UnsupportedOpError(
                f"module buffer {s.target} is updated in place (at {at}): buffers are constants of the "
                "compiled program; pass the state as an argument and return its new value")
        raise UnsupportedOpError(f"unsupported program output {s.arg} of kind {s.kind.name} (at {at})")
    return user


def data_dependent_hint() -> str:
    """The message for a trace that reads a tensor's value on the host (a data-dependent guard).

    The common cause is a 0-d integer tensor used as an index (``cache[:, :, pos] = k``):
    PyTorch turns it into a Python int with ``.item()``, which a compiled program cannot do.
    """
    return ("the program reads a tensor's value on the host while tracing (for example a 0-d tensor "
            "used as an index, `cache[:, :, pos] = k`, calls pos.item()); index with a 1-element tensor "
            "(`cache[:, :, pos.reshape(1)] = k.unsqueeze(2)`), or use `cache.index_copy_(2, pos.reshape(1), "
            "k.unsqueeze(2))` or `torch.ops.aten.index_put_(cache, [None, None, pos], k)`")
