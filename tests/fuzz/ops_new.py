"""Op generators for the ops being added (issue 20, "missing ops"): on ``main`` they raise
``UnsupportedOpError`` (counted as unsupported); as they land the same programs check them.

Enabled by the feature ``"new_ops"`` (``tests.fuzz.generate.DEFAULT_FEATURES``; the environment
variable ``SPMD_FUZZ_NEW_OPS=0`` turns it off). Indices produced by argmax/topk/sort are compared
exactly, so those ops only read exact input data (no near-ties that rounding could flip).
"""

from __future__ import annotations

import torch

from tests.fuzz.builder import Builder, Reject, Value
from tests.fuzz.ops import rand_dim


def _exact_float(b: Builder) -> Value:
    """An operand whose data are an input's, in float32/float64 (distinct values, no ties)."""
    try:
        return b.pick(lambda v: v.exact and v.dtype in (torch.float32, torch.float64) and v.rank >= 1, "exact")
    except Reject:
        b.new_input(b.random_shape(), b.d.choice((torch.float32, torch.float64)))
        return b.values[-1]


def op_argmax(b: Builder) -> None:
    a = _exact_float(b)
    d = rand_dim(b, a)
    kind = b.d.choice(("argmax", "argmin", "max_indices", "max_values"))
    keep = b.d.boolean()
    if kind == "max_values":
        a = b.pick_float(min_rank=1)
        b.emit(f"{a.name}.max(dim={rand_dim(b, a)}, keepdim={keep}).values")
    elif kind == "max_indices":
        b.emit(f"{a.name}.max(dim={d}, keepdim={keep}).indices")
    else:
        b.emit(f"torch.{kind}({a.name}, dim={d}, keepdim={keep})")


def op_topk_sort(b: Builder) -> None:
    indices = b.d.boolean(0.4)
    a = _exact_float(b) if indices else b.pick_float(min_rank=1)
    d = rand_dim(b, a)
    field = "indices" if indices else "values"
    if b.d.boolean():
        k = b.d.integer(1, a.shape[d])
        b.emit(f"torch.topk({a.name}, {k}, dim={d}, largest={b.d.boolean(0.7)}).{field}")
    else:
        b.emit(f"torch.sort({a.name}, dim={d}, descending={b.d.boolean()}).{field}")


def op_cumsum(b: Builder) -> None:
    a = b.pick_float(min_rank=1)
    fn = b.d.choice(("cumsum", "cumprod"))
    b.emit(f"torch.{fn}({a.name}, dim={rand_dim(b, a)})")


def op_gather(b: Builder) -> None:
    a = b.pick(lambda v: v.rank >= 1 and v.is_float, "gather operand")
    d = b.d.integer(0, a.rank - 1)
    kind = b.d.choice(("gather", "index_select", "scatter_add", "index_add", "index_put"))
    if kind in ("gather", "scatter_add"):
        shape = tuple(b.d.integer(1, s) for s in a.shape)
        idx = b.new_input(shape, torch.int64, high=a.shape[d])
        if kind == "gather":
            b.emit(f"torch.gather({a.name}, {d}, {idx})")
        else:
            src = b.new_input(shape, a.dtype)
            b.emit(f"torch.scatter_add({a.name}, {d}, {idx}, {src})")
        return
    m = b.d.choice((3, 1, 5))
    if kind == "index_put":
        d = 0  # index_put((idx,), ...) indexes dim 0
    idx = b.new_input((m,), torch.int64, high=a.shape[d])
    if kind == "index_select":
        b.emit(f"torch.index_select({a.name}, {d}, {idx})")
    elif kind == "index_add":
        src = b.new_input(tuple(m if i == d else s for i, s in enumerate(a.shape)), a.dtype)
        b.emit(f"{a.name}.index_add({d}, {idx}, {src})")
    else:
        src = b.new_input((m, *a.shape[1:]), a.dtype)
        b.emit(f"{a.name}.index_put(({idx},), {src}, accumulate=True)")


def op_one_hot(b: Builder) -> None:
    classes = b.d.choice((4, 8, 5))
    idx = b.new_input(b.random_shape(b.d.choice((1, 2))), torch.int64, high=classes)
    b.emit(f"F.one_hot({idx}, {classes}).to({b.d.choice(('F32', 'BF16', 'F64'))})")


def op_cross_entropy(b: Builder) -> None:
    a = b.pick_float(min_rank=2, max_rank=3)
    n, c = a.shape[0], a.shape[1]
    target = b.new_input((n, *a.shape[2:]), torch.int64, high=c)
    red = b.d.choice(("mean", "sum", "none"))
    b.emit(f"F.cross_entropy({a.name}, {target}, reduction={red!r})")


def op_slice_assign(b: Builder) -> None:
    a = b.pick(lambda v: v.rank >= 1 and v.is_float, "slice-assign target")
    d = b.d.integer(0, a.rank - 1)
    n = a.shape[d]
    start = b.d.integer(0, n - 1)
    stop = b.d.integer(start + 1, n)
    shape = tuple(stop - start if i == d else s for i, s in enumerate(a.shape))
    src = b.new_input(shape, a.dtype) if b.d.boolean(0.7) else "1.5"
    index = ":, " * d + f"{start}:{stop}"
    b.emit(None, stmts=("{name} = " + f"{a.name}.clone()", "{name}" + f"[{index}] = {src}"))


