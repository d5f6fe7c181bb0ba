"""Memory analysis on one GPU: the planned peak bounds what PyTorch's allocator measures for a train step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.mark.gpu
@pytest.mark.parametrize("remat", ["none", "full"])
def test_planned_peak_bounds_max_memory_allocated(remat):
    """Eager (no CUDA graph) GPT train step, bf16 compute: the bytes the step allocates on top of what
    is resident before it (arguments, arena, constants, cuBLAS workspaces) stay within the planned heap
    peak (allocator rounding: 512-byte blocks, plus 1 MiB)."""
    from spmd import Mesh
    from spmd.models.gpt import gpt3_layers
    from spmd.passes.pipeline import CompileOptions
    from spmd.train import AdamW, make_train_step

    torch.manual_seed(0)
    model = gpt3_layers(2, small=True, seed=0).train().requires_grad_()
    hidden = model.layers[0].mlp.fc_in.in_features
    ts = make_train_step(model, Mesh.create(("dp",), devices="cuda:1"), None,
                         lambda apply, b: F.mse_loss(apply(b["x"]), b["y"]), optimizer=AdamW(lr=1e-3),
                         compute_dtype=torch.bfloat16, options=CompileOptions(remat=remat, cuda_graphs=False))
    batch = ts.place_batch({"x": torch.randn(2, 512, hidden), "y": torch.randn(2, 512, hidden)})
    ts.step(batch)  # compile, allocate the arena and the library workspaces
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ts.step(batch)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - before
    report = ts.memory_analysis()
    planned_heap = report.peak_size_bytes - report.argument_size_bytes - report.arena_size_bytes \
        - report.constant_size_bytes
    assert grown <= planned_heap * 1.02 + 2**20, (grown, report)
