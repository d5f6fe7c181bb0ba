"""Small programs for the dispatch benchmark, with their tensor-parallel shardings.

Each :class:`Workload` is a plain PyTorch function, the shapes of its tensor arguments and the
PartitionSpec entries of each argument over the mesh axis ``"tp"`` (Megatron-style: first
matmul of a pair split by columns, second by rows; activations replicated). Sizes divide by
tp up to 8. ``benchmarks/anchors/jax_xla.py`` mirrors these functions in ``jax.numpy``.

MiniLM (``minilm_case``) comes from ``spmd.models`` and is built on demand: real weights when
the model files are found, else the same architecture with seeded random weights (dispatch
cost does not depend on the weight values).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily: the JAX child reads BLOCK_HEADS and WORKLOADS
    import torch

BLOCK_HEADS = 8


def tiny_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y; x, y float32 [1024] sharded over tp."""
    return x + y


def mlp2(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """relu(x @ w1) @ w2; x [B, D] replicated, w1 [D, F] column-split, w2 [F, D] row-split."""
    import torch

    return torch.relu(x @ w1) @ w2


def block(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor,
          w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One pre-norm transformer block on x [S, D]: attention with BLOCK_HEADS heads, then a GELU MLP.

    wq/wk/wv [D, D] and w1 [D, F] are column-split (by heads for attention), wo [D, D] and
    w2 [F, D] row-split. LayerNorms have no affine parameters. Returns [S, D].
    """
    import torch
    import torch.nn.functional as F

    s, d = x.shape
    dh = d // BLOCK_HEADS
    h = F.layer_norm(x, (d,))
    q = (h @ wq).reshape(s, BLOCK_HEADS, dh).transpose(0, 1)  # [H, S, dh]
    k = (h @ wk).reshape(s, BLOCK_HEADS, dh).transpose(0, 1)
    v = (h @ wv).reshape(s, BLOCK_HEADS, dh).transpose(0, 1)
    p = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(dh), dim=-1)  # [H, S, S]
    o = (p @ v).transpose(0, 1).reshape(s, d)
    x = x + o @ wo
    h = F.layer_norm(x, (d,))
    return x + F.gelu(h @ w1) @ w2


@dataclass(frozen=True)
class Workload:
    """A dispatch workload: function, argument shapes, per-argument specs over "tp", output spec."""

    name: str
    fn: Callable[..., torch.Tensor]
    shapes: tuple[tuple[int, ...], ...]
    specs: tuple[tuple[str | None, ...], ...]
    out_spec: tuple[str | None, ...]
    dtype: str = "float32"


WORKLOADS: dict[str, Workload] = {
    "add": Workload("add", tiny_add, ((1024,), (1024,)), (("tp",), ("tp",)), ("tp",)),
    "mlp": Workload("mlp", mlp2, ((16, 1024), (1024, 4096), (4096, 1024)),
                    ((), (None, "tp"), ("tp", None)), ()),
    "block": Workload("block", block,
                      ((128, 512), (512, 512), (512, 512), (512, 512), (512, 512), (512, 2048), (2048, 512)),
                      ((), (None, "tp"), (None, "tp"), (None, "tp"), ("tp", None), (None, "tp"), ("tp", None)),
                      ()),
}


def make_inputs(wl: Workload, device: Any, seed: int) -> list[torch.Tensor]:
    """Fresh random inputs for ``wl`` on ``device`` (normal, scaled 1/sqrt(last dim); never zeros)."""
    import torch

    from benchmarks.common import fresh_randn

    dtype = getattr(torch, wl.dtype)
    return [fresh_randn(shape, dtype, device, seed + i) for i, shape in enumerate(wl.shapes)]


@dataclass(frozen=True)
class ModelCase:
    """MiniLM as a function of (params dict, input_ids, attention_mask) plus its inputs and specs."""

    fn: Callable[..., torch.Tensor]
    params: dict[str, torch.Tensor]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    param_specs: dict[str, Any] | None
    real_weights: bool
    module: Any = None  # the nn.Module itself (``fn`` calls it with ``params``)


def minilm_case(device: Any, seed: int, batch: int = 8, seq: int = 128, mesh: Any = None) -> ModelCase:
    """all-MiniLM-L6-v2 from ``spmd.models`` on ``device`` with a random token batch [batch, seq].

    ``param_specs`` is ``spmd.models.plans.bert_plan`` resolved for ``mesh`` (None without a
    mesh). Raises ImportError / ValueError when ``spmd.models`` cannot provide the model.
    """
    import torch

    from spmd.models import minilm
    from spmd.models.bert import BertConfig, BertSentenceEncoder
    from spmd.models.common import init_random_

    try:
        model, real = minilm.load_model(), True
    except (ValueError, ImportError, OSError):
        model, real = init_random_(BertSentenceEncoder(BertConfig()), seed), False
    model = model.to(device).eval().requires_grad_(False)
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (batch, seq), generator=gen).to(device)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[batch // 2:, seq * 3 // 4:] = 0  # some padded rows
    mask = mask.to(device)

    def fn(p: dict[str, torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (input_ids, attention_mask))

    specs = None
    if mesh is not None:
        from spmd.models.plans import bert_plan, resolve_plan

        specs = resolve_plan(model, mesh, bert_plan("tp"))
    return ModelCase(fn, params, ids, mask, specs, real, model)
