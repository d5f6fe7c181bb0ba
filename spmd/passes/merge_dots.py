"""merge-dots: dots that share an operand become one dot on concatenated operands.

Modelled on XLA's DotMerger (xla/service/dot_merger.cc): two or more ``dot``s that read
the same instruction on the same side (the same LHS, as the Q/K/V projections
``h @ wq``, ``h @ wk``, ``h @ wv`` of a transformer block; or the same RHS, one weight
applied to several activations) are replaced by one dot whose other operand is the
concatenation of theirs along a free (non-batch, non-contracting) dim, followed by one
``slice`` per original dot. On a GPU each small GEMM costs a launch (and often a
split-K reduction kernel); one GEMM over the concatenated operand costs about as much
as one of them, while the concatenation costs one copy and the slices are views.

Before (the partitioned block program on 2 devices, per-device shapes)::

    %q = f32[128,256] dot(%h, %wq), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    %k = f32[128,256] dot(%h, %wk), lhs_contracting_dims={1}, rhs_contracting_dims={0}

after::

    %q.concat = f32[512,512] concatenate(%wq, %wk), dimensions={1}
    %q.merged = f32[128,512] dot(%h, %q.concat), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    %q = f32[128,256] slice(%q.merged), slice={[0:128:1], [0:256:1]}
    %k = f32[128,256] slice(%q.merged), slice={[0:128:1], [256:512:1]}

A group is merged when its dots: are in the entry computation and not partial dots of a
windowed einsum (``backend_config`` without ``"windowed_einsum"``); read the same operand
on the same side; have equal attributes (dimension numbers, backend_config), result
dtype, sharding and stream; have other operands of one dtype whose dims are equal except
in one free dim (the concatenation dim; the first free dim when all are equal); do not
depend on each other (no dot of the group is an ancestor of another, so the merged
graph stays acyclic; DotMerger checks this with a reachability map, here a search back
from one dot that stops below the other's position in the def-before-use order); and
produce together at most ``max_merged_bytes`` (XLA's DotMerger has a size threshold too:
large GEMMs gain nothing from merging and pay for the concatenation). The threshold does not
apply where every concatenated operand is a weight (a parameter in ``weights``, as
``spmd.passes.hoist_weights`` takes them): that concatenation is hoisted and runs once per weight
version, so only the merged GEMM's speed is left, and a wider GEMM is at least as fast as its
parts (MiniLM's Q/K/V projections at 128 × 128 tokens on an H200: 18.9 µs for Q and K merged
plus 12.2 µs for V with the threshold, 37.7 MB for all three).

Bias epilogue (``merge_bias_adds``, on by default): when each dot's only user is
``add(dot, broadcast(bias))`` with the biases varying along the merged dim (a linear
layer's bias), the biases are concatenated too and added once to the merged dot; the
slices then replace the adds. Three projections with biases become one GEMM, one add
and two small concatenations instead of three GEMMs and three adds.

Padding rows of the partitioned program (see docs/architecture.md) stay where they were:
a dot never mixes free dims, so each slice equals the original dot row for row.
The slices keep the original dots' names, shardings, streams and source locations; the
concatenation and the merged dot take the first dot's location, the common sharding of
the dots (merged dot) and of the other operands (concatenation) where they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.builder import Builder
from spmd.ir.hlo import Computation, Instruction, Module, Shape
from spmd.passes.windowed_einsum import MARK, stable_toposort

DEFAULT_MAX_MERGED_BYTES = 32 * 2**20


@dataclass(frozen=True)
class MergeDots:
    """The merge-dots pass (see the module docstring).

    max_merged_bytes: the largest merged dot output (per-device bytes) the pass creates where a
      concatenation runs on every call.
    weights: parameter numbers of weights whose values are hoisted (``CompileOptions.hoist_weights``);
      a group whose concatenated operands are all such parameters has no size threshold.
    merge_bias_adds: also merge the bias additions of the dots (see ``BiasEpilogue``).
    enabled: False leaves every module unchanged (``CompileOptions.merge_dots``).
    Raises TypeError for a non-int ``max_merged_bytes`` or a non-bool ``merge_bias_adds``,
    ValueError for a negative ``max_merged_bytes``;
    ``run`` raises ValueError for a module that is not partitioned.
    """

    name: ClassVar[str] = "merge-dots"
    max_merged_bytes: int = DEFAULT_MAX_MERGED_BYTES
    merge_bias_adds: bool = True
    enabled: bool = True
    weights: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.max_merged_bytes, int) or isinstance(self.max_merged_bytes, bool):
            raise TypeError(f"max_merged_bytes must be an int, got {type(self.max_merged_bytes).__name__}")
        if self.max_merged_bytes < 0:
            raise ValueError(f"max_merged_bytes must be >= 0, got {self.max_merged_bytes}")
        if not isinstance(self.merge_bias_adds, bool):
            raise TypeError(f"merge_bias_adds must be a bool, got {type(self.merge_bias_adds).__name__}")
        object.__setattr__(self, "weights", frozenset(self.weights))

    def run(self, module: Module) -> Module:
        if not module.is_partitioned:
            raise ValueError(f"module {module.name!r} is not partitioned; merge-dots runs after spmd-partition")
        if not self.enabled:
            return module
        comp = module.entry
        merged = True
        while merged:  # a merge can unlock or forbid others: search again until nothing merges
            merged = False
            for group in find_groups(comp, self.max_merged_bytes, self.weights):
                reach = _Reach.of(comp)  # the graph as the earlier merges of this round left it
                if not reach.still_mergeable(group):
                    continue
                bias = bias_epilogue(comp, group, reach) if self.merge_bias_adds else None
                if not merge_group(module, group, bias):
                    comp.instructions = stable_toposort(comp.instructions)
                merged = True
        return module


@dataclass(frozen=True)
class DotGroup:
    """Dots to merge: ``dots`` (program order, >= 2) share operand number ``side`` (0 = LHS, 1 = RHS);
    their other operands are concatenated along their dim ``dim``."""

    dots: tuple[Instruction, ...]
    side: int
    dim: int

    @property
    def out_dim(self) -> int:
        """The dim of the dots' results that ``dim`` of the other operand becomes."""
        lhs_free, rhs_free = free_dims(self.dots[0], 0), free_dims(self.dots[0], 1)
        nb = len(self.dots[0].attrs.get("lhs_batch_dims", ()))
        if self.side == 0:
            return nb + len(lhs_free) + rhs_free.index(self.dim)
        return nb + lhs_free.index(self.dim)


