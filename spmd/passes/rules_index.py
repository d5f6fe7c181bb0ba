"""Sharding rules of ``gather`` and ``scatter`` (the forms of ``spmd.ir.index_shapes``).

Dims are matched up as factors (Shardy's factor propagation; GSPMD's gather/scatter handlers in
XLA ``xla/service/spmd/gather_scatter_handler.cc``). Each factor keeps the axes an operand
already has, else takes the wanted result's, each mesh axis once:

- index batch dims <-> result batch dims (gather) / update scatter dims (scatter): pass through;
- operand dims sliced whole (row contents) or batching dims <-> result / update / index dims
  of the same size: pass through;
- the **indexed operand dim** ``a`` may stay sharded: for a gather each shard looks up the
  indices that fall in its range, zeros the others, and the result is ``partial`` over those
  axes (Megatron-LM's VocabParallelEmbedding, Shoeybi et al. 2019, arXiv:1909.08053; XLA's
  "trivial slice dims" gather); for a scatter each shard applies only the updates whose index
  falls in its range (the others are out of its local range and dropped), the result keeps the
  operand's sharding;
- a scatter's **update scatter dims** (index batch dims) may stay sharded when it adds: each
  shard adds its updates into a ``partial`` copy of the operand (the operand on one device,
  zeros elsewhere), the result is partial over those axes; other combiners replicate them.

The partitioner's side (offsets from partition-id, masks) is ``spmd.passes.partition_index``.
"""

from __future__ import annotations

from spmd.ir.hlo import Instruction
from spmd.ir.index_shapes import gather_form, scatter_form, scatter_kind
from spmd.ir.sharding import MeshShape, TensorSharding
from spmd.passes.plan_base import Plan, _d, _Picker, _rep

__all__ = ["dus_plan", "gather_dims", "gather_plan", "scatter_plan"]


def gather_dims(inst: Instruction):
    """(output batch dims, matching indices dims, output offset dims, matching operand dims)."""
    a = inst.attrs
    table, idx = inst.operands[0].shape, inst.operands[1].shape
    ivd = a.get("index_vector_dim", idx.rank)
    offset = tuple(a["offset_dims"])
    out_batch = tuple(d for d in range(inst.shape.rank) if d not in offset)
    idx_batch = tuple(d for d in range(idx.rank) if d != ivd)
    skip = set(a["collapsed_slice_dims"]) | set(a.get("operand_batching_dims", ()))
    tab_off = tuple(d for d in range(table.rank) if d not in skip)
    return out_batch, idx_batch, offset, tab_off


def _ordered(axes, mesh: MeshShape) -> tuple[str, ...]:
    return tuple(x for x in mesh.axis_names if x in set(axes))


def _replicated(inst: Instruction) -> Plan:
    return Plan(tuple(TensorSharding.replicated(o.shape.rank) for o in inst.operands), _rep(inst))


def _assign(factors, used=()) -> list[tuple[str, ...]]:
    """Axes per factor: first from the operands' current shardings (no communication), then from the
    wanted result's; each factor is ``(current candidates, wanted candidate)``, each mesh axis used once."""
    picker = _Picker(used)
    axes = [picker.pick(*cur) for cur, _ in factors]
    return [ax or picker.pick(want) for ax, (_, want) in zip(axes, factors, strict=True)]


