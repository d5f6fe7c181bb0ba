"""Windowed einsum through a reshape: all-gather → reshape (merging the gathered dim) → dot.

A sequence-parallel transformer gathers activations ``[B, S/P, H]`` along the sequence dim
and the linear layer flattens them to ``[B*S, H]`` before its GEMM; attention gathers
``[B, heads/P, S, d]`` and merges batch and heads into the batch dim of a ``bmm``. In both
the dot reads the gathered value through a reshape that merges the gathered dim with its
neighbours, so ``spmd.passes.windowed_einsum`` (which needs the all-gather to feed the dot)
leaves it alone, and when ``B > 1`` one device's chunk is not a contiguous block of the
merged dim. Here each ring step reshapes the chunk it holds the same way, runs the partial
dot on it, un-merges the partial result and writes it into the accumulator at the chunk's
position along the gathered dim; the accumulator is reshaped to the dot's shape at the end
(Wang et al., ASPLOS 2023, applied per merged layout). Before (P=2, B=2)::

    %ag = f32[2,8,16] all-gather(%x), dimensions={1}, replica_groups={{0,1}}
    %v = f32[16,16] reshape(%ag)
    %d = f32[16,32] dot(%v, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}

after (one ring step shown)::

    %d.in0 = f32[8,16] reshape(%x)
    %d.0 = f32[8,32] dot(%d.in0, %w), ..., backend_config={"windowed_einsum":0}
    %d.out0 = f32[2,4,32] reshape(%d.0)
    %d.acc0 = f32[2,8,32] dynamic-update-slice(%d.init, %d.out0, %zero, %ag.off0, %zero)
    ...
    %d = f32[16,32] reshape(%d.acc1)

The reduce-scatter side is the mirror image: ``dot → reshape (splitting a dot dim) →
reduce-scatter`` along a split piece (the sequence-parallel row-parallel output ``[B*S, H]`` viewed
as ``[B, S, H]`` and scattered over S, or the column-parallel dgrad). Each ring step un-merges the
operand(s) holding that dot dim, slices the destination chunk, merges back, runs the partial dot,
reshapes it to the chunk's ``[B, S/P, H]`` and adds the accumulator received from the ring
predecessor (``RsReshapeSite``).

The merged dim may be a free dim of the dot or a batch dim; for a batch dim the other
operand's batch dim is un-merged, dynamic-sliced to the chunk and merged again. One
all-gather with one reshape user; the dots among the reshape's users that do not contract the
merged dim read the ring (several share it unless one feeds another). Other users (the weight
gradient dots of the backward, which contract the tokens) keep the all-gather, which
async-collectives then re-issues under the backward GEMMs before them, as Megatron-LM's
sequence parallelism re-gathers the saved shard in backward. Unidirectional ring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.hlo import Computation, Instruction, Shape, ancestor_ids
from spmd.passes.cost_model import GemmShape
from spmd.passes.windowed_einsum import (
    MARK,
    GatherSizes,
    ScatterSizes,
    _contract_numel,
    _dot_layout,
    _Emitter,
    _empty,
    _groups,
    _insert_before,
    _lanes,
    _replace,
)


@dataclass(frozen=True)
class _ReshapeUse:
    dot: Instruction
    side: int
    out_dim: int
    other_dim: int | None


@dataclass(frozen=True)
class AgReshapeSite(GatherSizes):
    """all-gather ``ag`` (dim ``dim``) → reshape ``view`` merging dims [first, last] → dots ``uses``.

    ``keep``: the reshape has other users (e.g. weight-gradient dots contracting the merged dim),
    which keep reading the all-gather; only ``uses`` read the ring.
    """

    ag: Instruction
    view: Instruction
    groups: tuple[tuple[int, ...], ...]
    dim: int
    first: int
    last: int
    uses: tuple[_ReshapeUse, ...]
    keep: bool = False
    collective: ClassVar[str] = "all-gather"

    def gemms(self) -> list[GemmShape]:
        m = self.view.shape.dims[self.first]
        return [GemmShape(m, _contract_numel(u.dot), u.dot.shape.numel // m if m else 0) for u in self.uses]

    def _group(self, chunk: bool) -> tuple[int, ...]:
        """The dims the reshape merges, with the gathered one at chunk size when ``chunk``."""
        dims = list(self.ag.shape.dims[self.first:self.last + 1])
        if chunk:
            dims[self.dim - self.first] = self.chunk
        return tuple(dims)

    def rewrite(self, em: _Emitter, comp: Computation, bidir: bool) -> None:
        """The unidirectional ring (``bidir`` is ignored: a merged chunk has no contiguous halves)."""
        x, p, c, a = self.ag.operands[0], self.p, self.chunk, self.first
        r = em.ring_index(self.groups)
        (lane,) = _lanes(self.groups, c, False, rs=False)
        inner = self.dim - a
        merged_chunk = math.prod(self._group(True))
        accs = [em.op("broadcast", _expand(u.dot.shape, u.out_dim, self._group(False)),
                      [em.const(0, u.dot.shape.dtype)], f"{u.dot.name}.init", dimensions=()) for u in self.uses]
        cur = x
        for s in range(p):
            off = em.offset(r, lane, s, p, c, self.ag.name)
            nxt = None
            if s + 1 < p:
                nxt = em.op("collective-permute", x.shape, [cur], f"{self.ag.name}.chunk{s + 1}",
                            source_target_pairs=lane.pairs)
            flat = em.op("reshape", _with(self.view.shape, a, merged_chunk), [cur], f"{self.ag.name}.in{s}")
            for k, u in enumerate(self.uses):
                ops = list(u.dot.operands)
                ops[u.side] = flat
                if u.other_dim is not None:
                    ops[1 - u.side] = self._slice_other(em, ops[1 - u.side], u, off, s)
                part = em.partial_dot(u.dot, ops, u.out_dim, merged_chunk, f"{u.dot.name}.{s}", s)
                part = em.op("reshape", _expand(part.shape, u.out_dim, self._group(True)), [part],
                             f"{u.dot.name}.out{s}")
                accs[k] = em.dus(accs[k], part, u.out_dim + inner, off, f"{u.dot.name}.acc{s}")
            cur = nxt
        finals = [em.op("reshape", u.dot.shape, [acc], f"{u.dot.name}.whole") for u, acc in
                  zip(self.uses, accs, strict=True)]
        _insert_before(comp, max((u.dot for u in self.uses), key=comp.instructions.index), em.new)
        for u, final in zip(self.uses, finals, strict=True):
            _replace(comp, u.dot, final)
        if not self.keep:
            comp.instructions.remove(self.view)
            comp.instructions.remove(self.ag)

    def _slice_other(self, em: _Emitter, other: Instruction, u: _ReshapeUse, off: Instruction, s: int) -> Instruction:
        """The other operand's merged batch dim, un-merged, sliced to the chunk, merged again."""
        od = u.other_dim
        full = em.op("reshape", _expand(other.shape, od, self._group(False)), [other], f"{u.dot.name}.other{s}")
        part = em.dslice(full, od + self.dim - self.first, off, self.chunk, f"{u.dot.name}.otherin{s}")
        return em.op("reshape", _with(other.shape, od, math.prod(self._group(True))), [part],
                     f"{u.dot.name}.othermerged{s}")


