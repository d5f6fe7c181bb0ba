"""Custom-call targets for ops along one dim: sort, topk, cumsum, cumprod, cummax, cummin.

Each target runs PyTorch's own kernel on the local array, so its results (including the order
of ties, which ``torch.sort(stable=False)`` and ``torch.topk`` leave to the implementation)
are those of PyTorch eager on the same device type. A multi-output op (sort, topk) is one
custom call per output, told apart by ``backend_config["output"]`` (``"values"`` or
``"indices"``); both run the same deterministic kernel on the same operand.

=========  ========  ==================================================================
target     operands  backend_config
=========  ========  ==================================================================
sort       x         dim, descending (False), stable (False), output (values | indices)
topk       x         dim, k, largest (True), sorted (True), output (values | indices)
cumsum     x         dim (result dtype = x's dtype: the frontend converts x first)
cumprod    x         dim (same)
cummax     x         dim, output ("values" | "indices"): torch.cummax (NaN and ties as PyTorch)
cummin     x         dim, output (same)
=========  ========  ==================================================================

Sharding rules: sort and topk are ``"reduction-last-dims"`` with ``dim`` as the one dim that must
be unsharded (XLA's SPMD partitioner does the same for sort: the sorted dim is all-gathered, the
other dims pass their shardings through), and so are cummax and cummin; cumsum and cumprod
are ``"scan"``: every dim keeps its sharding, a sharded scanned dim through a parallel prefix
(``spmd.passes.partition_scan``).
The result of ``topk`` has ``k`` rows along ``dim`` instead of the operand's ``n``; the rule
reads shardings only, and that dim is unsharded on both sides.
Indices are s64, global along ``dim`` (the dim is whole on every device).
"""

from __future__ import annotations

from typing import Any

import torch

Config = dict[str, Any]


def _dim(config: Config, rank: int) -> int:
    return int(config.get("dim", -1)) % max(rank, 1)


def _along_dim(config: Config, rank: int) -> tuple[int, ...]:
    return (_dim(config, rank),) if rank else ()


def _pick(pair: tuple[torch.Tensor, torch.Tensor], config: Config) -> torch.Tensor:
    output = config.get("output", "values")
    if output not in ("values", "indices"):
        raise ValueError(f"backend_config output: expected 'values' or 'indices', got {output!r}")
    return pair[0] if output == "values" else pair[1]


def _sort(operands: list[torch.Tensor], config: Config) -> torch.Tensor:
    """``torch.sort`` of x along ``dim``: values (x's dtype) or indices (int64), x's shape."""
    x = operands[0]
    out = torch.sort(x, dim=_dim(config, x.dim()), descending=bool(config.get("descending", False)),
                     stable=bool(config.get("stable", False)))
    return _pick((out.values, out.indices), config)


def _topk(operands: list[torch.Tensor], config: Config) -> torch.Tensor:
    """``torch.topk`` of x along ``dim``: values or int64 indices, ``k`` rows along ``dim``."""
    x = operands[0]
    out = torch.topk(x, int(config["k"]), dim=_dim(config, x.dim()), largest=bool(config.get("largest", True)),
                     sorted=bool(config.get("sorted", True)))
    return _pick((out.values, out.indices), config)


def _cumsum(operands: list[torch.Tensor], config: Config) -> torch.Tensor:
    """Inclusive prefix sum of x along ``dim`` in x's dtype (``torch.cumsum``)."""
    x = operands[0]
    return torch.cumsum(x, dim=_dim(config, x.dim()), dtype=x.dtype)


def _cumprod(operands: list[torch.Tensor], config: Config) -> torch.Tensor:
    """Inclusive prefix product of x along ``dim`` in x's dtype (``torch.cumprod``)."""
    x = operands[0]
    return torch.cumprod(x, dim=_dim(config, x.dim()), dtype=x.dtype)


def _cumextreme(fn):
    def kernel(operands: list[torch.Tensor], config: Config) -> torch.Tensor:
        x = operands[0]
        if x.dim() == 0:
            return _pick((x, torch.zeros((), dtype=torch.int64, device=x.device)), config)
        out = fn(x, dim=_dim(config, x.dim()))
        return _pick((out.values, out.indices), config)
    kernel.__doc__ = f"``torch.{fn.__name__}`` of x along ``dim``: running values (x's dtype) or int64 indices."
    return kernel


#: (target, kernel, sharding-rule kind, unsharded dims, doc): ``spmd.ir.custom_calls`` builds the specs.
SORT_CALLS = (
    ("sort", _sort, "reduction-last-dims", _along_dim, "sort along config['dim'] (values or indices)"),
    ("topk", _topk, "reduction-last-dims", _along_dim, "k largest/smallest along config['dim']"),
    ("cumsum", _cumsum, "scan", None, "inclusive prefix sum along config['dim']"),
    ("cumprod", _cumprod, "scan", None, "inclusive prefix product along config['dim']"),
    ("cummax", _cumextreme(torch.cummax), "reduction-last-dims", _along_dim,
     "running maximum along config['dim'] (values or indices; the dim is gathered)"),
    ("cummin", _cumextreme(torch.cummin), "reduction-last-dims", _along_dim,
     "running minimum along config['dim'] (values or indices; the dim is gathered)"),
)
