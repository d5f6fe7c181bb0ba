"""Indexing kernels: pad, gather (embedding form), dynamic-slice, dynamic-update-slice.

Semantics follow XLA (https://openxla.org/xla/operation_semantics): dynamic start indices
and gather indices are clamped so the slice stays inside the operand. Start indices held on a
CUDA device are never read back to the host (no synchronisation): the slice is taken with
``index_select`` / ``index_copy_`` on ``start + arange(size)`` instead of ``narrow``.
"""

from __future__ import annotations

import torch

from spmd.ir.hlo import Instruction
from spmd.runtime.kernels_dus import write_rows

Tensor = torch.Tensor


def _write(out: Tensor | None, value: Tensor) -> Tensor:
    if out is None:
        return value
    out.copy_(value)
    return out


# --------------------------------------------------------------------------- pad
def build_pad(inst: Instruction, dev=None):
    """pad(x, value) with padding ``((lo, hi, interior), ...)``; lo/hi may be negative (crop).

    Raises NotImplementedError for interior padding > 0.
    """
    padding = tuple(inst.attrs["padding"])
    if any(p[2] != 0 for p in padding):
        raise NotImplementedError(f"pad %{inst.name}: interior padding {padding} is not supported")
    in_dims = inst.operands[0].shape.dims
    out_dims = inst.shape.dims
    dst = tuple(slice(max(lo, 0), o - max(hi, 0)) for (lo, hi, _), o in zip(padding, out_dims, strict=True))
    src = tuple(slice(max(-lo, 0), n - max(-hi, 0)) for (lo, hi, _), n in zip(padding, in_dims, strict=True))
    dtype = inst.shape.torch_dtype

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        x, value = ops
        r = torch.empty(out_dims, dtype=dtype, device=x.device) if out is None else out
        r.fill_(value.to(device=x.device))
        r[dst].copy_(x[src])
        return r
    return kernel


# --------------------------------------------------------------------------- gather
def build_gather(inst: Instruction, dev=None):
    """Embedding-form gather: whole slices of operand along ``start_index_map[0]``.

    Supported: one indexed dim ``a`` (``start_index_map == collapsed_slice_dims == (a,)``),
    ``slice_sizes`` full except 1 at ``a``, and ``index_vector_dim`` equal to the indices' rank
    or naming a dim of size 1. The result holds the operand's other dims at ``offset_dims``
    and the indices' batch dims elsewhere, in order. Indices are clamped to ``[0, n_a - 1]``.
    Raises NotImplementedError for other forms.
    """
    operand, indices = inst.operands
    od, idims = operand.shape.dims, indices.shape.dims
    smap = tuple(inst.attrs["start_index_map"])
    collapsed = tuple(inst.attrs.get("collapsed_slice_dims", ()))
    sizes = tuple(inst.attrs["slice_sizes"])
    offset_dims = tuple(inst.attrs["offset_dims"])
    ivd = inst.attrs.get("index_vector_dim", len(idims))
    a = smap[0] if len(smap) == 1 else -1
    full = all(s == (1 if d == a else od[d]) for d, s in enumerate(sizes))
    if len(smap) != 1 or collapsed != smap or not full or (ivd != len(idims) and idims[ivd] != 1):
        raise NotImplementedError(f"gather %{inst.name}: only the embedding form is supported "
                                  f"(start_index_map={smap}, collapsed_slice_dims={collapsed}, slice_sizes={sizes})")
    batch = tuple(s for d, s in enumerate(idims) if d != ivd)
    nb = len(batch)
    tmp_dims = od[:a] + batch + od[a + 1:]
    perm, next_batch = [], 0
    for p in range(nb + len(offset_dims)):
        if p in offset_dims:
            j = offset_dims.index(p)
            perm.append(j if j < a else j + nb)
        else:
            perm.append(a + next_batch)
            next_batch += 1
    perm_t = None if perm == list(range(len(perm))) else tuple(perm)
    limit = od[a] - 1

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        x, idx = ops
        idx = idx.reshape(-1)
        if idx.dtype not in (torch.int32, torch.int64):
            idx = idx.to(torch.int64)
        idx = idx.clamp(0, limit)
        if out is not None and perm_t is None and out.is_contiguous() and out.dtype == x.dtype:
            # the rows go straight into the assigned buffer (no second pass over the result)
            torch.index_select(x, a, idx, out=out.view(*od[:a], idx.numel(), *od[a + 1:]))
            return out
        r = x.index_select(a, idx).reshape(tmp_dims)
        if perm_t is not None:
            r = r.permute(perm_t)
        return _write(out, r)
    return kernel


