"""Op generators for random transformer-style programs (the ops ``spmd`` supports on main).

Each ``op_*(b)`` draws operands from the ``Builder`` ``b``, may add inputs, and emits lines;
``CORE_OPS`` lists them with weights. Ops whose result is discontinuous in their inputs (masks,
comparisons) only read inputs' exact data, so the float64 reference and the low-precision runs
take the same branch.
"""

from __future__ import annotations

import torch

from tests.fuzz.builder import Builder, Reject, Value, divisors
from tests.fuzz.case import DTYPE_NAMES, spec_text

FLOATS = ("F32", "BF16", "F64", "F16")


def dn(v: Value) -> str:
    return DTYPE_NAMES[v.dtype]


def rand_dim(b: Builder, v: Value) -> int:
    """A dim of ``v``, sometimes written negatively."""
    d = b.d.integer(0, v.rank - 1)
    return d - v.rank if b.d.boolean(0.4) else d


# ------------------------------------------------------------------ dots


def op_matmul(b: Builder) -> None:
    a = b.pick_float(min_rank=1)
    k = a.shape[-1]
    n = b.d.choice((4, 8, 2, 3, 6, 16, 5))
    form = b.d.choice(("matmul", "linear", "existing", "bmm", "einsum", "qk"))
    if form == "matmul":
        w = b.new_input((k, n), a.dtype)
        b.emit(f"{a.name} @ {w}")
    elif form == "linear":
        w = b.new_input((n, k), a.dtype)
        bias = b.new_input((n,), a.dtype) if b.d.boolean() else None
        b.emit(f"F.linear({a.name}, {w}{', ' + bias if bias else ''})")
    elif form == "existing":
        c = b.pick(lambda v: v.is_float and v.dtype == a.dtype and v.rank >= 2 and v.shape[-2] == k
                   and v.name != a.name, "matmul partner")
        b.emit(f"torch.matmul({a.name}, {c.name})")
    elif form == "bmm":
        if a.rank != 3:
            raise Reject("bmm needs rank 3")
        w = b.new_input((a.shape[0], k, n), a.dtype)
        b.emit(f"torch.bmm({a.name}, {w})")
    elif form == "einsum":
        letters = "abcde"[:a.rank]
        kind = b.d.choice(("last", "batch", "first"))
        if kind == "last":
            w = b.new_input((k, n), a.dtype)
            eq = f"{letters},{letters[-1]}z->{letters[:-1]}z"
        elif kind == "batch" and a.rank >= 3:
            w = b.new_input((*a.shape[:-2], k, n), a.dtype)
            eq = f"{letters},{letters[:-2]}{letters[-1]}z->{letters[:-1]}z"
        elif kind == "first" and a.rank >= 2:
            w = b.new_input((a.shape[0], n), a.dtype)
            eq = f"{letters},{letters[0]}z->{letters[1:]}z"
        else:
            raise Reject("einsum form")
        b.emit(f"torch.einsum({eq!r}, {a.name}, {w})")
    else:  # attention scores: q @ k^T over the last dim
        if a.rank < 2:
            raise Reject("qk needs rank >= 2")
        kk = b.new_input((*a.shape[:-2], b.d.choice((a.shape[-2], 4, 3)), k), a.dtype)
        b.emit(f"{a.name} @ {kk}.transpose(-1, -2)")


# ------------------------------------------------------------------ elementwise

UNARY = ("torch.relu({a})", "F.gelu({a})", "F.silu({a})", "{a} * 0.5", "torch.tanh({a})",
         "F.gelu({a}, approximate='tanh')", "torch.sigmoid({a})", "torch.exp({a}.clamp(-4.0, 4.0))",
         "torch.log({a}.abs() + 1)", "torch.sqrt({a}.abs() + 0.1)", "torch.rsqrt({a}.abs() + 0.5)",
         "-{a}", "{a}.abs()", "torch.square({a})", "{a}.pow(2)", "{a} ** 3", "2 * {a}", "{a} / 3",
         "1 - {a}", "{a}.clamp(-1.0, 1.0)", "{a} + 1.5", "F.relu({a})", "torch.nn.functional.softplus({a})")


def op_unary(b: Builder) -> None:
    a = b.pick_float()
    b.emit(b.d.choice(UNARY).format(a=a.name))