def free_dims(dot: Instruction, operand: int) -> list[int]:
    """The free (non-batch, non-contracting) dims of ``dot``'s operand 0 (LHS) or 1 (RHS), ascending."""
    prefix = "lhs" if operand == 0 else "rhs"
    used = set(dot.attrs.get(f"{prefix}_batch_dims", ())) | set(dot.attrs.get(f"{prefix}_contracting_dims", ()))
    return [d for d in range(dot.operands[operand].shape.rank) if d not in used]


def find_groups(comp: Computation, max_merged_bytes: int, weights: frozenset[int] = frozenset()) -> list[DotGroup]:
    """Mergeable groups of dots of ``comp`` (see the module docstring), LHS-sharing buckets first.

    The groups are found on the current graph (``comp.instructions`` in def-before-use
    order); merging one can take a dot of another group or make it unsafe, which
    ``_Reach.still_mergeable`` checks before each merge.
    """
    reach = _Reach.of(comp)
    buckets: dict[tuple, list[Instruction]] = {}
    for side in (0, 1):
        for inst in comp.instructions:
            if _eligible(inst):
                buckets.setdefault((side, id(inst.operands[side])), []).append(inst)
    groups: list[DotGroup] = []
    for (side, _), dots in buckets.items():
        if len(dots) >= 2:
            groups += _partition(dots, side, reach, max_merged_bytes, weights)
    return groups


@dataclass(frozen=True)
class BiasEpilogue:
    """The bias additions of a group: ``adds[i] = add(dots[i], broadcast(biases[i]))`` (either order).

    When every dot of the group has its add as only user and the biases vary along the
    merged dim, the biases are concatenated too and added once to the merged dot: one
    add instead of one per dot, and the merged dot and its add form the pair that the
    runtime's dot+add fusion (fusion (b) of ``spmd.runtime.fusions``: ``torch.addmm``
    for 2-d products) looks for, as each original pair did.
    ``dim``: the biases' dim that is concatenated; ``dimensions``: the broadcasts' map.
    """

    adds: tuple[Instruction, ...]
    broadcasts: tuple[Instruction, ...]
    dim: int
    dimensions: tuple[int, ...]

    @property
    def biases(self) -> list[Instruction]:
        return [c.operands[0] for c in self.broadcasts]


def bias_epilogue(comp: Computation, group: DotGroup, reach: _Reach) -> BiasEpilogue | None:
    """The ``BiasEpilogue`` of ``group`` in ``comp``, or None where the dots lack one."""
    users = comp.users()
    adds, bcasts = [], []
    for d in group.dots:
        us = users[d]
        if len(us) != 1 or us[0].opcode != "add" or comp.root is d or us[0].shape != d.shape:
            return None
        c = next(o for o in us[0].operands if o is not d) if us[0].operands.count(d) == 1 else None
        if c is None or c.opcode != "broadcast":
            return None
        adds.append(us[0])
        bcasts.append(c)
    dimensions = bcasts[0].attrs["dimensions"]
    if group.out_dim not in dimensions or any(c.attrs["dimensions"] != dimensions for c in bcasts):
        return None
    dim = dimensions.index(group.out_dim)
    biases = [c.operands[0] for c in bcasts]
    ref = biases[0].shape
    if any(b.shape.dtype != ref.dtype or b.shape.rank != ref.rank or _differ(b.shape.dims, ref.dims) - {dim}
           for b in biases):
        return None
    if any(not reach.independent(c, d) for c in bcasts for d in group.dots):
        return None
    return BiasEpilogue(tuple(adds), tuple(bcasts), dim, dimensions)


