"""Peephole fusion of the lowering: a matrix product and the elementwise op that is its only reader.

``%p = dot(%a, %b)`` (or fusion (b) of ``spmd.runtime.fusions``: ``add(dot(%a, %b), %c)`` as one
addmm) whose result is read by exactly one op ``%g`` on the same stream, where ``%g`` is

- a custom call ``gelu`` (erf or tanh form) or ``silu`` of ``%p``,
- an elementwise instruction (``ELEMENTWISE_OPCODES``) with ``%p`` as an operand of its dims
  (``maximum(%p, 0)``: ReLU), or
- a ``fusion`` (``spmd.passes.fuse_elementwise``) whose body is elementwise in ``%p``: every
  instruction is elementwise (``ELEMENTWISE_OPCODES``, ``gelu`` / ``silu``) of the root's dims,
  or a ``broadcast`` of another operand (a bias row added inside the fusion, as float32 programs
  fuse ``gelu(x @ w.T + b)``), and the root is one array,

becomes one op on ``%g``'s instruction: ``g(p(a, b[, c]), others...)``. This is the epilogue
fusion of cuBLASLt and of Inductor's and XLA's GEMM emitters (the activation applied to the
accumulator tile before it is stored), decided per shape at run time by
``spmd.runtime.kernels_epilogue``: op by op (exactly the two kernels the pair ran: the product
rounded to its dtype, then the elementwise op) or one generated GEMM with the op in its epilogue.

The fused op has no arena buffer (as the unfused custom call / fusion it replaces: its result is
fresh memory), and the product's buffer is no longer written.
"""

from __future__ import annotations

from collections.abc import Callable

from spmd.ir.hlo import ELEMENTWISE_OPCODES, Computation
from spmd.runtime import fusions, kernels_epilogue, kernels_gemv

#: custom calls that are elementwise in their one operand (``spmd.ir.custom_calls``)
ACTIVATIONS = frozenset({"gelu", "silu"})


def fuse_epilogues(ops: list, blocked: set[int]) -> None:
    """Fuse every (product, elementwise reader) pair of ``ops`` (a list of ``lower.Op``) in place.

    ``blocked``: slots whose value must stay materialised (program outputs, operands of views).
    Runs after ``fusions.fuse`` (it takes the addmm of fusion (b) as a product).
    """
    readers, producer = fusions.use_def(ops)
    removed: set[int] = set()
    for k, op in enumerate(ops):
        if op.fn is not None or "spec" in op.extra or op.alias_of >= 0:
            continue
        for pos in _epilogue_positions(op.inst):
            d = _product(ops, producer, readers, blocked, op.ins[pos], op.stream, k) if pos < len(op.ins) else None
            if d is not None and d not in removed and fusions.only_views_between(ops, d, k, removed):
                _fuse(ops[d], op, pos)
                removed.add(d)
                break
    if removed:
        ops[:] = [op for k, op in enumerate(ops) if k not in removed]


def _epilogue_positions(inst) -> list[int]:
    """Operand numbers of ``inst`` that it reads element for element at its result's index (a
    product there may be fused into it); empty when ``inst`` is no elementwise epilogue."""
    if inst.shape.is_tuple:
        return []
    if inst.opcode == "custom-call":
        ok = inst.attrs.get("custom_call_target") in ACTIVATIONS and len(inst.operands) == 1
        return [0] if ok else []
    if inst.opcode in ELEMENTWISE_OPCODES:
        return [i for i, o in enumerate(inst.operands) if o.shape.dims == inst.shape.dims]
    if inst.opcode != "fusion":
        return []
    body: Computation = inst.attrs["calls"]
    if body.root.shape.is_tuple or not _pointwise_body(body):
        return []
    return [p.attrs["parameter_number"] for p in body.parameters if p.shape.dims == body.root.shape.dims]


def _pointwise_body(body: Computation) -> bool:
    """Every instruction elementwise at the root's dims, or a parameter, a constant or a broadcast of one."""
    dims = body.root.shape.dims
    for inst in body.instructions:
        if inst.opcode in ("parameter", "constant"):
            continue
        if inst.opcode == "broadcast":
            if inst.operands[0].opcode not in ("parameter", "constant") or inst.shape.dims != dims:
                return False
            continue
        call = inst.opcode == "custom-call" and inst.attrs.get("custom_call_target") in ACTIVATIONS
        if not (inst.opcode in ELEMENTWISE_OPCODES or call) or inst.shape.dims != dims:
            return False
    return True


