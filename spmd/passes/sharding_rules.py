"""Per-op sharding rules shared by sharding propagation and the SPMD partitioner.

``plan(inst, current, out, mesh)`` answers, for one instruction: given the operands' current
shardings (None = not known yet) and the wanted result sharding (None = no preference), which
sharding each operand should have so that running the op *locally* on the shards is correct,
and which sharding the local result then has. Propagation reads ``result`` (forward) and
``operands`` (backward); the partitioner reshards the operands to ``operands``, emits the local
op and reshards ``result`` to the instruction's sharding.

Choices follow GSPMD (Xu et al. 2021, arXiv:2105.04663, §3.4 and XLA's
``xla/service/sharding_propagation.cc``, ``xla/service/spmd/dot_handler.cc``) and Shardy's
named-axis factor propagation: a dim keeps the axes its operand already has (no
communication), falls back to the wanted result's axes (a local slice, no communication), and
an axis is used at most once. Dot contracting dims sharded alike give a ``partial`` result;
``partial`` passes only through ops linear in that operand, and in 16-bit float types only
through the exact ones (add, subtract, negate, copy, widening converts): a product or quotient
of a partial value would round each device's term at its own scale before the sum.
"""

from __future__ import annotations

import math

from spmd.ir.custom_calls import CUSTOM_CALLS
from spmd.ir.custom_calls_attention import seq_major, slab_dim
from spmd.ir.hlo import ELEMENTWISE_OPCODES, Instruction
from spmd.ir.sharding import MeshShape, TensorSharding
from spmd.passes.dot_plans import _dot, dot_dims  # noqa: F401  (dot_dims is re-exported)
from spmd.passes.plan_base import Axes, Plan, _d, _p, _Picker, _rep
from spmd.passes.rules_conv import plan_conv1d
from spmd.passes.rules_index import dus_plan, gather_dims, gather_plan, scatter_plan  # noqa: F401  (gather_dims re-exported)


def plan(inst: Instruction, current: list[TensorSharding | None], out: TensorSharding | None,
         mesh: MeshShape, gather_discount: float = 1.0) -> Plan | None:
    """The local plan of ``inst`` (see the module docstring); None when nothing is known.

    ``current[k]`` is operand k's sharding or None; tuple-shaped operands are not handled
    here (tuple and get-tuple-element are handled by the callers). ``gather_discount``
    scales the cost of all-gathering a dot operand (< 1 when windowed einsum can hide it).
    """
    op = inst.opcode
    if not inst.operands:
        if op == "iota" and out is not None:  # each device builds its shard (spmd.passes.partition_iota)
            return Plan((), out.with_partial(()))
        return Plan((), _rep(inst)) if out is not None else None
    if out is None and all(c is None for c in current):
        return None
    if out is None and current[0] is None and op in _NEEDS_OPERAND0:
        return None
    if op in ELEMENTWISE_OPCODES:
        return _elementwise(inst, current, out, linear=_linear_operands(inst, current))
    if op == "dot":
        return _dot(inst, current, out, mesh, gather_discount)
    rule = _RULES.get(op)
    if rule is None:
        return Plan(tuple(TensorSharding.replicated(o.shape.rank) for o in inst.operands), _rep(inst))
    return rule(inst, current, out, mesh)


# --------------------------------------------------------------------------- elementwise
# 16-bit floats: a partial value multiplied, divided or rounded to the type per device
# before the sum rounds each device's term at the scale of that term (which may be far larger
# than the sum), so those ops take the all-reduced value instead; in 32- and 64-bit types the
# reordering is harmless and saves the collective (as XLA does).
HALF_FLOATS = _LOW_PRECISION = frozenset({"bf16", "f16"})
_EXACT_ON_PARTIALS = frozenset({"add", "subtract", "negate", "copy", "convert"})


