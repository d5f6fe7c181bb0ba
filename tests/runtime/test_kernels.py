"""Runtime kernels against direct PyTorch on fresh random inputs."""

import math

import pytest
import torch
import torch.nn.functional as F

from spmd.ir.hlo import Computation, Instruction, Shape
from spmd.runtime.kernels import compile_kernel, run_kernel

torch.manual_seed(0)


def param(t: torch.Tensor, i: int = 0) -> Instruction:
    return Instruction(f"p{i}", "parameter", Shape.of(t), attrs={"parameter_number": i})


def const(t: torch.Tensor, name: str = "c") -> Instruction:
    return Instruction(name, "constant", Shape.of(t), attrs={"literal": t})


def inst(opcode, shape, operands, **attrs) -> Instruction:
    return Instruction("r", opcode, shape, operands, attrs)


def run_both(i: Instruction, ops: list[torch.Tensor]) -> torch.Tensor:
    """Run without and with ``out`` and check both agree; returns the first."""
    r = run_kernel(i, ops)
    out = torch.empty(i.shape.dims, dtype=i.shape.torch_dtype)
    r2 = compile_kernel(i)(ops, out)
    assert r2 is out
    torch.testing.assert_close(r2, r, rtol=0, atol=0)
    return r


def f32(*dims):
    return torch.randn(*dims)


@pytest.mark.parametrize("op,fn", [
    ("exponential", torch.exp), ("negate", torch.neg), ("tanh", torch.tanh),
    ("logistic", torch.sigmoid), ("rsqrt", lambda x: torch.rsqrt(x.abs())), ("erf", torch.erf),
])
def test_unary(op, fn):
    x = f32(3, 5)
    if op == "rsqrt":
        x = x.abs()
    r = run_both(inst(op, Shape.of(x), [param(x)]), [x])
    torch.testing.assert_close(r, fn(x))


@pytest.mark.parametrize("op,fn", [
    ("add", torch.add), ("subtract", torch.sub), ("multiply", torch.mul), ("divide", torch.div),
    ("maximum", torch.maximum), ("minimum", torch.minimum),
])
def test_binary(op, fn):
    a, b = f32(4, 6), f32(4, 6)
    r = run_both(inst(op, Shape.of(a), [param(a), param(b, 1)]), [a, b])
    torch.testing.assert_close(r, fn(a, b))


def test_integer_divide_truncates_and_u32_arithmetic():
    a = torch.tensor([7, -7, 9], dtype=torch.int32)
    b = torch.tensor([2, 2, -4], dtype=torch.int32)
    r = run_both(inst("divide", Shape.of(a), [param(a), param(b, 1)]), [a, b])
    assert r.tolist() == [3, -3, -2]
    u = torch.tensor(3, dtype=torch.uint32)
    v = torch.tensor(5, dtype=torch.uint32)
    assert int(run_kernel(inst("add", Shape("u32"), [param(u), param(v, 1)]), [u, v])) == 8


def test_compare_select_clamp_convert():
    a, b = f32(5, 3), f32(5, 3)
    for d, fn in [("LT", torch.lt), ("GE", torch.ge), ("EQ", torch.eq)]:
        r = run_both(inst("compare", Shape("pred", (5, 3)), [param(a), param(b, 1)], direction=d), [a, b])
        assert torch.equal(r, fn(a, b))
    p = a > b
    r = run_both(inst("select", Shape.of(a), [param(p), param(a, 1), param(b, 2)]), [p, a, b])
    assert torch.equal(r, torch.where(p, a, b))
    lo, hi = torch.tensor(-0.5), torch.tensor(0.5)
    r = run_both(inst("clamp", Shape.of(a), [param(lo), param(a, 1), param(hi, 2)]), [lo, a, hi])
    assert torch.equal(r, a.clamp(-0.5, 0.5))
    r = run_both(inst("convert", Shape("bf16", (5, 3)), [param(a)]), [a])
    assert r.dtype == torch.bfloat16 and torch.equal(r, a.bfloat16())


def test_constant_iota_broadcast():
    lit = f32(2, 3)
    r = run_both(Instruction("c", "constant", Shape.of(lit), attrs={"literal": lit}), [])
    assert torch.equal(r, lit)
    r = run_both(inst("iota", Shape("s32", (3, 4)), [], iota_dimension=1), [])
    assert torch.equal(r, torch.arange(4, dtype=torch.int32).expand(3, 4))
    x = f32(3)
    r = run_both(inst("broadcast", Shape("f32", (2, 3, 4)), [param(x)], dimensions=(1,)), [x])
    assert torch.equal(r, x[None, :, None].expand(2, 3, 4))
    y = f32(3, 4)
    r = run_both(inst("broadcast", Shape("f32", (4, 2, 3)), [param(y)], dimensions=(2, 0)), [y])
    assert torch.equal(r, y.t()[:, None, :].expand(4, 2, 3))