def _product(ops, producer, readers, blocked, slot: int, stream: int, k: int) -> int | None:
    """Index of the unbatched 2-d-weight product (dot or fusion (b)'s addmm) of more than
    ``kernels_gemv.MAX_ROWS`` rows producing ``slot`` when ``ops[k]`` is its only reader, on the
    same stream, and the value is not blocked."""
    d = producer.get(slot)
    if d is None or slot in blocked or readers.get(slot) != [k]:
        return None
    op = ops[d]
    if op.stream != stream or op.alias_of >= 0 or "spec" in op.extra:
        return None
    dims = op.inst.shape.dims
    if dims and dims[-1] and op.inst.shape.numel // dims[-1] <= kernels_gemv.MAX_ROWS:
        return None  # a skinny product: its own kernel choice (kernels_gemv / kernels_prologue)
    if "mm" in op.extra:
        return None if op.extra["mm"][0] else d
    if op.inst.opcode != "dot" or op.fn is not None:
        return None
    layout = fusions._mm_layout(op.inst)
    lhs, rhs = op.inst.operands
    if layout is None or layout[0] or not (op.inst.shape.dtype == lhs.shape.dtype == rhs.shape.dtype):
        return None
    return d


def _fuse(prod, op, pos: int) -> None:
    from spmd.runtime.kernels import compile_kernel

    prod_fn = prod.fn if prod.fn is not None else compile_kernel(prod.inst)
    inst = op.inst
    if inst.opcode == "fusion":
        from spmd.runtime import kernels_fusion as kf

        epi_key = ("fusion", kf.structure_key(inst.attrs["calls"]), pos)
        body = inst.attrs["calls"]
        act_fn = compile_kernel(inst)
        traced_act = _interpreted(body)
    else:
        attrs = tuple(sorted((k, str(v)) for k, v in inst.attrs.items()))
        epi_key = (inst.opcode, attrs, pos, tuple(str(o.shape) for o in inst.operands))
        act_fn = traced_act = compile_kernel(inst)
    prod_key = (("mm", tuple(prod.extra["mm"])) if "mm" in prod.extra
                else ("dot", tuple(prod.inst.attrs["rhs_contracting_dims"]), str(prod.inst.shape)))
    n_prod = len(prod.ins)
    work = prod.extra["work"] if "work" in prod.extra else fusions.dot_work(prod.inst)
    op.fn = kernels_epilogue.make_kernel(
        _pair(prod_fn, act_fn, pos, n_prod), _pair(prod_fn, traced_act, pos, n_prod), key=(prod_key, epi_key),
        flops=2 * work, product_dtype=prod.inst.shape.torch_dtype, name=f"{prod.inst.name}+{inst.name}")
    op.ins = [*prod.ins, *(s for i, s in enumerate(op.ins) if i != pos)]
    op.buffer_name = None  # fresh memory, as the custom call / fusion it replaces
    op.extra["work"] = work
    op.extra["epilogue"] = (prod.inst.name, n_prod, pos)


def _interpreted(body: Computation) -> Callable:
    """``(operands, out) -> Tensor``: ``body`` op by op with the unfused kernels (traceable by make_fx)."""
    from spmd.runtime import kernels_fusion as kf

    runs: dict[str, Callable] = {}

    def kernel(ops, out):
        key = str(ops[0].device)
        if key not in runs:
            runs[key] = kf.interpreter(body, ops[0].device)
        r = runs[key](*ops)
        return r if out is None else out.copy_(r)
    return kernel


def _pair(prod_fn: Callable, act_fn: Callable, pos: int, n_prod: int) -> Callable:
    """``(ops, out) -> Tensor``: ``act_fn`` of the product ``prod_fn(ops[:n_prod])`` placed at operand
    ``pos`` among the other operands ``ops[n_prod:]`` (the two kernels the unfused ops ran)."""
    def pair(ops, out):
        args = list(ops[n_prod:])
        args.insert(pos, prod_fn(ops[:n_prod], None))
        return act_fn(args, out)
    return pair
