"""Peephole fusions of the lowering for the windowed-einsum hot path.

(a) ``%u = dot(%a, %b)``; ``%r = dynamic-update-slice(%buf, %u, offsets...)`` where ``%u`` has
    no other user, ``%buf`` is read by nothing after ``%r`` (and only on ``%r``'s stream), and
    the updated region is contiguous (the update spans whole trailing dims): the dot writes
    straight into the view of ``%buf`` (``torch.mm(a, b, out=view)`` via the dot kernel), in
    place when ``%buf`` is memory the runtime owns, else into a copy of it. This is the result
    accumulation of XLA's windowed einsum loops (xla/service/spmd/dot_handler.cc), where the
    partial products land in slices of one output buffer.
(b) ``add(dot(%a, %b), %c)`` (either order) where the dot has no other user and is a plain or
    batched matrix product in the operands' dtype: ``torch.addmm`` / ``torch.baddbmm``. The dot
    may also reach the add through a view ``reshape`` that only splits its rows (a residual add
    of a linear layer on ``[B, S, D]`` activations after ``view(B * S, D)``: the reshape's only
    reader is the add): the addmm then writes the add's shape.

(a) also takes a fused addmm of (b) as its update (``torch.addmm(c, a, b, out=view)``), and a
    2-d matrix product may land in any rectangle of a 2-d buffer (cuBLAS writes a stride-1
    view with a leading dimension; the column blocks of an all-gather of weights).
(c) a chain of (a)-fused updates whose slices cover the whole buffer on every device (read
    from the offsets folded at lowering time) starts from new memory instead of a copy of
    the initial value (the zero broadcast of windowed einsum's accumulators), and that
    initial value's op is dropped when nothing else reads it.

All rewrite the ``Op`` list of ``spmd.runtime.lower`` in place; the unfused path stays for
everything else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from spmd.ir.hlo import ELEMENTWISE_OPCODES
from spmd.runtime import kernels_gemv

# Opcodes whose kernel result is fresh memory (never a view or an operand): safe to write into.
FRESH_OPCODES = (ELEMENTWISE_OPCODES - {"convert"}) | {"dot", "dynamic-update-slice", "concatenate", "fusion"}
# Custom-call targets whose kernel returns one of its operands (not fresh memory).
_ALIASING_CUSTOM_CALLS = frozenset({"Sharding"})


def is_fresh(inst) -> bool:
    """Whether the kernel of ``inst`` always returns fresh memory (never a view of an operand).

    ``FRESH_OPCODES`` (fusions among them), and custom calls other than the identity ``Sharding``
    (their kernels are PyTorch functions returning new tensors).
    """
    if inst.opcode == "custom-call":
        return inst.attrs.get("custom_call_target") not in _ALIASING_CUSTOM_CALLS
    return inst.opcode in FRESH_OPCODES


def fuse(ops: list, outputs: set[int], buffers: Any, folded: dict[int, list] | None = None,
         view_sources: set[int] | frozenset[int] = frozenset()) -> None:
    """Apply fusions (a), (b) and (c) to ``ops`` (a list of ``lower.Op``) in place.

    ``outputs``: slots no fusion may write or drop (program outputs). ``view_sources``: slots
    that view ops read (never updated in place; a dot read only by a row-splitting reshape
    view feeds (b) through it). ``folded``: slot -> per-device host values of the values folded
    at lowering time (the dynamic-update-slice offsets); enables (c).
    """
    blocked = set(outputs) | set(view_sources)
    readers, producer = use_def(ops)
    removed: set[int] = set()
    for k, op in enumerate(ops):
        if op.fn is not None or "spec" in op.extra:
            continue
        if op.inst.opcode == "dynamic-update-slice":
            d = _fusable_dot(ops, producer, readers, blocked, op.ins[1], op.stream)
            if d is not None and _dus_ok(ops, k, d, readers, blocked):
                _fuse_dus(ops, k, d, producer, buffers)
                removed.add(d)
        elif op.inst.opcode == "add":
            for pos in (0, 1):
                d = _fusable_dot(ops, producer, readers, blocked, op.ins[pos], op.stream)
                v = None if d is not None else _row_split_view(ops, producer, readers, outputs, op.ins[pos], op.stream)
                if v is not None:
                    d = _fusable_dot(ops, producer, readers, outputs, ops[v].ins[0], op.stream)
                if d is not None and "mm" not in ops[d].extra and _addmm_ok(
                        ops[d].inst, op.inst, op.inst.operands[1 - pos]):
                    _fuse_addmm(ops, k, d, op.ins[1 - pos])
                    removed.update((d,) if v is None else (d, v))
                    break
    if folded is not None:
        _skip_covered_inits(ops, producer, readers, removed, folded)
    ops[:] = [op for k, op in enumerate(ops) if k not in removed]


def use_def(ops: list) -> tuple[dict[int, list[int]], dict[int, int]]:
    """(slot -> indices of the ops reading it, in order; slot -> index of the op writing it) of an ``Op`` list."""
    readers: dict[int, list[int]] = {}
    for k, op in enumerate(ops):
        for s in op.ins:
            readers.setdefault(s, []).append(k)
    return readers, {op.out: k for k, op in enumerate(ops)}


def only_views_between(ops: list, first: int, last: int, removed: set[int] | frozenset[int] = frozenset()) -> bool:
    """Whether every op strictly between ``ops[first]`` and ``ops[last]`` is a view (or in
    ``removed``): nothing runs in between that could write memory. A fusion that moves the reads
    of ``ops[first]``'s operands to ``ops[last]`` needs this: the buffer assignment, which saw
    those reads end at ``ops[first]``, may have given their bytes to an op in between."""
    return all(t in removed or "view" in ops[t].extra for t in range(first + 1, last))


def dot_work(dot_inst) -> int:
    """Multiply-adds of a dot: result elements times the contracted size."""
    k = 1
    for d in dot_inst.attrs["lhs_contracting_dims"]:
        k *= dot_inst.operands[0].shape.dims[d]
    return dot_inst.shape.numel * k


def _fusable_dot(ops, producer, readers, outputs, slot: int, stream: int) -> int | None:
    """Index of the op producing ``slot`` when it is a dot (or a fused addmm) that can be fused
    into its single reader on ``stream``."""
    d = producer.get(slot)
    if d is None:
        return None
    dot = ops[d]
    plain = dot.inst.opcode == "dot" and dot.fn is None
    if not (plain or "mm" in dot.extra) or dot.stream != stream:
        return None
    if slot in outputs or len(readers.get(slot, ())) != 1:
        return None
    return d


def _dus_ok(ops, k: int, d: int, readers, outputs) -> bool:
    op = ops[k]
    buf = op.ins[0]
    if buf in outputs or buf in ops[d].ins or op.ins[1] == buf:
        return False
    if any(r > k or ops[r].stream != op.stream for r in readers.get(buf, ())):
        return False
    if buf in op.ins[2:]:
        return False
    buf_dims, upd_dims = op.inst.operands[0].shape.dims, op.inst.operands[1].shape.dims
    if contiguous_update(buf_dims, upd_dims):
        return True
    # a 2-d product may land in any rectangle: cuBLAS writes rows of a stride-1 view
    return len(buf_dims) == 2 and _direct_mm(ops[d]) is not None


def contiguous_update(buf_dims: tuple[int, ...], upd_dims: tuple[int, ...]) -> bool:
    """Whether ``buf[o0:o0+u0, ...]`` of a row-major buffer is contiguous for any offsets.

    True when, for the last dim ``m`` where the update is smaller, every update dim before
    ``m`` is 1 (dims after ``m`` are whole by the choice of ``m``).
    """
    diff = [i for i, (b, u) in enumerate(zip(buf_dims, upd_dims, strict=False)) if b != u]
    if not diff:
        return True
    return all(u == 1 for u in upd_dims[:diff[-1]])


def _owned(ops, producer, slot: int) -> bool:
    """The slot's tensor is fresh memory produced in this call (not a parameter/constant/view)."""
    p = producer.get(slot)
    if p is None:
        return False
    op = ops[p]
    return "spec" in op.extra or op.alias_of >= 0 or is_fresh(op.inst)