# --------------------------------------------------------------------------- dynamic slices
def _start_index(start: Tensor, n: int, size: int) -> Tensor:
    """``clamp(start, 0, n - size) + arange(size)`` as int64 on start's device.

    One kernel for a single row (a decode step's KV-cache write), two otherwise: the ``arange``
    is made once per size and device, not per call (under CUDA graphs, a launch saved per call).
    """
    s = start.to(torch.int64).clamp(0, n - size).reshape(1)
    return s if size == 1 else s + _arange(size, start.device)


_ARANGES: dict[tuple[int, torch.device], Tensor] = {}


def _arange(size: int, device: torch.device) -> Tensor:
    key = (size, device)
    r = _ARANGES.get(key)
    if r is None:
        r = torch.arange(size, device=device)
        # made inside a CUDA graph capture, its values would exist only once that graph replays
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _ARANGES[key] = r
    return r


def _host_start(start: Tensor, n: int, size: int) -> int:
    return min(max(int(start), 0), n - size)


def build_dynamic_slice(inst: Instruction, dev=None):
    """dynamic-slice(x, start_0, ...): ``dynamic_slice_sizes`` rows from clamped starts."""
    dims = inst.operands[0].shape.dims
    sizes = tuple(inst.attrs["dynamic_slice_sizes"])
    moving = tuple(d for d, (n, s) in enumerate(zip(dims, sizes, strict=True)) if s < n)

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        x = ops[0]
        for d in moving:
            start = ops[1 + d]
            if start.device.type == "cpu":
                x = x.narrow(d, _host_start(start, dims[d], sizes[d]), sizes[d])
            else:
                x = x.index_select(d, _start_index(start.to(x.device), dims[d], sizes[d]))
        return _write(out, x)
    return kernel


def build_dynamic_update_slice(inst: Instruction, dev=None):
    """dynamic-update-slice(x, update, start_0, ...): x with update written at clamped starts.

    With ``out`` aliasing x (same storage), x is updated in place without a copy.
    """
    dims = inst.operands[0].shape.dims
    sizes = inst.operands[1].shape.dims
    moving = tuple(d for d, (n, s) in enumerate(zip(dims, sizes, strict=True)) if s < n)

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        x, update = ops[0], ops[1]
        if out is None:
            r = x.clone()
        else:
            r = out
            if out.data_ptr() != x.data_ptr() or out.stride() != x.stride():
                out.copy_(x)
        starts = [ops[2 + d] for d in moving]
        if all(s.device.type == "cpu" for s in starts):
            view = r
            for d, s in zip(moving, starts, strict=True):
                view = view.narrow(d, _host_start(s, dims[d], sizes[d]), sizes[d])
            view.copy_(update)
        elif len(moving) == 1:
            d = moving[0]
            if not write_rows(r, d, starts[0], update):
                r.index_copy_(d, _start_index(starts[0].to(r.device), dims[d], sizes[d]), update)
        else:
            index = []
            for d in range(len(dims)):
                if d in moving:
                    idx = _start_index(ops[2 + d].to(r.device), dims[d], sizes[d])
                else:
                    idx = _arange(dims[d], r.device)
                shape = [1] * len(dims)
                shape[d] = -1
                index.append(idx.reshape(shape))
            r.index_put_(tuple(index), update)
        return r
    return kernel
