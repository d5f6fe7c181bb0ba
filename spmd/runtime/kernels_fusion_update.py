"""The kernel of an in-place update fusion (``spmd.passes.fuse_update_slice``): updates computed and stored at once.

The called computation ends in one ``dynamic-update-slice`` or a ``tuple`` of them (the k and v
cache writes of a decode step, merged by multi-output-fusion), possibly beside values over the
updates' iteration space (the rotary embedding of q, merged as a sibling). Each writes an update computed by
the rest of the body (the rotary embedding of k, a transposed slice of the merged Q/K/V product)
into its operand 0, a parameter of the body, at start indices clamped as XLA clamps them
(``[0, n - size]`` per dim). The kernel takes the fusion's operands and one destination per
output (``None``: fresh memory): a destination that is operand 0's own tensor (a donated KV
cache, ``spmd.runtime.donation``) is updated in place, only the update's elements are stored;
any other destination first receives a copy of operand 0.

On CUDA (``SPMD_FUSION_COMPILER``, as ``spmd.runtime.kernels_fusion``) the update computation and
every store are traced with ``make_fx`` into ``dest_i.index_copy_(dim, rows_i, update_i)`` (an
``index_put_`` where several dims move; ``dest_i.copy_(value_i)`` for a value) on mutated graph
inputs and compiled by PyTorch Inductor: one Triton kernel over the update's elements with one
store per output (XLA's in-place dynamic-update-slice loop fusion). A value output without a
destination is returned by the graph, and the kernel launches with programmatic dependent launch
where spmd's Triton kernels do. It is checked once against the op-by-op result (each kernel
compiled counts ``fusion.update.compiled`` and the kernels Inductor generated for it
``fusion.update.kernels``, 0 for a graph from Inductor's cache; a failure
``fusion.fallback.<exception type>``). Elsewhere,
and where Inductor fails or the destinations overlap other operands, the body runs op by op
(every update computed before any store) and each update is written with the unfused
dynamic-update-slice kernel, in place over its destination.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spmd import metrics
from spmd.ir.hlo import Computation, Instruction
from spmd.runtime.kernels_fusion import (
    _INDUCTOR_OPTIONS,
    _cached_compile,
    _graph_call,
    _overlaps,
    _same_view,
    fusion_compiler,
    op_steps,
    run_steps,
    structure_key,
)

Tensor = torch.Tensor


def output_roots(body: Computation) -> list[Instruction]:
    """The outputs of a fused computation: its root, or every element of a ``tuple`` root."""
    root = body.root
    return list(root.operands) if root.opcode == "tuple" else [root]


def is_update_fusion(body: Computation) -> bool:
    """Whether ``body`` (a fused computation) runs with this module's kernel: some output is a
    dynamic-update-slice, and every such output updates a body parameter."""
    updates = [r for r in output_roots(body) if r.opcode == "dynamic-update-slice"]
    return bool(updates) and all(r.operands[0].opcode == "parameter" for r in updates)


def build_update_fusion(inst: Instruction, dev: torch.device | None = None) -> Callable:
    """Kernel for a ``fusion`` with dynamic-update-slice outputs (``is_update_fusion``).

    Array fusion: ``(operands, out) -> Tensor``; tuple fusion: ``(operands, dests) -> tuple``
    (``dests`` None or one tensor-or-None per element). Operands on one device, any strides;
    each destination has its element's shape and dtype.
    """
    from spmd.runtime.kernels import compile_kernel

    body: Computation = inst.attrs["calls"]
    plan = _Plan(body)
    multi = body.root.opcode == "tuple"
    structure = structure_key(body)
    writers = {}  # device -> per output: the unfused dynamic-update-slice kernel, or None (a value)

    def kernel(ops: list[Tensor], dests):
        dests = ([None] * len(plan.roots) if dests is None else list(dests)) if multi else [dests]
        device = ops[0].device
        if device not in writers:
            writers[device] = [compile_kernel(r, device) if b >= 0 else None
                               for r, b in zip(plan.roots, plan.buffers, strict=True)]
        mode = fusion_compiler(device)
        outs = None
        if plan.exclusive and not (mode == "eager" or (mode == "graphs" and not _graph_call())):
            outs = _generated(plan, structure, ops, dests)
        if outs is None:
            outs = _op_by_op(plan, writers[device], ops, dests)
        return tuple(outs) if multi else outs[0]
    return kernel


class _Plan:
    """Per output its buffer parameter (-1 for a value), and the op-by-op evaluation of the body
    up to the stores: each update with its starts, each value."""

    def __init__(self, body: Computation) -> None:
        self.roots = output_roots(body)
        dus = [r.opcode == "dynamic-update-slice" for r in self.roots]
        self.buffers = [r.operands[0].attrs["parameter_number"] if u else -1 for r, u in zip(self.roots, dus,
                                                                                               strict=True)]
        users = body.users()
        updates = [r for r, u in zip(self.roots, dus, strict=True) if u]
        # in place only over a buffer nothing else in the body reads (else the stores could race its reads)
        self.exclusive = len({r.operands[0].name for r in updates}) == len(updates) and all(
            users.get(r.operands[0], []) == [r] and r.operands.count(r.operands[0]) == 1 for r in updates)
        self.moving = [tuple(d for d, (n, s) in enumerate(zip(r.shape.dims, r.operands[1].shape.dims, strict=True))
                             if s < n) if u else () for r, u in zip(self.roots, dus, strict=True)]
        skip = {id(r) for r in updates} | ({id(body.root)} if body.root.opcode == "tuple" else set())
        self.steps, source = op_steps(body, frozenset(skip))
        self.kernels: dict[str, list] = {}
        self.reads = [[source(o) for o in (r.operands[1:] if u else [r])] for r, u in zip(self.roots, dus, strict=True)]

    def values(self, ops: list[Tensor]) -> list[list[Tensor]]:
        """Per output: [update, start_0, ..., start_{rank-1}], or [value], from the fusion's operands."""
        from spmd.runtime.kernels import compile_kernel

        device = ops[0].device
        ks = self.kernels.get(str(device))
        if ks is None:
            ks = self.kernels[str(device)] = [compile_kernel(i, device) for i, _ in self.steps]
        vals = run_steps(ks, self.steps, ops)
        return [[ops[k] if is_param else vals[k] for is_param, k in srcs] for srcs in self.reads]