def merge_group(module: Module, group: DotGroup, bias: BiasEpilogue | None = None) -> bool:
    """Rewrite ``group`` in ``module.entry`` into concatenate -> dot -> slices.

    With ``bias``, the biases are concatenated and added to the merged dot, and the
    slices replace the adds. The new instructions go right after the last operand they
    read; users of the replaced instructions read the slices. Returns whether the
    instruction order is still def-before-use; when False (a user of a replaced
    instruction came before that operand) the caller reorders (``stable_toposort``).
    """
    comp, dots, side = module.entry, group.dots, group.side
    first, shared = dots[0], dots[0].operands[side]
    others = [d.operands[1 - side] for d in dots]
    pos = {id(i): k for k, i in enumerate(comp.instructions)}
    last = max(pos[id(o)] for o in [shared, *others, *(bias.biases if bias is not None else ())])
    out_dim = group.out_dim
    b = Builder(module)
    with b.insert_before(comp.instructions[last + 1]):
        cat = b.concatenate(others, group.dim, name=f"{first.name}.concat")
        _annotate(cat, _common([o.sharding for o in others]), first)
        dims = list(first.shape.dims)
        dims[out_dim] = sum(d.shape.dims[out_dim] for d in dots)
        operands = [shared, cat] if side == 0 else [cat, shared]
        merged = b.add("dot", operands, dict(first.attrs), shape=Shape(first.shape.dtype, tuple(dims)),
                       name=f"{first.name}.merged", sharding=first.sharding, stream_id=first.stream_id,
                       location=first.location)
        result, replaced = merged, list(dots)
        if bias is not None:
            result, replaced = _add_bias(b, merged, bias), list(bias.adds)
        slices = _slices(b, result, replaced, out_dim)
    users = comp.users()
    in_order = all(pos[id(u)] > last for old in replaced for u in users[old])
    gone = {id(i) for i in [*dots, *replaced, *_dead_broadcasts(comp, bias, users)]}
    comp.instructions = [i for i in comp.instructions if id(i) not in gone]
    for old, piece in zip(replaced, slices, strict=True):
        for u in users[old]:
            u.operands = [piece if o is old else o for o in u.operands]
        if comp.root is old:
            comp.root = piece
        piece.name, piece.sharding, piece.stream_id, piece.location = (
            old.name, old.sharding, old.stream_id, old.location)
    return in_order


# --------------------------------------------------------------------------- helpers
def _add_bias(b: Builder, merged: Instruction, bias: BiasEpilogue) -> Instruction:
    """add(merged, broadcast(concatenate(biases))), annotated like the first add."""
    first = bias.adds[0]
    cat = b.concatenate(bias.biases, bias.dim, name=f"{first.name}.concat")
    _annotate(cat, _common([x.sharding for x in bias.biases]), first)
    wide = b.broadcast(cat, merged.shape.dims, bias.dimensions, name=f"{first.name}.bcast")
    _annotate(wide, _common([c.sharding for c in bias.broadcasts]), first)
    out = b.add("add", [merged, wide], name=f"{first.name}.merged")
    _annotate(out, _common([a.sharding for a in bias.adds]), first)
    return out


def _dead_broadcasts(comp: Computation, bias: BiasEpilogue | None, users) -> list[Instruction]:
    """The epilogue's broadcasts that only the adds read (they go with them)."""
    if bias is None:
        return []
    adds = {id(a) for a in bias.adds}
    dead = {id(c): c for c in bias.broadcasts if comp.root is not c and all(id(u) in adds for u in users[c])}
    return list(dead.values())


def _annotate(inst: Instruction, sharding, like: Instruction) -> None:
    inst.sharding, inst.stream_id, inst.location = sharding, like.stream_id, like.location


def _differ(a: tuple[int, ...], b: tuple[int, ...]) -> set[int]:
    """The dims where ``a`` and ``b`` (of one rank) differ."""
    return {k for k in range(len(a)) if a[k] != b[k]}