def _with(shape: Shape, dim: int, size: int) -> Shape:
    dims = list(shape.dims)
    dims[dim] = size
    return shape.with_dims(tuple(dims))


def _expand(shape: Shape, dim: int, sizes: tuple[int, ...]) -> Shape:
    """``shape`` with dim ``dim`` split into ``sizes``."""
    return shape.with_dims((*shape.dims[:dim], *sizes, *shape.dims[dim + 1:]))


def _merged_group(g: tuple[int, ...], r: tuple[int, ...]) -> tuple[int, int] | None:
    """(first, last): the dims of ``g`` a reshape to ``r`` merges into dim ``first`` of ``r`` (others kept)."""
    extra = len(g) - len(r)
    if extra < 1:
        return None
    for a in range(len(r)):
        b = a + extra
        if g[:a] == r[:a] and g[b + 1:] == r[a + 1:] and math.prod(g[a:b + 1]) == r[a]:
            return a, b
    return None


def match_ag_reshape(ag: Instruction, users, comp: Computation, n: int) -> AgReshapeSite | None:
    """The site of an all-gather read by dots through one merging reshape, else None."""
    groups = _groups(ag, n)
    dims = ag.attrs.get("dimensions", ())
    if groups is None or len(dims) != 1 or ag is comp.root or len(users[ag]) != 1:
        return None
    dim, x, view = dims[0], ag.operands[0], users[ag][0]
    if view.opcode != "reshape" or view is comp.root or not users[view]:
        return None
    if ag.shape.dims[dim] != len(groups[0]) * x.shape.dims[dim]:
        return None
    merge = _merged_group(ag.shape.dims, view.shape.dims)
    if merge is None or not merge[0] <= dim <= merge[1]:
        return None
    uses = []
    for dot in dict.fromkeys(users[view]):
        use = _use(view, dot, merge[0])
        if (use is not None and not any(ancestor_ids([o]) & {id(v.dot) for v in uses} for o in dot.operands)
                and not any(id(dot) in ancestor_ids([v.dot.operands[1 - v.side]]) for v in uses)):
            uses.append(use)  # no use feeds another: one shared ring is no cycle
    if not uses:
        return None
    keep = len(uses) < len(set(map(id, users[view])))
    return AgReshapeSite(ag, view, groups, dim, merge[0], merge[1], tuple(uses), keep)


