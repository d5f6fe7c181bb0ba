"""The kernel of a multi-output ``fusion`` (``spmd.passes.multi_output_fusion``): one kernel, several outputs.

The called computation ends in a ``tuple`` of N arrays. The kernel takes the fusion's operands
and N destinations (``None`` where the lowering assigned no buffer: a fresh tensor is allocated)
and stores element i into destination i. A destination may be the buffer of an operand the
fusion reads only element for element (``pointwise_parameters``: an optimizer's parameter and
moments, updated in place); any other overlap between a destination and an operand makes the
kernel compute every element first and copy after.

As for single-output fusions (``spmd.runtime.kernels_fusion``): on CUDA the computation is
traced with ``make_fx`` into ``dest_i.copy_(value_i)`` for every i and compiled by PyTorch
Inductor (one Triton kernel for a pointwise body: XLA's multi-output loop fusion emits one loop
with several stores), under CUDA graphs (``SPMD_FUSION_COMPILER``); elsewhere, and where Inductor
fails, op by op with the unfused kernels, then copied into the destinations. The generated kernel
is checked once: against the op-by-op result, and, with the destinations aliasing the operands as
in the call (on copies), bit for bit against its own result into fresh destinations, so a
schedule that reads an operand after storing over it never runs (the fusion then runs op by op).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spmd.ir.hlo import Computation, Instruction
from spmd.runtime.kernels_fusion import (
    _INDUCTOR_OPTIONS,
    _cached_compile,
    _graph_call,
    _overlaps,
    _same_view,
    fusion_compiler,
    interpreter,
    pointwise_parameters,
    structure_key,
)

Tensor = torch.Tensor
Dests = "list[Tensor | None] | None"


def build_multi_output_fusion(inst: Instruction, dev: torch.device | None = None) -> Callable:
    """Kernel ``(operands, dests) -> tuple[Tensor, ...]`` for a tuple-shaped ``fusion`` instruction.

    ``dests``: None, or per output element a tensor of the element's shape and dtype
    (contiguous) to store it into, or None (a fresh contiguous tensor). Returns the N element
    tensors (the destinations where given).
    """
    body: Computation = inst.attrs["calls"]
    structure = structure_key(body)
    in_place_ok = pointwise_parameters(body)
    shapes = [o.shape for o in body.root.operands]
    prepared: dict[tuple, list] = {}  # (device, strides) -> [mode, op-by-op fn]

    def kernel(ops: list[Tensor], dests: Dests) -> tuple[Tensor, ...]:
        dests = list(dests) if dests is not None else [None] * len(shapes)
        key = (ops[0].device, *(t.stride() for t in ops))
        entry = prepared.get(key)
        if entry is None:
            entry = prepared[key] = [fusion_compiler(ops[0].device), interpreter(body, ops[0].device)]
        mode, eager = entry
        if mode == "eager" or (mode == "graphs" and not _graph_call()):
            return _deliver(eager(*ops), dests)
        outs = [d if d is not None else torch.empty(s.dims, dtype=s.torch_dtype, device=ops[0].device)
                for d, s in zip(dests, shapes, strict=True)]
        if _unsafe(ops, outs, in_place_ok):
            return _deliver(eager(*ops), dests)
        writer = _compile_multi_into(structure, eager, ops, outs)
        if writer is None:
            return _deliver(eager(*ops), dests)
        writer(*ops, *outs)
        return tuple(outs)
    return kernel


def _deliver(values: tuple[Tensor, ...], dests: list[Tensor | None]) -> tuple[Tensor, ...]:
    """Each computed element into its destination (all computed before any is written)."""
    out = []
    for v, d in zip(values, dests, strict=True):
        if d is None:
            out.append(v if v.is_contiguous() else v.contiguous())
        else:
            out.append(d.copy_(v))
    return tuple(out)


def _unsafe(ops: list[Tensor], outs: list[Tensor], in_place_ok: frozenset[int]) -> bool:
    """Whether storing straight into ``outs`` could change an operand before the kernel reads it.

    A destination may be exactly an operand read only element for element; it must not
    overlap any other operand or another destination.
    """
    for i, d in enumerate(outs):
        if _overlaps(d, [t for k, t in enumerate(ops) if not (k in in_place_ok and _same_view(t, d))]):
            return True
        if _overlaps(d, outs[:i]):
            return True
    return False


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Equal values, NaNs in the same places."""
    if torch.equal(a, b):
        return True
    inf = float("inf")
    return (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
            and torch.equal(a.nan_to_num(0.0, inf, -inf), b.nan_to_num(0.0, inf, -inf)))


def _compile_multi_into(structure: tuple, eager: Callable, ops: list[Tensor],
                        outs: list[Tensor]) -> Callable | None:
    """A generated kernel ``fn(*ops, *outs)`` storing every element into its destination (cached
    per structure, device, layouts and the aliasing of destinations to operands), or None where
    Inductor is unavailable for it or its check fails (the caller runs op by op and copies)."""
    alias = tuple(next((k for k, t in enumerate(ops) if _same_view(t, d)), -1) for d in outs)
    key = ("multi-into", structure, str(ops[0].device), alias,
           *((tuple(t.shape), t.stride(), t.dtype) for t in [*ops, *outs]))
    return _cached_compile(key, lambda: _inductor_multi_into(eager, ops, outs, alias), None)


def _inductor_multi_into(fn: Callable, ops: list[Tensor], outs: list[Tensor], alias: tuple[int, ...]) -> Callable:
    """``dest_i.copy_(fn(*ops)[i])`` for every i, traced and compiled by Inductor (mutated graph
    inputs); checked once on copies of the operands with the call's aliasing."""
    from torch.fx.experimental.proxy_tensor import make_fx

    n = len(outs)

    def write(*args: Tensor) -> tuple[Tensor, ...]:
        values = fn(*args[:-n])
        return tuple(d.copy_(v) for d, v in zip(args[-n:], values, strict=True))

    with torch.no_grad():
        want = fn(*ops)
        scratch = [torch.empty_strided(d.shape, d.stride(), dtype=d.dtype, device=d.device) for d in outs]
        gm = make_fx(write)(*ops, *scratch)
        compiled = torch._inductor.compile(gm, [*ops, *scratch], options=_INDUCTOR_OPTIONS)
        compiled(*ops, *scratch)  # fresh destinations: the operands stay as they are
        written = {a for a in alias if a >= 0}  # operands the call stores over: on copies of the same layout
        copies = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
                  if k in written else t for k, t in enumerate(ops)]
        dests = [copies[a] if a >= 0 else torch.empty_like(s) for a, s in zip(alias, scratch, strict=True)]
        compiled(*copies, *dests)
    for got, w in zip(scratch, want, strict=True):
        if got.shape != w.shape or got.dtype != w.dtype:
            raise RuntimeError(f"fusion value {w.dtype}{list(w.shape)} does not fit its buffer "
                               f"{got.dtype}{list(got.shape)}")
        if not torch.allclose(got.double(), w.double(), rtol=1e-2, atol=1e-2, equal_nan=True):
            raise RuntimeError("compiled multi-output fusion wrote a different value into its buffer")
    # stored over its operands, the kernel must give the same bits: a value read after its operand
    # was overwritten (the work split over kernels that store between loads) differs
    if not all(_same_bits(got, fresh) for got, fresh in zip(dests, scratch, strict=True)):
        raise RuntimeError("compiled multi-output fusion reads an operand after storing over it")

    def run(*args: Tensor) -> None:
        compiled(*args)
    return run
