"""Recognise fusions that a skinny product can compute in its prologue (``spmd.runtime.fusions_prologue``).

Two forms, as ``spmd.passes.fuse_elementwise`` leaves them for a Llama decoder layer (16-bit
activations; ``x`` and ``g`` are fusion parameters, reshapes of ``x`` anywhere):

- **RMS norm** (``LlamaRMSNorm`` computed in float32: the Llama layers of HF transformers and
  ``spmd.models.llama``; ``torch.nn.RMSNorm`` / ``F.rms_norm`` lower to another form and are not
  matched)::

      x32 = convert(x) (f32)
      r   = rsqrt(divide(reduce-add(multiply(x32, x32), 0, last dim), divisor) + eps)
      out = multiply(broadcast(g), convert(multiply(x32, broadcast(r))))      (either operand order)

  ``divisor`` and ``eps`` must be fusion operands that are constants (or broadcasts of one), read
  at lowering.
- **SwiGLU**: ``out = multiply(silu(slice(a)), slice(b))`` (either order), slices of whole rows
  and a contiguous range of the last dim, of one operand or two.

``match_prologue`` returns a ``Prologue`` or None; it never raises on a fusion of another form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spmd.ir.hlo import Instruction

_HALF = ("bf16", "f16")


@dataclass(frozen=True)
class Prologue:
    """What a fusion feeding a product's input computes, in terms of the fusion's operands.

    Fields:
      kind: "rms-norm" or "swiglu".
      x: operand number of the normalised input (rms-norm) or of the gate's source (swiglu).
      g: operand number of the norm weight ``g [K]`` (rms-norm) or of the up projection's source (swiglu).
      eps, divisor: rms-norm's epsilon and the mean's divisor (floats; 0 and 1 for swiglu).
      x_start, g_start: swiglu: first column of the gate / up slice in its operand's last dim.
      width: K, the last dim of the fusion's result.
    """

    kind: str
    x: int
    g: int
    eps: float = 0.0
    divisor: float = 1.0
    x_start: int = 0
    g_start: int = 0
    width: int = 0


def match_prologue(fusion: Instruction) -> Prologue | None:
    """The ``Prologue`` that ``fusion`` (a ``fusion`` instruction of the entry) computes, or None."""
    if fusion.opcode != "fusion" or fusion.shape.is_tuple or fusion.shape.dtype not in _HALF:
        return None
    body = fusion.attrs.get("calls")
    root = getattr(body, "root", None)
    if root is None or root.opcode != "multiply" or fusion.shape.rank < 1:
        return None
    for a, b in (root.operands, root.operands[::-1]):
        found = _rms_norm(fusion, a, b) or _swiglu(fusion, a, b)
        if found is not None:
            return found
    return None


def _param(inst: Instruction) -> int | None:
    return inst.attrs["parameter_number"] if inst.opcode == "parameter" else None


def _skip(inst: Instruction, opcodes: tuple[str, ...] = ("reshape",)) -> Instruction:
    while inst.opcode in opcodes and inst.operands:
        inst = inst.operands[0]
    return inst


def _constant(fusion: Instruction, inst: Instruction) -> float | None:
    """The value of a fusion parameter whose entry operand is a one-value constant (or a broadcast /
    reshape of one)."""
    p = _param(_skip(inst, ("reshape", "broadcast")))
    if p is None or p >= len(fusion.operands):
        return None
    src = _skip(fusion.operands[p], ("reshape", "broadcast"))
    if src.opcode != "constant":
        return None
    lit = src.attrs.get("literal")
    if not isinstance(lit, torch.Tensor) or lit.numel() != 1 or not lit.dtype.is_floating_point:
        return None
    return float(lit.reshape(()).item())


def _rms_norm(fusion: Instruction, gb: Instruction, normed: Instruction) -> Prologue | None:
    k = fusion.shape.dims[-1]
    g_inst = _skip(gb, ("reshape", "broadcast"))
    g = _param(g_inst)
    if g is None or g_inst.shape.dims != (k,) or g_inst.shape.dtype != fusion.shape.dtype:
        return None
    if not _along(_dim_labels(gb, g_inst), fusion.shape.dims, {len(fusion.shape.dims) - 1: 0}):
        return None  # g [K] must scale the last dim (not broadcast along the rows)
    if normed.opcode != "convert" or normed.shape.dtype != fusion.shape.dtype:
        return None
    prod = normed.operands[0]
    if prod.opcode != "multiply" or prod.shape.dtype != "f32":
        return None
    for x32, rb in (prod.operands, prod.operands[::-1]):
        x = _source(x32, fusion.shape.dtype)
        if x is None or fusion.operands[x].shape.dims[-1] != k:
            continue
        found = _row_scale(fusion, _skip(rb, ("reshape", "broadcast")), x32)
        if found is not None and _rows_kept(rb, found[2], fusion.shape.dims):
            eps, divisor, _ = found
            return Prologue("rms-norm", x, g, eps=eps, divisor=divisor, width=k)
    return None


def _source(x32: Instruction, dtype: str) -> int | None:
    """The parameter number of ``x`` when ``x32`` is ``convert(reshape*(x))`` to f32 of a 16-bit ``x``."""
    if x32.opcode != "convert" or x32.shape.dtype != "f32":
        return None
    x = _skip(x32.operands[0])
    return _param(x) if x.shape.dtype == dtype else None


def _row_scale(fusion: Instruction, r: Instruction, x32: Instruction) -> tuple[float, float, Instruction] | None:
    """(eps, divisor, the reduce) when ``r`` is ``rsqrt(divide(reduce-add(x32 * x32), divisor) + eps)``
    over the last dim."""
    if r.opcode != "rsqrt":
        return None
    add = _skip(r.operands[0])
    if add.opcode != "add":
        return None
    for mean, eps_inst in (add.operands, add.operands[::-1]):
        div = _skip(mean)
        eps = _constant(fusion, eps_inst)
        if div.opcode != "divide" or eps is None:
            continue
        divisor = _constant(fusion, div.operands[1])
        red = _skip(div.operands[0])
        if divisor is None or red.opcode != "reduce" or len(red.operands) != 2:
            continue
        if tuple(red.attrs.get("dimensions", ())) != (x32.shape.rank - 1,) or _constant(fusion, red.operands[1]) != 0:
            continue
        comp = red.attrs.get("to_apply")
        if comp is None or comp.root is None or comp.root.opcode != "add":
            continue
        sq = red.operands[0]
        if sq.opcode == "multiply" and sq.operands[0] is x32 and sq.operands[1] is x32:
            return eps, divisor, red
    return None


def _rows_kept(rb: Instruction, red: Instruction, dims: tuple[int, ...]) -> bool:
    """Whether ``rb`` (of ``dims``) holds row ``i``'s value of ``red`` (the reduce over the last dim,
    of ``dims[:-1]``) at every ``[i..., j]``: its leading dims kept in place, broadcast along the last."""
    return _along(_dim_labels(rb, red), dims, {d: d for d in range(len(dims) - 1)})


def _dim_labels(inst: Instruction, leaf: Instruction) -> tuple[int | None, ...] | None:
    """For each dim of ``inst``, the dim of ``leaf`` it indexes (None: a broadcast or size-1 dim),
    where ``inst`` is ``leaf`` through broadcasts, reshapes that only add or drop size-1 dims, and
    elementwise ops of one shape; None for any other path."""
    if inst is leaf:
        return tuple(d if n != 1 else None for d, n in enumerate(inst.shape.dims))
    if not inst.operands:
        return None
    src = _dim_labels(inst.operands[0], leaf) if inst.opcode in ("reshape", "broadcast") else None
    if inst.opcode == "broadcast" and src is not None:
        out: list[int | None] = [None] * inst.shape.rank
        for i, d in enumerate(inst.attrs["dimensions"]):
            out[d] = src[i] if inst.shape.dims[d] != 1 else None
        return tuple(out)
    if inst.opcode == "reshape" and src is not None:
        before = [(n, lab) for n, lab in zip(inst.operands[0].shape.dims, src, strict=True) if n != 1]
        after = [d for d, n in enumerate(inst.shape.dims) if n != 1]
        if [n for n, _ in before] != [inst.shape.dims[d] for d in after]:
            return None
        out = [None] * inst.shape.rank
        for d, (_, lab) in zip(after, before, strict=True):
            out[d] = lab
        return tuple(out)
    if inst.opcode in ("add", "divide", "rsqrt", "multiply", "convert"):
        for o in inst.operands:
            if o.shape.dims == inst.shape.dims:
                found = _dim_labels(o, leaf)
                if found is not None:
                    return found
    return None


def _along(labels: tuple[int | None, ...] | None, dims: tuple[int, ...], want: dict[int, int]) -> bool:
    """Whether ``labels`` (``_dim_labels`` of a value of ``dims``) name, for every dim larger than 1,
    the source dim ``want[d]`` (None where ``d`` is not in ``want``: broadcast)."""
    if labels is None:
        return False
    return all(n == 1 or labels[d] == want.get(d) for d, n in enumerate(dims))


def _swiglu(fusion: Instruction, act: Instruction, up: Instruction) -> Prologue | None:
    if act.opcode != "custom-call" or act.attrs.get("custom_call_target") != "silu":
        return None
    k = fusion.shape.dims[-1]
    gate = _row_slice(act.operands[0], fusion.shape.dims)
    upper = _row_slice(up, fusion.shape.dims)
    if gate is None or upper is None or act.shape.dtype != fusion.shape.dtype:
        return None
    (x, x_start), (g, g_start) = gate, upper
    return Prologue("swiglu", x, g, x_start=x_start, g_start=g_start, width=k)


def _row_slice(inst: Instruction, dims: tuple[int, ...]) -> tuple[int, int] | None:
    """(parameter number, first column) when ``inst`` is a parameter, or a slice of one, of ``dims``
    taking whole leading dims and a contiguous (stride-1) range of the last dim."""
    if inst.shape.dims != dims:
        return None
    if _param(inst) is not None:
        return _param(inst), 0
    if inst.opcode != "slice" or _param(inst.operands[0]) is None:
        return None
    src = inst.operands[0].shape.dims
    spans = inst.attrs["slice"]
    if len(src) != len(dims) or any(st != 1 for _, _, st in spans):
        return None
    if any(s != 0 or e != d for (s, e, _), d in zip(spans[:-1], src[:-1], strict=True)):
        return None
    return _param(inst.operands[0]), spans[-1][0]
