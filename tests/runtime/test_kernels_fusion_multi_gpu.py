"""Multi-output fusions on CUDA: one generated Triton kernel storing every output in place, and an
AdamW train step (CUDA graphs) against torch.optim. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from spmd import metrics
from spmd.ir.text import parse_module
from spmd.passes.multi_output_fusion import MultiOutputFusion
from spmd.runtime import kernels_fusion as kf
from spmd.runtime.kernels import compile_kernel
from tests.passes.multi_output_fusion_programs import ADAMW

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _auto_compiler(monkeypatch):
    monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    monkeypatch.setattr(kf, "_cache", {})
    monkeypatch.setattr(kf, "_logged", set())
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _fallbacks() -> dict[str, int]:
    return {k: v for k, v in metrics.snapshot()["counters"].items() if k.startswith("fusion.fallback.")}


def test_adamw_update_is_one_triton_kernel_storing_in_place():
    from torch.profiler import ProfilerActivity, profile

    mod = parse_module(ADAMW.replace("[8,4]", "[1024,512]"))
    MultiOutputFusion().run(mod)
    (inst,) = [i for i in mod.entry.instructions if i.opcode == "fusion"]
    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(3)
    ops = [(torch.randn(o.shape.dims, generator=gen) + 0.1).to(dev) for o in inst.operands]  # g, m, v, p
    want = kf.interpreter(inst.attrs["calls"], dev)(*[t.clone() for t in ops])
    kernel = compile_kernel(inst, dev)
    before = _fallbacks()
    with kf.graph_warmup():
        ptrs = [t.data_ptr() for t in ops[1:]]
        got = kernel(ops, ops[1:])  # compiles (checked on copies), then stores m', v', p' over m, v, p
        torch.cuda.synchronize(dev)
        assert [t.data_ptr() for t in got] == ptrs
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            kernel(ops, ops[1:])
            torch.cuda.synchronize(dev)
    assert _fallbacks() == before
    names = [e.key for e in prof.key_averages()]
    if not names:
        pytest.skip("the profiler recorded no CUDA kernels here (no CUPTI)")
    kernels = [n for n in names if "triton" in n or "copy" in n.lower() or "elementwise" in n.lower()]
    assert len(kernels) == 1 and "triton" in kernels[0], names


def test_adamw_train_step_on_one_gpu_equals_torch_optim():
    import torch.nn as nn
    import torch.nn.functional as F

    from spmd import Mesh
    from spmd.train import AdamW, make_train_step

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).cuda()

    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    ts = make_train_step(model(), Mesh.create(("dp",), devices="cuda:1"), None,
                         lambda apply, b: F.mse_loss(apply(b["x"]), b["y"]), optimizer=AdamW(lr=1e-2, weight_decay=0.1))
    g = torch.Generator().manual_seed(1)
    before = _fallbacks()
    for _ in range(6):
        b = {"x": torch.randn(8, 32, generator=g).cuda(), "y": torch.randn(8, 32, generator=g).cuda()}
        got = float(ts.step(b)["loss"])
        opt.zero_grad()
        loss = F.mse_loss(ref(b["x"]), b["y"])
        loss.backward()
        opt.step()
        assert abs(got - float(loss)) <= 1e-4 * abs(float(loss))
    assert _fallbacks() == before
    assert "get-tuple-element" in ts.lowered.as_text("multi-output-fusion")
    sd = ts.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd[f"param.{name}"].cuda(), p.detach(), rtol=0, atol=1e-4, msg=name)