def _broadcast_partner(b: Builder, a: Value) -> str:
    """A value broadcastable against ``a``: an existing one, a new input, or a Python scalar."""
    kind = b.d.choice(("input", "existing", "scalar"))
    if kind == "scalar":
        return b.d.choice(("0.5", "2.0", "-1.25", "3"))
    if kind == "existing":
        def ok(v: Value) -> bool:  # either side may broadcast (x - x.mean(-1, keepdim=True))
            if not v.is_float or v.name == a.name:
                return False
            return all(s == t or 1 in (s, t) for s, t in zip(reversed(v.shape), reversed(a.shape)))
        return b.pick(ok, "broadcast partner").name
    shape = list(a.shape)
    drop = b.d.integer(0, len(shape)) if b.d.boolean(0.3) else 0
    shape = [1 if b.d.boolean(0.3) else s for s in shape[drop:]]
    dtype = a.dtype if b.d.boolean(0.8) else b.d.choice(list(DTYPE_NAMES)[:4])
    return b.new_input(tuple(shape), dtype)


BINARY = ("{a} + {c}", "{a} * {c}", "{a} - {c}", "{c} - {a}", "{a} / ({c}.abs() + 0.5)" , "torch.maximum({a}, {c})",
          "torch.minimum({a}, {c})", "{c} * {a} + {a}")


def op_binary(b: Builder) -> None:
    a = b.pick_float()
    c = _broadcast_partner(b, a)
    form = b.d.choice(BINARY)
    if c[0].isdigit() or c[0] == "-":
        if "torch." in form or ".abs()" in form:
            form = "{a} * {c}"
        c = f"({c})" if c.startswith("-") else c
    b.emit(form.format(a=a.name, c=c))


# ------------------------------------------------------------------ reductions and norms


def op_reduce(b: Builder) -> None:
    a = b.pick_float(min_rank=1)
    fn = b.d.choice(("sum", "mean", "amax", "var", "amin", "vector_norm"))
    dims = sorted({rand_dim(b, a) % a.rank for _ in range(b.d.choice((1, 2)))})
    dim = str(dims[0] - a.rank if b.d.boolean(0.5) else dims[0]) if len(dims) == 1 else str(tuple(dims))
    keep = b.d.boolean()
    if b.d.boolean(0.1) and fn in ("sum", "mean", "amax"):
        b.emit(f"{a.name}.{fn}()")
    elif fn == "var":
        count = 1
        for i in dims:
            count *= a.shape[i]
        correction = b.d.choice((1, 0)) if count > 1 else 0  # correction 1 over one element is nan
        b.emit(f"torch.var({a.name}, dim={dim}, correction={correction}, keepdim={keep})")
    elif fn == "vector_norm":
        b.emit(f"torch.linalg.vector_norm({a.name}, dim={dim}, keepdim={keep})")
    else:
        b.emit(f"{a.name}.{fn}(dim={dim}, keepdim={keep})")


def op_softmax(b: Builder) -> None:
    a = b.pick_float(min_rank=1)
    d = rand_dim(b, a)
    fn = b.d.choice(("torch.softmax", "F.log_softmax", "F.softmax"))
    b.emit(f"{fn}({a.name}, dim={d})")


def op_norm(b: Builder) -> None:
    a = b.pick_float(min_rank=1)
    n = a.shape[-1]
    kind = b.d.choice(("layer_norm", "rms", "layer_norm_plain", "layer_norm_2d"))
    if kind == "layer_norm":
        w, bias = b.new_input((n,), a.dtype), b.new_input((n,), a.dtype)
        b.emit(f"F.layer_norm({a.name}, ({n},), {w}, {bias}, eps=1e-5)")
    elif kind == "layer_norm_plain":
        b.emit(f"F.layer_norm({a.name}, ({n},))")
    elif kind == "layer_norm_2d" and a.rank >= 2:
        b.emit(f"F.layer_norm({a.name}, {tuple(a.shape[-2:])!r})")
    else:
        w = b.new_input((n,), a.dtype)
        b.emit(f"{a.name} * torch.rsqrt({a.name}.pow(2).mean(-1, keepdim=True) + 1e-6) * {w}")


# ------------------------------------------------------------------ shapes


