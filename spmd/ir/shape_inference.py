"""Shape inference of HLO-lite instructions (``infer_shape``).

Follows XLA's shape inference
(https://github.com/openxla/xla/blob/main/xla/service/shape_inference.cc) and
operation semantics (https://openxla.org/xla/operation_semantics); async
start/done shapes follow the conventions in ``docs/architecture.md``:
``async-start`` = ((operands...), result), ``all-gather-start`` and
``collective-permute-start`` = (operand, result), ``all-reduce-start`` =
result, every ``*-done`` = the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spmd.ir.hlo import BINARY_OPCODES, OPCODES, UNARY_OPCODES, Shape, hlo_dtype
from spmd.ir.index_shapes import infer_gather, infer_scatter

__all__ = ["INT_DTYPES", "infer_shape"]

INT_DTYPES = frozenset({"s8", "s16", "s32", "s64", "u8", "u32"})
_EXPLICIT = frozenset({"parameter", "iota", "custom-call", "reshape", "broadcast", "convert"})


def _fail(opcode: str, msg: str) -> ValueError:
    return ValueError(f"{opcode}: {msg}")


def _array(opcode: str, s: Shape, what: str = "operand") -> Shape:
    if s.is_tuple:
        raise _fail(opcode, f"{what} must be an array, got tuple shape {s}")
    return s


def _dims_in_range(opcode: str, dims: Sequence[int], rank: int, what: str) -> None:
    if any(not 0 <= d < rank for d in dims) or len(set(dims)) != len(dims):
        raise _fail(opcode, f"{what} {tuple(dims)} must be distinct dims in [0, {rank})")


def _group_size(opcode: str, attrs: dict, num_partitions: int | None) -> int:
    groups = attrs.get("replica_groups", ())
    if groups:
        if len({len(g) for g in groups}) != 1:
            raise _fail(opcode, f"replica_groups {groups} must all have the same size")
        return len(groups[0])
    if num_partitions is None:
        raise _fail(opcode, "replica_groups is empty (all devices) and num_partitions is unknown")
    return num_partitions


def _elementwise(opcode: str, ops: list[Shape], attrs: dict, shape: Shape | None) -> Shape:
    if opcode == "select":
        pred, t, f = ops
        if pred.dtype != "pred" or (pred.dims != t.dims and pred.rank) or t != f:
            raise _fail(opcode, f"expected pred[{t.dims}] (or pred[]) and two equal shapes, got {pred}, {t}, {f}")
        return t
    if opcode == "clamp":
        lo, x, hi = ops
        for b in (lo, hi):
            if b.dtype != x.dtype or (b.dims != x.dims and b.rank):
                raise _fail(opcode, f"bound {b} must be {x.dtype}[] or {x}")
        return x
    if len({(s.dtype, s.dims) for s in ops}) != 1:
        raise _fail(opcode, f"operands must have equal shapes, got {', '.join(map(str, ops))}")
    if opcode == "compare":
        if attrs.get("direction") not in ("EQ", "NE", "LT", "LE", "GT", "GE"):
            raise _fail(opcode, f"direction must be EQ/NE/LT/LE/GT/GE, got {attrs.get('direction')!r}")
        return Shape("pred", ops[0].dims)
    if opcode == "convert":
        if shape is None or shape.is_tuple or shape.dims != ops[0].dims:
            raise _fail(opcode, f"an explicit result shape with dims {ops[0].dims} is needed, got {shape}")
        return shape
    return ops[0]


def _data_movement(opcode: str, ops: list[Shape], attrs: dict, shape: Shape | None) -> Shape:
    x = ops[0]
    if opcode == "reshape":
        if shape is None or shape.numel != x.numel or shape.dtype != x.dtype:
            raise _fail(opcode, f"an explicit {x.dtype} result with {x.numel} elements is needed, got {shape}")
        return shape
    if opcode == "broadcast":
        dims = attrs["dimensions"]
        if shape is None or shape.is_tuple or shape.dtype != x.dtype:
            raise _fail(opcode, f"an explicit {x.dtype} result shape is needed, got {shape}")
        _dims_in_range(opcode, dims, shape.rank, "dimensions")
        if len(dims) != x.rank or any(shape.dims[o] != x.dims[i] for i, o in enumerate(dims)):
            raise _fail(opcode, f"operand {x} does not map onto {shape} with dimensions={tuple(dims)}")
        return shape
    if opcode == "transpose":
        perm = attrs["dimensions"]
        if sorted(perm) != list(range(x.rank)):
            raise _fail(opcode, f"dimensions {tuple(perm)} must be a permutation of range({x.rank})")
        return x.with_dims(tuple(x.dims[p] for p in perm))
    if opcode == "slice":
        sl = attrs["slice"]
        if len(sl) != x.rank:
            raise _fail(opcode, f"slice has {len(sl)} entries for rank-{x.rank} operand {x}")
        for (a, b, c), n in zip(sl, x.dims, strict=True):
            if not (0 <= a <= b <= n and c >= 1):
                raise _fail(opcode, f"slice [{a}:{b}:{c}] out of range for dim size {n}")
        return x.with_dims(tuple(-(-(b - a) // c) for a, b, c in sl))
    if opcode == "pad":
        pad, value = attrs["padding"], ops[1]
        if value.rank or value.dtype != x.dtype or len(pad) != x.rank:
            raise _fail(opcode, f"needs a {x.dtype}[] value and {x.rank} padding entries, got {value}, {pad}")
        out = tuple(lo + hi + n + max(n - 1, 0) * it for (lo, hi, it), n in zip(pad, x.dims, strict=True))
        if any(it < 0 for _, _, it in pad) or any(d < 0 for d in out):
            raise _fail(opcode, f"padding {pad} gives negative sizes {out}")
        return x.with_dims(out)
    # concatenate
    (d,) = attrs["dimensions"]
    _dims_in_range(opcode, (d,), x.rank, "dimensions")
    for s in ops[1:]:
        others = [(a, b) for i, (a, b) in enumerate(zip(s.dims, x.dims, strict=False)) if i != d]
        if s.dtype != x.dtype or s.rank != x.rank or any(a != b for a, b in others):
            raise _fail(opcode, f"operand {s} does not match {x} outside dim {d}")
    return x.with_dims(tuple(sum(s.dims[d] for s in ops) if i == d else n for i, n in enumerate(x.dims)))


def _dot(ops: list[Shape], attrs: dict, shape: Shape | None) -> Shape:
    lhs, rhs = ops
    lb, rb = attrs.get("lhs_batch_dims", ()), attrs.get("rhs_batch_dims", ())
    lc, rc = attrs.get("lhs_contracting_dims", ()), attrs.get("rhs_contracting_dims", ())
    _dims_in_range("dot", (*lb, *lc), lhs.rank, "lhs batch+contracting dims")
    _dims_in_range("dot", (*rb, *rc), rhs.rank, "rhs batch+contracting dims")
    for what, a, b in (("batch", lb, rb), ("contracting", lc, rc)):
        if [lhs.dims[i] for i in a] != [rhs.dims[i] for i in b]:
            raise _fail("dot", f"{what} dims differ: lhs {lhs} dims {a} vs rhs {rhs} dims {b}")
    free_l = [n for i, n in enumerate(lhs.dims) if i not in lb and i not in lc]
    free_r = [n for i, n in enumerate(rhs.dims) if i not in rb and i not in rc]
    dtype = shape.dtype if shape is not None and not shape.is_tuple else lhs.dtype
    return Shape(dtype, tuple([lhs.dims[i] for i in lb] + free_l + free_r))


def _reduce(ops: list[Shape], attrs: dict) -> Shape:
    x, init = ops
    dims = attrs["dimensions"]
    _dims_in_range("reduce", dims, x.rank, "dimensions")
    if init.rank or init.dtype != x.dtype:
        raise _fail("reduce", f"init value must be {x.dtype}[], got {init}")
    return x.with_dims(tuple(n for i, n in enumerate(x.dims) if i not in dims))


def _dynamic(opcode: str, ops: list[Shape], attrs: dict) -> Shape:
    x = ops[0]
    first = 1 if opcode == "dynamic-slice" else 2
    starts = ops[first:]
    if len(starts) != x.rank or any(s.rank or s.dtype not in INT_DTYPES for s in starts):
        raise _fail(opcode, f"needs {x.rank} integer scalar start indices, got {', '.join(map(str, starts))}")
    if opcode == "dynamic-slice":
        sizes = attrs["dynamic_slice_sizes"]
        if len(sizes) != x.rank or any(not 0 <= s <= n for s, n in zip(sizes, x.dims, strict=False)):
            raise _fail(opcode, f"dynamic_slice_sizes {sizes} do not fit operand {x}")
        return x.with_dims(tuple(sizes))
    upd = ops[1]
    if upd.dtype != x.dtype or upd.rank != x.rank or any(u > n for u, n in zip(upd.dims, x.dims, strict=False)):
        raise _fail(opcode, f"update {upd} does not fit operand {x}")
    return x


def _collective(opcode: str, x: Shape, attrs: dict, num_partitions: int | None) -> Shape:
    if opcode in ("all-reduce", "collective-permute"):
        if opcode == "collective-permute" and "source_target_pairs" not in attrs:
            raise _fail(opcode, "missing attribute 'source_target_pairs'")
        return x
    g = _group_size(opcode, attrs, num_partitions)
    dims = list(x.dims)
    if opcode == "all-to-all":
        s, c = attrs["split_dimension"], attrs["concat_dimension"]
        _dims_in_range(opcode, (s,), x.rank, "split_dimension")
        _dims_in_range(opcode, (c,), x.rank, "concat_dimension")
        if dims[s] % g:
            raise _fail(opcode, f"split dim {s} of {x} is not divisible by the group size {g}")
        dims[s] //= g
        dims[c] *= g
        return x.with_dims(tuple(dims))
    (d,) = attrs["dimensions"]
    _dims_in_range(opcode, (d,), x.rank, "dimensions")
    if opcode == "all-gather":
        dims[d] *= g
    elif dims[d] % g:
        raise _fail(opcode, f"dim {d} of {x} is not divisible by the group size {g}")
    else:
        dims[d] //= g
    return x.with_dims(tuple(dims))


def _async(opcode: str, ops: list[Shape], attrs: dict, num_partitions: int | None) -> Shape:
    if opcode == "fusion":
        comp = attrs["calls"]
        params = [p.shape for p in comp.parameters]
        root = comp.root.shape if comp.root is not None else None
        outputs = root.tuple_shapes if root is not None and root.is_tuple else (root,)
        if params != ops or root is None or any(s.is_tuple for s in outputs):
            raise _fail(opcode, f"operands ({', '.join(map(str, ops))}) do not match %{comp.name}'s parameters "
                                f"({', '.join(map(str, params))}), or its root is neither an array nor a tuple "
                                f"of arrays (a multi-output fusion)")
        return root
    if opcode == "async-start":
        comp = attrs["calls"]
        params = [p.shape for p in comp.parameters]
        if params != ops or comp.root is None:
            raise _fail(opcode, f"operands ({', '.join(map(str, ops))}) do not match %{comp.name}'s parameters "
                                f"({', '.join(map(str, params))})")
        return Shape.tuple([Shape.tuple(ops), comp.root.shape])
    if opcode == "all-reduce-start":
        return _array(opcode, ops[0])
    if opcode in ("all-gather-start", "collective-permute-start"):
        x = _array(opcode, ops[0])
        return Shape.tuple([x, _collective(opcode.removesuffix("-start"), x, attrs, num_partitions)])
    x = ops[0]  # a *-done
    if opcode == "all-reduce-done":
        return _array(opcode, x)
    if not x.is_tuple or len(x.tuple_shapes) != 2:
        raise _fail(opcode, f"operand must be a (operands, result) tuple from a start, got {x}")
    return x.tuple_shapes[1]


_ARITY = {"select": 3, "clamp": 3, "parameter": 0, "constant": 0, "iota": 0, "partition-id": 0,
          "broadcast": 1, "reshape": 1, "transpose": 1, "slice": 1, "pad": 2, "dot": 2, "reduce": 2,
          "gather": 2, "scatter": 3, "get-tuple-element": 1}


def _check_arity(opcode: str, ops: list[Shape]) -> None:
    n = _ARITY.get(opcode, 1 if opcode in UNARY_OPCODES else 2 if opcode in BINARY_OPCODES else None)
    if opcode in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute") or (
            opcode.endswith(("-start", "-done")) and opcode != "async-start"):
        n = 1
    if n is not None and len(ops) != n:
        raise _fail(opcode, f"expected {n} operand(s), got {len(ops)}")
    if opcode in ("concatenate", "dynamic-slice", "dynamic-update-slice") and not ops:
        raise _fail(opcode, "expected at least one operand")
    tuple_ok = opcode in ("tuple", "get-tuple-element", "custom-call", "async-start") or opcode.endswith("-done")
    if not tuple_ok:
        for s in ops:
            _array(opcode, s)


def infer_shape(
    opcode: str,
    operand_shapes: Sequence[Shape],
    attrs: dict[str, Any] | None = None,
    *,
    shape: Shape | None = None,
    num_partitions: int | None = None,
) -> Shape:
    """The result shape of ``opcode`` applied to operands of ``operand_shapes`` with ``attrs``.

    Semantics follow XLA: dot = batch dims, lhs free dims, rhs free dims;
    broadcast maps operand dim i to output dim dimensions[i]; transpose output
    dim i = operand dim dimensions[i]; reduce removes ``dimensions``; compare
    gives pred; all-gather multiplies dim dimensions[0] by the group size,
    reduce-scatter divides it; all-to-all divides split_dimension and
    multiplies concat_dimension; async starts give (operand(s), result) tuples
    as in ``docs/architecture.md``.

    Args:
      shape: the declared result shape. Required for opcodes whose result the
        operands do not determine (parameter, iota, custom-call, reshape,
        broadcast, convert), where it is checked and returned; for dot it
        gives the result element type. Ignored otherwise.
      num_partitions: the group size of collectives with empty replica_groups.
    Raises:
      ValueError: naming the opcode, for a missing attribute, wrong operand
        count or shapes, or dims out of range.
    """
    if opcode not in OPCODES:
        raise ValueError(f"opcode {opcode!r} is not one of OPCODES")
    attrs = attrs or {}
    ops = list(operand_shapes)
    _check_arity(opcode, ops)
    try:
        return _infer(opcode, ops, attrs, shape, num_partitions)
    except KeyError as e:
        raise _fail(opcode, f"missing attribute {e.args[0]!r}") from None


def _infer(opcode: str, ops: list[Shape], attrs: dict, shape: Shape | None, num_partitions: int | None) -> Shape:
    if opcode in _EXPLICIT and opcode not in ("reshape", "broadcast", "convert"):
        if shape is None:
            raise _fail(opcode, "the result shape must be given explicitly")
        if opcode == "parameter" and attrs["parameter_number"] < 0:
            raise _fail(opcode, f"parameter_number must be >= 0, got {attrs['parameter_number']}")
        if opcode == "iota":
            _dims_in_range(opcode, (attrs["iota_dimension"],), _array(opcode, shape, "result").rank, "iota_dimension")
        if opcode == "custom-call" and not shape.is_tuple:
            from spmd.ir.custom_calls_attention import check_result_shape

            check_result_shape(attrs.get("custom_call_target", ""), ops, shape)
        return shape
    if opcode in UNARY_OPCODES or opcode in BINARY_OPCODES or opcode in ("select", "clamp"):
        return _elementwise(opcode, ops, attrs, shape)
    if opcode in ("reshape", "broadcast", "transpose", "slice", "pad", "concatenate"):
        return _data_movement(opcode, ops, attrs, shape)
    if opcode == "constant":
        lit = attrs["literal"]
        return Shape(hlo_dtype(lit.dtype), tuple(lit.shape))
    if opcode == "partition-id":
        return Shape("u32", ())
    if opcode == "dot":
        return _dot(ops, attrs, shape)
    if opcode == "reduce":
        return _reduce(ops, attrs)
    if opcode == "gather":
        return infer_gather(ops, attrs)
    if opcode == "scatter":
        return infer_scatter(ops, attrs)
    if opcode in ("dynamic-slice", "dynamic-update-slice"):
        return _dynamic(opcode, ops, attrs)
    if opcode in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"):
        return _collective(opcode, ops[0], attrs, num_partitions)
    if opcode == "tuple":
        return Shape.tuple(ops)
    if opcode == "get-tuple-element":
        t, i = ops[0], attrs["index"]
        if not t.is_tuple or not 0 <= i < len(t.tuple_shapes):
            raise _fail(opcode, f"index {i} out of range for {t}")
        return t.tuple_shapes[i]
    return _async(opcode, ops, attrs, num_partitions)