def _use(view: Instruction, dot: Instruction, merged: int) -> _ReshapeUse | None:
    """How ``dot`` reads ``view`` if a ring can feed it (the merged dim not contracted), else None."""
    if dot.opcode != "dot" or dot.operands.count(view) != 1 or MARK in dot.attrs.get("backend_config", {}):
        return None
    if _empty(dot):
        return None
    side = dot.operands.index(view)
    found = [(o, pair) for o, pair in enumerate(_dot_layout(dot)) if pair[side] == merged]
    if not found:
        return None  # the merged dim is contracted (a weight gradient): it keeps the all-gather
    o, pair = found[0]
    return _ReshapeUse(dot, side, o, pair[1 - side])


@dataclass(frozen=True)
class RsReshapeSite(ScatterSizes):
    """dot → reshape ``view`` (splitting dot dim ``first`` into view dims [first, last]) → reduce-scatter
    ``rs`` over view dim ``dim``."""

    rs: Instruction
    view: Instruction
    dot: Instruction
    groups: tuple[tuple[int, ...], ...]
    dim: int
    first: int
    last: int
    collective: ClassVar[str] = "reduce-scatter"

    def gemms(self) -> list[GemmShape]:
        m = self.dot.shape.dims[self.first]
        return [GemmShape(m, _contract_numel(self.dot), self.dot.shape.numel // m if m else 0)]

    def rewrite(self, em: _Emitter, comp: Computation, bidir: bool) -> None:
        """The unidirectional ring (``bidir`` is ignored)."""
        p, c, dot = self.p, self.chunk, self.dot
        r = em.ring_index(self.groups)
        (lane,) = _lanes(self.groups, c, False, rs=True)
        full = tuple(self.view.shape.dims[self.first:self.last + 1])
        part_group = tuple(c if k == self.dim else n for k, n in enumerate(full, start=self.first))
        src = _dot_layout(dot)[self.first]
        wide = [None if d is None else em.op("reshape", _expand(op.shape, d, full), [op],
                                             f"{dot.name}.{'lhs' if k == 0 else 'rhs'}wide")
                for k, (op, d) in enumerate(zip(dot.operands, src, strict=True))]
        acc = None
        for s in range(p):
            recv = None
            if acc is not None:
                recv = em.op("collective-permute", acc.shape, [acc], f"{self.rs.name}.recv{s}",
                             source_target_pairs=lane.pairs)
            off = em.offset(r, lane, s, p, c, self.rs.name)
            ops = [op if d is None else self._slice(em, op, w, d, len(full), off, s, k)
                   for k, (op, w, d) in enumerate(zip(dot.operands, wide, src, strict=True))]
            part = em.partial_dot(dot, ops, self.first, math.prod(part_group), f"{dot.name}.{s}", s)
            part = em.op("reshape", _expand(part.shape, self.first, part_group), [part], f"{dot.name}.out{s}")
            acc = part if recv is None else em.op("add", part.shape, [part, recv], f"{self.rs.name}.acc{s}")
        _insert_before(comp, self.rs, em.new)
        _replace(comp, self.rs, acc)
        comp.instructions.remove(self.view)
        comp.instructions.remove(dot)

    def _slice(self, em: _Emitter, op: Instruction, wide: Instruction, d: int, width: int, off: Instruction, s: int,
               k: int) -> Instruction:
        """Operand ``op``'s dim ``d`` (merged like the dot's dim; ``wide`` un-merges it into ``width``
        dims): the chunk sliced, merged back."""
        side = "lhs" if k == 0 else "rhs"
        part = em.dslice(wide, d + self.dim - self.first, off, self.chunk, f"{self.dot.name}.{side}in{s}")
        return em.op("reshape", _with(op.shape, d, math.prod(part.shape.dims[d:d + width])), [part],
                     f"{self.dot.name}.{side}{s}")


def match_rs_reshape(rs: Instruction, users, comp: Computation, n: int) -> RsReshapeSite | None:
    """The site of a reduce-scatter of a dot's result split by one reshape, else None."""
    groups, dims, view = _groups(rs, n), rs.attrs.get("dimensions", ()), rs.operands[0]
    reducer = rs.attrs.get("to_apply")
    if groups is None or len(dims) != 1 or view.opcode != "reshape" or users[view] != [rs] or view is comp.root:
        return None
    dot = view.operands[0]
    if dot.opcode != "dot" or users[dot] != [view] or dot is comp.root or MARK in dot.attrs.get("backend_config", {}):
        return None
    if (reducer is not None and reducer.root.opcode != "add") or _empty(dot) or rs.shape.numel == 0:
        return None
    split = _merged_group(view.shape.dims, dot.shape.dims)
    dim = dims[0]
    if split is None or not split[0] <= dim <= split[1]:
        return None
    if view.shape.dims[dim] != len(groups[0]) * rs.shape.dims[dim]:
        return None
    return RsReshapeSite(rs, view, dot, groups, dim, split[0], split[1])