def _fresh(root: Instruction, device: torch.device) -> Tensor:
    return torch.empty(root.shape.dims, dtype=root.shape.torch_dtype, device=device)


def _op_by_op(plan: _Plan, writers: list, ops: list[Tensor], dests: list) -> list[Tensor]:
    """Every update and value computed, then each destination filled (from its buffer) and updated."""
    values = plan.values(ops)
    outs = [d if d is not None else _fresh(r, ops[0].device) for r, d in zip(plan.roots, dests, strict=True)]
    sources = []
    for b, d in zip(plan.buffers, outs, strict=True):
        src = ops[b] if b >= 0 else None
        same = src is not None and _same_view(src, d)
        if src is not None and not same and _overlaps(src, outs):
            src = src.clone()  # a source another destination overwrites is read first
        sources.append((src, same))
    values = [[v.clone() if _overlaps(v, outs) else v for v in vs] for vs in values]
    for (src, same), d in zip(sources, outs, strict=True):
        if src is not None and not same:
            d.copy_(src)
    for w, vs, d in zip(writers, values, outs, strict=True):
        if w is None:
            d.copy_(vs[0])
        else:
            w([d, *vs], d)
    return outs


def _generated(plan: _Plan, structure: tuple, ops: list[Tensor], dests: list) -> list[Tensor] | None:
    """The fusion through one Inductor-generated kernel, or None where it cannot be used here.

    A value output without a destination is an output of the generated graph (stored by the
    kernel that computes it), not a copy into fresh memory: Inductor ran such a copy as a kernel
    of its own (the rotary embedding of q in a decode step, on an H200)."""
    device = ops[0].device
    buffers = {b for b in plan.buffers if b >= 0}
    fresh = tuple(i for i, (d, b) in enumerate(zip(dests, plan.buffers, strict=True)) if d is None and b < 0)
    outs = [None if i in fresh else d if d is not None else
            torch.empty_like(ops[b], memory_format=torch.contiguous_format)
            for i, (d, b) in enumerate(zip(dests, plan.buffers, strict=True))]
    given = [d for d in outs if d is not None]
    others = [t for k, t in enumerate(ops) if k not in buffers]
    for i, (d, b) in enumerate(zip(outs, plan.buffers, strict=True)):
        if d is None:
            continue
        if d.device != device or _overlaps(d, others) or _overlaps(d, [o for o in outs[:i] if o is not None]):
            return None
        if b >= 0 and not _same_view(ops[b], d) and _overlaps(d, [ops[b]]):
            return None
        if b < 0 and _overlaps(d, [ops[k] for k in buffers]):
            return None
    if any(t.device != device for t in others):
        return None  # host start indices: the unfused writer narrows on the host values
    writer = _compile(plan, structure, ops, outs, fresh)
    if writer is None:
        return None
    for d, b in zip(outs, plan.buffers, strict=True):
        if d is not None and b >= 0 and not _same_view(ops[b], d):
            d.copy_(ops[b])
    for i, t in zip(fresh, writer(*others, *given), strict=True):
        outs[i] = t
    return outs