def op_int_bool(b: Builder) -> None:
    """Integer floor-divide of an index tensor (into an embedding) or a bool xor mask (into a where)."""
    if b.d.boolean():
        vocab = b.d.choice((8, 16))
        idx = b.new_input(b.random_shape(b.d.choice((1, 2))), torch.int64, high=2 * vocab)
        table = b.new_input((vocab, b.d.choice((4, 6))), b.d.choice((torch.float32, torch.bfloat16)))
        b.emit(f"F.embedding({idx} // 2, {table})")
        return
    a = b.pick_float()
    m1, m2 = b.new_input(a.shape, a.dtype), b.new_input(a.shape, a.dtype)
    b.emit(f"torch.where(({m1} > 0) ^ ({m2} < 0.5), {a.name}, -{a.name})")


def op_conv1d(b: Builder) -> None:
    a = b.pick_float(min_rank=3, max_rank=3)
    n, c, length = a.shape
    k = b.d.integer(1, min(3, length))
    w = b.new_input((b.d.choice((4, 2, 6)), c, k), a.dtype)
    pad = b.d.integer(0, k - 1)
    b.emit(f"F.conv1d({a.name}, {w}, padding={pad})")


def op_copy(b: Builder) -> None:
    """``copy_`` into a slice of a clone (an in-place update the program then returns)."""
    a = b.pick(lambda v: v.rank >= 1 and v.is_float, "copy target")
    n = a.shape[-1]
    start = b.d.integer(0, n - 1)
    src = b.new_input((*a.shape[:-1], n - start), a.dtype)
    b.emit(None, stmts=("{name} = " + f"{a.name}.clone()", "{name}" + f"[..., {start}:].copy_({src})"))


def op_log1p_expm1(b: Builder) -> None:
    a = b.pick_float()
    form = b.d.choice(("torch.log1p({a}.abs())", "torch.expm1({a}.tanh())", "{a}.abs().log1p() * {a}"))
    b.emit(form.format(a=a.name))


def op_prod(b: Builder) -> None:
    a = b.pick_float(min_rank=1)
    base = f"(1 + 0.25 * {a.name}.tanh())"
    if b.d.boolean(0.3):
        b.emit(f"{base}.prod()")
    else:
        b.emit(f"{base}.prod(dim={rand_dim(b, a)}, keepdim={b.d.boolean()})")


def op_any_all(b: Builder) -> None:
    a = b.pick_float(min_rank=1)
    fn = b.d.choice(("any", "all"))
    cut = b.d.choice(("0", "0.5", "-0.5"))
    dim = "" if b.d.boolean(0.3) else f"dim={rand_dim(b, a)}, keepdim={b.d.boolean()}"
    b.emit(f"({a.name} > {cut}).{fn}({dim}).to({a.name}.dtype)")


def op_flip(b: Builder) -> None:
    a = b.pick_float(min_rank=1)
    dims = sorted({rand_dim(b, a) % a.rank for _ in range(b.d.integer(1, a.rank))})
    b.emit(f"torch.flip({a.name}, {tuple(dims)})")


def op_pad(b: Builder) -> None:
    a = b.pick_float(min_rank=1)
    n = b.d.integer(1, min(a.rank, 3))
    pad = [b.d.integer(-1 if a.shape[a.rank - 1 - k // 2] > 2 else 0, 2) for k in range(2 * n)]
    if b.d.boolean(0.6):
        b.emit(f"F.pad({a.name}, {tuple(pad)}, value={b.d.choice(('0.0', '1.5', '-2.0'))})")
        return
    if a.rank < 2 or a.rank > 4:
        raise Reject("reflect/replicate/circular pad needs a batch dim and at most 3 padded dims")
    k = min(n, a.rank - 1)
    pad = [b.d.integer(0, min(2, a.shape[a.rank - 1 - j // 2] - 1)) for j in range(2 * k)]
    b.emit(f"F.pad({a.name}, {tuple(pad)}, mode={b.d.choice(('reflect', 'replicate', 'circular'))!r})")


def op_order_statistic(b: Builder) -> None:
    indices = b.d.boolean(0.3)
    a = _exact_float(b) if indices else b.pick_float(min_rank=1)
    d = rand_dim(b, a)
    field = "indices" if indices else "values"
    keep = b.d.boolean()
    if b.d.boolean(0.3):
        b.emit(f"torch.{b.d.choice(('cummax', 'cummin'))}({a.name}, dim={d}).{field}")
    elif b.d.boolean():
        k = b.d.integer(1, a.shape[d])
        b.emit(f"torch.kthvalue({a.name}, {k}, dim={d}, keepdim={keep}).{field}")
    elif b.d.boolean(0.8):
        b.emit(f"{a.name}.median(dim={d}, keepdim={keep}).{field}")
    else:
        b.emit(f"{a.name}.median()")


NEW_OPS = (
    ("argmax", op_argmax, 1), ("topk_sort", op_topk_sort, 1), ("cumsum", op_cumsum, 1), ("gather", op_gather, 1),
    ("one_hot", op_one_hot, 1), ("cross_entropy", op_cross_entropy, 1), ("slice_assign", op_slice_assign, 1),
    ("int_bool", op_int_bool, 1), ("conv1d", op_conv1d, 1), ("copy", op_copy, 1),
    ("log1p_expm1", op_log1p_expm1, 1), ("prod", op_prod, 1), ("any_all", op_any_all, 1), ("flip", op_flip, 1),
    ("pad", op_pad, 1), ("order_statistic", op_order_statistic, 1),
)