def _direct_mm(prod) -> Callable | None:
    """``(operands, out) -> out`` on torch.mm / torch.addmm writing into a strided 2-d ``out``, or None.

    None unless the product is 2-d: a linear layer on ``[B, S, D]`` activations (an ``a`` of rank
    > 2, flattened by ``make_addmm``) cannot write into a rectangle of a higher-rank buffer."""
    if prod.inst.shape.rank != 2:
        return None
    if "mm" in prod.extra:
        batched, trans = prod.extra["mm"]
        return None if batched else make_addmm(False, trans)
    layout = _mm_layout(prod.inst)
    lhs, rhs = prod.inst.operands
    if layout is None or layout[0] or not (prod.inst.shape.dtype == lhs.shape.dtype == rhs.shape.dtype):
        return None
    trans = layout[1]

    def kernel(ops: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
        a, b = ops
        if trans:
            b = b.t()
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    return kernel


def _fuse_dus(ops, k: int, d: int, producer, buffers) -> None:
    from spmd.runtime.kernels import compile_kernel

    op, dot = ops[k], ops[d]
    buf_dims = op.inst.operands[0].shape.dims
    upd_dims = op.inst.operands[1].shape.dims
    buf = op.ins[0]
    offsets = getattr(buffers, "offsets_bytes", {}) if buffers is not None else {}
    buf_name = ops[producer[buf]].buffer_name if buf in producer else None
    in_arena = buf_name in offsets or op.inst.name in offsets
    inplace = _owned(ops, producer, buf) and not in_arena
    if buf_name in offsets and op.inst.name in offsets and offsets[buf_name] == offsets[op.inst.name]:
        inplace = True  # the buffer assignment shares the bytes: write in place via ``out``
    prod_fn = _direct_mm(dot) or (dot.fn if dot.fn is not None else compile_kernel(dot.inst))
    op.fn = make_dot_into_slice(prod_fn, buf_dims, upd_dims, inplace and not in_arena, num_ins=len(dot.ins))
    op.ins = [buf, *dot.ins, *op.ins[2:]]
    op.extra["offset_from"] = 1 + len(dot.ins)
    op.extra["work"] = dot.extra.get("work", dot_work(dot.inst) if dot.inst.opcode == "dot" else 0)
    op.extra["into_slice"] = (buf_dims, upd_dims, len(dot.ins), prod_fn)
    if inplace:
        op.alias_of = buf


def make_dot_into_slice(dot_fn: Callable, buf_dims: tuple[int, ...], upd_dims: tuple[int, ...],
                        inplace: bool, num_ins: int = 2, fresh: bool = False,
                        dtype: torch.dtype | None = None) -> Callable:
    """Closure ``([buf, p_0, ..., p_{n-1}, start_0, ...], out) -> Tensor`` for fusion (a).

    Writes ``dot_fn([p_0, ...], view)`` (a dot, or an addmm) into
    ``buf[start_0:start_0+u_0, ...]`` (starts clamped as XLA's dynamic-update-slice does). The
    target is ``out`` when given (``buf`` copied into it unless it is the same memory), else
    ``buf`` itself when ``inplace`` and ``buf`` is a contiguous non-view tensor, else a copy of
    ``buf``. With ``fresh`` (fusion (c): later updates overwrite every element ``buf`` would
    contribute), ``buf`` is not an operand and the target is ``out`` or new memory of
    ``dtype`` (default: the last operand's).
    """
    moving = tuple(i for i, (b, u) in enumerate(zip(buf_dims, upd_dims, strict=False)) if b != u)
    limits = {i: buf_dims[i] - upd_dims[i] for i in moving}
    first = 0 if fresh else 1
    off0 = first + num_ins

    def kernel(ops: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
        prods = ops[first:off0]
        if fresh:
            target = out if out is not None else torch.empty(buf_dims, dtype=dtype or prods[-1].dtype,
                                                             device=prods[-1].device)
        else:
            buf = ops[0]
            if out is not None:
                if out.data_ptr() != buf.data_ptr():
                    out.copy_(buf)
                target = out
            elif inplace and buf._base is None and buf.is_contiguous():
                target = buf
            else:
                target = buf.clone(memory_format=torch.contiguous_format)
        view = target
        for i in moving:
            view = view.narrow(i, min(max(int(ops[off0 + i]), 0), limits[i]), upd_dims[i])
        dot_fn(prods, view)
        return target
    return kernel


def _skip_covered_inits(ops, producer, readers, removed: set[int], folded: dict[int, list]) -> None:
    """Fusion (c): a chain of fused dynamic-update-slices whose updates cover the whole buffer
    on every device (the accumulators of windowed einsum) starts from new memory instead of
    a copy of its initial value; that value's op goes when nothing else reads it."""
    chain_next: dict[int, int] = {}
    for k, op in enumerate(ops):
        if k not in removed and "into_slice" in op.extra and op.alias_of >= 0 and op.alias_of in producer:
            chain_next[producer[op.alias_of]] = k
    heads = [k for k, op in enumerate(ops) if k not in removed and "into_slice" in op.extra
             and op.ins[0] in producer and ops[producer[op.ins[0]]].inst.opcode == "broadcast"]
    for k in heads:
        chain = [k]
        while chain[-1] in chain_next:
            chain.append(chain_next[chain[-1]])
        if not _covers(ops, chain, folded):
            continue
        op = ops[k]
        buf_dims, upd_dims, num_ins, prod_fn = op.extra["into_slice"]
        init = op.ins[0]
        op.fn = make_dot_into_slice(prod_fn, buf_dims, upd_dims, False, num_ins=num_ins, fresh=True,
                                    dtype=op.inst.shape.torch_dtype)
        op.ins = op.ins[1:]
        op.alias_of = -1
        op.extra["offset_from"] -= 1
        readers[init].remove(k)
        if not readers[init]:
            removed.add(producer[init])


def _covers(ops, chain: list[int], folded: dict[int, list]) -> bool:
    """Whether the updates of ``chain`` write every element of the buffer on every device."""
    buf_dims, upd_dims, num_ins, _ = ops[chain[0]].extra["into_slice"]
    moving = [i for i, (b, u) in enumerate(zip(buf_dims, upd_dims, strict=False)) if b != u]
    if len(moving) > 1:
        return False
    for k in chain[1:]:
        if ops[k].extra["into_slice"][:2] != (buf_dims, upd_dims):
            return False
    if not moving:
        return True
    dim = moving[0]
    slots = [ops[k].ins[1 + num_ins + dim] for k in chain]
    if any(s not in folded for s in slots):
        return False
    limit = buf_dims[dim] - upd_dims[dim]
    for dev in range(len(folded[slots[0]])):
        starts = sorted(min(max(int(folded[s][dev]), 0), limit) for s in slots)
        end = 0
        for st in starts:
            if st > end:
                return False
            end = max(end, st + upd_dims[dim])
        if end < buf_dims[dim]:
            return False
    return True


def _row_split_view(ops, producer, readers, outputs, slot: int, stream: int) -> int | None:
    """Index of the view op producing ``slot`` when it is a ``reshape`` of an unbatched dot's
    result that only splits the rows (same last dim), read only by one op on ``stream``."""
    v = producer.get(slot)
    if v is None or slot in outputs or len(readers.get(slot, ())) != 1:
        return None
    op = ops[v]
    if "view" not in op.extra or op.inst.opcode != "reshape" or op.stream != stream:
        return None
    src, dims = op.inst.operands[0].shape.dims, op.inst.shape.dims
    if len(src) < 2 or len(dims) < 2 or src[-1] != dims[-1] or op.inst.operands[0].opcode != "dot":
        return None
    layout = _mm_layout(op.inst.operands[0])
    return v if layout is not None and not layout[0] else None


def _addmm_ok(dot_inst, add_inst, other) -> bool:
    """The add of a dot and ``other`` as one addmm: equal dtypes, ``other`` of the add's dims, and
    the dot's result of those dims (or, through a row-splitting reshape, of their rows flattened)."""
    layout = _mm_layout(dot_inst)
    if layout is None:
        return False
    dt = add_inst.shape.dtype
    lhs, rhs = dot_inst.operands
    dims = add_inst.shape.dims
    same = dot_inst.shape.dims == dims or (not layout[0] and dot_inst.shape.numel == add_inst.shape.numel
                                           and dot_inst.shape.dims[-1] == dims[-1])
    return (dot_inst.shape.dtype == dt == lhs.shape.dtype == rhs.shape.dtype == other.shape.dtype
            and other.shape.dims == dims and same)


def _mm_layout(dot_inst) -> tuple[bool, bool] | None:
    """(batched, rhs_transposed) when the dot is a non-empty ``a @ b`` / ``a @ b.T`` (optionally batched on dim 0).

    An unbatched ``a`` of rank > 2 contracting its last dim with a 2-d ``b`` counts as ``a @ b``
    on ``a`` flattened to 2-d (a linear layer on ``[B, S, D]`` activations).
    """
    a = dot_inst.attrs
    lhs, rhs = dot_inst.operands
    if dot_inst.shape.numel == 0 or lhs.shape.numel == 0 or rhs.shape.numel == 0:
        return None  # an empty M, K or N: the unfused dot and add handle it; addmm rejects some
    lb, rb = tuple(a.get("lhs_batch_dims", ())), tuple(a.get("rhs_batch_dims", ()))
    lc, rc = tuple(a["lhs_contracting_dims"]), tuple(a["rhs_contracting_dims"])
    if not lb and not rb and lhs.shape.rank == 2 == rhs.shape.rank and lc == (1,) and rc in ((0,), (1,)):
        return False, rc == (1,)
    if not lb and not rb and lhs.shape.rank > 2 == rhs.shape.rank and lc == (lhs.shape.rank - 1,) \
            and rc in ((0,), (1,)):
        return False, rc == (1,)
    if lb == rb == (0,) and lhs.shape.rank == 3 == rhs.shape.rank and lc == (2,) and rc in ((1,), (2,)):
        return True, rc == (2,)
    return None


def _fuse_addmm(ops, k: int, d: int, c_slot: int) -> None:
    batched, trans = _mm_layout(ops[d].inst)
    op = ops[k]
    op.fn = make_addmm(batched, trans, op.inst.shape.dims)
    op.ins = [c_slot, *ops[d].ins]
    op.extra["work"] = dot_work(ops[d].inst)
    op.extra["mm"] = (batched, trans)


def make_addmm(batched: bool, rhs_transposed: bool, dims: tuple[int, ...] | None = None) -> Callable:
    """Closure ``([c, a, b], out) -> c + a @ b`` on torch.addmm / torch.baddbmm (fusion (b)).

    Unbatched, an ``a`` of rank > 2 is flattened to 2-d (and ``c`` / ``out`` with it); a ``c``
    that is a row broadcast (stride 0 over rows) goes in as the 1-d bias, which cuBLASLt adds
    in the GEMM epilogue. ``dims``: the result's dims when they split the product's rows
    (unbatched only; default: ``a``'s leading dims and ``b``'s columns).
    """
    mm = torch.baddbmm if batched else torch.addmm

    def kernel(ops: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
        c, a, b = ops
        if rhs_transposed:
            b = b.transpose(-1, -2)
        # C in the output's own bytes (buffer assignment shares them): accumulate in place
        in_place = out is not None and c.data_ptr() == out.data_ptr() and c.stride() == out.stride() \
            and c.shape == out.shape
        if batched:
            if in_place:
                return out.baddbmm_(a, b)
            return mm(c, a, b) if out is None else mm(c, a, b, out=out)
        shape = dims if dims is not None else (*a.shape[:-1], b.shape[-1])
        a, c = a.reshape(-1, a.shape[-1]), c.reshape(-1, c.shape[-1])
        if in_place:
            o = out.view(-1, out.shape[-1])
            w = kernels_gemv.as_weight(b) if a.shape[0] <= kernels_gemv.MAX_ROWS else None
            if w is not None and kernels_gemv.gemv(a, w, o, True):
                return out
            o.addmm_(a, b)
            return out
        if c.stride(0) == 0:
            c = c[0]
        if out is None:
            return mm(c, a, b).view(shape)
        mm(c, a, b, out=out.view(-1, out.shape[-1]))
        return out
    return kernel
