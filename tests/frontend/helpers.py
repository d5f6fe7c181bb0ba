"""Single-device execution of an imported program with the runtime kernels (test oracle)."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from spmd.frontend.torch_export import ImportedProgram, import_program
from spmd.runtime.kernels import run_kernel


def run_entry(prog: ImportedProgram, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Execute the entry computation instruction by instruction; returns the flat outputs."""
    env: dict[int, object] = {}
    params = prog.module.entry.parameters
    assert len(params) == len(inputs), (len(params), len(inputs))
    for p, x in zip(params, inputs, strict=True):
        env[id(p)] = x
    for inst in prog.module.entry.instructions:
        if inst.opcode == "parameter":
            continue
        env[id(inst)] = run_kernel(inst, [env[id(o)] for o in inst.operands])
    root = env[id(prog.module.entry.root)]
    return list(root) if isinstance(root, tuple) else [root]


def run_imported(fn, args, kwargs=None):
    """Import ``fn`` and run it through the kernels; returns (program, outputs unflattened)."""
    prog = import_program(fn, args, kwargs)
    leaves = pytree.tree_leaves((tuple(args), kwargs or {}))
    user = [leaves[i] for i in prog.user_leaf_indices]
    flat = run_entry(prog, user + list(prog.param_values))
    return prog, pytree.tree_unflatten(flat, prog.out_tree)


def assert_close_tree(got, want, rtol=1e-5, atol=1e-5):
    g, gs = pytree.tree_flatten(got)
    w, ws = pytree.tree_flatten(want)
    assert gs == ws, (gs, ws)
    for a, b in zip(g, w, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def sdpa_inputs(b: int = 4, h: int = 4, s: int = 6, d: int = 8, mask: str | None = None,
                dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple:
    """Seeded q, k, v ``[b, h, s, d]`` of ``dtype`` and the mask: None, a bool ``[b, 1, s, s]`` (every
    row attends to key 0) or a float ``[s, s]`` (``mask`` = None, "bool" or "float")."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(dtype) for _ in range(3))
    if mask == "bool":
        m = torch.rand(b, 1, s, s, generator=g) > 0.4
        m[..., 0] = True
        return q, k, v, m
    if mask == "float":
        return q, k, v, torch.randn(s, s, generator=g).to(dtype)
    return q, k, v, None


def checkpointed_attention_grads(causal: bool, loss):
    """``f(q, k, v[, mask])``: ``torch.autograd.grad`` of ``loss(out)`` over q, k, v, with the
    attention ``out`` computed inside a non-reentrant ``torch.utils.checkpoint``."""
    import torch.nn.functional as F
    import torch.utils.checkpoint as cp

    def attn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    def f(q, k, v, *mask):
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = cp.checkpoint(attn, q, k, v, mask[0] if mask else None, use_reentrant=False)
        return torch.autograd.grad(loss(out), (q, k, v))
    return f