def test_reshape_transpose_slice_concat():
    x = f32(4, 6)
    assert torch.equal(run_both(inst("reshape", Shape("f32", (2, 12)), [param(x)]), [x]), x.reshape(2, 12))
    r = run_both(inst("transpose", Shape("f32", (6, 4)), [param(x)], dimensions=(1, 0)), [x])
    assert torch.equal(r, x.t()) and r.is_contiguous()
    r = run_both(inst("slice", Shape("f32", (2, 2)), [param(x)], slice=((1, 3, 1), (0, 6, 3))), [x])
    assert torch.equal(r, x[1:3, 0:6:3])
    y = f32(4, 2)
    r = run_both(inst("concatenate", Shape("f32", (4, 8)), [param(x), param(y, 1)], dimensions=(1,)), [x, y])
    assert torch.equal(r, torch.cat([x, y], 1))


def test_pad_positive_negative_and_interior_raises():
    x, v = f32(3, 4), torch.tensor(2.5)
    r = run_both(inst("pad", Shape("f32", (6, 3)), [param(x), param(v, 1)], padding=((1, 2, 0), (0, -1, 0))), [x, v])
    assert torch.equal(r, F.pad(x, (0, -1, 1, 2), value=2.5))
    with pytest.raises(NotImplementedError, match="interior"):
        compile_kernel(inst("pad", Shape("f32", (5, 4)), [param(x), param(v, 1)], padding=((0, 0, 1), (0, 0, 0))))


DOT_CASES = [
    # lhs dims, rhs dims, lb, rb, lc, rc, einsum
    ((8, 16), (16, 32), (), (), (1,), (0,), "mk,kn->mn"),
    ((8, 16), (32, 16), (), (), (1,), (1,), "mk,nk->mn"),
    ((16, 8), (16, 32), (), (), (0,), (0,), "km,kn->mn"),
    ((2, 5, 16), (16, 32), (), (), (2,), (0,), "bsk,kn->bsn"),
    ((2, 5, 16), (32, 16), (), (), (2,), (1,), "bsk,nk->bsn"),
    ((2, 3, 5, 8), (2, 3, 7, 8), (0, 1), (0, 1), (3,), (3,), "bhsd,bhtd->bhst"),
    ((2, 3, 5, 7), (2, 3, 7, 8), (0, 1), (0, 1), (3,), (2,), "bhst,bhtd->bhsd"),
    ((5, 2, 3, 4), (3, 4, 6), (), (), (2, 3), (0, 1), "abcd,cde->abe"),
    ((5, 4, 2), (2, 4, 6), (2,), (0,), (1,), (1,), "xkb,bky->bxy"),
]


