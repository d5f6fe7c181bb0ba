"""windowed-einsum: all-gather→dot and dot→reduce-scatter become unrolled ring loops.

The collective matmul of Wang et al., "Overlap Communication with Dependent
Computation via Decomposition in Large Deep Learning Models" (ASPLOS 2023), as XLA's
windowed einsum does it: the collective is split into P - 1 collective-permutes
around the ring of the replica group, and the dot into P partial dots, so that each
transfer overlaps with the partial dot of the chunk already present.

All-gather side (P=2, unidirectional), before::

    %ag = f32[8,4] all-gather(%x), dimensions={0}, replica_groups={{0,1}}
    ROOT %d = f32[8,6] dot(%ag, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}

after (``r`` = the device's index in its replica group, from partition-id)::

    %ag.chunk1 = f32[4,4] collective-permute(%x), source_target_pairs={{0,1},{1,0}}
    %d.0 = f32[4,6] dot(%x, %w), ..., backend_config={"windowed_einsum":0}
    %d.acc0 = f32[8,6] dynamic-update-slice(%d.init, %d.0, %ag.off0, %zero)   # rows r*4
    %d.1 = f32[4,6] dot(%ag.chunk1, %w), ..., backend_config={"windowed_einsum":1}
    ROOT %d = f32[8,6] dynamic-update-slice(%d.acc0, %d.1, %ag.off1, %zero)  # rows ((r+1)%2)*4

Reduce-scatter side: device ``r`` computes at step ``s`` its contribution to output
chunk ``(r - 1 - s) mod P`` from a dynamic-slice of the operand that holds the
scattered dim, adds it to the accumulator received from its ring predecessor
(``add(%dot, %received_acc)``), and passes the sum on; after P steps it holds
chunk ``r`` fully summed.

Bidirectional (``bidirectional=True``): every chunk is split in two halves along the
split dim; the first halves travel to the ring successor, the second halves to the
predecessor, and each step computes two half-chunk dots (XLA's / the paper's
bidirectional variant; it uses both directions of ring links). On the reduce-scatter
side the two halves interleave: a lane's accumulator travels while the other lane's
dot runs, so a partial dot that adds a received accumulator is marked
``"accumulate": true`` (assign-streams then puts the add in the dot's async unit and
the runtime accumulates with one addmm), and the halves of the result are written
into one buffer by dynamic-update-slices instead of a concatenate.

One all-gather feeding several dots (Q, K, V projections) shares one ring. An all-gather read
by a dot through a reshape that merges the gathered dim (``[B, S, H] -> [B*S, H]``) is handled
by ``spmd.passes.windowed_einsum_reshape``, as is a dot whose result is split by a reshape
(``[B*S, H] -> [B, S, H]``) before the reduce-scatter. Any group
size P >= 2, any chunk size (bidirectional needs chunks of >= 2 rows), 2-d meshes
(replica groups such as {{0,2},{1,3}}: a constant table maps partition-id to ``r``).
A site whose dot, collective or any operand has no elements (an empty M, N or K) is
left alone: there is nothing to overlap. Partial dots carry
``backend_config={"windowed_einsum": step}`` (plus ``"compute_streams": n`` where the
cost model chose the site); assign-streams puts them on compute streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from typing import ClassVar

import torch

from spmd.ir.builder import NameSet
from spmd.ir.hlo import Computation, Instruction, Module, Shape, ancestor_ids
from spmd.passes.cost_model import H200_NVLINK, GemmShape, MachineProfile, decide

_MODES = ("auto", "on", "off")
MARK = "windowed_einsum"  # backend_config key of a partial dot: its ring step
ACCUMULATE_KEY = "accumulate"  # backend_config key: the dot's add user joins its async unit
STREAMS_KEY = "compute_streams"  # backend_config key: compute streams the cost model advises


@dataclass(frozen=True)
class WindowedEinsum:
    """The windowed-einsum pass (see the module docstring).

    mode: "auto" (rewrite a site where ``cost_model`` predicts a gain), "on" (every
      matching site), "off" (nothing).
    bidirectional: force the uni- (False) or bidirectional (True) ring; None = the
      cost model's pick.
    cost_model: the MachineProfile that ``cost_model.decide`` predicts with.
    Raises ValueError for an unknown mode, or (in ``run``) an unpartitioned module.
    """

    name: ClassVar[str] = "windowed-einsum"
    mode: str = "auto"
    bidirectional: bool | None = None
    cost_model: MachineProfile = H200_NVLINK

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")

    def run(self, module: Module) -> Module:
        if not module.is_partitioned:
            raise ValueError(f"module {module.name!r} is not partitioned; windowed-einsum needs per-device shapes")
        if self.mode == "off":
            return module
        comp, n = module.entry, module.num_partitions
        changed = False
        users = comp.users()
        for inst in list(comp.instructions):
            if inst not in users:  # removed by an earlier rewrite
                continue
            site = _match_ag(inst, users, comp, n) if inst.opcode == "all-gather" else None
            if site is None and inst.opcode == "all-gather":  # through a merging reshape (B*S, B*heads)
                from spmd.passes.windowed_einsum_reshape import match_ag_reshape
                site = match_ag_reshape(inst, users, comp, n)
            if site is None and inst.opcode == "reduce-scatter":
                from spmd.passes.windowed_einsum_reshape import match_rs_reshape
                site = _match_rs(inst, users, comp, n) or match_rs_reshape(inst, users, comp, n)
            choice = None if site is None else self._choose(site)
            if choice is None:
                continue
            bidir, streams = choice
            site.rewrite(_Emitter(module, streams), comp, bidir and site.chunk >= 2)
            users, changed = comp.users(), True
        if changed:
            comp.instructions = stable_toposort(comp.instructions)
        return module

    def _choose(self, site: _AgSite | _RsSite) -> tuple[bool, int | None] | None:
        """None = leave the site alone; else (bidirectional ring?, compute streams the cost model advises)."""
        if self.mode == "on" and self.bidirectional is not None:
            return self.bidirectional, None
        if site.dtype not in self.cost_model.gemm_tflops:
            return None if self.mode == "auto" else (False, None)
        dec = decide(site.gemms(), site.p, site.dtype, self.cost_model, collective=site.collective,
                     chunk_bytes=site.chunk_bytes)
        if self.mode == "auto" and not dec.decompose:
            return None
        return (dec.bidirectional if self.bidirectional is None else self.bidirectional), dec.num_compute_streams


# --------------------------------------------------------------------------- matching
def _dot_layout(dot: Instruction) -> list[tuple[int | None, int | None]]:
    """Per output dim of ``dot``: (lhs dim, rhs dim) it comes from (None where absent)."""
    a = dot.attrs
    lb, rb = tuple(a.get("lhs_batch_dims", ())), tuple(a.get("rhs_batch_dims", ()))
    lc, rc = tuple(a.get("lhs_contracting_dims", ())), tuple(a.get("rhs_contracting_dims", ()))
    lfree = [d for d in range(dot.operands[0].shape.rank) if d not in lb and d not in lc]
    rfree = [d for d in range(dot.operands[1].shape.rank) if d not in rb and d not in rc]
    return [*zip(lb, rb, strict=True), *((d, None) for d in lfree), *((None, d) for d in rfree)]


def _groups(inst: Instruction, n: int) -> tuple[tuple[int, ...], ...] | None:
    """Replica groups of a collective if all have one size P >= 2, else None."""
    groups = tuple(tuple(g) for g in inst.attrs.get("replica_groups") or (tuple(range(n)),))
    sizes = {len(g) for g in groups}
    return groups if len(sizes) == 1 and min(sizes) >= 2 else None


def _empty(inst: Instruction) -> bool:
    """True if ``inst``'s result or any operand has no elements: nothing to overlap, never windowed."""
    return inst.shape.numel == 0 or any(o.shape.numel == 0 for o in inst.operands)


