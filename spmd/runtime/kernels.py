"""Opcode -> PyTorch kernel for every non-collective, non-async HLO-lite instruction.

``compile_kernel(inst)`` builds, once per instruction, a closure
``kernel(operands: list[Tensor], out: Tensor | None) -> Tensor``; the runtime calls it per
execution with minimal Python overhead. ``run_kernel(inst, operands, out)`` compiles and calls
in one go (for interpreters and tests).

Semantics follow XLA's operation semantics (https://openxla.org/xla/operation_semantics),
as ``spmd.ir.hlo.OPCODES`` documents. Contract:

- Operands are tensors of the operand instructions' shapes (tuples of tensors for tuple
  shapes) on one device; kernels never write into an operand.
- With ``out`` (a preallocated tensor of the result shape and dtype), the result is written
  into ``out`` and ``out`` is returned. Without ``out`` the result may be a view of an operand
  or a cached constant: treat it as read-only.
- ``device`` (for operand-less ops: constant, iota) is where results are created; it defaults
  to ``out``'s device, else the CPU.
- ``partition-id``, ``parameter``, collectives and async start/done are not kernels (the
  runtime handles them); compiling one raises ValueError.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from spmd.ir.custom_calls import get_custom_call
from spmd.ir.hlo import (
    ASYNC_DONE_OPCODES,
    ASYNC_START_OPCODES,
    COLLECTIVE_OPCODES,
    Instruction,
)
from spmd.runtime import kernels_dot as _dot
from spmd.runtime import kernels_index as _ix
from spmd.runtime import kernels_scatter as _sc

Tensor = torch.Tensor
Kernel = Callable[[list[Tensor], "Tensor | None"], Tensor]

NOT_KERNELS = COLLECTIVE_OPCODES | ASYNC_START_OPCODES | ASYNC_DONE_OPCODES | {"parameter", "partition-id"}


def run_kernel(inst: Instruction, operands: list[Tensor], out: Tensor | None = None,
               device: torch.device | str | None = None) -> Tensor:
    """Execute ``inst`` on ``operands`` (see the module docstring for the contract)."""
    return compile_kernel(inst, device)(operands, out)


def compile_kernel(inst: Instruction, device: torch.device | str | None = None) -> Kernel:
    """A closure ``(operands, out) -> Tensor`` computing ``inst``.

    Args:
      inst: an instruction whose opcode is not in ``NOT_KERNELS``.
      device: where operand-less ops (constant, iota) create their result when no ``out`` is
        given; None = the CPU.
    Raises:
      ValueError: the opcode is not executed by a kernel (collective, async, parameter,
        partition-id) or is unknown.
      NotImplementedError: an attribute combination outside what is supported (interior
        padding, non-embedding gather, variadic reduce, unknown reduce computation).
    """
    if inst.opcode in NOT_KERNELS:
        raise ValueError(f"opcode {inst.opcode!r} of %{inst.name} is not run by a kernel; "
                         "the runtime executes it")
    builder = _BUILDERS.get(inst.opcode)
    if builder is None:
        raise ValueError(f"no kernel for opcode {inst.opcode!r} of %{inst.name}")
    dev = torch.device(device) if device is not None else None
    return builder(inst, dev)


VIEW_KERNEL_OPCODES = frozenset({"reshape", "transpose", "broadcast", "slice"})


def compile_view_kernel(inst: Instruction) -> Kernel:
    """A closure ``(operands, out) -> Tensor`` returning ``inst`` as a view of operand 0, no copy.

    For the instructions ``spmd.passes.views`` decides are views: transpose is ``permute``,
    broadcast ``expand``, slice indexing and reshape ``Tensor.reshape``, a view whenever the
    operand's strides allow (always, for the layouts the analysis assumed; an operand that
    arrives with other strides, such as a caller's non-contiguous argument, is copied, so
    the result is right either way). ``out`` must be None: a view has no buffer.
    Raises ValueError for an opcode outside ``VIEW_KERNEL_OPCODES``.
    """
    if inst.opcode not in VIEW_KERNEL_OPCODES:
        raise ValueError(f"%{inst.name}: {inst.opcode!r} has no view kernel; "
                         f"expected one of {sorted(VIEW_KERNEL_OPCODES)}")
    if inst.opcode == "transpose":
        perm = tuple(inst.attrs["dimensions"])
        return lambda ops, out: ops[0].permute(perm)
    if inst.opcode == "reshape":
        dims = inst.shape.dims
        return lambda ops, out: ops[0].reshape(dims)
    return compile_kernel(inst)  # broadcast and slice kernels return views when given no ``out``


# --------------------------------------------------------------------------- helpers
def _write(out: Tensor | None, value: Tensor) -> Tensor:
    """``value``, or ``out`` after copying ``value`` into it."""
    if out is None:
        return value
    out.copy_(value)
    return out


def _operand_dtypes(inst: Instruction) -> set[str]:
    return {o.shape.dtype for o in inst.operands if not o.shape.is_tuple}


def _u32_safe(fn: Callable, inst: Instruction) -> Callable:
    """Wrap ``fn`` to compute in int64 when operands are u32 (PyTorch lacks most u32 kernels)."""
    if "u32" not in _operand_dtypes(inst):
        return fn
    dtype = inst.shape.torch_dtype

    def wrapped(*args, out=None):
        args = [a.to(torch.int64) if isinstance(a, Tensor) and a.dtype == torch.uint32 else a for a in args]
        return _write(out, fn(*args).to(dtype))
    return wrapped


def _elementwise(fn: Callable, inst: Instruction) -> Kernel:
    """Kernel calling ``fn(*operands)`` or ``fn(*operands, out=out)``."""
    fn = _u32_safe(fn, inst)
    n = len(inst.operands)
    if n == 1:
        def k1(ops: list[Tensor], out: Tensor | None) -> Tensor:
            return fn(ops[0]) if out is None else fn(ops[0], out=out)
        return k1
    if n == 2:
        def k2(ops: list[Tensor], out: Tensor | None) -> Tensor:
            return fn(ops[0], ops[1]) if out is None else fn(ops[0], ops[1], out=out)
        return k2

    def kn(ops: list[Tensor], out: Tensor | None) -> Tensor:
        return fn(*ops) if out is None else fn(*ops, out=out)
    return kn


_UNARY: dict[str, Callable] = {
    "abs": torch.abs, "negate": torch.neg, "exponential": torch.exp, "log": torch.log,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "tanh": torch.tanh, "logistic": torch.sigmoid,
    "erf": torch.erf, "sine": torch.sin, "cosine": torch.cos, "floor": torch.floor,
    "ceil": torch.ceil, "sign": torch.sign, "not": torch.bitwise_not,
    "log-plus-one": torch.log1p, "exponential-minus-one": torch.expm1,
}
_BINARY: dict[str, Callable] = {
    "add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "maximum": torch.maximum,
    "minimum": torch.minimum, "power": torch.pow, "remainder": torch.fmod,
    "and": torch.bitwise_and, "or": torch.bitwise_or,
}
_COMPARE: dict[str, Callable] = {
    "EQ": torch.eq, "NE": torch.ne, "LT": torch.lt, "LE": torch.le, "GT": torch.gt, "GE": torch.ge,
}


def _trunc_div(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """Integer division rounding toward zero, as XLA's integer divide."""
    if out is None:
        return torch.div(a, b, rounding_mode="trunc")
    return torch.div(a, b, rounding_mode="trunc", out=out)


