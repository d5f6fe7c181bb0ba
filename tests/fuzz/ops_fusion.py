"""Op generators for the lowering's product fusions: a skinny 16-bit product whose input is an RMS
norm or a SwiGLU (fusion (d), ``spmd.runtime.fusions_prologue``) and a product with its activation
(``spmd.runtime.epilogue_fusion``).

The core ops rarely reach them: their RMS norm runs in the operand's dtype (fusion (d) takes the
float32 form of ``LlamaRMSNorm`` / HF transformers) and their products seldom have at most 16 rows
and a 16-bit dtype. Enabled by the feature ``"fusions"`` (``tests.fuzz.generate``).
"""

from __future__ import annotations

import math

import torch

from tests.fuzz.builder import Builder, Reject, Value
from tests.fuzz.ops import dn

HALF = (torch.bfloat16, torch.float16)
MAX_ROWS = 16  # spmd.runtime.kernels_gemv.MAX_ROWS (not imported: the generator runs without spmd)
WIDTHS = (8, 16, 12, 6, 32, 5)


def _skinny_half(b: Builder) -> Value:
    """A 16-bit operand of at most MAX_ROWS rows (all dims but the last), mostly an earlier value."""
    ok = lambda v: v.dtype in HALF and 1 <= v.rank <= 3 and v.shape[-1] >= 2 and math.prod(v.shape[:-1]) <= MAX_ROWS
    try:
        return b.pick(ok, "skinny 16-bit operand")
    except Reject:
        rows = b.d.choice(((1,), (4,), (2, 1), (16,), (3, 5), (2, 8), (7,)))
        b.new_input((*rows, b.d.choice(WIDTHS)), b.d.choice(HALF))
        return b.values[-1]


def op_rms_linear(b: Builder) -> None:
    """``F.linear(rms_norm(a), w)``, the norm in float32 as LlamaRMSNorm computes it (weight on
    either side, eps drawn), sometimes plus a residual of ``a``'s rows."""
    a = _skinny_half(b)
    k, dt = a.shape[-1], dn(a)
    g = b.new_input((k,), a.dtype)
    n = b.d.choice((k, 4, 16, 24, 7))
    w = b.new_input((n, k), a.dtype)
    eps = b.d.choice(("1e-6", "1e-5", "0.1"))
    normed = f"({a.name}.float() * torch.rsqrt({a.name}.float().pow(2).mean(-1, keepdim=True) + {eps})).to({dt})"
    normed = f"({g} * {normed})" if b.d.boolean() else f"({normed} * {g})"
    out = f"F.linear({normed}, {w})" if b.d.boolean(0.7) else f"{normed} @ {w}.T"
    if n == k and b.d.boolean(0.4):
        out = f"{a.name} + {out}"
    b.emit(out)


def op_swiglu_linear(b: Builder) -> None:
    """``F.linear(silu(gate) * up, w_down)`` with gate/up one merged projection sliced (either half
    first) or two projections; sometimes plus a residual."""
    a = _skinny_half(b)
    k = a.shape[-1]
    inner = b.d.choice((8, 6, 16, 5))
    n = b.d.choice((k, 4, 12))
    down = b.new_input((n, inner), a.dtype)
    if b.d.boolean():
        gu = b.new_input((2 * inner, k), a.dtype)
        first, second = ("[..., :{i}]", "[..., {i}:]") if b.d.boolean(0.7) else ("[..., {i}:]", "[..., :{i}]")
        gate, up = "{name}" + first.format(i=inner), "{name}" + second.format(i=inner)
        stmts = ("{name} = " + f"F.linear({a.name}, {gu})",)
    else:
        wg, wu = b.new_input((inner, k), a.dtype), b.new_input((inner, k), a.dtype)
        gate, up = f"F.linear({a.name}, {wg})", f"F.linear({a.name}, {wu})"
        stmts = ()
    h = f"F.silu({gate}) * {up}" if b.d.boolean(0.7) else f"{up} * F.silu({gate})"
    out = f"F.linear({h}, {down})"
    if n == k and b.d.boolean(0.4):
        out = f"{a.name} + {out}"
    b.emit(None, stmts=(*stmts, "{name} = " + out))


def op_linear_act(b: Builder) -> None:
    """``act(F.linear(a, w[, bias]))`` of more than MAX_ROWS rows: a product and its activation."""
    try:
        a = b.pick(lambda v: v.is_float and v.rank >= 2 and math.prod(v.shape[:-1]) > MAX_ROWS, "tall operand")
    except Reject:
        rows = b.d.choice(((72,), (40,), (4, 17), (136,), (8, 12)))  # > MAX_ROWS per device on 1-8 devices
        b.new_input((*rows, b.d.choice(WIDTHS)), b.d.choice((torch.float32, *HALF)))
        a = b.values[-1]
    k = a.shape[-1]
    n = b.d.choice((8, 16, 12, 24))
    w = b.new_input((n, k), a.dtype)
    bias = f", {b.new_input((n,), a.dtype)}" if b.d.boolean() else ""
    act = b.d.choice(("F.gelu({})", "F.gelu({}, approximate='tanh')", "F.silu({})", "torch.relu({})"))
    b.emit(act.format(f"F.linear({a.name}, {w}{bias})"))


FUSION_OPS = (("rms_linear", op_rms_linear, 2), ("swiglu_linear", op_swiglu_linear, 2),
              ("linear_act", op_linear_act, 2))
