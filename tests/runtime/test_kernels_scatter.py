"""gather / scatter kernels: against PyTorch references, XLA's out-of-range rules (a gather clamps,
a scatter drops the update), the operand never written, results written into ``out``."""

import pytest
import torch

from spmd.ir.hlo import Computation, Instruction, Shape
from spmd.ir.shape_inference import infer_shape
from spmd.runtime.kernels import run_kernel

F64 = torch.float64
ROWS = {"update_window_dims": (1, 2), "inserted_window_dims": (1,), "scatter_dims_to_operand_dims": (1,),
        "index_vector_dim": 1}
ALONG = {"update_window_dims": (), "inserted_window_dims": (1,), "scatter_dims_to_operand_dims": (1,),
         "index_vector_dim": 2, "input_batching_dims": (0,), "scatter_indices_batching_dims": (0,)}
TORCH = {"add": "sum", "maximum": "amax", "minimum": "amin", "multiply": "prod"}


def _comp(kind: str) -> Computation:
    x = Instruction("x", "parameter", Shape("f64"), (), {"parameter_number": 0})
    y = Instruction("y", "parameter", Shape("f64"), (), {"parameter_number": 1})
    if kind == "replace":
        return Computation("c", [x, y], y)
    root = Instruction("r", kind, Shape("f64"), (x, y))
    return Computation("c", [x, y, root], root)


def _inst(opcode, tensors, attrs):
    ops = [Instruction(f"p{i}", "parameter", Shape.of(t), (), {"parameter_number": i}) for i, t in enumerate(tensors)]
    return Instruction("k", opcode, infer_shape(opcode, [o.shape for o in ops], attrs), ops, attrs)


def _rows_reference(x, i, u, kind):
    """x [3, n, 4], i [k], u [k, 3, 4]: combine u[j] into x[:, i[j]] for i[j] in range, one at a time."""
    r = x.clone()
    for j, row in enumerate(i.tolist()):
        if 0 <= row < x.shape[1]:
            old, new = r[:, row], u[j]
            r[:, row] = {"add": old + new, "maximum": torch.maximum(old, new), "minimum": torch.minimum(old, new),
                         "multiply": old * new, "replace": new}[kind]
    return r


@pytest.mark.parametrize("kind", ["add", "maximum", "minimum", "multiply", "replace"])
def test_rows_scatter_drops_out_of_range_rows(kind):
    x, u = torch.randn(3, 6, 4, dtype=F64), torch.randn(5, 3, 4, dtype=F64)
    i = torch.tensor([4, -1, 1, 6, 4] if kind != "replace" else [4, -1, 1, 6, 2])
    inst = _inst("scatter", [x, i, u], {**ROWS, "to_apply": _comp(kind)})
    before = x.clone()
    got = run_kernel(inst, [x, i, u])
    torch.testing.assert_close(got, _rows_reference(x, i, u, kind))
    torch.testing.assert_close(x, before)  # the operand is never written


@pytest.mark.parametrize("kind", ["add", "maximum", "minimum", "multiply", "replace"])
def test_along_scatter_matches_torch_and_drops_out_of_range(kind):
    x, u = torch.randn(4, 9, dtype=F64), torch.randn(4, 5, dtype=F64)
    i = torch.stack([torch.randperm(9)[:5] for _ in range(4)])
    i[0, 0], i[1, 1] = -3, 9  # dropped
    inst = _inst("scatter", [x, i, u], {**ALONG, "to_apply": _comp(kind)})
    keep = (i >= 0) & (i < 9)
    ref = x.clone()
    for b in range(4):
        ii, uu = i[b][keep[b]], u[b][keep[b]]
        if kind == "replace":
            ref[b].scatter_(0, ii, uu)
        else:
            ref[b].scatter_reduce_(0, ii, uu, TORCH[kind])
    torch.testing.assert_close(run_kernel(inst, [x, i, u]), ref)


def test_scatter_writes_into_out_and_in_place():
    x, u, i = torch.randn(3, 6, 4, dtype=F64), torch.randn(2, 3, 4, dtype=F64), torch.tensor([5, 0])
    inst = _inst("scatter", [x, i, u], {**ROWS, "to_apply": _comp("add")})
    want = _rows_reference(x, i, u, "add")
    out = torch.empty_like(x)
    assert run_kernel(inst, [x, i, u], out) is out
    torch.testing.assert_close(out, want)
    y = x.clone()
    assert run_kernel(inst, [y, i, u], y) is y  # operand and out the same buffer: updated in place
    torch.testing.assert_close(y, want)


def test_along_gather_clamps_and_permuted_batching_dims():
    x = torch.randn(4, 9, dtype=F64)
    i = torch.randint(-3, 12, (4, 5))
    attrs = {"offset_dims": (), "collapsed_slice_dims": (1,), "start_index_map": (1,), "index_vector_dim": 2,
             "slice_sizes": (1, 1), "operand_batching_dims": (0,), "start_indices_batching_dims": (0,)}
    got = run_kernel(_inst("gather", [x, i], attrs), [x, i])
    torch.testing.assert_close(got, torch.gather(x, 1, i.clamp(0, 8)))
    it = i.t().contiguous()  # indices [5, 4]: the batching dim is indices dim 1
    attrs = {**attrs, "start_indices_batching_dims": (1,)}
    got = run_kernel(_inst("gather", [x, it], attrs), [x, it])
    torch.testing.assert_close(got, torch.gather(x, 1, i.clamp(0, 8)).t())


def test_unsupported_form_is_not_implemented():
    x, i, u = torch.randn(3, 6, 4, dtype=F64), torch.tensor([1, 2]), torch.randn(2, 3, 2, dtype=F64)
    inst = _inst("scatter", [x, i, u], {**ROWS, "to_apply": _comp("add")})  # partial windows
    with pytest.raises(NotImplementedError, match="rows and along forms"):
        run_kernel(inst, [x, i, u])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["add", "maximum", "replace"])
def test_kernels_on_cuda_match_cpu(kind):
    x, u = torch.randn(3, 6, 4, dtype=F64), torch.randn(5, 3, 4, dtype=F64)
    i = torch.tensor([4, -1, 1, 6, 2])
    inst = _inst("scatter", [x, i, u], {**ROWS, "to_apply": _comp(kind)})
    cuda = [t.cuda() for t in (x, i, u)]
    torch.testing.assert_close(run_kernel(inst, cuda).cpu(), run_kernel(inst, [x, i, u]))
    xa, ia = torch.randn(4, 9, dtype=F64), torch.randint(-2, 11, (4, 5))
    attrs = {"offset_dims": (), "collapsed_slice_dims": (1,), "start_index_map": (1,), "index_vector_dim": 2,
             "slice_sizes": (1, 1), "operand_batching_dims": (0,), "start_indices_batching_dims": (0,)}
    g = _inst("gather", [xa, ia], attrs)
    torch.testing.assert_close(run_kernel(g, [xa.cuda(), ia.cuda()]).cpu(), run_kernel(g, [xa, ia]))
