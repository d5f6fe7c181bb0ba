"""Fusion (d) of the lowering: a skinny 16-bit product takes over the fusion that computes its input.

``%x = fusion(...)`` (an RMS norm or a SwiGLU, ``spmd.runtime.prologue_match``) whose only reader
is the lhs of

- a ``dot`` ``x[..., K] @ w[N, K].T`` (or ``@ w[K, N]``) of at most ``kernels_gemv.MAX_ROWS`` rows, or
- the accumulating addmm that ``spmd.runtime.fusions`` made of ``c + dot(x, w)`` (fusion (b)),

becomes one op reading the fusion's operands, where nothing but views runs between the two (the
bytes of the fusion's operands cannot have been reused in between):
``kernels_prologue.make_prologue_product`` runs the Triton kernel with the prologue where it was
timed faster, and the fusion's kernel then the product otherwise (the same kernels as before, so
CPU programs compute exactly what they did). A decode step of a Llama layer can lose three kernels
(two RMS norms, SwiGLU) and the round trips of their results. The norm's per-row scale is applied
after the product, as FlashNorm (Graef, Wasielewski, Clapp, 2024, arXiv:2407.09577) defers it.
Runs after ``spmd.runtime.fusions.fuse`` on the same ``Op`` list.
"""

from __future__ import annotations

from spmd.runtime import kernels_gemv
from spmd.runtime.fusions import _mm_layout as mm_layout
from spmd.runtime.fusions import only_views_between, use_def
from spmd.runtime.prologue_match import match_prologue

_HALF = ("bf16", "f16")


def fuse_prologues(ops: list, outputs: set[int], view_sources: set[int] | frozenset[int] = frozenset()) -> None:
    """Apply fusion (d) to ``ops`` (a list of ``lower.Op``) in place.

    ``outputs``: slots that must stay materialised (program outputs); ``view_sources``: slots a
    view op reads. A fusion writing either is left alone.
    """
    from spmd.runtime.kernels import compile_kernel
    from spmd.runtime.kernels_prologue import make_prologue_product

    readers, producer = use_def(ops)
    removed: set[int] = set()
    for k, op in enumerate(ops):
        site = _product_site(op)
        if site is None:
            continue
        pos, accumulate, transposed = site
        slot = op.ins[pos]
        f = producer.get(slot)
        if f is None or f in removed or slot in outputs or slot in view_sources or readers.get(slot) != [k]:
            continue
        if not only_views_between(ops, f, k, removed):
            continue  # the fusion's operands are read at ``op`` now: nothing may reuse their bytes before
        fusion = ops[f]
        if fusion.fn is not None or fusion.alias_of >= 0 or fusion.stream != op.stream or fusion.extra:
            continue
        pro = match_prologue(fusion.inst)
        if pro is None:
            continue
        product_fn = op.fn if accumulate else compile_kernel(op.inst)
        op.fn = make_prologue_product(pro, compile_kernel(fusion.inst), product_fn, len(fusion.ins), accumulate,
                                      transposed, fusion.inst.attrs["calls"])
        rhs = op.ins[pos + 1]
        op.ins = [op.ins[0], *fusion.ins, rhs] if accumulate else [*fusion.ins, rhs]
        op.extra["prologue"] = pro.kind
        removed.add(f)
    ops[:] = [op for k, op in enumerate(ops) if k not in removed]


def _product_site(op) -> tuple[int, bool, bool] | None:
    """(lhs operand position, accumulate, rhs is ``[N, K]``) of a skinny unbatched 16-bit product
    ``op`` (a plain dot of ``fusions._mm_layout``'s layouts, or fusion (b)'s addmm), or None."""
    if "spec" in op.extra or "view" in op.extra:
        return None
    dims = op.inst.shape.dims
    rows = op.inst.shape.numel // dims[-1] if dims and dims[-1] else 0
    if op.inst.shape.dtype not in _HALF or not 1 <= rows <= kernels_gemv.MAX_ROWS:
        return None
    if "mm" in op.extra and len(op.ins) == 3:  # fusion (b): [c, a, b]
        batched, transposed = op.extra["mm"]
        return None if batched else (1, True, transposed)
    if op.inst.opcode != "dot" or op.fn is not None:
        return None
    layout = mm_layout(op.inst)
    lhs, rhs = op.inst.operands
    if layout is None or layout[0] or not op.inst.shape.dtype == lhs.shape.dtype == rhs.shape.dtype:
        return None
    return 0, False, layout[1]