def _build_unary(inst: Instruction, dev) -> Kernel:
    return _elementwise(_UNARY[inst.opcode], inst)


def _build_binary(inst: Instruction, dev) -> Kernel:
    return _elementwise(_BINARY[inst.opcode], inst)


def _build_divide(inst: Instruction, dev) -> Kernel:
    floating = inst.shape.torch_dtype.is_floating_point
    return _elementwise(torch.div if floating else _trunc_div, inst)


def _build_compare(inst: Instruction, dev) -> Kernel:
    direction = inst.attrs["direction"]
    if direction not in _COMPARE:
        raise ValueError(f"compare %{inst.name}: direction must be one of {sorted(_COMPARE)}, got {direction!r}")
    return _elementwise(_COMPARE[direction], inst)


def _build_select(inst: Instruction, dev) -> Kernel:
    return _elementwise(torch.where, inst)


def _build_clamp(inst: Instruction, dev) -> Kernel:
    """clamp(min, x, max): min and max are 0-d or of x's shape."""
    clamp = _u32_safe(torch.clamp, inst)

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        lo, x, hi = ops
        return clamp(x, lo, hi) if out is None else clamp(x, lo, hi, out=out)
    return kernel


def _build_convert(inst: Instruction, dev) -> Kernel:
    dtype = inst.shape.torch_dtype

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        return ops[0].to(dtype) if out is None else out.copy_(ops[0])
    return kernel


