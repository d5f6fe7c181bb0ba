"""Batch-dim analysis: which dim of every value carries the batch, if the program is row-separable.

The split-batch pass (``spmd.passes.split_batch``) runs a program on two halves of the batch
independently. That is valid when every output row of the batch depends only on the same rows
of the inputs (and on values shared by all rows: weights, constants). This module checks it,
op by op, and says for each value which of its dims holds the batch:

- ``(dim, unit)``: ``dim`` of the value holds the batch as its outer factor: its size is
  ``batch * unit`` (``unit`` > 1 after a reshape merged the batch with the dims after it);
- ``None``: the value is the same for every row (computed from weights and constants only).

Rules (``UnsplittableError`` otherwise): elementwise ops, ``convert``, gelu / silu, the
``Sharding`` identity, all-reduce and collective-permute keep the dim; all-gather and
reduce-scatter keep it when they do not concatenate or scatter along it; ``broadcast``,
``transpose`` and ``reshape`` move it (a reshape must keep the batch as the outer factor of an
output dim); ``slice``, ``pad`` and ``dynamic-slice`` must not cut it; ``reduce``, softmax and
layer-norm must not reduce along it; ``concatenate`` must not join along it; a ``dot`` may carry
it in a batch dim of both operands or a free dim of one operand, never in a contracting dim;
``attention`` in a leading (batch or head) dim of q, k and v; ``gather`` in an index dim. A shared
operand of an op that aligns rows (elementwise, a dot's batch dim, attention) is sliced per half
by the rewrite (``needs_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd.ir.hlo import ELEMENTWISE_OPCODES, Computation, Instruction

BDim = tuple[int, int] | None  # (dim, unit) or None (shared by all rows)
_KEEP = ELEMENTWISE_OPCODES | frozenset({"all-reduce", "collective-permute"})
_KEEP_CALLS = frozenset({"gelu", "silu", "Sharding"})
_SHARED_ONLY = frozenset({"constant", "iota", "partition-id"})


class UnsplittableError(ValueError):
    """The program is not row-separable along the requested dim (the message says where)."""


@dataclass(frozen=True)
class BatchDims:
    """The result of ``analyze``: per instruction its ``BDim``; ``batch`` rows in all."""

    dims: dict
    batch: int


def analyze(comp: Computation, carriers: dict[int, int], batch: int) -> BatchDims:
    """Batch dims of every instruction of ``comp``.

    Args:
      comp: a partitioned entry computation (per-device shapes).
      carriers: parameter number -> the dim that holds the batch (size ``batch``); other
        parameters are shared by all rows.
      batch: the batch size (rows of each carrier's dim).
    Raises:
      UnsplittableError: an op mixes rows (see the module docstring), naming the instruction.
    """
    dims: dict[Instruction, BDim] = {}
    for inst in comp.instructions:
        if inst.opcode == "parameter":
            num = inst.attrs["parameter_number"]
            dims[inst] = (carriers[num], 1) if num in carriers else None
            continue
        if inst.opcode == "tuple" and inst is comp.root:
            continue  # the outputs: each is joined along its own batch dim
        ops = [dims[o] for o in inst.operands]
        if inst.opcode in _SHARED_ONLY or all(b is None for b in ops):
            if inst.opcode in ("tuple", "get-tuple-element") or inst.opcode.endswith(("-start", "-done")):
                raise UnsplittableError(f"%{inst.name}: {inst.opcode} is not supported")
            dims[inst] = None
            continue
        dims[inst] = _rule(inst, ops, batch)
    return BatchDims(dims, batch)


def _fail(inst: Instruction, why: str) -> UnsplittableError:
    return UnsplittableError(f"%{inst.name} ({inst.opcode}): {why}")


def _same(inst: Instruction, ops: list[BDim]) -> tuple[int, int]:
    found = {b for b in ops if b is not None}
    if len(found) != 1:
        raise _fail(inst, f"operands carry the batch in different dims {sorted(found)}")
    return found.pop()


def _rule(inst: Instruction, ops: list[BDim], batch: int) -> tuple[int, int]:
    op = inst.opcode
    if op in _KEEP or (op == "custom-call" and inst.attrs.get("custom_call_target") in _KEEP_CALLS):
        return _same(inst, ops)
    handler = _HANDLERS.get(op if op != "custom-call" else inst.attrs.get("custom_call_target"))
    if handler is None:
        raise _fail(inst, "not supported")
    return handler(inst, ops, batch)


def _gather_like(inst, ops, batch):  # all-gather / reduce-scatter
    d, u = _same(inst, ops)
    if inst.attrs["dimensions"][0] == d:
        raise _fail(inst, "gathers or scatters along the batch dim")
    return d, u


def _broadcast(inst, ops, batch):
    d, u = ops[0]
    return inst.attrs["dimensions"][d], u


def _transpose(inst, ops, batch):
    d, u = ops[0]
    return tuple(inst.attrs["dimensions"]).index(d), u


def _reshape(inst, ops, batch):
    d, u = ops[0]
    src, out = inst.operands[0].shape.dims, inst.shape.dims
    prefix = _prod(src[:d])
    for k in range(len(out)):
        if _prod(out[:k]) == prefix and out[k] % batch == 0 and out[k] // batch * _prod(out[k + 1:]) \
                == u * _prod(src[d + 1:]):
            return k, out[k] // batch
    raise _fail(inst, "merges or splits the batch with an outer dim")


def _full_on(inst, d: int, what: str, spans) -> None:
    if spans:
        raise _fail(inst, f"{what} along the batch dim")


def _slice(inst, ops, batch):
    d, u = ops[0]
    start, limit, stride = inst.attrs["slice"][d]
    _full_on(inst, d, "slices", (start, limit, stride) != (0, inst.operands[0].shape.dims[d], 1))
    return d, u


def _dynamic_slice(inst, ops, batch):
    if any(b is not None for b in ops[1:]) or ops[0] is None:
        raise _fail(inst, "start indices depend on the batch")
    d, u = ops[0]
    _full_on(inst, d, "slices", inst.attrs["dynamic_slice_sizes"][d] != inst.operands[0].shape.dims[d])
    return d, u


def _pad(inst, ops, batch):
    if ops[0] is None:
        raise _fail(inst, "pads a shared value with a per-row value")
    d, u = ops[0]
    _full_on(inst, d, "pads", tuple(inst.attrs["padding"][d]) != (0, 0, 0))
    return d, u


def _concatenate(inst, ops, batch):
    d, u = _same(inst, ops)
    _full_on(inst, d, "concatenates", inst.attrs["dimensions"][0] == d)
    return d, u


def _reduce(inst, ops, batch):
    if ops[0] is None:
        raise _fail(inst, "init value depends on the batch")
    d, u = ops[0]
    reduced = inst.attrs["dimensions"]
    _full_on(inst, d, "reduces", d in reduced)
    return d - sum(1 for r in reduced if r < d), u


def _normalizing(inst, ops, batch):  # softmax, layer-norm
    d, u = _same(inst, ops)
    rank = inst.shape.rank
    cfg = inst.attrs.get("backend_config") or {}
    if inst.attrs.get("custom_call_target") == "softmax":
        axis = int(cfg.get("dim", -1)) % rank
        _full_on(inst, d, "normalizes", axis == d)
    else:
        _full_on(inst, d, "normalizes", d >= rank - int(cfg.get("normalized_ndim", 1)))
    return d, u


def _attention(inst, ops, batch):
    d, u = _same(inst, ops)
    if d >= inst.shape.rank - 2 or any(b not in (None, (d, u)) for b in ops):
        raise _fail(inst, "attends along the batch dim")
    return d, u


def _dot(inst, ops, batch):
    a = inst.attrs
    lb, rb = a.get("lhs_batch_dims", ()), a.get("rhs_batch_dims", ())
    lc, rc = a.get("lhs_contracting_dims", ()), a.get("rhs_contracting_dims", ())
    lhs, rhs = inst.operands
    lfree = [i for i in range(lhs.shape.rank) if i not in lb and i not in lc]
    rfree = [i for i in range(rhs.shape.rank) if i not in rb and i not in rc]
    (ld, rd) = ops
    if ld is not None and rd is not None:
        if ld[0] in lb and rd[0] in rb and lb.index(ld[0]) == rb.index(rd[0]) and ld[1] == rd[1]:
            return lb.index(ld[0]), ld[1]
        raise _fail(inst, "both operands carry the batch, not in the same batch dim")
    (d, u), batch_dims, contracting, side = (ld, lb, lc, 0) if ld is not None else (rd, rb, rc, 1)
    if d in contracting:
        raise _fail(inst, "contracts the batch dim")
    if d in batch_dims:
        return batch_dims.index(d), u
    return len(lb) + (lfree.index(d) if side == 0 else len(lfree) + rfree.index(d)), u


def _gather(inst, ops, batch):
    if ops[0] is not None or ops[1] is None:
        raise _fail(inst, "gathers from a per-row table")
    d, u = ops[1]
    ivd = inst.attrs.get("index_vector_dim", inst.operands[1].shape.rank)
    _full_on(inst, d, "indexes", d == ivd)
    offset = inst.attrs["offset_dims"]
    position = [i for i in range(inst.shape.rank) if i not in offset]
    return position[d - (1 if ivd < d else 0)], u


def _prod(dims) -> int:
    out = 1
    for n in dims:
        out *= n
    return out


_HANDLERS = {
    "all-gather": _gather_like, "reduce-scatter": _gather_like, "broadcast": _broadcast, "transpose": _transpose,
    "reshape": _reshape, "slice": _slice, "dynamic-slice": _dynamic_slice, "pad": _pad,
    "concatenate": _concatenate, "reduce": _reduce, "softmax": _normalizing, "layer-norm": _normalizing,
    "attention": _attention, "dot": _dot, "gather": _gather,
}


def needs_rows(inst: Instruction, k: int, bdim: tuple[int, int], dims: dict) -> int | None:
    """The dim along which shared operand ``k`` of ``inst`` must be sliced per half, or None.

    ``bdim`` is ``inst``'s result batch dim. Elementwise ops (and the ops that keep the dim)
    read every operand row-aligned with the result; a dot's operand aligns along its batch
    dim when the batch is in a dot batch dim; attention's k, v and mask along the same dim
    when they have the batch's size there.
    """
    opnd = inst.operands[k]
    op = inst.opcode
    target = inst.attrs.get("custom_call_target") if op == "custom-call" else op
    if target in _KEEP or target in _KEEP_CALLS or op == "concatenate":
        return bdim[0] if opnd.shape.rank == inst.shape.rank else None
    if op == "dot":
        a = inst.attrs
        lb, rb = a.get("lhs_batch_dims", ()), a.get("rhs_batch_dims", ())
        if bdim[0] < len(lb):
            return (lb if k == 0 else rb)[bdim[0]]
        return None
    if target == "attention":
        d = bdim[0]
        full = inst.shape.dims[d]
        return d if opnd.shape.rank == inst.shape.rank and opnd.shape.dims[d] == full else None
    return None
