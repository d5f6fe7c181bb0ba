"""Dot plans: which operand keeps a contested mesh axis, costed by the bytes resharding moves.

Split from ``sharding_rules`` (same contract: a ``Plan`` of operand shardings and the local
result's sharding). Follows XLA's ``spmd/dot_handler.cc`` in spirit: batch dims first, then
contracting dims (a shared axis makes the result partial), then free dims; when both operands
want one axis on their free dims, the cheaper plan wins.
"""

from __future__ import annotations

from spmd.ir.hlo import Instruction
from spmd.ir.sharding import MeshShape, TensorSharding
from spmd.passes.plan_base import Plan, _d, _p, _Picker


def dot_dims(inst: Instruction):
    """(lhs batch, rhs batch, lhs contracting, rhs contracting, lhs free, rhs free) dims of a dot."""
    a = inst.attrs
    lb, rb = tuple(a.get("lhs_batch_dims", ())), tuple(a.get("rhs_batch_dims", ()))
    lc, rc = tuple(a["lhs_contracting_dims"]), tuple(a["rhs_contracting_dims"])
    lf = tuple(d for d in range(inst.operands[0].shape.rank) if d not in lb + lc)
    rf = tuple(d for d in range(inst.operands[1].shape.rank) if d not in rb + rc)
    return lb, rb, lc, rc, lf, rf


def _dot(inst, current, out, mesh, gather_discount: float = 1.0) -> Plan:
    """The cheapest of the dot plans that differ in which operand keeps a contested mesh axis.

    When the same axis shards a free dim of both operands (e.g. x split on rows and w on
    columns, both over ``tp``) only one can keep it; the other is all-gathered. As in GSPMD's
    dot handler, the candidates are costed by the bytes each device would receive to reshard
    the operands (and the result, when its wanted sharding is known), and the cheapest wins;
    ties keep the lhs-first order. An operand all-gather that a windowed einsum can overlap
    with the dot itself counts ``gather_discount`` of its bytes.
    """
    candidates = [_dot_plan(inst, current, out, mesh, rhs_first) for rhs_first in (False, True)]
    if candidates[0] == candidates[1]:
        return candidates[0]
    costs = [_plan_cost(inst, current, out, p, mesh, gather_discount) for p in candidates]
    return candidates[1] if costs[1] < costs[0] else candidates[0]


def _plan_cost(inst, current, out, p: Plan, mesh, gather_discount: float = 1.0) -> float:
    cost = 0.0
    for o, c, w in zip(inst.operands, current, p.operands, strict=False):
        if c is not None:
            only_gathers = c.partial == w.partial and all(set(b) <= set(a) for a, b in zip(c.dims, w.dims))
            cost += reshard_bytes(o.shape, c, w, mesh) * (gather_discount if only_gathers else 1.0)
    if out is not None:
        cost += reshard_bytes(inst.shape, p.result, out, mesh)
    return cost


def reshard_bytes(shape, src: TensorSharding, dst: TensorSharding, mesh: MeshShape) -> float:
    """Approximate bytes one device receives to reshard a value of ``shape`` from ``src`` to ``dst``.

    Axes dropped from a dim are all-gathered (local size × (n − 1)); partial axes that
    ``dst`` does not keep are reduced (≈ local size); an axis moving between dims is an
    all-to-all (≈ local size); axes that ``dst`` adds are a local slice (free).
    """
    local = shape.numel * shape.itemsize / max(1, mesh.axes_size(src.used_axes()))
    cost = 0.0
    dst_dim_of = {a: i for i, d in enumerate(dst.dims) for a in d}
    for i, axes in enumerate(src.dims):
        for a in axes:
            j = dst_dim_of.get(a)
            if j is None:
                cost += local * (mesh.size(a) - 1)
                local *= mesh.size(a)
            elif j != i:
                cost += local
    for a in src.partial:
        if a not in dst.partial:
            cost += local
    return cost


def _dot_plan(inst, current, out, mesh, rhs_first: bool) -> Plan:
    lb, rb, lc, rc, lf, rf = dot_dims(inst)
    a, b = current
    pa, pb = _p(a), _p(b)
    part_a = pa if pa and not pb else ()
    part_b = pb if pb and not pa else ()
    picker = _Picker(part_a + part_b)
    nb = len(lb)
    batch = [picker.pick(_d(a, i), _d(b, j), _d(out, k)) for k, (i, j) in enumerate(zip(lb, rb, strict=False))]
    contract = [picker.pick(_d(a, i), _d(b, j)) for i, j in zip(lc, rc, strict=False)]

    def pick_lfree():
        return [picker.pick(_d(a, i), _d(out, nb + k)) for k, i in enumerate(lf)]

    def pick_rfree():
        return [picker.pick(_d(b, i), _d(out, nb + len(lf) + k)) for k, i in enumerate(rf)]

    if rhs_first:
        rfree = pick_rfree()
        lfree = pick_lfree()
    else:
        lfree = pick_lfree()
        rfree = pick_rfree()
    lhs, rhs = [()] * inst.operands[0].shape.rank, [()] * inst.operands[1].shape.rank
    for axes, i, j in zip(batch, lb, rb, strict=False):
        lhs[i], rhs[j] = axes, axes
    for axes, i, j in zip(contract, lc, rc, strict=False):
        lhs[i], rhs[j] = axes, axes
    for axes, i in zip(lfree, lf, strict=False):
        lhs[i] = axes
    for axes, i in zip(rfree, rf, strict=False):
        rhs[i] = axes
    partial = tuple(x for axes in contract for x in axes) + part_a + part_b
    order = {x: i for i, x in enumerate(mesh.axis_names)}
    result = TensorSharding(tuple(batch + lfree + rfree), tuple(sorted(partial, key=order.__getitem__)))
    return Plan((TensorSharding(tuple(lhs), part_a), TensorSharding(tuple(rhs), part_b)), result)