def _build_copy(inst: Instruction, dev) -> Kernel:
    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        return ops[0].clone() if out is None else out.copy_(ops[0])
    return kernel


def _device_of(out: Tensor | None, dev: torch.device | None) -> torch.device:
    if out is not None:
        return out.device
    return dev if dev is not None else torch.device("cpu")


def _build_constant(inst: Instruction, dev) -> Kernel:
    """The literal moved once per device to the result dtype (cached)."""
    literal: Tensor = inst.attrs["literal"]
    dtype = inst.shape.torch_dtype
    dims = inst.shape.dims
    cache: dict[torch.device, Tensor] = {}

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        device = _device_of(out, dev)
        value = cache.get(device)
        if value is None:
            value = literal.to(device=device, dtype=dtype).reshape(dims)
            cache[device] = value
        return _write(out, value)
    return kernel


def _build_iota(inst: Instruction, dev) -> Kernel:
    dims = inst.shape.dims
    d = inst.attrs["iota_dimension"]
    dtype = inst.shape.torch_dtype
    view = [1] * len(dims)
    view[d] = dims[d]

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        device = _device_of(out, dev)
        line = torch.arange(dims[d], device=device).to(dtype).reshape(view)
        return _write(out, line.expand(dims))
    return kernel


def _build_broadcast(inst: Instruction, dev) -> Kernel:
    """operand dim i -> output dim dimensions[i]; the other output dims repeat (an expanded view)."""
    dims = tuple(inst.attrs["dimensions"])
    out_dims = inst.shape.dims
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    perm = None if order == list(range(len(dims))) else order
    view = [1] * len(out_dims)
    for i in dims:
        view[i] = out_dims[i]

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        x = ops[0] if perm is None else ops[0].permute(perm)
        return _write(out, x.reshape(view).expand(out_dims))
    return kernel


def _build_reshape(inst: Instruction, dev) -> Kernel:
    dims = inst.shape.dims

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        if out is None:
            return ops[0].reshape(dims)
        out.view(ops[0].shape).copy_(ops[0]) if out.is_contiguous() else out.copy_(ops[0].reshape(dims))
        return out
    return kernel


def _build_transpose(inst: Instruction, dev) -> Kernel:
    perm = tuple(inst.attrs["dimensions"])

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        x = ops[0].permute(perm)
        return x.contiguous() if out is None else out.copy_(x)
    return kernel


def _build_slice(inst: Instruction, dev) -> Kernel:
    index = tuple(slice(s, e, st) for s, e, st in inst.attrs["slice"])

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        return _write(out, ops[0][index])
    return kernel


def _build_concatenate(inst: Instruction, dev) -> Kernel:
    dim = inst.attrs["dimensions"][0]

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        return torch.cat(ops, dim=dim) if out is None else torch.cat(ops, dim=dim, out=out)
    return kernel


def _build_tuple(inst: Instruction, dev) -> Kernel:
    def kernel(ops: list[Tensor], out: Tensor | None):
        return tuple(ops)
    return kernel


def _build_gte(inst: Instruction, dev) -> Kernel:
    index = inst.attrs["index"]

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        return _write(out, ops[0][index])
    return kernel


def _build_custom_call(inst: Instruction, dev) -> Kernel:
    """Dispatch to the ``spmd.ir.custom_calls`` kernel of ``custom_call_target``."""
    spec = get_custom_call(inst.attrs["custom_call_target"])
    config = dict(inst.attrs.get("backend_config") or {})
    fn = spec.fn
    if spec.writes_out:
        return lambda ops, out: fn(ops, config, out)

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        return _write(out, fn(ops, config))
    return kernel


def _build_fusion(inst: Instruction, dev) -> Kernel:
    """A ``fusion``: its called computation as one kernel (``spmd.runtime.kernels_fusion``)."""
    from spmd.runtime.kernels_fusion import build_fusion

    return build_fusion(inst, dev)


