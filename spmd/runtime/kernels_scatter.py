"""Kernels of ``gather`` (rows and along forms) and ``scatter`` (rows and along forms).

The forms and the index rules are those of ``spmd.ir.index_shapes``: a gather clamps its
indices into range, a scatter skips updates whose index is out of range (XLA). The kernels use
PyTorch's ``index_select`` / ``gather`` / ``index_add_`` / ``index_copy_`` / ``scatter_*_``; an
update with an out-of-range index is dropped without reading indices back to the host (no
synchronisation): it becomes the combiner's identity (0 for add, 1 for multiply, -inf / +inf for
max / min) combined into row 0; a replacing update lands in one extra row past the end that is
cut off afterwards.
"""

from __future__ import annotations

import math

import torch

from spmd.ir.hlo import Instruction
from spmd.ir.index_shapes import gather_form, scatter_form, scatter_kind
from spmd.runtime import kernels_index as _ix

Tensor = torch.Tensor

_TORCH_REDUCE = {"maximum": "amax", "minimum": "amin", "multiply": "prod"}


def _write(out: Tensor | None, value: Tensor) -> Tensor:
    if out is None:
        return value
    out.copy_(value)
    return out


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def build_gather(inst: Instruction, dev=None):
    """gather in the rows form (``spmd.runtime.kernels_index.build_gather``) or the along form.

    Along form: ``torch.gather`` on the operand with the indices permuted to operand dim order,
    clamped into ``[0, n - 1]``. Raises NotImplementedError for any other form.
    """
    form = gather_form(inst)
    if form is None:
        raise NotImplementedError(f"gather %{inst.name}: only the rows (embedding) and along (torch.gather) "
                                  f"forms are supported, got attributes {inst.attrs}")
    if form.kind == "rows":
        return _ix.build_gather(inst, dev)
    a, perm = form.axis, form.index_of
    inv = _inverse(perm)
    n = inst.operands[0].shape.dims[a]
    shape = inst.shape.dims

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        x, idx = ops
        if n == 0 or idx.numel() == 0:
            return _write(out, x.new_zeros(shape))
        i = idx.permute(perm).to(torch.int64).clamp(0, n - 1)
        return _write(out, torch.gather(x, a, i).permute(inv))
    return kernel


def build_scatter(inst: Instruction, dev=None):
    """scatter in the rows or along form with add / maximum / minimum / multiply / replace.

    The result is written into ``out`` (or a fresh tensor); the operand is never written.
    Raises NotImplementedError for another form or combiner.
    """
    form, kind = scatter_form(inst), scatter_kind(inst)
    if form is None:
        raise NotImplementedError(f"scatter %{inst.name}: only the rows and along forms with an add, maximum, "
                                  f"minimum, multiply or replacing to_apply are supported, got {inst.attrs}")
    a = form.axis
    x_shape = inst.operands[0].shape.dims
    n = x_shape[a]
    if form.kind == "rows":
        rest = tuple(d for i, d in enumerate(x_shape) if i != a)

        def arrange(idx: Tensor, upd: Tensor) -> tuple[Tensor, Tensor]:
            return idx.reshape(-1), upd.reshape((-1, *rest)).movedim(0, a)
    else:
        perm = form.index_of

        def arrange(idx: Tensor, upd: Tensor) -> tuple[Tensor, Tensor]:
            return idx.permute(perm), upd.permute(perm)

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        x, idx, upd = ops
        r = x.clone() if out is None else out
        if out is not None and (out.data_ptr() != x.data_ptr() or out.stride() != x.stride()):
            out.copy_(x)
        if idx.numel() == 0 or n == 0:
            return r
        i, u = arrange(idx, upd)
        _combine(r, a, i.to(torch.int64), u, kind, form.kind, n)
        return r
    return kernel


def _valid_mask(i: Tensor, n: int) -> Tensor:
    return (i >= 0) & (i < n)


def _broadcast_rows(valid: Tensor, u: Tensor, a: int, rows: bool) -> Tensor:
    """``valid`` (per index) shaped to broadcast against the arranged updates ``u``."""
    if not rows:
        return valid
    shape = [1] * u.dim()
    shape[a] = -1
    return valid.reshape(shape)


def _identity(kind: str, dtype: torch.dtype) -> float | int:
    """The value that ``kind`` leaves unchanged (0 for add, 1 for multiply, -inf/+inf for max/min)."""
    if kind in ("add", "multiply"):
        return 0 if kind == "add" else 1
    if dtype.is_floating_point:
        return -math.inf if kind == "maximum" else math.inf
    info = torch.iinfo(dtype)
    return info.min if kind == "maximum" else info.max


def _combine(r: Tensor, a: int, i: Tensor, u: Tensor, kind: str, form: str, n: int) -> None:
    """Combine updates ``u`` at indices ``i`` along dim ``a`` into ``r`` in place; skip indices out of range.

    An update with an index out of range becomes the combiner's identity at index 0 (a no-op);
    a replacing update cannot be made a no-op, so it goes to an extra row past the end.
    """
    rows = form == "rows"
    valid = _valid_mask(i, n)
    if kind != "replace":
        u = torch.where(_broadcast_rows(valid, u, a, rows), u,
                        torch.full((), _identity(kind, u.dtype), dtype=u.dtype, device=u.device))
        i = torch.where(valid, i, torch.zeros((), dtype=i.dtype, device=i.device))
        if kind == "add":
            (r.index_add_ if rows else r.scatter_add_)(a, i, u)
            return
        if rows:  # one index per row, spread over the row (index_reduce_ is still a beta API)
            i = _broadcast_rows(i, u, a, rows).expand(u.shape)
        r.scatter_reduce_(a, i, u, _TORCH_REDUCE[kind], include_self=True)
        return
    ext_shape = list(r.shape)
    ext_shape[a] = n + 1
    ext = r.new_empty(ext_shape)
    ext.narrow(a, 0, n).copy_(r)
    i = torch.where(valid, i, torch.full((), n, dtype=i.dtype, device=i.device))
    (ext.index_copy_ if rows else ext.scatter_)(a, i, u)
    r.copy_(ext.narrow(a, 0, n))
