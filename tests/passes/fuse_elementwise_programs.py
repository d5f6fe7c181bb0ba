"""Programs shared by the fuse-elementwise tests and the fusion-kernel tests (CPU and GPU).

Only torch, spmd and pytest here: GPU test modules import this, and must be collectable with
only torch and pytest installed.
"""
# ruff: noqa: E501  (HLO text lines are long)

from __future__ import annotations

import torch
import torch.nn.functional as F

import spmd

P = spmd.PartitionSpec

SUM = """%add.f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%max.f32 (a.1: f32[], b.1: f32[]) -> f32[] {
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a.1, %b.1)
}

"""
DOT = "lhs_contracting_dims={1}, rhs_contracting_dims={0}"
LN = 'custom_call_target="layer-norm", backend_config={"normalized_ndim":1,"eps":1e-05}'


def module(params: list[str], body: list[str], result: str, p: int = 1, reducers: bool = False) -> str:
    """A partitioned module text: ``params`` are 'name: shape', ``body`` the lines after the parameters."""
    lines = [f"%{n} = {s} parameter({k})" for k, (n, s) in enumerate(x.split(": ") for x in params)]
    text = "\n".join(f"  {ln}" for ln in [*lines, *body])
    return (f"HloModule m, num_partitions={p}, mesh={{tp={p}}}, is_partitioned=true\n\n{SUM if reducers else ''}"
            f"ENTRY %main ({', '.join(params)}) -> {result} {{\n{text}\n}}\n")


def random_args(mod, seed: int = 0) -> list[list[torch.Tensor]]:
    """Fresh random per-device parameters (never zeros; integers in [0, 2))."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(mod.num_partitions):
        per = []
        for p in mod.entry.parameters:
            t = p.shape.torch_dtype
            if t.is_floating_point:
                per.append((torch.randn(p.shape.dims, generator=gen, dtype=torch.float64) + 0.1).to(t))
            else:
                per.append(torch.randint(0, 2, p.shape.dims, generator=gen).to(t))
        out.append(per)
    return out



AFTER_ALL_REDUCE = module(
    ["h: f32[4,8,16]", "w: f32[16,8]", "bias: f32[8]", "res: f32[4,8,8]", "g: f32[8]", "beta: f32[8]"],
    ["%dot = f32[4,8,8] dot(%h, %w), lhs_contracting_dims={2}, rhs_contracting_dims={0}",
     "%ar = f32[4,8,8] all-reduce(%dot), to_apply=%add.f32, replica_groups={{0,1}}",
     "%bb = f32[4,8,8] broadcast(%bias), dimensions={2}",
     "%x = f32[4,8,8] add(%ar, %bb)",
     "%y = f32[4,8,8] add(%x, %res)",
     f"ROOT %ln = f32[4,8,8] custom-call(%y, %g, %beta), {LN}"],
    "f32[4,8,8]", p=2, reducers=True)


def ln_bias_residual(h, w, b, res, g, beta):
    """LayerNorm(h @ w + b + res) with affine g, beta; h [B,S,F] split on F, w [F,D] on rows: an all-reduce first."""
    return F.layer_norm(h @ w + b + res, (w.shape[1],), g, beta)


def gelu_softmax(x, m):
    """softmax(gelu(x) / 2 + m) over the last dim; x [B,S,S] split on B, m [S,S]."""
    return torch.softmax(F.gelu(x) * 0.5 + m, dim=-1)


def silu_residual(x, w, y):
    """tanh(x + 2 silu(x @ w) - y); x, y [S,D] replicated, w [D,D] split on columns."""
    return torch.tanh(x + F.silu(x @ w) * 2.0 - y)


def reductions(x):
    """sum(exp(x - max x)) + mean(x^2) over the last dim; x [B,S,D] split on B."""
    return torch.exp(x - x.amax(-1, keepdim=True)).sum(-1) + x.pow(2).mean(-1)


def mask_softmax(scores, mask):
    """softmax(scores + (1 - mask) * -1e4); scores [B,H,S,S] split on H, mask int64 [B,S] of 0 / 1."""
    bias = (1.0 - mask[:, None, None, :].to(torch.float32)) * -10000.0
    return torch.softmax(scores + bias, dim=-1)


def rotary(x, cos, sin):
    """Rotary embedding x * cos + cat(-x2, x1) * sin (x1, x2: halves of the last dim); x [B,H,S,D] split on H."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _mask(b: int, s: int, gen: torch.Generator) -> torch.Tensor:
    m = torch.ones(b, s, dtype=torch.int64)
    m[:, s // 2:] = torch.randint(0, 2, (b, s - s // 2), generator=gen)
    return m


CASES = {  # name: (fn, arguments from a generator, input specs, output spec)
    "ln_bias_residual": (ln_bias_residual, lambda g: [torch.randn(2, 4, 16, generator=g), torch.randn(16, 8, generator=g),
                                                      torch.randn(8, generator=g), torch.randn(2, 4, 8, generator=g),
                                                      torch.randn(8, generator=g) + 1, torch.randn(8, generator=g)],
                         [P(None, None, "tp"), P("tp", None), P(), P(), P(), P()], P()),
    "gelu_softmax": (gelu_softmax, lambda g: [torch.randn(4, 6, 6, generator=g), torch.randn(6, 6, generator=g)],
                     [P("tp"), P()], P("tp")),
    "silu_residual": (silu_residual, lambda g: [torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g) / 3,
                                                torch.randn(4, 8, generator=g)], [P(), P(None, "tp"), P()], P()),
    "reductions": (reductions, lambda g: [torch.randn(8, 3, 5, generator=g)], [P("tp")], P("tp")),
    "rotary": (rotary, lambda g: [torch.randn(2, 3, 5, 8, generator=g), torch.randn(5, 8, generator=g),
                                  torch.randn(5, 8, generator=g)], [P(None, "tp"), P(), P()], P(None, "tp")),
    "mask_softmax": (mask_softmax, lambda g: [torch.randn(2, 4, 6, 6, generator=g), _mask(2, 6, g)],
                     [P(None, "tp"), P()], P(None, "tp")),
}
