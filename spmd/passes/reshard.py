"""Resharding between two TensorShardings of one value, as per-device HLO-lite instructions.

``reshard(em, value, src, dst, global_dims)`` appends to ``em`` the instructions that turn the
local shard of a value laid out as ``src`` into its local shard under ``dst`` (GSPMD's
``PartitionedHlo::Reshard``, Xu et al. 2021, arXiv:2105.04663 §3.3, and XLA's
``xla/service/spmd/spmd_partitioner.cc``):

- partial -> sharded dim (even split): reduce-scatter;  partial -> otherwise: all-reduce;
- an axis moving from dim i to dim j (even splits): all-to-all;
- sharded -> fewer axes: all-gather (uneven dims: gather every axis of the dim, then slice off
  the padding);
- more axes on a dim: local dynamic-slice at offsets derived from partition-id (pad first when
  the dim does not divide);
- not partial -> partial: keep the value on the first device of each group, zeros elsewhere.

Shapes are per-device padded shard shapes (``TensorSharding.shard_dims``). Replica groups are
``mesh.groups(axes)``, whose member order matches the shard order along ``axes``.

Example (mesh {tp=4}, f32[8,16] partial over tp -> sharded on dim 0 over tp)::

    %rs = f32[2,16] reduce-scatter(%x), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add.f32
"""

from __future__ import annotations

import math

import torch

from spmd.ir.builder import NameSet
from spmd.ir.hlo import Computation, Instruction, Module, Shape
from spmd.ir.sharding import MeshShape, TensorSharding

IDENTITY = {"add": 0.0, "maximum": -math.inf, "minimum": math.inf}


class Emitter:
    """Appends per-device instructions to ``computation`` of ``module``.

    Keeps names unique, and caches the small scalar programs (partition-id, constants,
    axis indices) and the reducer computations (``add``/``maximum``/``minimum`` per dtype)
    that collectives reference through ``to_apply``.
    """

    def __init__(self, module: Module, computation: Computation) -> None:
        self.module = module
        self.computation = computation
        self._names = NameSet(module)
        self._cache: dict[tuple, object] = {}

    @property
    def mesh(self) -> MeshShape:
        return self.module.mesh

    def name(self, base: str) -> str:
        """A fresh instruction name starting with ``base``."""
        return self._names.fresh(base)

    def emit(self, opcode: str, shape: Shape, operands=(), attrs=None, sharding=None,
             name: str | None = None) -> Instruction:
        """Append a new instruction; ``name`` defaults to the opcode."""
        inst = Instruction(self.name(name or opcode), opcode, shape, list(operands), attrs or {}, sharding)
        self.computation.instructions.append(inst)
        return inst

    def constant(self, value, dtype: str = "s32") -> Instruction:
        """A cached scalar constant of HLO type ``dtype``."""
        key = ("const", dtype, float(value))
        if key not in self._cache:
            tdtype = Shape(dtype).torch_dtype
            if math.isinf(value) and not tdtype.is_floating_point and tdtype != torch.bool:
                info = torch.iinfo(tdtype)
                value = info.min if value < 0 else info.max
            lit = torch.tensor(value, dtype=tdtype)
            self._cache[key] = self.emit("constant", Shape(dtype), attrs={"literal": lit}, name="constant")
        return self._cache[key]

    def partition_id_s32(self) -> Instruction:
        """``s32[]`` partition id of the executing device."""
        if "pid" not in self._cache:
            pid = self.emit("partition-id", Shape("u32"), name="partition-id")
            self._cache["pid"] = self.emit("convert", Shape("s32"), [pid], name="pid")
        return self._cache["pid"]

    def axis_index(self, axes: tuple[str, ...]) -> Instruction:
        """``s32[]`` linear index of the device along ``axes`` (major to minor), as MeshShape.axis_index."""
        key = ("axis_index", tuple(axes))
        if key in self._cache:
            return self._cache[key]
        mesh, s32 = self.mesh, Shape("s32")
        total = None
        for a in axes:
            pos = mesh.axis_names.index(a)
            stride = math.prod(mesh.axis_sizes[pos + 1:])
            coord = self.partition_id_s32()
            if stride != 1:
                coord = self.emit("divide", s32, [coord, self.constant(stride)])
            if pos != 0:
                coord = self.emit("remainder", s32, [coord, self.constant(mesh.axis_sizes[pos])])
            if total is None:
                total = coord
            else:
                scaled = self.emit("multiply", s32, [total, self.constant(mesh.size(a))])
                total = self.emit("add", s32, [scaled, coord])
        self._cache[key] = total if total is not None else self.constant(0)
        return self._cache[key]

    def reducer(self, kind: str, dtype: str) -> Computation:
        """Scalar computation ``%{kind}.{dtype}`` = ``(lhs, rhs) -> kind(lhs, rhs)`` used as ``to_apply``.

        Named as ``spmd.ir.builder.Builder.scalar_computation`` names it; reused when present.
        """
        cname = f"{kind}.{dtype}"
        for comp in self.module.computations:
            if comp.name == cname and comp.root is not None and comp.root.opcode == kind:
                return comp
        s = Shape(dtype)
        a = Instruction(self.name(f"{cname}.lhs"), "parameter", s, attrs={"parameter_number": 0})
        b = Instruction(self.name(f"{cname}.rhs"), "parameter", s, attrs={"parameter_number": 1})
        root = Instruction(self.name(f"{cname}.out"), kind, s, [a, b])
        comp = Computation(self.name(cname), [a, b, root], root)
        self.module.computations.append(comp)
        return comp

    def broadcast_scalar(self, scalar: Instruction, shape: Shape) -> Instruction:
        """``scalar`` repeated to ``shape``."""
        return self.emit("broadcast", shape.with_dtype(scalar.shape.dtype), [scalar], {"dimensions": ()})