@pytest.mark.parametrize("ld,rd,lb,rb,lc,rc,eq", DOT_CASES)
def test_dot_general(ld, rd, lb, rb, lc, rc, eq):
    a, b = f32(*ld), f32(*rd)
    want = torch.einsum(eq, a, b)
    i = inst("dot", Shape("f32", tuple(want.shape)), [param(a), param(b, 1)],
             lhs_batch_dims=lb, rhs_batch_dims=rb, lhs_contracting_dims=lc, rhs_contracting_dims=rc)
    r = run_kernel(i, [a, b])
    torch.testing.assert_close(r, want, rtol=1e-5, atol=1e-5)
    out = torch.full(want.shape, math.nan)
    compile_kernel(i)([a, b], out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_dot_bf16_to_f32_result():
    a, b = f32(4, 8).bfloat16(), f32(8, 3).bfloat16()
    i = inst("dot", Shape("f32", (4, 3)), [param(a), param(b, 1)], lhs_contracting_dims=(1,), rhs_contracting_dims=(0,))
    r = run_both(i, [a, b])
    assert r.dtype == torch.float32  # accumulated in float32, not rounded to bf16 first
    torch.testing.assert_close(r, a.float() @ b.float())


def _scalar_comp(opcode: str) -> Computation:
    x = Instruction("x", "parameter", Shape("f32"), attrs={"parameter_number": 0})
    y = Instruction("y", "parameter", Shape("f32"), attrs={"parameter_number": 1})
    root = Instruction("r", opcode, Shape("f32"), [x, y])
    return Computation(opcode, [x, y, root], root)


@pytest.mark.parametrize("kind,init,fn", [
    ("add", 0.0, lambda x: x.sum((0, 2))),
    ("add", 1.5, lambda x: x.sum((0, 2)) + 1.5),
    ("maximum", -math.inf, lambda x: x.amax((0, 2))),
    ("maximum", 0.25, lambda x: x.amax((0, 2)).clamp(min=0.25)),
    ("minimum", math.inf, lambda x: x.amin((0, 2))),
])
def test_reduce(kind, init, fn):
    x = f32(3, 4, 5)
    init_t = torch.tensor(init)
    i = inst("reduce", Shape("f32", (4,)), [param(x), const(init_t)], dimensions=(0, 2), to_apply=_scalar_comp(kind))
    r = run_both(i, [x, init_t])
    torch.testing.assert_close(r, fn(x))
    # a non-constant init operand is always combined
    i2 = inst("reduce", Shape("f32", (4,)), [param(x), param(init_t, 1)], dimensions=(0, 2),
              to_apply=_scalar_comp(kind))
    torch.testing.assert_close(run_kernel(i2, [x, init_t]), fn(x))


def test_gather_embedding_and_clamp():
    table = f32(10, 4)
    ids = torch.tensor([[1, 9], [0, 12]])
    i = inst("gather", Shape("f32", (2, 2, 4)), [param(table), param(ids, 1)], offset_dims=(2,),
             collapsed_slice_dims=(0,), start_index_map=(0,), index_vector_dim=2, slice_sizes=(1, 4))
    r = run_both(i, [table, ids])
    assert torch.equal(r, F.embedding(ids.clamp(max=9), table))
    # gather columns: operand [4, 10] indexed along dim 1, batch dims first
    t2 = f32(4, 10)
    i2 = inst("gather", Shape("f32", (2, 2, 4)), [param(t2), param(ids, 1)], offset_dims=(2,),
              collapsed_slice_dims=(1,), start_index_map=(1,), index_vector_dim=2, slice_sizes=(4, 1))
    assert torch.equal(run_kernel(i2, [t2, ids]), t2[:, ids.clamp(max=9)].permute(1, 2, 0))


def test_gather_writes_rows_into_the_assigned_buffer():
    """An embedding gather with a buffer runs one index_select into it (no copy of its result);
    a permuted result or a strided buffer still gets the right values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    table, ids = f32(10, 4), torch.tensor([[3, -2], [9, 11]])
    i = inst("gather", Shape("f32", (2, 2, 4)), [param(table), param(ids, 1)], offset_dims=(2,),
             collapsed_slice_dims=(0,), start_index_map=(0,), index_vector_dim=2, slice_sizes=(1, 4))
    kernel, out = compile_kernel(i), torch.empty(2, 2, 4)
    with Ops() as mode:
        assert kernel([table, ids], out) is out
    assert not any(n.startswith("copy") for n in mode.names), mode.names
    assert torch.equal(out, F.embedding(ids.clamp(0, 9), table))
    strided = torch.empty(2, 4, 2).transpose(1, 2)
    assert torch.equal(kernel([table, ids], strided), F.embedding(ids.clamp(0, 9), table))


def test_dynamic_slice_and_update_slice_clamp():
    x, upd = f32(6, 8), f32(2, 3)
    s0, s1 = torch.tensor(5), torch.tensor(1)  # row start 5 clamps to 4
    i = inst("dynamic-slice", Shape("f32", (2, 3)), [param(x), param(s0, 1), param(s1, 2)], dynamic_slice_sizes=(2, 3))
    assert torch.equal(run_both(i, [x, s0, s1]), x[4:6, 1:4])
    i = inst("dynamic-update-slice", Shape.of(x), [param(x), param(upd, 1), param(s0, 2), param(s1, 3)])
    want = x.clone()
    want[4:6, 1:4] = upd
    x_before = x.clone()
    assert torch.equal(run_both(i, [x, upd, s0, s1]), want)
    assert torch.equal(x, x_before)
    # in place when out aliases the operand
    buf = x.clone()
    compile_kernel(i)([buf, upd, s0, s1], buf)
    assert torch.equal(buf, want)


def test_custom_call_and_tuple():
    x = f32(3, 7)
    i = inst("custom-call", Shape.of(x), [param(x)], custom_call_target="softmax", backend_config={"dim": -1})
    torch.testing.assert_close(run_both(i, [x]), torch.softmax(x, -1))
    t = run_kernel(inst("tuple", Shape.tuple([Shape.of(x), Shape.of(x)]), [param(x), param(x, 1)]), [x, x * 2])
    g = Instruction("g", "get-tuple-element", Shape.of(x), [param(x)], {"index": 1})
    assert torch.equal(run_kernel(g, [t]), x * 2)


def test_not_a_kernel():
    with pytest.raises(ValueError, match="not run by a kernel"):
        compile_kernel(Instruction("pid", "partition-id", Shape("u32")))


@pytest.mark.parametrize("kind,init,dtype,fill", [
    ("maximum", -math.inf, torch.float32, -math.inf), ("minimum", math.inf, torch.float32, math.inf),
    ("maximum", -math.inf, torch.int32, torch.iinfo(torch.int32).min), ("add", 0.0, torch.float32, 0.0),
    ("maximum", 0.5, torch.float32, 0.5),
])
def test_reduce_over_a_zero_size_dim_is_the_init_value(kind, init, dtype, fill):
    """A reduction over no elements is its init value (XLA's reduce); torch.amax / amin raise
    IndexError on a zero-size dim, which reached users through a variance's max shift."""
    x = torch.empty(3, 0, 2, dtype=dtype)
    v = torch.tensor(init).to(dtype) if dtype.is_floating_point else torch.tensor(fill, dtype=dtype)
    out_shape = Shape.of(torch.empty(3, 2, dtype=dtype))
    for init_op in (const(v), param(v, 1)):  # an identity init is skipped, any other one combined
        r = run_both(inst("reduce", out_shape, [param(x), init_op], dimensions=(1,), to_apply=_scalar_comp(kind)),
                     [x, v])
        assert torch.equal(r, torch.full((3, 2), fill, dtype=dtype))