def _linear_operands(inst: Instruction, current) -> tuple[int, ...]:
    """Operands that may stay partial (all of them with the same partial axes)."""
    op = inst.opcode
    parts = [_p(c) for c in current]
    if inst.shape.dtype in _LOW_PRECISION and op not in _EXACT_ON_PARTIALS:
        return ()
    if op in ("add", "subtract"):
        return (0, 1) if parts[0] and parts[0] == parts[1] else ()
    if op in ("negate", "copy") or (op == "convert" and inst.shape.torch_dtype.is_floating_point
                                    and inst.operands[0].shape.torch_dtype.is_floating_point
                                    and _float_bits(inst.shape.dtype) >= _float_bits(inst.operands[0].shape.dtype)):
        return (0,) if parts[0] else ()
    if op == "multiply" and bool(parts[0]) != bool(parts[1]):
        return (0,) if parts[0] else (1,)
    if op == "divide" and parts[0] and not parts[1]:
        return (0,)
    return ()


def _float_bits(dtype: str) -> int:
    """Bits of an HLO floating type name (``"bf16"`` -> 16)."""
    return int(dtype.lstrip("bf"))


def _merge_dims(shardings: list[TensorSharding], used=()) -> tuple[Axes, ...]:
    """Per-dim union of the given shardings' axes, most-sharded first, each axis once."""
    known = sorted(shardings, key=lambda s: -len(s.used_axes()))
    picker = _Picker(used)
    rank = known[0].rank
    return tuple(picker.pick(*[s.dims[i] for s in known]) for i in range(rank))


def _elementwise(inst, current, out, linear=()) -> Plan:
    """Operands (0-d ones replicated) and result share dims; linear operands may stay partial."""
    rank = inst.shape.rank
    partial = _p(current[linear[0]]) if linear else ()
    if out is not None:
        dims = out.dims
    else:
        full = [c for c in current if c is not None and c.rank == rank]
        dims = _merge_dims(full, used=partial) if full else ((),) * rank
    if set(partial) & {a for d in dims for a in d}:
        partial, linear = (), ()
    plain = TensorSharding(dims)
    ops = tuple(plain.with_partial(partial) if k in linear else
                (plain if o.shape.rank == rank else TensorSharding.replicated(o.shape.rank))
                for k, o in enumerate(inst.operands))
    return Plan(ops, plain.with_partial(partial))


# --------------------------------------------------------------------------- layout ops
def _keep_partial(cur: TensorSharding | None, dims: tuple[Axes, ...]) -> tuple[str, ...]:
    part = _p(cur)
    return () if set(part) & {a for d in dims for a in d} else part


def _broadcast(inst, current, out, mesh) -> Plan:
    bd = inst.attrs["dimensions"]
    x = current[0]
    if out is not None:
        res_dims = out.dims
    else:
        res = [()] * inst.shape.rank
        for i, d in enumerate(bd):
            res[d] = x.dims[i]
        res_dims = tuple(res)
    op_dims = tuple(res_dims[d] for d in bd)
    part = _keep_partial(x, res_dims)
    return Plan((TensorSharding(op_dims, part),), TensorSharding(res_dims, part))


def _transpose(inst, current, out, mesh) -> Plan:
    perm = inst.attrs["dimensions"]
    x = current[0]
    if out is not None:
        op = [()] * len(perm)
        for i, p in enumerate(perm):
            op[p] = out.dims[i]
        op_dims = tuple(op)
    else:
        op_dims = x.dims
    part = _keep_partial(x, op_dims)
    return Plan((TensorSharding(op_dims, part),), TensorSharding(tuple(op_dims[p] for p in perm), part))