def normalize(s: TensorSharding, mesh: MeshShape) -> TensorSharding:
    """``s`` with its partial axes in mesh order (so equal shardings compare equal)."""
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    return TensorSharding(s.dims, tuple(sorted(s.partial, key=order.__getitem__)))


def local_shape(shape: Shape, s: TensorSharding, mesh: MeshShape) -> Shape:
    """Padded per-device shape of a value of global ``shape`` under sharding ``s``."""
    return shape.with_dims(s.shard_dims(shape.dims, mesh))


def _drop_trivial(s: TensorSharding, mesh: MeshShape) -> TensorSharding:
    """``s`` without mesh axes of size 1 (they split nothing and sum nothing)."""
    def keep(axes):
        return tuple(a for a in axes if mesh.size(a) > 1)
    return TensorSharding(tuple(keep(d) for d in s.dims), keep(s.partial))


def _even(n: int, axes: tuple[str, ...], mesh: MeshShape) -> bool:
    return n % mesh.axes_size(axes) == 0


def reshard(em: Emitter, value: Instruction, src: TensorSharding, dst: TensorSharding,
            global_dims: tuple[int, ...]) -> Instruction:
    """Instructions turning ``value`` (the local shard under ``src``) into the shard under ``dst``.

    Args:
      em: where the instructions go.
      value: a per-device value of shape ``src.shard_dims(global_dims)``.
      src, dst: shardings of the value over ``em.mesh`` (same rank as ``global_dims``).
      global_dims: the global dims of the value.
    Returns:
      The instruction holding the shard under ``dst`` (``value`` itself when equal).
    Raises:
      ValueError: the ranks do not match ``global_dims``.
    """
    if src.rank != len(global_dims) or dst.rank != len(global_dims):
        raise ValueError(f"reshard: ranks of src {src} and dst {dst} must equal len(global_dims)={len(global_dims)}")
    mesh = em.mesh
    src, dst = _drop_trivial(normalize(src, mesh), mesh), _drop_trivial(normalize(dst, mesh), mesh)
    if src == dst:
        return value
    x, cur = _reduce_partial(em, value, src, dst, global_dims)
    x, cur = _all_to_all(em, x, cur, dst, global_dims)
    x, cur = _gather(em, x, cur, dst, global_dims)
    x, cur = _slice(em, x, cur, dst, global_dims)
    x, cur = _make_partial(em, x, cur, dst, global_dims)
    assert normalize(cur, mesh) == dst, (cur, dst)
    return x


def _shape(x: Instruction, s: TensorSharding, gdims, mesh) -> Shape:
    return x.shape.with_dims(s.shard_dims(tuple(gdims), mesh))