def _compile(plan: _Plan, structure: tuple, ops: list[Tensor], outs: list[Tensor | None],
             fresh: tuple[int, ...]) -> Callable | None:
    buffers = {b for b in plan.buffers if b >= 0}
    others = [t for k, t in enumerate(ops) if k not in buffers]
    pdl = ops[0].is_cuda and _pdl(ops[0].device)
    key = ("update-into", structure, str(ops[0].device), fresh, pdl,
           *((tuple(t.shape), t.stride(), t.dtype) for t in [*others, *(o for o in outs if o is not None)]))
    return _cached_compile(key, lambda: _inductor(plan, ops, outs, fresh, pdl), None)


def _inductor(plan: _Plan, ops: list[Tensor], outs: list[Tensor | None], fresh: tuple[int, ...],
              pdl: bool = False) -> Callable:
    """The traced and compiled ``write(*other operands, *given dests) -> fresh values``; checked
    once on copies. ``outs[i]`` is None for the outputs in ``fresh`` (values the graph returns);
    ``pdl``: see ``_options``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    buffers = {b for b in plan.buffers if b >= 0}
    positions = [k for k in range(len(ops)) if k not in buffers]
    given = [i for i in range(len(outs)) if i not in fresh]

    def write(*args: Tensor) -> tuple[Tensor, ...]:
        full: list = [None] * len(ops)
        for k, t in zip(positions, args[:len(positions)], strict=True):
            full[k] = t
        dest = dict(zip(given, args[len(positions):], strict=True))
        for i, b in enumerate(plan.buffers):
            if b >= 0:
                full[b] = dest[i]  # never read by the body (exclusive buffers)
        made = []
        for i, (b, moving, vs) in enumerate(zip(plan.buffers, plan.moving, plan.values(full), strict=True)):
            if i in dest:
                _store(dest[i], b, moving, vs)
            else:
                made.append(vs[0].clone(memory_format=torch.contiguous_format))
        return tuple(made)

    others = [ops[k] for k in positions]
    with torch.no_grad():
        want = [ops[b].clone() if b >= 0 else _fresh(r, ops[0].device) for r, b in zip(plan.roots, plan.buffers,
                                                                                          strict=True)]
        for d, b, moving, vs in zip(want, plan.buffers, plan.moving, plan.values(ops), strict=True):
            _store(d, b, moving, [v.clone() for v in vs])
        scratch = [torch.empty_strided(outs[i].shape, outs[i].stride(), dtype=outs[i].dtype, device=outs[i].device)
                   for i in given]
        for t, i in zip(scratch, given, strict=True):
            if plan.buffers[i] >= 0:
                t.copy_(ops[plan.buffers[i]])
        gm = make_fx(write)(*others, *[s.clone() for s in scratch])
        kernels = _generated_kernels()
        compiled = torch._inductor.compile(gm, [*others, *scratch], options=_options(pdl))
        kernels = _generated_kernels() - kernels
        made = compiled(*others, *scratch)
    got = dict(zip(given, scratch, strict=True)) | dict(zip(fresh, made, strict=True))
    for i, w in enumerate(want):
        if not torch.allclose(got[i].double(), w.double(), rtol=1e-2, atol=1e-2, equal_nan=True):
            raise RuntimeError("compiled update fusion wrote other values")
    metrics.counter("fusion.update.compiled").inc()
    metrics.counter("fusion.update.kernels").inc(kernels)

    def run(*args: Tensor) -> tuple[Tensor, ...]:
        return tuple(compiled(*args))
    return run


def _generated_kernels() -> int:
    """Inductor's count of the kernels it generated in this process (0 where this torch lacks it)."""
    from torch._inductor import metrics as inductor_metrics

    return int(getattr(inductor_metrics, "generated_kernel_count", 0))