def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Minimal groups of consecutive src and dst dims with equal element counts.

    Size-1 dims at a group boundary form groups of their own. With no elements (a size-0 dim
    on both sides) all dims form one group. Raises ValueError when the element counts differ.
    """
    if 0 in src or 0 in dst:
        if math.prod(src) != math.prod(dst):
            raise ValueError(f"reshape {src} -> {dst}: element counts differ")
        return [(list(range(len(src))), list(range(len(dst))))]
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            raise ValueError(f"reshape {src} -> {dst}: element counts differ")
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                if i >= len(src):
                    raise ValueError(f"reshape {src} -> {dst}: element counts differ")
                gi.append(i)
                pi *= src[i]
                i += 1
            else:
                if j >= len(dst):
                    raise ValueError(f"reshape {src} -> {dst}: element counts differ")
                gj.append(j)
                pj *= dst[j]
                j += 1
        groups.append((gi, gj))
    return groups


def _map_reshape(src_dims, dst_dims, src_sh: TensorSharding, mesh) -> tuple[tuple[Axes, ...], tuple[Axes, ...]]:
    """(kept src dims sharding, mapped dst dims sharding) for a reshape src -> dst."""
    keep = [()] * len(src_dims)
    mapped = [()] * len(dst_dims)
    for gi, gj in reshape_groups(tuple(src_dims), tuple(dst_dims)):
        if not gi or not gj:
            continue
        axes = src_sh.dims[gi[0]]
        if not axes:
            continue
        k = mesh.axes_size(axes)
        if len(gi) == 1 and len(gj) == 1 or src_dims[gi[0]] % k == 0 and dst_dims[gj[0]] % k == 0:
            keep[gi[0]], mapped[gj[0]] = axes, axes
    return tuple(keep), tuple(mapped)


def _reshape(inst, current, out, mesh) -> Plan:
    src, dst = inst.operands[0].shape.dims, inst.shape.dims
    x = current[0]
    if out is not None:
        _, op_dims = _map_reshape(dst, src, TensorSharding(out.dims), mesh)
    else:
        op_dims, _ = _map_reshape(src, dst, TensorSharding(x.dims), mesh)
    op_dims, res_dims = _map_reshape(src, dst, TensorSharding(op_dims), mesh)
    part = _keep_partial(x, op_dims)
    return Plan((TensorSharding(op_dims, part),), TensorSharding(res_dims, part))


def _unsharded(dims: tuple[Axes, ...], which) -> tuple[Axes, ...]:
    return tuple(() if i in which else d for i, d in enumerate(dims))


def _slice(inst, current, out, mesh) -> Plan:
    n = inst.operands[0].shape.dims
    cut = {i for i, (s, e, st) in enumerate(inst.attrs["slice"]) if (s, e, st) != (0, n[i], 1)}
    base = out if out is not None else current[0]
    dims = _unsharded(base.dims, cut)
    part = _keep_partial(current[0], dims)
    return Plan((TensorSharding(dims, part),), TensorSharding(dims, part))


def _concatenate(inst, current, out, mesh) -> Plan:
    cat = inst.attrs["dimensions"][0]
    known = [c for c in current if c is not None]
    dims = out.dims if out is not None else _merge_dims(known)
    dims = _unsharded(dims, {cat})
    parts = {_p(c) for c in current}
    part = _keep_partial(current[0], dims) if len(parts) == 1 else ()
    sh = TensorSharding(dims, part)
    return Plan(tuple(sh for _ in current), sh)


def _pad(inst, current, out, mesh) -> Plan:
    padded = {i for i, p in enumerate(inst.attrs["padding"]) if tuple(p) != (0, 0, 0)}
    base = out if out is not None else current[0]
    dims = _unsharded(base.dims, padded)
    return Plan((TensorSharding(dims), TensorSharding(())), TensorSharding(dims))


# --------------------------------------------------------------------------- dot
# --------------------------------------------------------------------------- reduce
def reduce_kind(inst: Instruction) -> str:
    """The to_apply root opcode of a reduce (add / maximum / minimum / ...)."""
    return inst.attrs["to_apply"].root.opcode


def _reduce(inst, current, out, mesh) -> Plan:
    x = current[0]
    red = tuple(inst.attrs["dimensions"])
    kept = [d for d in range(inst.operands[0].shape.rank) if d not in red]
    kind = reduce_kind(inst)
    linear = kind == "add"
    part = _p(x) if linear else ()
    picker = _Picker(part)
    splittable = kind in ("add", "maximum", "minimum")
    red_axes = {d: picker.pick(_d(x, d)) if splittable else () for d in red}
    res = [picker.pick(_d(x, d), _d(out, k)) for k, d in enumerate(kept)]
    op = [()] * inst.operands[0].shape.rank
    for k, d in enumerate(kept):
        op[d] = res[k]
    for d, axes in red_axes.items():
        op[d] = axes
    new_part = tuple(a for d in red for a in red_axes[d]) if linear else ()
    order = {x: i for i, x in enumerate(mesh.axis_names)}
    result = TensorSharding(tuple(res), tuple(sorted(part + new_part, key=order.__getitem__)))
    return Plan((TensorSharding(tuple(op), part), TensorSharding(())), result)


# --------------------------------------------------------------------------- indexing
def _dynamic_slice(inst, current, out, mesh) -> Plan:
    x = current[0]
    n = inst.operands[0].shape.dims
    sizes = inst.attrs["dynamic_slice_sizes"]
    picker = _Picker(_p(x))
    dims = tuple(picker.pick(_d(x, i), _d(out, i)) if sizes[i] == n[i] else () for i in range(len(n)))
    part = _p(x)
    scalars = tuple(TensorSharding(()) for _ in inst.operands[1:])
    return Plan((TensorSharding(dims, part), *scalars), TensorSharding(dims, part))


# --------------------------------------------------------------------------- custom calls
def _custom_call(inst, current, out, mesh) -> Plan:
    target = inst.attrs.get("custom_call_target")
    spec = CUSTOM_CALLS.get(target)
    rank = inst.shape.rank
    if spec is None:
        return Plan(tuple(TensorSharding.replicated(o.shape.rank) for o in inst.operands), _rep(inst))
    if spec.rule == "sharding-constraint":
        want = inst.sharding if inst.sharding is not None else (out if out is not None else current[0])
        return Plan((want,), want)
    if spec.rule in ("elementwise", "scan"):  # a scan along a sharded dim: spmd.passes.partition_scan
        return _elementwise(inst, current, out)
    if spec.rule == "convolution":
        return plan_conv1d(inst, current, out, mesh)
    config = dict(inst.attrs.get("backend_config") or {})
    if spec.rule == "reduction-last-dims":
        fixed = set(spec.unsharded_dims(config, rank))
        picker = _Picker()
        dims = tuple(() if i in fixed else picker.pick(_d(current[0], i), _d(out, i)) for i in range(rank))
        rest = tuple(TensorSharding.replicated(o.shape.rank) for o in inst.operands[1:])
        return Plan((TensorSharding(dims), *rest), TensorSharding(dims))
    return _attention(inst, current, out)


def _attention(inst, current, out) -> Plan:
    """q, k, v[, mask]: leading (batch, head) dims shared by every operand, last two unsharded. The
    training calls' packed results (``attention-forward``'s result, ``attention-backward``'s result
    and its operand 3) hold the leading dims at their sequence-major slab dims (``slab_dim``)."""
    q_dims = inst.operands[0].shape.dims
    rank = len(q_dims)
    training = inst.attrs.get("custom_call_target") in ("attention-forward", "attention-backward")
    picker = _Picker()
    lead = []
    for i in range(rank - 2):
        cands = [_d(c, i) for c in current[:3]] + [_d(out, slab_dim(rank - 2, i) if training else i)]
        lead.append(picker.pick(*cands))
    lead = tuple(lead)
    qkv = TensorSharding(lead + ((), ()))
    slabs = TensorSharding(((), *seq_major(lead, (), ())))
    ops = [qkv, qkv, qkv]
    rest = inst.operands[3:]
    if inst.attrs.get("custom_call_target") == "attention-backward":
        ops += [slabs, qkv]
        rest = rest[2:]
    for mask in rest:
        mdims, off = mask.shape.dims, rank - mask.shape.rank
        ops.append(TensorSharding(tuple(
            lead[off + j] if off + j < rank - 2 and mdims[j] == q_dims[off + j] else () for j in range(len(mdims)))))
    return Plan(tuple(ops), slabs if training else qkv)


_NEEDS_OPERAND0 = frozenset({
    "broadcast", "transpose", "reshape", "slice", "pad", "reduce", "dynamic-slice", "custom-call"})

_RULES = {
    "broadcast": _broadcast,
    "transpose": _transpose,
    "reshape": _reshape,
    "slice": _slice,
    "concatenate": _concatenate,
    "pad": _pad,
    "dot": _dot,
    "reduce": _reduce,
    "gather": gather_plan,
    "scatter": scatter_plan,
    "dynamic-slice": _dynamic_slice,
    "dynamic-update-slice": dus_plan,
    "custom-call": _custom_call,
}