def _reduce_partial(em, x, cur, dst, gdims):
    """Reduce-scatter partial axes that become the next split of a dim; all-reduce the rest."""
    mesh = em.mesh
    pending = [p for p in cur.partial if p not in dst.partial]
    for d, want in enumerate(dst.dims):
        while len(cur.dims[d]) < len(want) and want[:len(cur.dims[d])] == cur.dims[d]:
            p = want[len(cur.dims[d])]
            if p not in pending or not _even(gdims[d], cur.dims[d] + (p,), mesh):
                break
            pending.remove(p)
            new = TensorSharding(cur.dims, tuple(a for a in cur.partial if a != p)).with_dim(d, cur.dims[d] + (p,))
            x = em.emit("reduce-scatter", _shape(x, new, gdims, mesh), [x], {
                "replica_groups": mesh.groups((p,)), "dimensions": (d,),
                "to_apply": em.reducer("add", x.shape.dtype)}, new)
            cur = new
    if pending:
        new = TensorSharding(cur.dims, tuple(a for a in cur.partial if a not in pending))
        x = em.emit("all-reduce", x.shape, [x], {
            "replica_groups": mesh.groups(tuple(a for a in mesh.axis_names if a in pending)),
            "to_apply": em.reducer("add", x.shape.dtype)}, new)
        cur = new
    return x, cur


def _is_prefix(a: tuple, b: tuple) -> bool:
    return b[:len(a)] == a


def _all_to_all(em, x, cur, dst, gdims):
    """Move the minor axis of a dim to the next split of another dim (even dims only)."""
    mesh = em.mesh
    changed = True
    while changed:
        changed = False
        for i, have in enumerate(cur.dims):
            if not have or _is_prefix(have, dst.dims[i]) or not _even(gdims[i], have, mesh):
                continue
            a = have[-1]
            for j, want in enumerate(dst.dims):
                cj = cur.dims[j]
                if j == i or len(want) <= len(cj) or want[:len(cj)] != cj or want[len(cj)] != a:
                    continue
                if not _even(gdims[j], cj + (a,), mesh):
                    continue
                new = cur.with_dim(i, have[:-1]).with_dim(j, cj + (a,))
                x = em.emit("all-to-all", _shape(x, new, gdims, mesh), [x], {
                    "replica_groups": mesh.groups((a,)), "split_dimension": j, "concat_dimension": i}, new)
                cur, changed = new, True
                break
    return x, cur


def _gather(em, x, cur, dst, gdims):
    """All-gather every dim whose axes are not a prefix of the wanted axes."""
    mesh = em.mesh
    for d, have in enumerate(cur.dims):
        want = dst.dims[d]
        if _is_prefix(have, want):
            continue
        keep = 0
        while keep < min(len(have), len(want)) and have[keep] == want[keep]:
            keep += 1
        if not _even(gdims[d], have, mesh):
            keep = 0
        x, cur = all_gather(em, x, cur, d, have[keep:], gdims)
    return x, cur


def all_gather(em: Emitter, x: Instruction, cur: TensorSharding, d: int, axes: tuple[str, ...],
               gdims) -> tuple[Instruction, TensorSharding]:
    """All-gather the minor ``axes`` of dim ``d``; slice off padding when ``d`` ends unsplit.

    Returns the new value and its sharding.
    """
    mesh = em.mesh
    assert cur.dims[d][len(cur.dims[d]) - len(axes):] == axes, (cur, d, axes)
    new = cur.with_dim(d, cur.dims[d][:len(cur.dims[d]) - len(axes)])
    dims = list(x.shape.dims)
    dims[d] *= mesh.axes_size(axes)
    x = em.emit("all-gather", x.shape.with_dims(tuple(dims)), [x], {
        "replica_groups": mesh.groups(axes), "dimensions": (d,)}, new)
    target = new.shard_dims(tuple(gdims), mesh)
    if tuple(dims) != target:
        assert not new.dims[d], "uneven gathers go to the unsplit dim"
        x = em.emit("slice", x.shape.with_dims(target), [x],
                    {"slice": tuple((0, t, 1) for t in target)}, new)
    return x, new


