"""Reshapes of the attention result left out of the arena (``aliasing.layout_views``): the
reshape back to [B, S, H * D] views the attention kernel's [B, S, H, D] memory instead of
copying it; numerics against float64 PyTorch eager on fresh inputs."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import spmd
from spmd.runtime import aliasing

P = spmd.PartitionSpec
B, S, H, D = 2, 16, 4, 8


def _layers(x, wqkv, wo, mask):
    """Two attention layers with merged q/k/v projections, as MiniLM's (x: [B, S, H * D])."""
    for _ in range(2):
        qkv = x @ wqkv
        q, k, v = (qkv[..., i * H * D:(i + 1) * H * D].reshape(B, S, H, D).transpose(1, 2) for i in range(3))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + a.transpose(1, 2).reshape(B, S, H * D) @ wo
    return x


def _inputs(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H * D, generator=g)
    wqkv = torch.randn(H * D, 3 * H * D, generator=g) / (H * D) ** 0.5
    wo = torch.randn(H * D, H * D, generator=g) / (H * D) ** 0.5
    mask = torch.randn(B, 1, 1, S, generator=g)
    return tuple(t.to(dtype) for t in (x, wqkv, wo, mask))


class _Copies(TorchDispatchMode):
    """Counts the aten copies (copy_, clone) of [B, S, H, D] values (the transposed attention output)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.clone.default) and \
                tuple(out.shape) == (B, S, H, D):
            self.count += 1
        return out


def _compiled(n: int, dtype=torch.float32, platform: str = "cpu"):
    mesh = spmd.Mesh.create({"dp": n}, f"{platform}:{n}")
    specs = (P("dp"), P(), P(), P("dp"))
    return spmd.jit(_layers, mesh=mesh, in_shardings=specs, out_shardings=P("dp"),
                    options=spmd.CompileOptions(cuda_graphs=False)).lower(*_inputs(0, dtype)).compile()


@pytest.mark.parametrize("n", [1, 2])
def test_attention_reshape_has_no_arena_view_and_matches_float64(n):
    compiled = _compiled(n)
    program = compiled.executable.program
    reshapes = [t for t in program.thunks if getattr(t, "name", "").startswith("reshape")
                and t.out not in program.view_slots]
    assert reshapes and all(t.buffer == -1 for t in reshapes)
    for seed in (1, 2):  # the arena is reused by the second call
        xs = _inputs(seed)
        want = _layers(*[t.double() for t in xs])
        got = compiled(*xs).to_torch().double()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _copies_per_call(monkeypatch, dtype, platform: str) -> dict[str, int]:
    """Copies of the attention output in one call, with and without ``layout_views``; checks numerics."""
    xs = _inputs(3, dtype)
    counts = {}
    for name in ("views", "copies"):
        if name == "copies":
            monkeypatch.setattr(aliasing, "layout_views", lambda ops: set())
        monkeypatch.setattr(sys.modules["spmd.jit"], "_GLOBAL_CACHE", {})  # compile again, not a cache hit
        compiled = _compiled(1, dtype, platform)
        compiled(*xs)  # first call: lazy setup
        with _Copies() as mode:
            got = compiled(*xs).to_torch()
        counts[name] = mode.count
        want = _layers(*[t.double() for t in xs])
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)
    return counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_output_is_not_copied(monkeypatch, dtype):
    """One copy of the attention output per layer without ``layout_views``, none with it (the
    CPU flash kernel allocates [B, S, H, D] memory, as the CUDA kernels do)."""
    assert _copies_per_call(monkeypatch, dtype, "cpu") == {"views": 0, "copies": 2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_output_is_not_copied_on_cuda(monkeypatch, dtype):
    """The same on one GPU (flash / cuDNN / memory-efficient kernels): the reshape after each
    attention runs no kernel, which removes one copy kernel per layer from the GPU profile."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    assert _copies_per_call(monkeypatch, dtype, "cuda") == {"views": 0, "copies": 2}