def _contract_numel(dot: Instruction) -> int:
    k = 1
    for d in dot.attrs.get("lhs_contracting_dims", ()):
        k *= dot.operands[0].shape.dims[d]
    return k



@dataclass(frozen=True)
class _Use:
    """One dot reading the gathered value: which side, the output dim it becomes, batch partner."""

    dot: Instruction
    side: int
    out_dim: int
    other_dim: int | None


@dataclass(frozen=True)
class _Lane:
    """One ring direction: chunk rows [row_off, row_off+rows) of origin (r + base + sign*s) % P."""

    pairs: tuple[tuple[int, int], ...]
    base: int
    sign: int
    row_off: int
    rows: int
    tag: str


def _lanes(groups, chunk: int, bidir: bool, rs: bool) -> list[_Lane]:
    p = len(groups[0])
    nxt = tuple((g[i], g[(i + 1) % p]) for g in groups for i in range(p))
    prv = tuple((g[i], g[(i - 1) % p]) for g in groups for i in range(p))
    base = p - 1 if rs else 0
    if not bidir:
        return [_Lane(nxt, base, -1, 0, chunk, "")]
    a = (chunk + 1) // 2
    return [_Lane(nxt, base, -1, 0, a, "cw"), _Lane(prv, 1 if rs else 0, 1, a, chunk - a, "ccw")]


