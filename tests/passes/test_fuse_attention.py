"""fuse-attention: golden HLO text, chains it must leave alone, numerics through the compile pipeline."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import math
import re
import sys

import pytest
import torch
from expecttest import TestCase

import spmd
from benchmarks.workloads import WORKLOADS, make_inputs
from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module
from spmd.passes import pipeline
from spmd.passes.fuse_attention import DEFAULT_DTYPES, FLOAT_DTYPES, FuseAttention
from tests.passes.block_program import BLOCK_2DEV_PARTITIONED

P = spmd.PartitionSpec
B, H, SQ, SK, D, DV = 2, 3, 5, 6, 4, 7  # distinct sizes, so that a mixed-up dim shows
ATTENTION = 'custom_call_target="attention"'


# --------------------------------------------------------------------------- programs
def program(t: str = "f32", kt: str = "transpose", scale: str | None = "divide", mask: str | None = None,
            dim: int = 3, root: str = "o", v_layout: str = "bhkd") -> str:
    """A one-device attention program over q [B,H,Sq,D], k, v [B,H,Sk,Dv] (partitioned form).

    kt: "transpose" (k [B,H,Sk,D] transposed), "kt" (a [B,H,D,Sk] parameter), "k" (the dot
    contracts k's last dim). scale: "divide" (s / 2), "multiply" (0.5 * s), "tensor" (s times a
    full-shape parameter), "negative" (s * -0.5), "zero" (s / 0), None. mask: "right" (s' + m),
    "left" (m + s'), None. root: "o", or "o+s" / "o+p" (a tuple: s or p gets a second use).
    v_layout "hbkd": v is [H,B,Sk,Dv] and the second dot's rhs batch dims are {1,0}.
    """
    def sh(*dims: int) -> str:
        return f"{t}[{','.join(map(str, dims))}]"

    scores_t, out_t = sh(B, H, SQ, SK), sh(B, H, SQ, DV)
    k_shape = sh(B, H, D, SK) if kt == "kt" else sh(B, H, SK, D)
    v_shape = sh(H, B, SK, DV) if v_layout == "hbkd" else sh(B, H, SK, DV)
    params = [("q", sh(B, H, SQ, D)), ("k", k_shape), ("v", v_shape)]
    params += [("m", scores_t)] if mask else []
    params += [("c", scores_t)] if scale == "tensor" else []
    body = [f"%{n} = {s} parameter({i})" for i, (n, s) in enumerate(params)]
    rhs, rc = "%k", 2 if kt != "k" else 3
    if kt == "transpose":
        body.append(f"%kt = {sh(B, H, D, SK)} transpose(%k), dimensions={{0,1,3,2}}")
        rhs = "%kt"
    body.append(f"%s = {scores_t} dot(%q, {rhs}), lhs_batch_dims={{0,1}}, rhs_batch_dims={{0,1}}, "
                f"lhs_contracting_dims={{3}}, rhs_contracting_dims={{{rc}}}")
    scores = "%s"
    if scale in ("divide", "multiply", "negative", "zero"):
        value = {"divide": 2, "multiply": 0.5, "negative": -0.5, "zero": 0}[scale]
        literal = str(int(value)) if t.startswith("s") else str(float(value))
        op = "divide(%s, %cb)" if scale in ("divide", "zero") else "multiply(%cb, %s)"
        body += [f"%c = {t}[] constant({literal})", f"%cb = {scores_t} broadcast(%c), dimensions={{}}", f"%s1 = {scores_t} {op}"]
        scores = "%s1"
    elif scale == "tensor":
        body.append(f"%s1 = {scores_t} multiply(%s, %c)")
        scores = "%s1"
    if mask:
        body.append(f"%x = {scores_t} add({scores}, %m)" if mask == "right" else f"%x = {scores_t} add(%m, {scores})")
        scores = "%x"
    body.append(f'%p = {scores_t} custom-call({scores}), custom_call_target="softmax", backend_config={{"dim":{dim}}}')
    vb = "{1,0}" if v_layout == "hbkd" else "{0,1}"
    o = (f"%o = {out_t} dot(%p, %v), lhs_batch_dims={{0,1}}, rhs_batch_dims={vb}, lhs_contracting_dims={{3}}, "
         f'rhs_contracting_dims={{2}}, metadata={{op_name="aten.matmul.default" source_file="attn.py" source_line=7}}')
    if root == "o":
        body.append("ROOT " + o)
        result = out_t
    else:
        other = "%s" if root == "o+s" else "%p"
        result = f"({out_t}, {scores_t})"
        body += [o, f"ROOT %out = {result} tuple(%o, {other})"]
    header = "HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true\n\n"
    sig = ", ".join(f"{n}: {s}" for n, s in params)
    return header + f"ENTRY %main ({sig}) -> {result} {{\n" + "".join(f"  {b}\n" for b in body) + "}\n"


def _fuse(text: str) -> str:
    mod = parse_module(text)
    FuseAttention(dtypes=FLOAT_DTYPES).run(mod)
    verify_module(mod)
    out = print_module(mod)
    assert print_module(parse_module(out)) == out
    return out


def _random_args(module, scale: float = 1.0) -> list[list[torch.Tensor]]:
    """Fresh random per-device parameters (never zeros)."""
    return [[(torch.randn(p.shape.dims) * scale + 0.1).to(p.shape.torch_dtype) for p in module.entry.parameters]
            for _ in range(module.num_partitions)]


# --------------------------------------------------------------------------- golden text
def _strip_metadata(text: str) -> str:
    return re.sub(r", metadata=\{[^}]*\}", "", text)


def _block_entry_before_fusion(n: int) -> str:
    wl = WORKLOADS["block"]
    mesh = spmd.Mesh.create({"tp": n}, f"cpu:{n}")
    f = spmd.jit(wl.fn, mesh=mesh, in_shardings=tuple(P(*s) for s in wl.specs), out_shardings=P(),
                 options=spmd.CompileOptions(windowed_einsum="off"))
    return f.lower(*make_inputs(wl, "cpu", 0)).as_text("windowed-einsum")


class GoldenTest(TestCase):
    def test_block_on_two_devices(self):
        before = _block_entry_before_fusion(2)
        self.assertEqual(_strip_metadata(before), BLOCK_2DEV_PARTITIONED)
        after = _fuse(before)
        self.assertExpectedInline(_strip_metadata(after).split("ENTRY", 1)[1], """\
 %main (x: f32[128,512], wq: f32[512,256], wk: f32[512,256], wv: f32[512,256], wo: f32[256,512], w1: f32[512,1024], w2: f32[1024,512]) -> f32[128,512] {
  %x = f32[128,512] parameter(0), sharding={replicated}
  %wq = f32[512,256] parameter(1), sharding={devices=[1,2]<=[2]}
  %wk = f32[512,256] parameter(2), sharding={devices=[1,2]<=[2]}
  %wv = f32[512,256] parameter(3), sharding={devices=[1,2]<=[2]}
  %wo = f32[256,512] parameter(4), sharding={devices=[2,1]<=[2]}
  %w1 = f32[512,1024] parameter(5), sharding={devices=[1,2]<=[2]}
  %w2 = f32[1024,512] parameter(6), sharding={devices=[2,1]<=[2]}
  %layer_norm = f32[128,512] custom-call(%x), custom_call_target="layer-norm", backend_config={"normalized_ndim":1,"eps":1e-05}, sharding={replicated}
  %matmul = f32[128,256] dot(%layer_norm, %wq), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,2]<=[2]}
  %reshape = f32[128,4,64] reshape(%matmul), sharding={devices=[1,2,1]<=[2]}
  %transpose = f32[4,128,64] transpose(%reshape), dimensions={1,0,2}, sharding={devices=[2,1,1]<=[2]}
  %matmul_1 = f32[128,256] dot(%layer_norm, %wk), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,2]<=[2]}
  %reshape_1 = f32[128,4,64] reshape(%matmul_1), sharding={devices=[1,2,1]<=[2]}
  %matmul_2 = f32[128,256] dot(%layer_norm, %wv), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,2]<=[2]}
  %reshape_2 = f32[128,4,64] reshape(%matmul_2), sharding={devices=[1,2,1]<=[2]}
  %transpose_2 = f32[4,128,64] transpose(%reshape_2), dimensions={1,0,2}, sharding={devices=[2,1,1]<=[2]}
  %transpose_3 = f32[4,64,128] transpose(%reshape_1), dimensions={1,2,0}, sharding={devices=[2,1,1]<=[2]}
  %transpose_3.transposed = f32[4,128,64] transpose(%transpose_3), dimensions={0,2,1}, sharding={devices=[2,1,1]<=[2]}
  %fused_attention = f32[4,128,64] custom-call(%transpose, %transpose_3.transposed, %transpose_2), custom_call_target="attention", backend_config={"is_causal":false,"has_mask":false,"scale":0.125}, sharding={devices=[2,1,1]<=[2]}
  %transpose_4 = f32[128,4,64] transpose(%fused_attention), dimensions={1,0,2}, sharding={devices=[1,2,1]<=[2]}
  %reshape_3 = f32[128,256] reshape(%transpose_4), sharding={devices=[1,2]<=[2]}
  %matmul_5 = f32[128,512] dot(%reshape_3, %wo), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,1,2]<=[2] last_tile_dims={partial}}
  %all-reduce = f32[128,512] all-reduce(%matmul_5), to_apply=%add.f32, replica_groups={{0,1}}, sharding={replicated}
  %add = f32[128,512] add(%x, %all-reduce), sharding={replicated}
  %layer_norm_1 = f32[128,512] custom-call(%add), custom_call_target="layer-norm", backend_config={"normalized_ndim":1,"eps":1e-05}, sharding={replicated}
  %matmul_6 = f32[128,1024] dot(%layer_norm_1, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,2]<=[2]}
  %gelu = f32[128,1024] custom-call(%matmul_6), custom_call_target="gelu", backend_config={"approximate":"none"}, sharding={devices=[1,2]<=[2]}
  %matmul_7 = f32[128,512] dot(%gelu, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,1,2]<=[2] last_tile_dims={partial}}
  %all-reduce.1 = f32[128,512] all-reduce(%matmul_7), to_apply=%add.f32, replica_groups={{0,1}}, sharding={replicated}
  ROOT %add_1 = f32[128,512] add(%add, %all-reduce.1), sharding={replicated}
}
""")
        fused = next(i for i in parse_module(after).entry.instructions if i.name == "fused_attention")
        o = next(i for i in parse_module(before).entry.instructions if i.name == "matmul_4")
        assert fused.location == o.location and fused.sharding == o.sharding

    def test_one_device_program_with_mask_and_inserted_transpose(self):
        text = program(kt="kt", scale="multiply", mask="right")
        self.assertExpectedInline(text.split("ENTRY", 1)[1], """\
 %main (q: f32[2,3,5,4], k: f32[2,3,4,6], v: f32[2,3,6,7], m: f32[2,3,5,6]) -> f32[2,3,5,7] {
  %q = f32[2,3,5,4] parameter(0)
  %k = f32[2,3,4,6] parameter(1)
  %v = f32[2,3,6,7] parameter(2)
  %m = f32[2,3,5,6] parameter(3)
  %s = f32[2,3,5,6] dot(%q, %k), lhs_batch_dims={0,1}, rhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_contracting_dims={2}
  %c = f32[] constant(0.5)
  %cb = f32[2,3,5,6] broadcast(%c), dimensions={}
  %s1 = f32[2,3,5,6] multiply(%cb, %s)
  %x = f32[2,3,5,6] add(%s1, %m)
  %p = f32[2,3,5,6] custom-call(%x), custom_call_target="softmax", backend_config={"dim":3}
  ROOT %o = f32[2,3,5,7] dot(%p, %v), lhs_batch_dims={0,1}, rhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_contracting_dims={2}, metadata={op_name="aten.matmul.default" source_file="attn.py" source_line=7}
}
""")
        self.assertExpectedInline(_fuse(text).split("ENTRY", 1)[1], """\
 %main (q: f32[2,3,5,4], k: f32[2,3,4,6], v: f32[2,3,6,7], m: f32[2,3,5,6]) -> f32[2,3,5,7] {
  %q = f32[2,3,5,4] parameter(0)
  %k = f32[2,3,4,6] parameter(1)
  %v = f32[2,3,6,7] parameter(2)
  %m = f32[2,3,5,6] parameter(3)
  %k.transposed = f32[2,3,6,4] transpose(%k), dimensions={0,1,3,2}
  ROOT %fused_attention = f32[2,3,5,7] custom-call(%q, %k.transposed, %v, %m), custom_call_target="attention", backend_config={"is_causal":false,"has_mask":true,"scale":0.5}, metadata={op_name="aten.matmul.default" source_file="attn.py" source_line=7}
}
""")

    def test_one_device_program_transpose_bypassed(self):
        self.assertExpectedInline(_fuse(program(mask="left")).split("ENTRY", 1)[1], """\
 %main (q: f32[2,3,5,4], k: f32[2,3,6,4], v: f32[2,3,6,7], m: f32[2,3,5,6]) -> f32[2,3,5,7] {
  %q = f32[2,3,5,4] parameter(0)
  %k = f32[2,3,6,4] parameter(1)
  %v = f32[2,3,6,7] parameter(2)
  %m = f32[2,3,5,6] parameter(3)
  ROOT %fused_attention = f32[2,3,5,7] custom-call(%q, %k, %v, %m), custom_call_target="attention", backend_config={"is_causal":false,"has_mask":true,"scale":0.5}, metadata={op_name="aten.matmul.default" source_file="attn.py" source_line=7}
}
""")

    def test_key_contracted_on_its_last_dim_without_scale(self):
        self.assertExpectedInline(_fuse(program(kt="k", scale=None)).split("ENTRY", 1)[1], """\
 %main (q: f32[2,3,5,4], k: f32[2,3,6,4], v: f32[2,3,6,7]) -> f32[2,3,5,7] {
  %q = f32[2,3,5,4] parameter(0)
  %k = f32[2,3,6,4] parameter(1)
  %v = f32[2,3,6,7] parameter(2)
  ROOT %fused_attention = f32[2,3,5,7] custom-call(%q, %k, %v), custom_call_target="attention", backend_config={"is_causal":false,"has_mask":false,"scale":1.0}, metadata={op_name="aten.matmul.default" source_file="attn.py" source_line=7}
}
""")


# --------------------------------------------------------------------------- what fuses, what does not
FUSING = [
    {}, {"kt": "kt"}, {"kt": "k"}, {"scale": "multiply"}, {"scale": None}, {"mask": "right"},
    {"mask": "left", "scale": None}, {"kt": "kt", "mask": "left"}, {"t": "bf16"}, {"t": "f64", "mask": "right"},
    {"dim": -1},
]


@pytest.mark.parametrize("variant", FUSING, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_fused_program_computes_the_same(variant):
    text = program(**variant)
    ref_mod, mod = parse_module(text), parse_module(text)
    args = _random_args(ref_mod)
    want = evaluate_spmd(ref_mod, args)[0][0]
    FuseAttention(dtypes=FLOAT_DTYPES).run(mod)
    verify_module(mod)
    opcodes = [i.opcode for i in mod.entry.instructions]
    assert opcodes.count("custom-call") == 1 and "dot" not in opcodes, print_module(mod)
    assert mod.entry.root.attrs["custom_call_target"] == "attention"
    got = evaluate_spmd(mod, args)[0][0]
    tol = 1e-2 if variant.get("t") == "bf16" else 1e-6
    assert got.dtype == want.dtype and got.shape == want.shape
    assert ((got.double() - want.double()).norm() / want.double().norm()) < tol


NOT_FUSING = {
    "softmax over another dim": {"dim": 2},
    "s has a second use": {"root": "o+s"},
    "p has a second use": {"root": "o+p"},
    "non-scalar scale": {"scale": "tensor"},
    "negative scale": {"scale": "negative"},
    "division by zero": {"scale": "zero"},
    "batch dims not leading on v": {"v_layout": "hbkd"},
    "integer dtype": {"t": "s32"},
}


@pytest.mark.parametrize("variant", NOT_FUSING.values(), ids=NOT_FUSING.keys())
def test_left_alone(variant):
    text = program(**variant)
    assert _fuse(text) == print_module(parse_module(text))


def test_batch_dims_of_the_score_dot_must_lead():
    text = program().replace("rhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_contracting_dims={2}\n",
                             "rhs_batch_dims={1,0}, lhs_contracting_dims={3}, rhs_contracting_dims={2}\n", 1)
    text = text.replace("%kt = f32[2,3,4,6] transpose(%k), dimensions={0,1,3,2}",
                        "%kt = f32[3,2,4,6] transpose(%k), dimensions={1,0,3,2}")
    assert "rhs_batch_dims={1,0}" in text and "f32[3,2,4,6]" in text
    assert _fuse(text) == print_module(parse_module(text))


def test_mixed_dtypes_and_marked_dots_are_left_alone():
    mixed = program().replace("%o = f32[2,3,5,7] dot", "%o = f64[2,3,5,7] dot").replace("-> f32[2,3,5,7]", "-> f64[2,3,5,7]")
    assert _fuse(mixed) == print_module(parse_module(mixed))
    marked = program().replace("rhs_contracting_dims={2}, metadata", 'rhs_contracting_dims={2}, backend_config={"windowed_einsum":0}, metadata')
    assert "windowed_einsum" in marked
    assert _fuse(marked) == print_module(parse_module(marked))


def test_constant_with_another_use_is_kept():
    text = program(root="o").replace("ROOT %o = f32[2,3,5,7]", "%o = f32[2,3,5,7]").replace(
        "\n}\n", "\n  ROOT %out = (f32[2,3,5,7], f32[]) tuple(%o, %c)\n}\n").replace("-> f32[2,3,5,7]", "-> (f32[2,3,5,7], f32[])")
    out = _fuse(text)
    assert ATTENTION in out and "%c = f32[] constant(2.0)" in out and "broadcast" not in out


def test_unpartitioned_module_is_rejected():
    text = program().replace(", is_partitioned=true", "")
    with pytest.raises(ValueError, match="not partitioned"):
        FuseAttention(dtypes=FLOAT_DTYPES).run(parse_module(text))


# --------------------------------------------------------------------------- numerics through the pipeline
@pytest.fixture
def fusing_pipeline(monkeypatch):
    """spmd.jit with fuse-attention after windowed-einsum (and a fresh process-wide compile cache)."""
    original = pipeline.build_passes

    def build(options, *args):
        passes = original(options, *args)
        k = next(i for i, p in enumerate(passes) if p.name == "windowed-einsum") + 1
        return [*passes[:k], FuseAttention(dtypes=FLOAT_DTYPES), *passes[k:]]

    monkeypatch.setattr(pipeline, "build_passes", build)
    monkeypatch.setattr(sys.modules["spmd.jit"], "_GLOBAL_CACHE", {})


def _run_fused(fn, n: int, args, in_specs, out_spec):
    """fn jitted on n CPU devices with fusion; asserts one attention call per softmax it replaced."""
    mesh = spmd.Mesh.create({"tp": n}, f"cpu:{n}")
    f = spmd.jit(fn, mesh=mesh, in_shardings=tuple(in_specs), out_shardings=out_spec,
                 options=spmd.CompileOptions(verify=True))
    lowered = f.lower(*args)
    final = lowered.as_text(lowered.stages[-1])
    assert "fuse-attention" in lowered.stages and ATTENTION in final and '"softmax"' not in final
    return f(*args).to_torch()


def _check(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == ref.shape
    got, ref = got.double(), ref.double()
    if dtype == torch.float32:
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, err
    else:  # bf16 rounds every intermediate: compare norms, not the worst element
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_block_workload(fusing_pipeline, n, dtype):
    wl = WORKLOADS["block"]
    xs = [x.to(dtype) for x in make_inputs(wl, "cpu", 11 * n)]
    got = _run_fused(wl.fn, n, xs, [P(*s) for s in wl.specs], P())
    _check(got, wl.fn(*[x.double() for x in xs]), dtype)


def attention(q, k, v):
    """softmax(q k^T * d^-0.5) v by hand; q [B, H, Sq, D], k [B, H, Sk, D], v [B, H, Sk, Dv]."""
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ v


def masked_attention(q, kt, v, m):
    """softmax(q kt / sqrt(d) + m) v with kt [B, H, D, Sk] given transposed and m [Sq, Sk] added."""
    return torch.softmax(q @ kt / math.sqrt(q.shape[-1]) + m, dim=-1) @ v


def _qkv(heads: int, dtype: torch.dtype, transposed_k: bool = False):
    q, k, v = torch.randn(2, heads, 16, 8), torch.randn(2, heads, 12, 8), torch.randn(2, heads, 12, 4)
    if transposed_k:
        k = k.transpose(-1, -2).contiguous()
    return [x.to(dtype) for x in (q, k, v)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_hand_written_attention(fusing_pipeline, n, dtype):
    args = _qkv(8, dtype)
    heads = P(None, "tp")
    got = _run_fused(attention, n, args, [heads] * 3, heads)
    _check(got, attention(*[x.double() for x in args]), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_hand_written_masked_attention(fusing_pipeline, n, dtype):
    args = [*_qkv(4, dtype, transposed_k=True), torch.randn(16, 12).to(dtype)]
    heads = P(None, "tp")
    got = _run_fused(masked_attention, n, args, [heads, heads, heads, P()], heads)
    _check(got, masked_attention(*[x.double() for x in args]), dtype)


def test_uneven_heads_and_sharded_queries(fusing_pipeline):
    args = _qkv(6, torch.float32)  # 6 heads over 4 devices: padded shards
    heads = P(None, "tp")
    _check(_run_fused(attention, 4, args, [heads] * 3, heads), attention(*[x.double() for x in args]), torch.float32)
    rows = P(None, None, "tp")  # queries split by sequence, keys and values replicated
    got = _run_fused(attention, 4, args, [rows, P(), P()], rows)
    _check(got, attention(*[x.double() for x in args]), torch.float32)


def test_default_dtypes_fuse_16_bit_only():
    """By default only f16 / bf16 attention is fused (float32 runs faster unfused on GPUs)."""
    assert {"f16", "bf16"} == DEFAULT_DTYPES
    wl = WORKLOADS["block"]
    mesh = spmd.Mesh.create({"tp": 2}, "cpu:2")
    specs = tuple(spmd.PartitionSpec(*s) for s in wl.specs)
    for dtype, fused in ((torch.float32, False), (torch.bfloat16, True)):
        xs = [x.to(dtype) for x in make_inputs(wl, "cpu", 3)]
        f = spmd.jit(wl.fn, mesh=mesh, in_shardings=specs, out_shardings=spmd.PartitionSpec())
        text = f.lower(*xs).as_text("fuse-attention")
        assert ('custom_call_target="attention"' in text) is fused, dtype