def _options(pdl: bool = False) -> dict:
    """Inductor options of the update kernel: ``_INDUCTOR_OPTIONS``, and every store fused into one
    loop. Inductor fuses two pointwise nodes only when they read common data
    (``score_fusion_memory_threshold``); the k and v cache writes share no read but the position
    (a scalar read counts for nothing), so they would be two kernels. ``pdl``: the kernel launches
    with programmatic dependent launch (Inductor's ``triton.enable_pdl``: it waits for the previous
    kernel before its first load), as spmd's own Triton kernels of a decode step do
    (``spmd.runtime.triton_pdl``), so the chain of a layer's kernels is not broken here. Options
    this torch lacks are left out."""
    import torch._inductor.config as config

    wanted = {"aggressive_fusion": True, "score_fusion_memory_threshold": 0}
    options = {**_INDUCTOR_OPTIONS, **{k: v for k, v in wanted.items() if hasattr(config, k)}}
    if pdl and hasattr(config.triton, "enable_pdl"):
        options["triton.enable_pdl"] = True
    return options


def _pdl(device: torch.device) -> bool:
    """Whether the update kernel on ``device`` uses PDL: ``triton_pdl.enabled`` for a one-wave launch
    (the kernel stores one token's rows); False where Triton is missing."""
    try:
        from spmd.runtime import triton_pdl
    except ImportError:
        return False
    return triton_pdl.enabled(device, 1)


def _store(dest: Tensor, buffer: int, moving: tuple[int, ...], vs: list[Tensor]) -> None:
    """``dest`` = value ``vs[0]`` (``buffer`` < 0), or ``vs[0]`` written in place at starts ``vs[1:]``
    clamped to ``[0, n - size]`` (traceable)."""
    update, starts = vs[0], vs[1:]
    if buffer < 0 or not moving:
        dest.copy_(update)
        return
    index = []
    for d in moving:
        n, size = dest.shape[d], update.shape[d]
        index.append(starts[d].to(torch.int64).reshape(1).clamp(0, n - size)
                     + torch.arange(size, device=dest.device))
    if len(moving) == 1:
        dest.index_copy_(moving[0], index[0], update)
        return
    grid = []
    for d in range(dest.dim()):
        idx = index[moving.index(d)] if d in moving else torch.arange(dest.shape[d], device=dest.device)
        shape = [1] * dest.dim()
        shape[d] = -1
        grid.append(idx.reshape(shape))
    dest.index_put_(tuple(grid), update)