def gather_plan(inst: Instruction, current, out, mesh: MeshShape) -> Plan:
    """Plan of a gather; operands replicated for a form outside ``spmd.ir.index_shapes``'s two."""
    form = gather_form(inst)
    if form is None:
        return _replicated(inst)
    t, ix = current
    a = form.axis
    res = [()] * inst.shape.rank
    idx = [()] * inst.operands[1].shape.rank
    tab = [()] * inst.operands[0].shape.rank
    links = []  # (result dim, indices dim or None, operand dim or None)
    if form.kind == "rows":
        out_batch, idx_batch, offset, tab_off = gather_dims(inst)
        links += [(od, idd, None) for od, idd in zip(out_batch, idx_batch, strict=True)]
        links += [(od, None, td) for od, td in zip(offset, tab_off, strict=True)]
    else:
        p = form.index_of
        links += [(p[d], p[d], d if d != a else None) for d in range(len(tab))]
    factors = [([_d(ix, i) if i is not None else None, _d(t, d) if d is not None else None], _d(out, o))
               for o, i, d in links]
    axes = _assign(factors + [([_d(t, a)], None)])
    for (o, i, d), ax in zip(links, axes, strict=False):
        res[o] = ax
        if i is not None:
            idx[i] = ax
        if d is not None:
            tab[d] = ax
    tab[a] = axes[-1]
    result = TensorSharding(tuple(res), _ordered(tab[a], mesh))
    return Plan((TensorSharding(tuple(tab)), TensorSharding(tuple(idx))), result)


def scatter_plan(inst: Instruction, current, out, mesh: MeshShape) -> Plan:
    """Plan of a scatter; operands replicated for a form outside ``spmd.ir.index_shapes``'s two."""
    form, kind = scatter_form(inst), scatter_kind(inst)
    if form is None:
        return _replicated(inst)
    x, ix, u = current
    a = form.axis
    rank = inst.shape.rank
    xs, idx = [()] * rank, [()] * inst.operands[1].shape.rank
    us = [()] * inst.operands[2].shape.rank
    links = []  # (operand dim or None, indices dim or None, updates dim)
    if form.kind == "rows":
        nb = len(idx)
        links += [(d, None, nb + k) for k, d in enumerate(d for d in range(rank) if d != a)]
        batch = list(range(nb))
    else:
        p = form.index_of
        links += [(d, p[d], p[d]) for d in range(rank) if d != a]
        batch = [p[a]]
    factors = [([_d(x, d), _d(ix, i) if i is not None else None, _d(u, j)], _d(out, d)) for d, i, j in links]
    factors.append(([_d(x, a)], _d(out, a)))
    if kind == "add":
        factors += [([_d(ix, j), _d(u, j)], None) for j in batch]
    axes = _assign(factors)
    for (d, i, j), ax in zip(links, axes, strict=False):
        xs[d] = us[j] = ax
        if i is not None:
            idx[i] = ax
    xs[a] = axes[len(links)]
    partial: list[str] = []
    for j, ax in zip(batch, axes[len(links) + 1:], strict=False):
        idx[j] = us[j] = ax
        partial += ax
    sh = TensorSharding(tuple(xs), _ordered(partial, mesh))
    return Plan((sh, TensorSharding(tuple(idx)), TensorSharding(tuple(us))), sh)


def dus_plan(inst: Instruction, current, out, mesh: MeshShape) -> Plan:
    """Plan of ``dynamic-update-slice(x, update, starts...)``.

    Dims the update covers whole pass through (operand, update and result alike). A dim the
    update covers with one row (a KV-cache position) keeps the operand's axes (else the wanted
    result's): each shard writes the row only when the position falls in its range
    (``spmd.passes.partition_index.partition_dus``). Other dims are unsharded.
    """
    x, u = current[0], current[1]
    n, m = inst.operands[0].shape.dims, inst.operands[1].shape.dims
    whole = [i for i in range(len(n)) if m[i] == n[i]]
    row = [i for i in range(len(n)) if m[i] == 1 < n[i]]
    factors = [([_d(x, i), _d(u, i)], _d(out, i)) for i in whole] + [([_d(x, i)], _d(out, i)) for i in row]
    dims, upd = [()] * len(n), [()] * len(n)
    for i, ax in zip(whole + row, _assign(factors), strict=True):
        dims[i] = ax
        if i in whole:
            upd[i] = ax
    sh = TensorSharding(tuple(dims))
    scalars = tuple(TensorSharding(()) for _ in inst.operands[2:])
    return Plan((sh, TensorSharding(tuple(upd)), *scalars), sh)
