"""attention_layout (part of fuse-elementwise): a fused q / k is stored [B, S, H, D] and read as a
view, so the attention output's reshape back to [B, S, H * D] copies nothing. Golden HLO text,
the cases left alone, and a Llama stack against float64 PyTorch eager with the copies counted."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import re
import sys

import pytest
import torch
from expecttest import TestCase
from torch.utils._python_dispatch import TorchDispatchMode

import spmd
import spmd.passes.fuse_elementwise as fe
from spmd.models.llama import llama_layers
from spmd.models.plans import llama_plan
from tests.passes.fuse_elementwise_programs import module
from tests.passes.test_fuse_elementwise import entry, fuse

ATTN = 'custom_call_target="attention", backend_config={"is_causal":true,"has_mask":false}'


def _program(s: int, q_read_twice: bool = False) -> str:
    """q and k: a multiply-add over a transposed slice of the projection (as rotary embeddings);
    v: a transposed view. B=2, H=2, D=4, S=``s``. ``q_read_twice``: the output also reads q."""
    b, h, d = 2, 2, 4
    t, r = f"f32[{b},{h},{s},{d}]", f"f32[{b},{s},{h * d}]"
    body = [
        *[f"%{n}s = {r} slice(%qkv), slice={{[0:{b}:1], [0:{s}:1], [{k * h * d}:{(k + 1) * h * d}:1]}}"
          for k, n in enumerate("qkv")],
        *[f"%{n}r = f32[{b},{s},{h},{d}] reshape(%{n}s)" for n in "qkv"],
        *[f"%{n}t = {t} transpose(%{n}r), dimensions={{0,2,1,3}}" for n in "qkv"],
        f"%cb = {t} broadcast(%cos), dimensions={{2,3}}",
        f"%qm = {t} multiply(%qt, %cb)",
        f"%q = {t} add(%qm, %qt)",
        f"%km = {t} multiply(%kt, %cb)",
        f"%k = {t} add(%km, %kt)",
        f"%a = {t} custom-call(%q, %k, %vt), {ATTN}",
        f"%at = f32[{b},{s},{h},{d}] transpose(%a), dimensions={{0,2,1,3}}",
        f"%o = {r} reshape(%at)",
    ]
    if q_read_twice:
        body += [f"%qb = f32[{b},{s},{h},{d}] transpose(%q), dimensions={{0,2,1,3}}", f"%qo = {r} reshape(%qb)",
                 f"ROOT %out = {r} add(%o, %qo)"]
    else:
        body[-1] = "ROOT " + body[-1]
    return module([f"qkv: f32[{b},{s},{3 * h * d}]", f"cos: f32[{s},{d}]"], body, r)


class GoldenTest(TestCase):
    def test_fused_q_and_k_are_stored_bshd_and_read_through_a_transpose(self):
        out, _ = fuse(_program(8))
        self.assertExpectedInline(entry(out).split("{", 1)[1].replace("\n\n", "\n"), """\

  %qkv = f32[2,8,24] parameter(0)
  %cos = f32[8,4] parameter(1)
  %vs = f32[2,8,8] slice(%qkv), slice={[0:2:1], [0:8:1], [16:24:1]}
  %vr = f32[2,8,2,4] reshape(%vs)
  %vt = f32[2,2,8,4] transpose(%vr), dimensions={0,2,1,3}
  %fusion.2 = f32[2,8,2,4] fusion(%qkv, %cos), calls=%fused_computation.2, kind=kLoop
  %fusion.1.t = f32[2,2,8,4] transpose(%fusion.2), dimensions={0,2,1,3}
  %fusion.3 = f32[2,8,2,4] fusion(%qkv, %cos), calls=%fused_computation.3, kind=kLoop
  %fusion.t = f32[2,2,8,4] transpose(%fusion.3), dimensions={0,2,1,3}
  %a = f32[2,2,8,4] custom-call(%fusion.1.t, %fusion.t, %vt), custom_call_target="attention", backend_config={"is_causal":true,"has_mask":false}
  %at = f32[2,8,2,4] transpose(%a), dimensions={0,2,1,3}
  ROOT %o = f32[2,8,8] reshape(%at)
}
""")
        roots = re.findall(r"ROOT %\S+ = f32\[2,8,2,4\] transpose\(%\S+\), dimensions=\{0,2,1,3\}", out)
        assert len(roots) == 2  # both fused computations end in the transpose to [B, S, H, D]

    def test_a_decode_shaped_call_is_left_alone(self):
        out, _ = fuse(_program(1))
        assert ".t = " not in out and "custom-call(%fusion" in out

    def test_a_fusion_with_another_reader_is_left_alone(self):
        out, _ = fuse(_program(8, q_read_twice=True))
        q, k = re.search(r"custom-call\((%[\w.]+), (%[\w.]+), ", out).groups()
        assert not q.endswith(".t") and k.endswith(".t")  # q, read by the output too, keeps its layout


class _Copies(TorchDispatchMode):
    """Counts aten copies (copy_, clone) whose result has ``dims``."""

    def __init__(self, dims: tuple[int, ...]) -> None:
        super().__init__()
        self.dims, self.count = dims, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.clone.default) and tuple(out.shape) == self.dims:
            self.count += 1
        return out


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_llama_attention_output_is_not_copied_and_matches_float64(monkeypatch, kv_heads, platform):
    """Two Llama layers (rotary q and k), 4 heads, 4 or 2 KV heads: the attention output's
    transpose-and-reshape copies once per layer without the rewrite and never with it (on a GPU
    with the fusions as Inductor kernels, whose results are stored row-major: no copy after them)."""
    if platform == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if platform == "cuda":
        monkeypatch.setenv("SPMD_FUSION_COMPILER", "inductor")
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    b, s = 2, 8
    model = llama_layers("llama2-7b", 2, small=True, seed=3, num_kv_heads=kv_heads)
    x = torch.randn(b, s, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    want = model.double()(x.double())
    model.to(device=platform, dtype=torch.float32)
    heads, hidden = model.config.num_heads, model.config.hidden_size
    counts = {}
    for name in ("rewrite", "no-rewrite"):
        if name == "no-rewrite":
            monkeypatch.setattr(fe, "attention_operand_layouts", lambda *a: 0)
        monkeypatch.setattr(sys.modules["spmd.jit"], "_GLOBAL_CACHE", {})  # compile again, not a cache hit
        mesh = spmd.Mesh.create({"tp": 1}, devices=f"{platform}:1")
        pm = spmd.parallelize(model, mesh, llama_plan("tp"), options=spmd.CompileOptions(cuda_graphs=False))
        placed = pm.place_inputs(x.to(platform))
        pm(*placed)  # first call: lazy setup, fusions compiled
        with _Copies((b, s, heads, hidden // heads)) as mode:
            got = pm(*placed).to_torch()
        counts[name] = mode.count
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-4)
    assert counts == {"rewrite": 0, "no-rewrite": 2}