def op_reshape(b: Builder) -> None:
    a = b.pick(lambda v: v.rank >= 1, "reshape operand")
    shape = list(a.shape)
    kind = b.d.choice(("merge", "split", "flatten", "unflatten", "view"))
    if kind in ("merge", "view") and a.rank >= 2:
        i = b.d.integer(0, a.rank - 2)
        new = shape[:i] + [shape[i] * shape[i + 1]] + shape[i + 2:]
        method = "view" if kind == "view" else "reshape"
        b.emit(f"{a.name}.{method}({', '.join(map(str, new))})", exact=a.exact)
    elif kind == "split":
        i = b.d.integer(0, a.rank - 1)
        f = b.d.choice(divisors(shape[i]))
        new = shape[:i] + [f, shape[i] // f] + shape[i + 1:]
        if len(new) > 5:
            raise Reject("rank")
        if b.d.boolean(0.3):
            new[b.d.integer(0, len(new) - 1)] = -1
        b.emit(f"{a.name}.reshape({', '.join(map(str, new))})", exact=a.exact)
    elif kind == "flatten" and a.rank >= 2:
        s = b.d.integer(0, a.rank - 2)
        e = b.d.integer(s + 1, a.rank - 1)
        b.emit(f"torch.flatten({a.name}, {s}, {e})" if b.d.boolean() else f"{a.name}.reshape(-1)", exact=a.exact)
    elif kind == "unflatten":
        i = b.d.integer(0, a.rank - 1)
        f = b.d.choice(divisors(shape[i]))
        b.emit(f"{a.name}.unflatten({i}, ({f}, {shape[i] // f}))", exact=a.exact)
    else:
        raise Reject("reshape form")


def op_transpose(b: Builder) -> None:
    a = b.pick(lambda v: v.rank >= 2, "transpose operand")
    kind = b.d.choice(("transpose", "permute", "T", "mT"))
    if kind == "transpose":
        i, j = b.d.integer(0, a.rank - 1), b.d.integer(0, a.rank - 1)
        b.emit(f"{a.name}.transpose({i}, {j - a.rank})", exact=a.exact)
    elif kind == "permute":
        b.emit(f"{a.name}.permute({', '.join(map(str, b.d.permutation(a.rank)))})", exact=a.exact)
    elif kind == "T" and a.rank == 2:
        b.emit(f"{a.name}.T", exact=a.exact)
    else:
        b.emit(f"{a.name}.mT", exact=a.exact)


def op_squeeze(b: Builder) -> None:
    a = b.pick(lambda v: v.rank >= 0, "squeeze operand")
    if b.d.boolean() and a.rank < 5:
        b.emit(f"{a.name}.unsqueeze({b.d.integer(-a.rank - 1, a.rank)})", exact=a.exact)
        return
    ones = [i for i, s in enumerate(a.shape) if s == 1]
    if not ones:
        raise Reject("no size-1 dim")
    b.emit(f"{a.name}.squeeze({b.d.choice(ones)})" if b.d.boolean(0.8) else f"{a.name}.squeeze()", exact=a.exact)


def op_expand(b: Builder) -> None:
    a = b.pick(lambda v: 1 in v.shape, "expand operand")
    shape = [b.d.choice((2, 3, 4)) if s == 1 and b.d.boolean(0.7) else s for s in a.shape]
    b.emit(f"{a.name}.expand({', '.join(map(str, shape))})")


def op_slice(b: Builder) -> None:
    a = b.pick(lambda v: v.rank >= 1, "slice operand")
    d = b.d.integer(0, a.rank - 1)
    n = a.shape[d]
    kind = b.d.choice(("slice", "select", "narrow", "negative"))
    pre = ":, " * d
    if kind == "slice":
        start = b.d.integer(0, n - 1)
        stop = b.d.integer(start + 1, n)
        step = b.d.choice((1, 2, 3))
        b.emit(f"{a.name}[{pre}{start}:{stop}:{step}]", exact=a.exact)
    elif kind == "select":
        b.emit(f"{a.name}[{pre}{b.d.integer(-n, n - 1)}]", exact=a.exact)
    elif kind == "narrow":
        start = b.d.integer(0, n - 1)
        b.emit(f"{a.name}.narrow({d}, {start}, {b.d.integer(1, n - start)})", exact=a.exact)
    else:
        b.emit(f"{a.name}[..., {b.d.integer(-a.shape[-1], -1)}:]", exact=a.exact)


def op_cat(b: Builder) -> None:
    a = b.pick(lambda v: v.rank >= 1 and v.is_float, "cat operand")
    d = rand_dim(b, a)
    stack = b.d.boolean(0.3)
    parts = [a.name]
    for _ in range(b.d.choice((1, 2))):
        if b.d.boolean(0.5):
            shape = list(a.shape)
            if not stack:
                shape[d] = b.d.choice((1, 2, 3, 4))
            parts.append(b.new_input(tuple(shape), a.dtype))
        else:
            def ok(v: Value, d=d) -> bool:
                if v.rank != a.rank or v.dtype != a.dtype:
                    return False
                return all(s == t or (i == d % a.rank and not stack) for i, (s, t) in enumerate(zip(v.shape, a.shape)))
            parts.append(b.pick(ok, "cat partner").name)
    if b.d.boolean(0.2):
        parts.append(a.name)
    fn = "torch.stack" if stack else b.d.choice(("torch.cat", "torch.concat"))
    b.emit(f"{fn}([{', '.join(parts)}], dim={d})")  # not exact: a part may repeat (ties for argmax/sort)


def op_split(b: Builder) -> None:
    a = b.pick(lambda v: v.rank >= 1 and max(v.shape) > 1, "split operand")
    d = b.d.choice([i for i, s in enumerate(a.shape) if s > 1])
    n = a.shape[d]
    kind = b.d.choice(("chunk", "split", "unbind", "split_sizes"))
    if kind == "chunk":
        k = b.d.integer(2, min(n, 4))
        pieces = len(a.t.chunk(k, d))
        b.emit(f"{a.name}.chunk({k}, dim={d})[{b.d.integer(0, pieces - 1)}]", exact=a.exact)
    elif kind == "split":
        s = b.d.integer(1, n - 1)
        pieces = -(-n // s)
        b.emit(f"torch.split({a.name}, {s}, dim={d})[{b.d.integer(0, pieces - 1)}]", exact=a.exact)
    elif kind == "split_sizes":
        first = b.d.integer(1, n - 1)
        b.emit(f"{a.name}.split([{first}, {n - first}], {d})[{b.d.integer(0, 1)}]", exact=a.exact)
    else:
        b.emit(f"{a.name}.unbind({d})[{b.d.integer(0, n - 1)}]", exact=a.exact)


# ------------------------------------------------------------------ selection and casts


def op_where(b: Builder) -> None:
    a = b.pick_float()
    mshape = tuple(1 if b.d.boolean(0.3) else s for s in a.shape)
    m = b.new_input(mshape, a.dtype if b.d.boolean() else b.d.choice(list(DTYPE_NAMES)[:4]))
    kind = b.d.choice(("where", "masked_fill", "where_scalar", "causal"))
    if kind == "where":
        c = _broadcast_partner(b, a)
        b.emit(f"torch.where({m} > 0.3, {a.name}, {c})")
    elif kind == "masked_fill":
        b.emit(f"{a.name}.masked_fill({m} < 0, {b.d.choice(('-1.0', '0.0', '-10000.0'))})")
    elif kind == "where_scalar":
        b.emit(f"torch.where({m} > 0, {a.name}, 0.0)")
    else:
        if a.rank < 2:
            raise Reject("causal needs rank 2")
        s1, s2 = a.shape[-2:]
        mask = f"torch.ones({s1}, {s2}, dtype=torch.bool).tril()"
        # -inf only inside the softmax: every row keeps its diagonal, so no row is all -inf.
        b.emit(f"torch.softmax({a.name}.masked_fill(~{mask}, float('-inf')), dim=-1)")


def op_cast(b: Builder) -> None:
    a = b.pick(lambda v: v.is_float or v.dtype.is_floating_point is False, "cast operand")
    target = b.d.choice([f for f in FLOATS if f != dn(a)])
    kind = b.d.choice(("to", "type_as"))
    if kind == "type_as":
        c = b.pick(lambda v: v.is_float and v.dtype != a.dtype, "type_as partner")
        b.emit(f"{a.name}.type_as({c.name})", exact=a.exact and not a.is_float)
    else:
        b.emit(f"{a.name}.to({target})", exact=False)


def op_constraint(b: Builder) -> None:
    """``spmd.with_sharding_constraint`` on an intermediate (the spec is drawn by the case generator)."""
    a = b.pick(lambda v: not v.name.startswith("x"), "constraint operand")
    b.emit(f"spmd.with_sharding_constraint({a.name}, {spec_text(b.random_spec(a.shape))})", exact=a.exact)


def op_sdpa(b: Builder) -> None:
    a = b.pick_float(min_rank=3, max_rank=4)
    lines_q = a.name
    if a.rank == 3:
        bsz, s, h = a.shape
        heads = b.d.choice([k for k in divisors(h) if k < h] or [1])
        q = b.emit(f"{a.name}.view({bsz}, {s}, {heads}, {h // heads}).transpose(1, 2)")
        lines_q = q.name
        shape = q.shape
    else:
        shape = a.shape
    bh, s, dh = shape[:-2], shape[-2], shape[-1]
    s2 = s if b.d.boolean(0.6) else b.d.choice((2, 4, 5))
    k = b.new_input((*bh, s2, dh), a.dtype)
    v = b.new_input((*bh, s2, b.d.choice((dh, 4))), a.dtype)
    manual = b.d.boolean(0.4)
    causal = s == s2 and b.d.boolean()
    if manual:
        sc = b.emit(f"({lines_q} @ {k}.transpose(-1, -2)) * {dh ** -0.5!r}")
        if causal:
            p = b.emit(f"torch.softmax({sc.name}.masked_fill(~torch.ones({s}, {s2}, dtype=torch.bool).tril(), "
                       f"float('-inf')), dim=-1)")
        else:
            p = b.emit(f"torch.softmax({sc.name}, dim=-1)")
        o = b.emit(f"{p.name} @ {v}")
    else:
        extra = f", scale={b.d.choice((0.5, 0.25))}" if b.d.boolean(0.3) else ""
        if not causal and b.d.boolean(0.3):  # an additive float mask (no row fully masked)
            extra += f", attn_mask={b.new_input((s, s2), a.dtype)}"
        o = b.emit(f"F.scaled_dot_product_attention({lines_q}, {k}, {v}, is_causal={causal}{extra})")
    if a.rank == 3 and b.d.boolean(0.7):
        b.emit(f"{o.name}.transpose(1, 2).reshape({a.shape[0]}, {s}, {o.shape[1] * o.shape[-1]})")


def op_embedding(b: Builder) -> None:
    kind = b.d.choice(("embedding", "index_table", "index_dim"))
    if kind == "index_dim":
        a = b.pick(lambda v: v.rank >= 2, "indexed operand")
        idx = b.new_input((b.d.choice((3, 2, 5)),), torch.int64, high=a.shape[1])
        b.emit(f"{a.name}[:, {idx}]")
        return
    if b.d.boolean(0.6):
        vocab, dim = b.d.choice((8, 16, 5)), b.d.choice((4, 8, 6))
        dtype = b.d.choice(list(DTYPE_NAMES)[:4])
        table = b.new_input((vocab, dim), dtype)
    else:
        t = b.pick(lambda v: v.rank == 2 and v.is_float, "embedding table")
        table, vocab = t.name, t.shape[0]
    idx = b.new_input(b.random_shape(b.d.choice((1, 2))), torch.int64, high=vocab)
    b.emit(f"F.embedding({idx}, {table})" if kind == "embedding" else f"{table}[{idx}]")


CORE_OPS = (
    ("matmul", op_matmul, 5), ("unary", op_unary, 4), ("binary", op_binary, 4), ("reduce", op_reduce, 3),
    ("softmax", op_softmax, 2), ("norm", op_norm, 2), ("reshape", op_reshape, 2), ("transpose", op_transpose, 2),
    ("squeeze", op_squeeze, 1), ("expand", op_expand, 1), ("slice", op_slice, 2), ("cat", op_cat, 2),
    ("split", op_split, 2), ("where", op_where, 2), ("cast", op_cast, 2), ("constraint", op_constraint, 2),
    ("sdpa", op_sdpa, 1), ("embedding", op_embedding, 1),
)
