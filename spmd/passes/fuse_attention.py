"""fuse-attention: explicit attention (dot, scale, softmax, dot) becomes one ``attention`` custom call.

A transformer written by hand computes ``softmax(q @ k^T / sqrt(d)) @ v`` as a batched GEMM, a
broadcast scale, a divide, a softmax and a second batched GEMM: five or more kernels per device,
and an ``[..., Sq, Sk]`` score tensor written to and read back from memory twice. The
``attention`` custom call (``spmd.ir.custom_calls``) runs PyTorch's
``scaled_dot_product_attention``, one flash / memory-efficient kernel where the backend has one.
XLA's cuDNN fused-MHA rewriter (xla/service/gpu/transforms/cudnn_fused_mha_rewriter.cc) matches
the same bmm-scale-softmax-bmm pattern and replaces it with one fused call.

Pattern, in the entry computation of a partitioned module (``B...`` = nb >= 0 leading batch dims)::

    s  = dot(q, kt)        q [B..., Sq, D]; batch dims 0..nb-1 on both sides; q contracts its last
                           dim with kt's dim -2 (kt [B..., D, Sk]) or last dim (kt [B..., Sk, D])
    s' = s * c | c * s | s / c      c a scalar constant (or its broadcast), optional (scale 1)
    x  = s' | s' + m | m + s'       m an additive float mask of the scores' shape, optional
    p  = softmax(x)        over the last dim
    o  = dot(p, v)         batched the same way, p's last dim with v's dim -2; v [B..., Sk, Dv]

becomes ``o = custom-call(q, k, v[, m]), custom_call_target="attention"`` with backend_config
``{"is_causal": false, "has_mask": m given, "scale": c | 1/c | 1.0}``. ``k`` is ``kt`` itself
when kt is ``[B..., Sk, D]``; for ``[B..., D, Sk]`` it is the operand of kt when kt is a
transpose swapping the last two dims (the transpose then usually dies), else a new transpose.
The new instruction is named ``fused_attention`` and takes o's shape, sharding, stream id and
metadata. Before (one device)::

    %kt = f32[4,64,128] transpose(%k), dimensions={0,2,1}
    %s = f32[4,128,128] dot(%q, %kt), lhs_batch_dims={0}, rhs_batch_dims={0}, lhs_contracting_dims={2}, ...
    %c = f32[] constant(8.0)
    %cb = f32[4,128,128] broadcast(%c), dimensions={}
    %s1 = f32[4,128,128] divide(%s, %cb)
    %p = f32[4,128,128] custom-call(%s1), custom_call_target="softmax", backend_config={"dim":2}
    ROOT %o = f32[4,128,64] dot(%p, %v), lhs_batch_dims={0}, rhs_batch_dims={0}, ...

after::

    ROOT %fused_attention = f32[4,128,64] custom-call(%q, %k, %v), custom_call_target="attention",
        backend_config={"is_causal":false,"has_mask":false,"scale":0.125}

Conditions (anything else is left unchanged): every intermediate (s, the broadcast of c, s', the
mask add, p) has exactly one use; q, kt, v, s, s', p, o (and m) share one floating dtype; the
dims agree exactly; c (or 1/c) is finite and positive, as softmax scales are (a negative one is
left alone rather than trusting every SDPA backend with it); neither dot is a windowed-einsum
partial dot (it carries a backend_config).

Partitioned shapes are padded shard shapes whose padding rows hold unspecified values. The pass
only fuses straight chains, so a padding mask the partitioner put between the ops (a select
before a softmax or a contraction along a padded dim) or a collective (a partial score tensor's
all-reduce) prevents the fusion; rows of padded batch or query dims stay independent in the
fused kernel as they were in the chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.builder import Builder
from spmd.ir.hlo import Computation, Instruction, Module
from spmd.ir.sharding import TensorSharding

FLOAT_DTYPES = frozenset({"f16", "bf16", "f32", "f64"})
#: Dtypes fused by default: PyTorch's fused attention kernels (flash / memory-efficient) pay for
#: 16-bit types. In float32 the memory-efficient kernel measured slower on H200 than the unfused
#: batched GEMMs + softmax (16.1 µs vs ~12.8 µs for the block benchmark's [4, 128, 64] heads), and
#: XLA's cuDNN fused-MHA rewriter likewise fuses only f16 / bf16.
DEFAULT_DTYPES = frozenset({"f16", "bf16"})
FUSED_NAME = "fused_attention"

_Users = dict[Instruction, list[Instruction]]


@dataclass(frozen=True)
class FuseAttention:
    """The fuse-attention pass (see the module docstring).

    enabled: False leaves every module unchanged (``CompileOptions.fuse_attention``).
    dtypes: element types (HLO names) whose attention is fused; default ``DEFAULT_DTYPES``.

    ``run(module)`` rewrites ``module`` in place and returns it.
    Raises ValueError (in ``run``) for a module that is not partitioned: the attention custom
    call's sharding rule (unsharded sequence dims) would then constrain the partitioner.
    """

    name: ClassVar[str] = "fuse-attention"
    enabled: bool = True
    dtypes: frozenset[str] = DEFAULT_DTYPES

    def run(self, module: Module) -> Module:
        if not module.is_partitioned:
            raise ValueError(f"module {module.name!r} is not partitioned; fuse-attention runs after spmd-partition")
        if not self.enabled:
            return module
        comp = module.entry
        builder = Builder(module, comp)
        users = comp.users()
        for inst in list(comp.instructions):
            if inst.opcode != "dot" or inst not in users or inst.shape.dtype not in self.dtypes:
                continue  # not a dot, removed by an earlier fusion, or a dtype left unfused
            site = match_attention(inst, users)
            if site is not None:
                _rewrite(builder, comp, site)
                users = comp.users()
        return module


@dataclass(frozen=True)
class AttentionSite:
    """One matched attention chain.

    Fields:
      q: ``[B..., Sq, D]``; kt: the first dot's rhs; k_ready: kt's value as ``[B..., Sk, D]`` when
      one exists (kt itself, or the operand of a last-two-dims transpose kt), None when a
      transpose must be inserted; v: ``[B..., Sk, Dv]``; mask: the additive mask (the scores'
      shape) or None; scale: the factor on ``q @ k^T``; out: the second dot ``o``;
      chain: the intermediates (s, broadcast, s', add, p) that die with o; maybe_dead: producers
      (the scale constant, kt) to remove if nothing else uses them afterwards.
    """

    q: Instruction
    kt: Instruction
    k_ready: Instruction | None
    v: Instruction
    mask: Instruction | None
    scale: float
    out: Instruction
    chain: tuple[Instruction, ...]
    maybe_dead: tuple[Instruction, ...]


# --------------------------------------------------------------------------- matching
def match_attention(o: Instruction, users: _Users) -> AttentionSite | None:
    """The attention chain ending at dot ``o``, or None when ``o`` does not end one.

    ``users`` is ``Computation.users()`` of the computation holding ``o`` (uses counted with
    repeats). See the module docstring for the pattern and conditions.
    """
    nb = _batched_dot(o, rhs_last_ok=False)
    if nb is None:
        return None
    p = o.operands[0]
    x = _softmax_input(p, users)
    if x is None:
        return None
    for mask, scores, add in _score_candidates(x, users):
        found = _scaled_scores(scores, users)
        if found is None:
            continue
        s, scale, scale_chain, const = found
        if _batched_dot(s, rhs_last_ok=True) != nb or not _single_use(s, users):
            continue
        if not _shapes_agree(s, o, nb) or not _one_float_dtype(s, o, scale_chain, x, mask):
            continue
        q, kt = s.operands
        if tuple(s.attrs["rhs_contracting_dims"]) == (nb + 1,):  # kt is [B..., Sk, D]: k itself
            k_ready, kt_dead = kt, None
        else:
            k_ready, kt_dead = _k_of(kt, nb)
        chain = (s, *scale_chain, *([add] if add is not None else []), p)
        maybe_dead = tuple(i for i in (const, kt_dead) if i is not None)
        return AttentionSite(q, kt, k_ready, o.operands[1], mask, scale, o, chain, maybe_dead)
    return None


def _shapes_agree(s: Instruction, o: Instruction, nb: int) -> bool:
    """q [B, Sq, D], kt [B, D, Sk] | [B, Sk, D], v [B, Sk, Dv]; s [B, Sq, Sk] and o [B, Sq, Dv]."""
    q, kt = s.operands
    v = o.operands[1]
    batch, (sq, d) = q.shape.dims[:nb], q.shape.dims[nb:]
    kd, sk = kt.shape.dims[nb:]
    if tuple(s.attrs["rhs_contracting_dims"]) == (nb + 1,):
        kd, sk = sk, kd
    return (kd == d and kt.shape.dims[:nb] == batch and v.shape.dims[:nb + 1] == (*batch, sk)
            and s.shape.dims == (*batch, sq, sk) and o.shape.dims == (*batch, sq, v.shape.dims[nb + 1]))


def _one_float_dtype(s: Instruction, o: Instruction, scale_chain: tuple[Instruction, ...], x: Instruction,
                     mask: Instruction | None) -> bool:
    """Every value of the chain (and its inputs q, kt, v, mask) has one floating dtype.

    Float32 intermediates between two converts of a 16-bit scale (``_opmath_scaled_scores``)
    are the one exception: the chain's value is back in the scores' dtype after them.
    """
    opmath = scale_chain[-1].opcode == "convert" if scale_chain else False
    chain = scale_chain[-1:] if opmath else scale_chain
    values = [*s.operands, s, *chain, x, *o.operands, o] + ([mask] if mask is not None else [])
    return len({i.shape.dtype for i in values}) == 1 and o.shape.dtype in FLOAT_DTYPES


def _single_use(inst: Instruction, users: _Users) -> bool:
    return len(users.get(inst, ())) == 1


def _batched_dot(dot: Instruction, rhs_last_ok: bool) -> int | None:
    """nb when ``dot`` is ``[B..., M, K] x [B..., K, N]`` (with ``rhs_last_ok`` also ``[B..., N, K]``).

    The batch dims are the nb leading dims of both operands; the lhs contracts its last dim.
    None when the dot is not of that form or is a windowed-einsum partial dot (backend_config).
    """
    if dot.opcode != "dot" or dot.attrs.get("backend_config"):
        return None
    lhs, rhs = dot.operands
    a = dot.attrs
    nb = len(a.get("lhs_batch_dims", ()))
    batch = tuple(range(nb))
    if lhs.shape.rank != nb + 2 or rhs.shape.rank != nb + 2:
        return None
    if tuple(a.get("lhs_batch_dims", ())) != batch or tuple(a.get("rhs_batch_dims", ())) != batch:
        return None
    if tuple(a["lhs_contracting_dims"]) != (nb + 1,) or lhs.shape.dims[:nb] != rhs.shape.dims[:nb]:
        return None
    allowed = {(nb,), (nb + 1,)} if rhs_last_ok else {(nb,)}
    return nb if tuple(a["rhs_contracting_dims"]) in allowed else None


def _softmax_input(p: Instruction, users: _Users) -> Instruction | None:
    """x when ``p`` is a single-use ``softmax(x)`` over its last dim, else None."""
    if p.opcode != "custom-call" or p.attrs.get("custom_call_target") != "softmax" or len(p.operands) != 1:
        return None
    rank = p.shape.rank
    dim = int((p.attrs.get("backend_config") or {}).get("dim", -1))
    if rank == 0 or not -rank <= dim < rank or dim % rank != rank - 1 or not _single_use(p, users):
        return None
    return p.operands[0]


def _score_candidates(
    x: Instruction, users: _Users
) -> list[tuple[Instruction | None, Instruction, Instruction | None]]:
    """(mask, scores, the add) readings of the softmax input x, most specific first.

    ``x = a + b`` (single-use, a is not b) reads as scores a with mask b, then scores b with
    mask a; any x also reads as unmasked scores (which matches only if x is a dot or a scale).
    """
    out: list[tuple[Instruction | None, Instruction, Instruction | None]] = []
    if x.opcode == "add" and _single_use(x, users) and x.operands[0] is not x.operands[1]:
        a, b = x.operands
        out += [(b, a, x), (a, b, x)]
    out.append((None, x, None))
    return out


def _scaled_scores(
    x: Instruction, users: _Users
) -> tuple[Instruction, float, tuple[Instruction, ...], Instruction | None] | None:
    """(s, scale, scale intermediates, the scale constant) for ``x = s * c | c * s | s / c | s``.

    Intermediates are x and the broadcast of c (each must be single-use); None when x is a
    multiply/divide without a usable scalar constant.
    """
    if x.opcode == "dot":
        return x, 1.0, (), None
    if x.opcode == "convert" and _single_use(x, users):
        return _opmath_scaled_scores(x, users)
    found = _scaled_by_constant(x, users)
    if found is None or found[0].opcode != "dot":
        return None
    s, scale, inter, const = found
    return s, scale, (*inter, x), const


def _scaled_by_constant(
    x: Instruction, users: _Users
) -> tuple[Instruction, float, tuple[Instruction, ...], Instruction] | None:
    """(y, scale, the broadcast of c if any, c) for a single-use ``x = y * c | c * y | y / c``
    with c a positive finite scalar constant; None otherwise."""
    if x.opcode not in ("multiply", "divide") or not _single_use(x, users):
        return None
    lhs, rhs = x.operands
    pairs = ((lhs, rhs), (rhs, lhs)) if x.opcode == "multiply" else ((lhs, rhs),)
    for y, c in pairs:
        found = _scalar_constant(c, users)
        if found is None or c is y:
            continue
        value, inter, const = found
        scale = value if x.opcode == "multiply" else (1.0 / value if value != 0 else math.inf)
        if not math.isfinite(scale) or scale <= 0:
            return None
        return y, scale, inter, const
    return None


def _opmath_scaled_scores(
    x: Instruction, users: _Users
) -> tuple[Instruction, float, tuple[Instruction, ...], Instruction | None] | None:
    """``x = convert(convert(s) * c)``: a 16-bit score scale computed in float32, as the frontend
    emits a Python-scalar multiply or divide that 16 bits cannot hold exactly (PyTorch's opmath).

    The float32 intermediates are returned apart from the chain's dtype check: their dtype is
    the computation's, not the scores'.
    """
    inner = x.operands[0]
    found = _scaled_by_constant(inner, users)
    if found is None:
        return None
    up, scale, inter, const = found
    if up.opcode != "convert" or not _single_use(up, users):
        return None
    s = up.operands[0]
    if s.opcode != "dot" or s.shape.dtype != x.shape.dtype:
        return None
    return s, scale, (up, *inter, inner, x), const


def _scalar_constant(
    c: Instruction, users: _Users
) -> tuple[float, tuple[Instruction, ...], Instruction] | None:
    """(value, the single-use broadcast if any, the constant) for a one-element constant c."""
    inter: tuple[Instruction, ...] = ()
    if c.opcode == "broadcast" and len(c.operands) == 1:
        if not _single_use(c, users):
            return None
        inter, c = (c,), c.operands[0]
    if c.opcode != "constant" or c.attrs["literal"].numel() != 1:
        return None
    return float(c.attrs["literal"].reshape(()).item()), inter, c


def _k_of(kt: Instruction, nb: int) -> tuple[Instruction | None, Instruction | None]:
    """For kt ``[B..., D, Sk]``: (k ``[B..., Sk, D]`` if kt transposes one, else None; kt if it may die)."""
    swap = (*range(nb), nb + 1, nb)
    if kt.opcode == "transpose" and tuple(kt.attrs["dimensions"]) == swap:
        return kt.operands[0], kt
    return None, None


# --------------------------------------------------------------------------- rewrite
def _rewrite(builder: Builder, comp: Computation, site: AttentionSite) -> Instruction:
    """Insert the attention custom call before ``site.out``, use it instead, drop the dead chain."""
    o = site.out
    with builder.insert_before(o):
        k = site.k_ready if site.k_ready is not None else _swap_last_two(builder, site.kt, o)
        operands = [site.q, k, site.v] + ([site.mask] if site.mask is not None else [])
        config = {"is_causal": False, "has_mask": site.mask is not None, "scale": site.scale}
        fused = builder.add("custom-call", operands, {"custom_call_target": "attention", "backend_config": config},
                            shape=o.shape, name=FUSED_NAME, sharding=o.sharding, stream_id=o.stream_id,
                            location=o.location)
    comp.replace_all_uses(o, fused)
    _remove_dead(comp, (o, *site.chain), site.maybe_dead)
    return fused


def _swap_last_two(builder: Builder, kt: Instruction, o: Instruction) -> Instruction:
    """A transpose of ``kt`` swapping its last two dims (sharding swapped alike)."""
    rank = kt.shape.rank
    perm = (*range(rank - 2), rank - 1, rank - 2)
    sharding = kt.sharding
    if sharding is not None:
        sharding = (TensorSharding(tuple(sharding.dims[i] for i in perm), sharding.partial)
                    if sharding.rank == rank else None)
    return builder.add("transpose", [kt], {"dimensions": perm}, name=f"{kt.name}.transposed", sharding=sharding,
                       stream_id=o.stream_id, location=kt.location)


def _remove_dead(comp: Computation, dead: tuple[Instruction, ...], maybe: tuple[Instruction, ...]) -> None:
    """Drop ``dead`` (now unused), then each of ``maybe`` that nothing uses and is not the root."""
    gone = {id(i) for i in dead}
    for m in maybe:
        used = any(id(u) not in gone and any(op is m for op in u.operands) for u in comp.instructions)
        if not used and m is not comp.root and m.opcode != "parameter":
            gone.add(id(m))
    comp.instructions = [i for i in comp.instructions if id(i) not in gone]
