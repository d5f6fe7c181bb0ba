"""Shared check of the pass tests: a pass keeps what a module computes, on fresh random inputs."""

from __future__ import annotations

import torch

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module


def run_pass_checked(pass_obj, text: str, exact: bool = False, tol: float = 1e-5) -> tuple[str, object]:
    """Run ``pass_obj`` on the module of ``text``; verify the result and compare it with ``text``.

    Every partition gets fresh random float64 inputs (cast to each parameter's dtype, shifted by
    0.1 so none is zero); outputs must have the same dtypes and shapes and be equal (``exact``)
    or close within ``tol``. Returns (printed result, result module).
    """
    before, mod = parse_module(text), parse_module(text)
    pass_obj.run(mod)
    verify_module(mod)
    args = [[torch.randn(pp.shape.dims, dtype=torch.float64).to(pp.shape.torch_dtype) + 0.1
             for pp in before.entry.parameters] for _ in range(mod.num_partitions)]
    for want, got in zip(evaluate_spmd(before, args), evaluate_spmd(mod, args), strict=True):
        for w, g in zip(want, got, strict=True):
            assert w.dtype == g.dtype and w.shape == g.shape
            if exact:
                assert torch.equal(g, w)
            else:
                assert torch.allclose(g.double(), w.double(), rtol=tol, atol=tol)
    return print_module(mod), mod