# --------------------------------------------------------------------------- reduce
_REDUCERS: dict[str, tuple[Callable, Callable, float | bool]] = {
    # to_apply root opcode -> (reduce over dims, combine with init, identity)
    "add": (lambda x, d, t: torch.sum(x, dim=d, dtype=t), torch.add, 0),
    "maximum": (lambda x, d, t: torch.amax(x, dim=d), torch.maximum, -math.inf),
    "minimum": (lambda x, d, t: torch.amin(x, dim=d), torch.minimum, math.inf),
    "multiply": (lambda x, d, t: _prod(x, d, t), torch.mul, 1),
    "and": (lambda x, d, t: torch.all(x, dim=d), torch.bitwise_and, True),
    "or": (lambda x, d, t: torch.any(x, dim=d), torch.bitwise_or, False),
}


def _prod(x: Tensor, dims: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Product of ``x`` over ``dims`` (torch.prod takes one dim at a time), accumulated in ``dtype``."""
    for d in sorted(dims, reverse=True):
        x = torch.prod(x, dim=d, dtype=dtype)
    return x


def _empty_reduction(x: Tensor, dims: tuple[int, ...], identity) -> Tensor:
    """The reduction of ``x`` over ``dims`` when one of them has size 0: ``identity`` everywhere.

    As XLA's reduce (a reduction over no elements is its init value); torch.amax / amin refuse a
    zero-size dim, so max / min reductions (a variance's or a norm's shift, a shard of a dim split
    into empty pieces) need this. ``identity`` +-inf becomes the integer type's max / min.
    """
    shape = [n for i, n in enumerate(x.shape) if i not in dims]
    if isinstance(identity, float) and math.isinf(identity) and not x.dtype.is_floating_point:
        if x.dtype == torch.bool:
            identity = identity > 0
        else:
            info = torch.iinfo(x.dtype)
            identity = info.max if identity > 0 else info.min
    return torch.full(shape, identity, dtype=x.dtype, device=x.device)


def _init_is_identity(init: Instruction, identity) -> bool:
    if init.opcode != "constant":
        return False
    lit: Tensor = init.attrs["literal"]
    if lit.numel() != 1:
        return False
    value = lit.reshape(()).item()
    if isinstance(identity, float) and math.isinf(identity) and not lit.dtype.is_floating_point:
        info = torch.iinfo(lit.dtype)
        return value == (info.min if identity < 0 else info.max)
    return value == identity


def _build_reduce(inst: Instruction, dev) -> Kernel:
    """reduce(x, init) over ``dimensions`` with to_apply's root opcode (add/multiply/maximum/minimum/and/or)."""
    if len(inst.operands) != 2:
        raise NotImplementedError(
            f"reduce %{inst.name}: variadic reduce ({len(inst.operands)} operands) is not supported")
    root = inst.attrs["to_apply"].root
    kind = root.opcode if root is not None else None
    if kind not in _REDUCERS:
        raise NotImplementedError(f"reduce %{inst.name}: to_apply root {kind!r} not in {sorted(_REDUCERS)}")
    reduce_fn, combine, identity = _REDUCERS[kind]
    dims = tuple(inst.attrs["dimensions"])
    dtype = inst.shape.torch_dtype
    use_init = not _init_is_identity(inst.operands[1], identity)

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        x, init = ops
        if dims and any(x.shape[d] == 0 for d in dims):
            r = _empty_reduction(x, dims, identity)
        else:
            r = reduce_fn(x, dims, dtype) if dims else x
        if use_init:
            r = combine(r, init.to(r.dtype))
        return _write(out, r.to(dtype))
    return kernel


# --------------------------------------------------------------------------- table
_BUILDERS: dict[str, Callable[[Instruction, torch.device | None], Kernel]] = {
    **{op: _build_unary for op in _UNARY},
    **{op: _build_binary for op in _BINARY},
    "divide": _build_divide,
    "compare": _build_compare,
    "select": _build_select,
    "clamp": _build_clamp,
    "convert": _build_convert,
    "copy": _build_copy,
    "constant": _build_constant,
    "iota": _build_iota,
    "broadcast": _build_broadcast,
    "reshape": _build_reshape,
    "transpose": _build_transpose,
    "slice": _build_slice,
    "concatenate": _build_concatenate,
    "pad": _ix.build_pad,
    "dot": _dot.build_dot,
    "reduce": _build_reduce,
    "gather": _sc.build_gather,
    "scatter": _sc.build_scatter,
    "dynamic-slice": _ix.build_dynamic_slice,
    "dynamic-update-slice": _ix.build_dynamic_update_slice,
    "custom-call": _build_custom_call,
    "fusion": _build_fusion,
    "tuple": _build_tuple,
    "get-tuple-element": _build_gte,
}