class RingSizes:
    """Ring sizes of a windowed-einsum site: ``p`` devices in each of ``groups``, and the per-device
    piece (``_piece``: its shape) that moves each step, cut along ``dim``."""

    groups: tuple[tuple[int, ...], ...]
    dim: int

    @property
    def _piece(self):
        raise NotImplementedError

    @property
    def p(self) -> int:
        return len(self.groups[0])

    @property
    def chunk(self) -> int:
        return self._piece.dims[self.dim]

    @property
    def dtype(self) -> str:
        return self._piece.dtype

    @property
    def chunk_bytes(self) -> int:
        return self._piece.size_bytes


class GatherSizes(RingSizes):
    """An all-gather site (field ``ag``): each step moves one operand shard."""

    ag: Instruction

    @property
    def _piece(self):
        return self.ag.operands[0].shape


class ScatterSizes(RingSizes):
    """A reduce-scatter site (field ``rs``): each step moves one result shard."""

    rs: Instruction

    @property
    def _piece(self):
        return self.rs.shape


@dataclass(frozen=True)
class _AgSite(GatherSizes):
    ag: Instruction
    groups: tuple[tuple[int, ...], ...]
    dim: int
    uses: tuple[_Use, ...]
    collective: ClassVar[str] = "all-gather"

    def gemms(self) -> list[GemmShape]:
        out = []
        for u in self.uses:
            m, k = self.p * self.chunk, _contract_numel(u.dot)
            out.append(GemmShape(m, k, u.dot.shape.numel // m if m else 0))
        return out

    def rewrite(self, em: _Emitter, comp: Computation, bidir: bool) -> None:
        x, p, c = self.ag.operands[0], self.p, self.chunk
        r = em.ring_index(self.groups)
        lanes = _lanes(self.groups, c, bidir, rs=False)
        chunks = [x if not bidir else em.slice(x, self.dim, ln.row_off, ln.rows, f"{self.ag.name}.{ln.tag}0")
                  for ln in lanes]
        accs = [em.op("broadcast", u.dot.shape, [em.const(0, u.dot.shape.dtype)], f"{u.dot.name}.init",
                      dimensions=()) for u in self.uses]
        for s in range(p):
            offs = [em.offset(r, ln, s, p, c, self.ag.name) for ln in lanes]
            cur = list(chunks)
            if s + 1 < p:
                chunks = [em.op("collective-permute", ch.shape, [ch], f"{self.ag.name}.{ln.tag or 'chunk'}{s + 1}",
                                source_target_pairs=ln.pairs) for ch, ln in zip(chunks, lanes, strict=True)]
            for ui, u in enumerate(self.uses):
                for ch, ln, off in zip(cur, lanes, offs, strict=True):
                    ops = list(u.dot.operands)
                    ops[u.side] = ch
                    if u.other_dim is not None:
                        ops[1 - u.side] = em.dslice(ops[1 - u.side], u.other_dim, off, ln.rows,
                                                    f"{u.dot.name}.{ln.tag}in{s}")
                    part = em.partial_dot(u.dot, ops, u.out_dim, ln.rows, f"{u.dot.name}.{ln.tag}{s}", s)
                    accs[ui] = em.dus(accs[ui], part, u.out_dim, off, f"{u.dot.name}.{ln.tag}acc{s}")
        _insert_before(comp, max((u.dot for u in self.uses), key=comp.instructions.index), em.new)
        for u, acc in zip(self.uses, accs, strict=True):
            _replace(comp, u.dot, acc)
        comp.instructions.remove(self.ag)


def _match_ag(ag: Instruction, users, comp: Computation, n: int) -> _AgSite | None:
    groups = _groups(ag, n)
    dims = ag.attrs.get("dimensions", ())
    if groups is None or len(dims) != 1 or ag is comp.root or not users[ag]:
        return None
    dim, x = dims[0], ag.operands[0]
    if ag.shape.dims[dim] != len(groups[0]) * x.shape.dims[dim]:
        return None
    uses = []
    for dot in dict.fromkeys(users[ag]):
        if dot.opcode != "dot" or dot.operands.count(ag) != 1 or MARK in dot.attrs.get("backend_config", {}):
            return None
        if _empty(dot):
            return None  # an empty gathered chunk, operand or result: nothing to overlap
        side = dot.operands.index(ag)
        found = [(o, pair) for o, pair in enumerate(_dot_layout(dot)) if pair[side] == dim]
        if not found:
            return None  # the gathered dim is contracted
        o, pair = found[0]
        uses.append(_Use(dot, side, o, pair[1 - side]))
    if len(uses) > 1:
        dots = {id(u.dot) for u in uses}
        if any(dots & (ancestor_ids([u.dot.operands[1 - u.side]]) - {id(u.dot)}) for u in uses):
            return None  # one consumer feeds another: one shared ring would be a cycle
    return _AgSite(ag, groups, dim, tuple(uses))


@dataclass(frozen=True)
class _RsSite(ScatterSizes):
    rs: Instruction
    dot: Instruction
    groups: tuple[tuple[int, ...], ...]
    dim: int
    src: tuple[int | None, int | None]
    collective: ClassVar[str] = "reduce-scatter"

    def gemms(self) -> list[GemmShape]:
        m = self.p * self.chunk
        return [GemmShape(m, _contract_numel(self.dot), self.dot.shape.numel // m if m else 0)]

    def rewrite(self, em: _Emitter, comp: Computation, bidir: bool) -> None:
        p, c, dot = self.p, self.chunk, self.dot
        r = em.ring_index(self.groups)
        lanes = _lanes(self.groups, c, bidir, rs=True)
        accs: list[Instruction | None] = [None] * len(lanes)
        for s in range(p):
            for li, ln in enumerate(lanes):
                recv = None
                if accs[li] is not None:
                    recv = em.op("collective-permute", accs[li].shape, [accs[li]], f"{self.rs.name}.{ln.tag}recv{s}",
                                 source_target_pairs=ln.pairs)
                off = em.offset(r, ln, s, p, c, self.rs.name)
                ops = [em.dslice(op, d, off, ln.rows, f"{dot.name}.{ln.tag}{'lhs' if k == 0 else 'rhs'}{s}")
                       if d is not None else op for k, (op, d) in enumerate(zip(dot.operands, self.src, strict=True))]
                part = em.partial_dot(dot, ops, self.dim, ln.rows, f"{dot.name}.{ln.tag}{s}", s,
                                      accumulate=bidir and recv is not None)
                accs[li] = part if recv is None else em.op("add", part.shape, [part, recv],
                                                           f"{self.rs.name}.{ln.tag}acc{s}")
        out = accs[0]
        if bidir:  # the halves land in one buffer (the runtime writes each sum straight into its rows)
            out = em.op("broadcast", self.rs.shape, [em.const(0, self.rs.shape.dtype)], f"{self.rs.name}.init",
                        dimensions=())
            for acc, ln in zip(accs, lanes, strict=True):
                out = em.dus(out, acc, self.dim, em.const(ln.row_off), f"{self.rs.name}.{ln.tag}out")
        _insert_before(comp, self.rs, em.new)
        _replace(comp, self.rs, out)
        comp.instructions.remove(dot)


def _match_rs(rs: Instruction, users, comp: Computation, n: int) -> _RsSite | None:
    groups, dims, dot = _groups(rs, n), rs.attrs.get("dimensions", ()), rs.operands[0]
    reducer = rs.attrs.get("to_apply")
    if groups is None or len(dims) != 1 or dot.opcode != "dot" or users[dot] != [rs] or dot is comp.root:
        return None
    if reducer is not None and reducer.root.opcode != "add":
        return None
    if _empty(dot) or rs.shape.numel == 0:
        return None  # nothing to overlap
    if MARK in dot.attrs.get("backend_config", {}) or dot.shape.dims[dims[0]] != len(groups[0]) * rs.shape.dims[
            dims[0]]:
        return None
    return _RsSite(rs, dot, groups, dims[0], _dot_layout(dot)[dims[0]])


# --------------------------------------------------------------------------- emitting
class _Emitter:
    """Creates the new instructions of one site with unique names, in order (``new``)."""

    def __init__(self, module: Module, streams: int | None = None) -> None:
        self.module, self.streams = module, streams
        self.names = NameSet(module)
        self.new: list[Instruction] = []
        self._consts: dict[tuple, Instruction] = {}
        self._offsets: dict[tuple, Instruction] = {}

    def name(self, base: str) -> str:
        return self.names.fresh(base)

    def op(self, opcode: str, shape: Shape, operands, name: str, **attrs) -> Instruction:
        inst = Instruction(self.name(name), opcode, shape, operands, attrs)
        self.new.append(inst)
        return inst

    def const(self, value, dtype: str = "s32") -> Instruction:
        key = (value, dtype)
        if key not in self._consts:
            shape = Shape(dtype)
            lit = torch.tensor(value, dtype=shape.torch_dtype)
            name = (f"c{value}" if value else "zero") if dtype == "s32" else f"{dtype}.{value}"
            self._consts[key] = self.op("constant", shape, [], name, literal=lit)
        return self._consts[key]

    def ring_index(self, groups) -> Instruction:
        """s32[] index of the executing device in its replica group."""
        n = self.module.num_partitions
        pid = self.op("partition-id", Shape("u32"), [], "pid")
        pid32 = self.op("convert", Shape("s32"), [pid], "pid.s32")
        if groups == (tuple(range(n)),):
            return pid32
        table = [0] * n
        for g in groups:
            for k, d in enumerate(g):
                table[d] = k
        tab = self.op("constant", Shape("s32", (n,)), [], "ring.table", literal=torch.tensor(table, dtype=torch.int32))
        one = self.op("dynamic-slice", Shape("s32", (1,)), [tab, pid32], "ring.idx1", dynamic_slice_sizes=(1,))
        return self.op("reshape", Shape("s32"), [one], "ring.idx")

    def offset(self, r: Instruction, ln: _Lane, s: int, p: int, c: int, site: str) -> Instruction:
        """s32[] element offset ``((r + shift) % p) * c + row_off`` of lane ``ln`` at step ``s``.

        Named ``<site>.off<shift>`` (``...h`` for the second half-chunk); shared by all users.
        """
        shift = (ln.base + ln.sign * s) % p
        key = (id(r), shift, c, ln.row_off)
        if key in self._offsets:
            return self._offsets[key]
        name, s32 = f"{site}.off{shift}", Shape("s32")
        if ln.row_off:
            base = self.offset(r, _Lane(ln.pairs, shift, 0, 0, ln.rows, ""), 0, p, c, site)
            v = self.op("add", s32, [base, self.const(ln.row_off)], name + "h")
        else:
            v = r
            if shift:
                v = self.op("add", s32, [v, self.const(shift)], name + ".sum")
                v = self.op("remainder", s32, [v, self.const(p)], name + ".idx")
            if c != 1:
                v = self.op("multiply", s32, [v, self.const(c)], name)
        self._offsets[key] = v
        return v

    def slice(self, x: Instruction, dim: int, start: int, rows: int, name: str) -> Instruction:
        spec = tuple((start, start + rows, 1) if d == dim else (0, n, 1) for d, n in enumerate(x.shape.dims))
        return self.op("slice", _with_dim(x.shape, dim, rows), [x], name, slice=spec)

    def dslice(self, x: Instruction, dim: int, off: Instruction, rows: int, name: str) -> Instruction:
        starts = [off if d == dim else self.const(0) for d in range(x.shape.rank)]
        shape = _with_dim(x.shape, dim, rows)
        return self.op("dynamic-slice", shape, [x, *starts], name, dynamic_slice_sizes=shape.dims)

    def dus(self, acc: Instruction, part: Instruction, dim: int, off: Instruction, name: str) -> Instruction:
        starts = [off if d == dim else self.const(0) for d in range(acc.shape.rank)]
        return self.op("dynamic-update-slice", acc.shape, [acc, part, *starts], name)

    def partial_dot(self, dot: Instruction, ops, out_dim: int, rows: int, name: str, step: int,
                    accumulate: bool = False) -> Instruction:
        attrs = dict(dot.attrs)
        attrs["backend_config"] = {**attrs.get("backend_config", {}), MARK: step}
        if accumulate:
            attrs["backend_config"][ACCUMULATE_KEY] = True
        if self.streams is not None:
            attrs["backend_config"][STREAMS_KEY] = self.streams
        return self.op("dot", _with_dim(dot.shape, out_dim, rows), ops, name, **attrs)


def _with_dim(shape: Shape, dim: int, size: int) -> Shape:
    dims = list(shape.dims)
    dims[dim] = size
    return shape.with_dims(tuple(dims))


def _insert_before(comp: Computation, anchor: Instruction, new: list[Instruction]) -> None:
    k = comp.instructions.index(anchor)
    comp.instructions[k:k] = new


def _replace(comp: Computation, old: Instruction, new: Instruction) -> None:
    """Replace ``old`` by ``new`` everywhere; ``new`` takes over the name and sharding of ``old``."""
    comp.replace_all_uses(old, new)
    comp.instructions.remove(old)
    new.name, new.sharding = old.name, old.sharding


def stable_toposort(insts: list[Instruction]) -> list[Instruction]:
    """A def-before-use order that keeps the given order wherever dependencies allow."""
    index = {id(i): k for k, i in enumerate(insts)}
    pending = {id(i): len({id(o) for o in i.operands if id(o) in index}) for i in insts}
    users: dict[int, list[Instruction]] = {id(i): [] for i in insts}
    for i in insts:
        for o in {id(o): o for o in i.operands if id(o) in index}.values():
            users[id(o)].append(i)
    heap = [(index[id(i)], i) for i in insts if pending[id(i)] == 0]
    heapify(heap)
    out = []
    while heap:
        _, inst = heappop(heap)
        out.append(inst)
        for u in users[id(inst)]:
            pending[id(u)] -= 1
            if pending[id(u)] == 0:
                heappush(heap, (index[id(u)], u))
    assert len(out) == len(insts), "cycle in computation"
    return out
