"""``with_sharding_constraint``: pin the sharding of an intermediate value.

Inside ``torch.export`` the call records the custom op ``spmd::sharding_constraint(x, spec)``
(identity semantics, a fake impl so it traces), which the frontend turns into
``custom-call(x), custom_call_target="Sharding"`` with ``Instruction.sharding`` set. Run eagerly
it returns ``x`` itself. As JAX's ``jax.lax.with_sharding_constraint``.

The spec travels through the graph as a JSON string
``{"dims": [["dp"], [], ["tp", "sp"]], "partial": []}`` (per dim the mesh axes that split it,
major to minor; then the axes over which the value is a pending sum).
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Iterable
from typing import Any

import torch

from spmd.ir.sharding import TensorSharding

__all__ = ["with_sharding_constraint", "encode_spec", "decode_spec", "normalize_spec"]


@torch.library.custom_op("spmd::sharding_constraint", mutates_args=())
def _sharding_constraint(x: torch.Tensor, spec: str) -> torch.Tensor:
    """Identity (a copy: custom ops may not return an alias of their input)."""
    return x.clone()


@_sharding_constraint.register_fake
def _sharding_constraint_fake(x: torch.Tensor, spec: str) -> torch.Tensor:
    return torch.empty_like(x)


def _sharding_constraint_backward(ctx, grad: torch.Tensor):
    return grad, None


_sharding_constraint.register_autograd(_sharding_constraint_backward)


def _entry(entry: Any, dim: int) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, Iterable) and all(isinstance(a, str) for a in entry):
        return tuple(entry)
    raise TypeError(f"spec entry for dim {dim}: expected None, a mesh axis name or a tuple of names, got {entry!r}")


def normalize_spec(spec: Any, rank: int) -> TensorSharding:
    """``spec`` as a TensorSharding of ``rank`` dims.

    Accepts a TensorSharding, an object with a ``.spec`` attribute (a PartitionSpec-like
    value; its ``.partial`` attribute, if any, gives pending-sum axes) or an iterable with one
    entry per dim (None | str | tuple of str). Fewer entries than ``rank`` leave the trailing
    dims unsharded, as in JAX.

    Raises:
      TypeError: an entry is not None / str / tuple of str.
      ValueError: more entries than ``rank``, or an axis used twice.
    """
    if isinstance(spec, TensorSharding):
        dims, partial = list(spec.dims), tuple(spec.partial)
    else:
        partial = tuple(getattr(spec, "partial", ()) or ())
        entries = getattr(spec, "spec", spec)
        if not isinstance(entries, Iterable) or isinstance(entries, str):
            raise TypeError(f"spec: expected a PartitionSpec or a sequence of per-dim entries, got {spec!r}")
        dims = [_entry(e, i) for i, e in enumerate(entries)]
    if len(dims) > rank:
        raise ValueError(f"spec: has {len(dims)} entries but the tensor has rank {rank}")
    dims += [()] * (rank - len(dims))
    used = [a for d in dims for a in d] + list(partial)
    twice = sorted({a for a in used if used.count(a) > 1})
    if twice:
        raise ValueError(f"spec: mesh axis {twice[0]!r} is used twice in {spec!r}; each axis may shard one dim")
    _check_against_tracing_mesh(spec, used)
    return TensorSharding(tuple(dims), partial)


# The mesh of the program being traced by spmd.jit, so constraints are checked where they are written.
TRACING_MESH: contextvars.ContextVar = contextvars.ContextVar("spmd_tracing_mesh", default=None)


def _check_against_tracing_mesh(spec: Any, used: list[str]) -> None:
    mesh = TRACING_MESH.get()
    if mesh is None:
        return
    spec_mesh = getattr(spec, "mesh", None)
    if spec_mesh is not None and spec_mesh != mesh:
        raise ValueError(f"spec: a sharding on mesh {spec_mesh}, expected one on the jit mesh {mesh}")
    unknown = [a for a in used if a not in mesh.shape.axis_names]
    if unknown:
        raise ValueError(f"spec: unknown mesh axis {unknown[0]!r}; the mesh has axes {mesh.shape.axis_names}")


def encode_spec(sharding: TensorSharding) -> str:
    """The JSON string the custom op carries."""
    return json.dumps({"dims": [list(d) for d in sharding.dims], "partial": list(sharding.partial)})


def decode_spec(text: str) -> TensorSharding:
    """Inverse of ``encode_spec``. Raises ValueError on malformed text."""
    try:
        obj = json.loads(text)
        return TensorSharding(tuple(tuple(d) for d in obj["dims"]), tuple(obj.get("partial", ())))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"malformed sharding constraint spec {text!r}: {e}") from None


def _is_tracing(x: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True
    return type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter)


def with_sharding_constraint(x: torch.Tensor, spec: Any) -> torch.Tensor:
    """Constrain the sharding of ``x`` (shape ``[d0, ...]``, any dtype) inside an spmd program.

    ``spec`` has one entry per dim: None (unsharded), a mesh axis name, or a tuple of names
    (major to minor); a PartitionSpec-like object with ``.spec`` works too. Eagerly this
    returns ``x``; under ``torch.export`` it records the constraint for the compiler.

    Raises:
      TypeError: ``x`` is not a tensor, or a spec entry has the wrong type.
      ValueError: the spec has more entries than ``x`` has dims.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    sharding = normalize_spec(spec, x.dim())
    if not _is_tracing(x):
        return x
    return torch.ops.spmd.sharding_constraint(x, encode_spec(sharding))
