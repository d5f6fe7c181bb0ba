"""Recognise fusions that a skinny product can compute in its prologue (``spmd.runtime.fusions_prologue``).

Two forms, as ``spmd.passes.fuse_elementwise`` leaves them for a Llama decoder layer (16-bit
activations; ``x`` and ``g`` are fusion parameters, reshapes of ``x`` anywhere):

- **RMS norm** (``LlamaRMSNorm`` / ``torch.nn.RMSNorm`` computed in float32, the Llama layers of
  HF transformers and ``spmd.models.llama``)::

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
    gb = _skip(gb, ("reshape", "broadcast"))
    g = _param(gb)
    if g is None or gb.shape.dims != (k,) or gb.shape.dtype != fusion.shape.dtype:
        return None
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
        if found is not None:
            eps, divisor = found
            return Prologue("rms-norm", x, g, eps=eps, divisor=divisor, width=k)
    return None


def _source(x32: Instruction, dtype: str) -> int | None:
    """The parameter number of ``x`` when ``x32`` is ``convert(reshape*(x))`` to f32 of a 16-bit ``x``."""
    if x32.opcode != "convert" or x32.shape.dtype != "f32":
        return None
    x = _skip(x32.operands[0])
    return _param(x) if x.shape.dtype == dtype else None


def _row_scale(fusion: Instruction, r: Instruction, x32: Instruction) -> tuple[float, float] | None:
    """(eps, divisor) when ``r`` is ``rsqrt(divide(reduce-add(x32 * x32), divisor) + eps)`` over the last dim."""
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
            return eps, divisor
    return None


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