def _slices(b: Builder, merged: Instruction, dots: list[Instruction], out_dim: int) -> list[Instruction]:
    out, start = [], 0
    for d in dots:
        size = d.shape.dims[out_dim]
        starts = [start if k == out_dim else 0 for k in range(merged.shape.rank)]
        limits = [start + size if k == out_dim else n for k, n in enumerate(merged.shape.dims)]
        out.append(b.slice(merged, starts, limits, name=f"{d.name}.slice"))
        start += size
    return out


def _common(values: list):
    """The one value all of ``values`` equal, else None."""
    return values[0] if all(v == values[0] for v in values) else None


def _eligible(inst: Instruction) -> bool:
    """A plain dot on arrays (not a partial dot of a windowed einsum)."""
    if inst.opcode != "dot" or inst.shape.is_tuple or any(o.shape.is_tuple for o in inst.operands):
        return False
    return MARK not in (inst.attrs.get("backend_config") or {})


@dataclass(frozen=True)
class _Reach:
    """Reachability in a def-before-use ordered computation: ``pos`` = position of each instruction.

    ``depends(a, b)`` searches back from ``a`` through operands, never below ``b``'s position
    (every path from ``b`` to ``a`` stays between them), so operands of nearby dots cost little.
    """

    pos: dict[int, int]

    @staticmethod
    def of(comp: Computation) -> _Reach:
        return _Reach({id(i): k for k, i in enumerate(comp.instructions)})

    def depends(self, a: Instruction, b: Instruction) -> bool:
        """Whether ``b`` is a transitive operand of ``a``."""
        floor, seen, stack = self.pos[id(b)], set(), list(a.operands)
        while stack:
            x = stack.pop()
            if x is b:
                return True
            if id(x) in seen or self.pos[id(x)] < floor:
                continue
            seen.add(id(x))
            stack.extend(x.operands)
        return False

    def independent(self, a: Instruction, b: Instruction) -> bool:
        """Neither of ``a`` and ``b`` is a transitive operand of the other."""
        return not (self.depends(a, b) or self.depends(b, a))

    def still_mergeable(self, group: DotGroup) -> bool:
        """Every dot of ``group`` is still in the computation and they are pairwise independent."""
        dots = group.dots
        return (all(id(d) in self.pos for d in dots)
                and all(self.independent(a, b) for k, a in enumerate(dots) for b in dots[k + 1:]))


@dataclass
class _Open:
    """A group being formed: its members and its concatenation dim (None while their other operands agree)."""

    members: list[Instruction]
    dim: int | None = None


def _partition(dots: list[Instruction], side: int, reach: _Reach, max_bytes: int,
               weights: frozenset[int] = frozenset()) -> list[DotGroup]:
    """Greedy, in program order: each dot joins the first open group it is compatible with."""
    groups: list[_Open] = []
    for d in dots:
        for g in groups:
            joined = _join(g, d, side, reach, max_bytes, weights)
            if joined is not False:
                g.members.append(d)
                g.dim = joined
                break
        else:
            groups.append(_Open([d]))
    return [DotGroup(tuple(g.members), side, free_dims(g.members[0], 1 - side)[0] if g.dim is None else g.dim)
            for g in groups if len(g.members) >= 2]


def _join(g: _Open, d: Instruction, side: int, reach: _Reach, max_bytes: int,
          weights: frozenset[int] = frozenset()) -> int | None | bool:
    """The group's concatenation dim once ``d`` joins (None: still undecided), or False if it cannot join."""
    ref = g.members[0]
    if not _same_kind(ref, d, side):
        return False
    diff = sorted(_differ(ref.operands[1 - side].shape.dims, d.operands[1 - side].shape.dims))
    if len(diff) > 1 or (diff and (diff[0] not in free_dims(d, 1 - side) or g.dim not in (None, diff[0]))):
        return False
    hoisted = all(_is_weight(m.operands[1 - side], weights) for m in (*g.members, d))
    if not hoisted and sum(m.shape.size_bytes for m in g.members) + d.shape.size_bytes > max_bytes:
        return False
    if not all(reach.independent(m, d) for m in g.members):
        return False
    return diff[0] if diff else g.dim


def _is_weight(inst: Instruction, weights: frozenset[int]) -> bool:
    """A parameter in ``weights``: its concatenation with others is hoisted, not run per call."""
    return inst.opcode == "parameter" and inst.attrs.get("parameter_number") in weights


def _same_kind(ref: Instruction, d: Instruction, side: int) -> bool:
    """Same attributes, result dtype, sharding, stream; other operands of one dtype and rank with a free dim."""
    ro, do = ref.operands[1 - side].shape, d.operands[1 - side].shape
    return (ref.attrs == d.attrs and ref.shape.dtype == d.shape.dtype and ref.sharding == d.sharding
            and ref.stream_id == d.stream_id and ro.dtype == do.dtype and ro.rank == do.rank
            and bool(free_dims(d, 1 - side)))
