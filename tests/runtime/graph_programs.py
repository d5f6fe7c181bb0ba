"""Programs and argument builders shared by the CUDA-graph runner tests (CPU and GPU)."""

from __future__ import annotations

import torch

import spmd
from spmd import PartitionSpec as P


def unwrap(executable):
    """The ``Executable`` behind a ``GraphRunner`` (or the executable itself)."""
    return getattr(executable, "executable", executable)


def mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def matmul(x, w):
    return x @ w


def compile_mlp(devices: str, m: int = 8, d: int = 16, h: int = 32, cuda_graphs=False):
    """2-layer MLP, tensor parallel: x replicated, w1 column-, w2 row-sharded, all-reduced output."""
    mesh = spmd.Mesh.create(("tp",), devices=devices)
    j = spmd.jit(mlp, mesh=mesh, in_shardings=(P(), P(None, "tp"), P("tp", None)), out_shardings=P(),
                 options=spmd.CompileOptions(cuda_graphs=cuda_graphs))
    shapes = [(m, d), (d, h), (h, d)]
    return j.lower(*[torch.randn(s) for s in shapes]).compile(), shapes


def compile_windowed(devices: str, m: int = 16, k: int = 32, f: int = 8, cuda_graphs=False):
    """x @ w with x P("tp", None), w P(None, "tp"), out P(None, "tp"): windowed einsum on 2 streams."""
    mesh = spmd.Mesh.create(("tp",), devices=devices)
    opts = spmd.CompileOptions(windowed_einsum="on", num_compute_streams=2, cuda_graphs=cuda_graphs)
    j = spmd.jit(matmul, mesh=mesh, in_shardings=(P("tp", None), P(None, "tp")), out_shardings=P(None, "tp"),
                 options=opts)
    shapes = [(m, k), (k, f)]
    return j.lower(*[torch.randn(s) for s in shapes]).compile(), shapes


def shards(compiled, tensors):
    """Per flat input, its per-device buffers (``Executable.run``'s ``args``)."""
    return [spmd.device_put(t, s)._buffers for t, s in zip(tensors, compiled.input_shardings, strict=True)]


def global_out(compiled, per_device, like: torch.Tensor, j: int = 0) -> torch.Tensor:
    """The global value of output ``j`` (shaped like ``like``) from per-device buffers, on the CPU."""
    from spmd.array import ShardedArray

    arr = ShardedArray._from_buffers(list(per_device), compiled.output_shardings[j], like.shape, like.dtype)
    return arr.to_torch()


def decode_step(cache, pos, x, w):
    """A decode-shaped step: ``cache`` [B, H, S, D] gets ``tanh(x @ w)`` at slot ``pos`` (an
    index_copy: a dynamic-update-slice at a device position); returns ``(readout [B, H, D],
    pos + 1, cache)``. Donating ``cache`` and ``pos`` writes outputs 2 and 1 into their buffers."""
    new = torch.tanh(x @ w)[:, :, None, :]
    cache = cache.index_copy(2, pos.reshape(1), new)
    return (cache * x[:, :, None, :]).sum(2), pos + 1, cache


DECODE_SHAPES = {"cache": (2, 4, 8, 16), "x": (2, 4, 16), "w": (16, 16)}


def compile_decode(devices: str, donate=(0, 1), cuda_graphs=False):
    """``decode_step`` with the cache and x sharded over heads on ``tp``, pos and w replicated."""
    mesh = spmd.Mesh.create(("tp",), devices=devices)
    heads = P(None, "tp")
    j = spmd.jit(decode_step, mesh=mesh, in_shardings=(heads, P(), heads, P()), out_shardings=(heads, P(), heads),
                 donate_argnums=donate, options=spmd.CompileOptions(cuda_graphs=cuda_graphs))
    s = DECODE_SHAPES
    return j.lower(torch.randn(s["cache"]), torch.tensor(0), torch.randn(s["x"]), torch.randn(s["w"])).compile()


def counter(name: str) -> int:
    """The value of the ``spmd.metrics`` counter ``name`` (0 when it was never bumped)."""
    from spmd import metrics

    return metrics.snapshot()["counters"].get(name, 0)


def under_graph_runner(compiled, backend=None, **opts):
    """``(Compiled, GraphRunner)``: ``compiled``'s executable under a ``GraphRunner`` with
    ``GraphOptions(**opts)`` (``backend``: e.g. ``HostReplayBackend`` on CPU; None = CUDA)."""
    from spmd.compiled import Compiled
    from spmd.runtime.graphs import GraphOptions, GraphRunner

    ex = unwrap(compiled.executable)
    runner = GraphRunner(ex, GraphOptions(**opts), **({} if backend is None else {"backend": backend(ex)}))
    c = Compiled(compiled.lowered, runner, compiled.output_shardings, [s for _, s, _ in compiled._outputs],
                 [d for _, _, d in compiled._outputs], compiled.buffers)
    return c, runner
