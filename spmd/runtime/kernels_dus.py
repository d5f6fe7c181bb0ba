"""A dynamic-update-slice along one dim as one generated kernel (the KV-cache write of a decode step).

Unfused, writing ``update`` into ``x`` at a device-resident start takes a clamp of the start,
an ``arange`` add for rows past the first and ``index_copy_``: two or three launches. Under
CUDA graphs (the decode step) the same write traced with ``make_fx`` and compiled by PyTorch
Inductor is one Triton kernel that clamps, indexes and stores, into ``x`` itself (a mutated
graph input, as ``spmd.runtime.kernels_fusion`` stores fusions into their buffers). gpt-fast's
``torch.compile``-d KV-cache update compiles to the same single kernel.

The compiled writer follows ``kernels_fusion``'s policy (``SPMD_FUSION_COMPILER``): generated
kernels for calls captured into CUDA graphs and their warm-up call, the unfused kernels for
everything else. A compile failure is counted (``dus.fallback.<exception type>``) and the
unfused path is kept for that layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spmd import metrics
from spmd.compile_lock import COMPILE_LOCK
from spmd.runtime import kernels_fusion as kf

Tensor = torch.Tensor
_cache: dict[tuple, Callable[..., None] | None] = {}


def write_rows(x: Tensor, dim: int, start: Tensor, update: Tensor) -> bool:
    """Write ``update`` into ``x`` in place at rows ``clamp(start, 0, n - size) ...`` of ``dim`` with
    one generated kernel; False (nothing written) where the caller's unfused path must run.

    x: a tensor (n = x.shape[dim]) on a device whose fusions are compiled (CUDA by default, any
    device under ``SPMD_FUSION_COMPILER=inductor``); update: x's shape except ``size`` rows along
    ``dim``; start: an integer scalar tensor on x's device.
    """
    if start.device != x.device or update.dtype != x.dtype:
        return False
    mode = kf.fusion_compiler(x.device)
    if mode == "eager" or (mode == "graphs" and not kf._graph_call()):
        return False
    key = (str(x.device), dim, tuple(x.shape), x.stride(), x.dtype, tuple(update.shape), update.stride(),
           update.dtype, start.dtype, tuple(start.shape))
    writer = _cache.get(key, False)
    if writer is False:
        writer = _compile(key, x, dim, start, update)
    if writer is None:
        return False
    writer(x, update, start)
    return True


def _compile(key: tuple, x: Tensor, dim: int, start: Tensor, update: Tensor) -> Callable[..., None] | None:
    from torch.fx.experimental.proxy_tensor import make_fx

    n, size = x.shape[dim], update.shape[dim]

    def write(buf: Tensor, upd: Tensor, s: Tensor) -> Tensor:
        rows = s.to(torch.int64).reshape(1).clamp(0, n - size) + torch.arange(size, device=s.device)
        return buf.index_copy_(dim, rows, upd)

    with COMPILE_LOCK:
        if key in _cache:
            return _cache[key]
        try:
            with torch.no_grad(), metrics.timer("dus.compile"):
                scratch, want = x.clone(), x.clone()
                write(want, update, start)
                gm = make_fx(write)(scratch, update, start)
                compiled = torch._inductor.compile(gm, [scratch, update, start])
                compiled(scratch, update, start)
                if not torch.equal(scratch, want):
                    raise RuntimeError("compiled dynamic-update-slice wrote other values")
            _cache[key] = compiled
        except Exception as exc:  # noqa: BLE001 - any compiler failure keeps the unfused kernels
            metrics.counter(f"dus.fallback.{type(exc).__name__}").inc()
            _cache[key] = None
        return _cache[key]