def test_layout_views_only_follows_attention_results():
    """A reshape of a transposed dot result (no attention) keeps its arena view (its memory is
    row-major, so the reshape needs the copy)."""
    mesh = spmd.Mesh.create({"dp": 1}, "cpu:1")

    def fn(x, w):
        return (x @ w).reshape(B, S, H, D).transpose(1, 2).reshape(B, H, S * D) * 2

    x, w = torch.randn(B, S, H * D), torch.randn(H * D, H * D)
    compiled = spmd.jit(fn, mesh=mesh, in_shardings=(P(), P()), out_shardings=P(),
                        options=spmd.CompileOptions(cuda_graphs=False)).lower(x, w).compile()
    program = compiled.executable.program
    reshapes = [t for t in program.thunks if getattr(t, "name", "").startswith("reshape")
                and t.out not in program.view_slots]
    assert reshapes and all(t.buffer >= 0 for t in reshapes)
    torch.testing.assert_close(compiled(x, w).to_torch().double(), fn(x.double(), w.double()), rtol=1e-4, atol=1e-4)


def test_attention_of_a_computed_q_keeps_the_arena_copy():
    """A q computed by a kernel (here scaled, as rotary embeddings do) is row-major [B, H, S, D], and
    so is the attention output: its reshape copies anyway and keeps its arena view."""
    mesh = spmd.Mesh.create({"dp": 1}, "cpu:1")

    def fn(x, wqkv, wo, mask):
        qkv = x @ wqkv
        q, k, v = (qkv[..., i * H * D:(i + 1) * H * D].reshape(B, S, H, D).transpose(1, 2) for i in range(3))
        a = F.scaled_dot_product_attention(torch.tanh(q), k, v, attn_mask=mask)
        return a.transpose(1, 2).reshape(B, S, H * D) @ wo

    xs = _inputs(4)
    compiled = spmd.jit(fn, mesh=mesh, in_shardings=(P(),) * 4, out_shardings=P(),
                        options=spmd.CompileOptions(cuda_graphs=False)).lower(*xs).compile()
    program = compiled.executable.program
    reshapes = [t for t in program.thunks if getattr(t, "name", "").startswith("reshape")
                and t.out not in program.view_slots]
    assert reshapes and all(t.buffer >= 0 for t in reshapes)
    torch.testing.assert_close(compiled(*xs).to_torch().double(), fn(*[t.double() for t in xs]),
                               rtol=1e-4, atol=1e-4)


def _storages(arr) -> set[int]:
    return {s.data.untyped_storage().data_ptr() for s in arr.shards}


@pytest.mark.parametrize("case", ["value-twice", "donated-input-twice", "view-of-another-output"])
def test_outputs_never_share_memory_so_donating_one_leaves_the_other(case):
    mesh = spmd.Mesh.create({"tp": 2}, devices="cpu:2")
    spec = spmd.PartitionSpec("tp") if case != "view-of-another-output" else spmd.PartitionSpec()
    fns = {"value-twice": lambda c: (lambda y: (y, y))(c * 2),
           "donated-input-twice": lambda c: (c, c),
           "view-of-another-output": lambda c: (lambda y: (y, y.reshape(2, 2)))(c * 2)}
    f = spmd.jit(fns[case], mesh=mesh, in_shardings=(spec,), out_shardings=(spec, spec),
                 donate_argnums=0 if case == "donated-input-twice" else ())
    x = torch.arange(4.0)
    first, second = f(spmd.device_put(x, spmd.NamedSharding(mesh, spec)))
    assert not _storages(first) & _storages(second)
    want = fns[case](x)[1].clone()
    bump = spmd.jit(lambda c: c.add_(1), mesh=mesh, in_shardings=(spec,), out_shardings=spec, donate_argnums=0)
    bump(first)  # writes into the donated buffer of the first output
    assert torch.equal(second.to_torch(), want)


def test_outputs_of_one_multi_output_fusion_are_not_copied():
    mesh = spmd.Mesh.create({"tp": 1}, devices="cpu:1")
    f = spmd.jit(lambda x: (torch.sin(x) + 1, torch.cos(x) * 3), mesh=mesh)
    x = torch.randn(8, 16)
    text = f.lower(x).as_text("multi-output-fusion")
    assert any(" = (f32[8,16], f32[8,16]) fusion(" in ln for ln in text.splitlines()), text
    program = f.lower(x).compile().executable.program
    assert program.output_clone == (False, False)  # separate buffers already: no copy
    a, b = f(x)
    assert not _storages(a) & _storages(b)
    torch.testing.assert_close(a.to_torch(), torch.sin(x) + 1)