def _slice(em, x, cur, dst, gdims):
    """Dynamic-slice every dim whose wanted axes extend the current ones."""
    mesh = em.mesh
    for d, have in enumerate(cur.dims):
        want = dst.dims[d]
        if have == want or not have:
            continue
        m_cur = cur.shard_dims(tuple(gdims), mesh)[d]
        m_new = dst.shard_dims(tuple(gdims), mesh)[d]
        if m_cur != m_new * mesh.axes_size(want[len(have):]):
            x, cur = all_gather(em, x, cur, d, have, gdims)
    starts, pads, target = [], [], cur
    for d, have in enumerate(cur.dims):
        want = dst.dims[d]
        if have == want:
            starts.append(None)
            pads.append(0)
            continue
        extra = want[len(have):]
        m_new = dst.shard_dims(tuple(gdims), mesh)[d]
        starts.append((extra, m_new))
        pads.append(m_new * mesh.axes_size(extra) - x.shape.dims[d])
        target = target.with_dim(d, want)
    if all(s is None for s in starts):
        return x, cur
    if any(p > 0 for p in pads):
        dims = tuple(n + max(p, 0) for n, p in zip(x.shape.dims, pads, strict=False))
        zero = em.constant(0, x.shape.dtype)
        x = em.emit("pad", x.shape.with_dims(dims), [x, zero],
                    {"padding": tuple((0, max(p, 0), 0) for p in pads)}, cur)
    offsets = []
    for s in starts:
        if s is None:
            offsets.append(em.constant(0))
        else:
            extra, m_new = s
            offsets.append(em.emit("multiply", Shape("s32"), [em.axis_index(extra), em.constant(m_new)]))
    out_shape = _shape(x, target, gdims, mesh)
    x = em.emit("dynamic-slice", out_shape, [x, *offsets], {"dynamic_slice_sizes": out_shape.dims}, target)
    return x, target


def _make_partial(em, x, cur, dst, gdims):
    """Turn a non-partial value partial over new axes: keep it on index 0 of those axes."""
    new_axes = tuple(a for a in em.mesh.axis_names if a in dst.partial and a not in cur.partial)
    if not new_axes:
        return x, cur
    first = em.emit("compare", Shape("pred"), [em.axis_index(new_axes), em.constant(0)], {"direction": "EQ"})
    pred = em.broadcast_scalar(first, x.shape)
    zeros = em.broadcast_scalar(em.constant(0, x.shape.dtype), x.shape)
    new = cur.with_partial(cur.partial + new_axes)
    return em.emit("select", x.shape, [pred, x, zeros], sharding=new), new


def mask_padding(em: Emitter, x: Instruction, s: TensorSharding, gdims, dims, fill: float) -> Instruction:
    """Replace padding rows of ``x`` (sharded as ``s``) along ``dims`` by ``fill``.

    Only dims split unevenly get masked; returns ``x`` itself when none is. The valid length
    of a shard along dim d is ``n - index * m`` (index along d's axes, m the padded size).
    """
    mesh = em.mesh
    pred = None
    local = s.shard_dims(tuple(gdims), mesh)
    for d in dims:
        axes = s.dims[d]
        if not axes or _even(gdims[d], axes, mesh):
            continue
        start = em.emit("multiply", Shape("s32"), [em.axis_index(axes), em.constant(local[d])])
        valid = em.emit("subtract", Shape("s32"), [em.constant(gdims[d]), start])
        iota = em.emit("iota", x.shape.with_dtype("s32"), attrs={"iota_dimension": d})
        limit = em.broadcast_scalar(valid, x.shape)
        cmp = em.emit("compare", x.shape.with_dtype("pred"), [iota, limit], {"direction": "LT"})
        pred = cmp if pred is None else em.emit("and", cmp.shape, [pred, cmp])
    if pred is None:
        return x
    fill_inst = em.broadcast_scalar(em.constant(fill, x.shape.dtype), x.shape)
    return em.emit("select", x.shape, [pred, x, fill_inst], sharding=x.sharding, name=x.name + ".masked")


def build_reshard_module(mesh: MeshShape, shape: Shape, src: TensorSharding, dst: TensorSharding) -> Module:
    """A partitioned module with one parameter (shard under ``src``) whose root is its shard under ``dst``.

    The runtime uses it to reshard arrays on device. Raises ValueError for mismatched ranks.
    """
    if src.rank != shape.rank or dst.rank != shape.rank:
        raise ValueError(f"src {src} / dst {dst}: expected rank {shape.rank} of shape {shape}")
    entry = Computation("reshard")
    module = Module("reshard", entry, [], mesh, is_partitioned=True)
    param = Instruction("x", "parameter", local_shape(shape, src, mesh), attrs={"parameter_number": 0},
                        sharding=src)
    entry.instructions.append(param)
    em = Emitter(module, entry)
    root = reshard(em, param, src, dst, shape.dims)
    if root is param:
        root = em.emit("copy", param.shape, [param], sharding=dst)
    root.sharding = dst
    entry.root = root
    return module
