"""Shared pieces of the ATen -> HLO-lite conversion table.

A converter is ``fn(em: Emitter, a: dict[str, Any], val) -> Instruction | tuple | None``:
``a`` holds the op's arguments by schema name (defaults filled in; graph values replaced by
their converted instructions), ``val`` is the node's ``meta["val"]`` (a FakeTensor, or a list of
them), which gives the result shape and dtype as PyTorch computed them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd.frontend.emitter import Emitter, dtype_of
from spmd.ir.hlo import Instruction

Converter = Callable[[Emitter, dict[str, Any], Any], Any]

ATEN_OPS: dict[Any, Converter] = {}


class UnsupportedOpError(TypeError):
    """An operation of the traced program has no HLO-lite conversion.

    The message names the ATen op and the user's source file:line.
    """


class InvalidArgumentError(TypeError):
    """An op of the traced program is given an argument PyTorch eager rejects (e.g. a float index
    tensor). The converter raises it; the message then gets the ATen op and the user's file:line.
    """


INDEX_DTYPES = (torch.int64, torch.int32)
LONG = (torch.int64,)  # index_copy and one_hot take int64 indices only
MASKS = (torch.int64, torch.int32, torch.bool)  # advanced indexing: x[i], x[i] = v (index / index_put)


def check_index(x: Instruction, what: str = "index", allowed: tuple = INDEX_DTYPES) -> None:
    """Raise ``InvalidArgumentError`` unless ``x``'s dtype is one of ``allowed``, as PyTorch eager does.

    Without it a float index would be truncated (and a uint8 one, a mask to eager, read as positions).
    """
    if x.shape.torch_dtype not in allowed:
        kinds, got = ("/".join(str(d).removeprefix("torch.") for d in ds) for ds in (allowed, [x.shape.torch_dtype]))
        raise InvalidArgumentError(f"expected an integer ({kinds}) {what} tensor, got {got}")


class Missing:
    """A multi-output op's result that is not converted (e.g. max.dim's indices).

    Using it as an operand raises UnsupportedOpError naming ``what``.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.where = "<unknown location>"


def register(*ops) -> Callable[[Converter], Converter]:
    """Decorator: register a converter for the given ATen op overloads."""
    def deco(fn: Converter) -> Converter:
        for op in ops:
            ATEN_OPS[op] = fn
        return fn
    return deco


def bind_args(op, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Arguments of an OpOverload call by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def norm_dim(d: int, rank: int) -> int:
    """A possibly negative dim as an index in ``[0, rank)`` (0 for rank 0)."""
    return d % rank if rank else 0


def norm_dims(dims: Sequence[int] | int | None, rank: int) -> tuple[int, ...]:
    """Reduction dims: None or [] mean all dims; a 0-d tensor has none (its dim 0 / -1 is itself)."""
    if dims is None or rank == 0:
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = (dims,)
    if len(dims) == 0:
        return tuple(range(rank))
    return tuple(sorted({norm_dim(d, rank) for d in dims}))


def _dummy(x: Any) -> Any:
    if isinstance(x, Instruction):
        return torch.empty((1,) * min(x.shape.rank, 1), dtype=x.shape.torch_dtype)
    return x


def promote(*xs: Any) -> str:
    """HLO dtype of PyTorch type promotion over instructions (as tensors) and Python scalars."""
    vals = [_dummy(x) for x in xs if x is not None]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    if not tensors:
        return dtype_of(torch.tensor(vals[0]).dtype)
    acc = tensors[0]
    for v in vals:
        if v is acc:
            continue
        dt = torch.result_type(acc, v)
        acc = torch.empty((1,) * max(acc.dim(), v.dim() if isinstance(v, torch.Tensor) else 0), dtype=dt)
    return dtype_of(acc.dtype)


def operand(em: Emitter, x: Any, dtype: str, dims: Sequence[int]) -> Instruction:
    """``x`` (an instruction or a Python scalar) as ``dtype`` broadcast NumPy-style to ``dims``."""
    dims = tuple(dims)
    if isinstance(x, Instruction):
        return em.broadcast_to(em.convert(x, dtype), dims)
    if isinstance(x, (bool, int, float)):
        return em.scalar(x, dtype, dims)
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        return em.scalar(x.item(), dtype, dims)
    raise TypeError(f"unsupported operand {x!r}")


def out_dtype(val: Any) -> str:
    return dtype_of(val.dtype)


def out_dims(val: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in val.shape)
