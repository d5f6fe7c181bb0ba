"""The communication passes of a training step on real GPUs (two or more): bucketed and async
collectives and windowed einsum on the communication / compute streams, with CUDA graphs as
configured by default, equal PyTorch eager + torch.optim step by step."""

from __future__ import annotations

import pytest
import torch
from test_step_overlap import MEGATRON_PLAN, _adamw, _megatron_mlp, _run, _sgd, _two_layer

from spmd import Mesh
from spmd.passes.pipeline import CompileOptions

CASES = {
    "dp": dict(model_fn=_two_layer, plan=None, optimizer=_adamw, fsdp=False, dp_axis="dp"),
    "fsdp": dict(model_fn=_two_layer, plan=None, optimizer=_adamw, fsdp=True, dp_axis="dp"),
    "tp-sp": dict(model_fn=_megatron_mlp, plan=MEGATRON_PLAN, optimizer=_sgd, fsdp=False, dp_axis="tp"),
}
VARIANTS = {
    "sync": CompileOptions(bucket_size_bytes=0, async_collectives=False, windowed_einsum="off"),
    "default": CompileOptions(),
    "small-buckets": CompileOptions(bucket_size_bytes=1024),
    "windowed": CompileOptions(windowed_einsum="on", bucket_size_bytes=1024),
}


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(CASES))
def test_train_step_matches_eager_on_two_gpus(case, variant):
    c = CASES[case]
    axis = "tp" if case == "tp-sp" else "dp"
    mesh = Mesh.create((axis,), devices="cuda:2")
    _run(c["model_fn"], mesh, c["plan"], *c["optimizer"](), dp_axis=c["dp_axis"], fsdp=c["fsdp"],
         options=VARIANTS[variant], loss_rtol=1e-4)
    torch.cuda.synchronize()
