"""Correctness on 8 virtual CPU devices: Megatron MLP, windowed einsum, a Llama block.

The CPU half of the 4/8-GPU benchmarks: every program the TP=8 benchmarks run is checked here
against a single-device float64 reference on fresh random inputs (float32 relative error
< 1e-5 for the matmul programs, < 1e-4 for the Llama block, whose softmax / RMSNorm add
rounding). Shapes are small so the whole file runs in well under a minute.
"""

import re

import pytest
import torch

import spmd
from spmd.models import llama, plans
from spmd.parallelize import parallelize
from spmd.sharding import PartitionSpec as P

MESH8 = spmd.Mesh.create(("tp",), devices="cpu:8")
#: benchmarks/cm_local.py SPECS: PartitionSpecs of x, w and the output per side.
SIDES = {
    "ag": (P("tp", None), P(None, "tp"), P(None, "tp")),
    "rs": (P(None, "tp"), P("tp", None), P("tp", None)),
}


def _rand(*shape, dtype=torch.float32):
    return (torch.randn(*shape, dtype=torch.float64) + 0.1).to(dtype)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def _collectives(text: str) -> set[str]:
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
    return {k for k in kinds if f" {k}(" in text or f" {k}-start(" in text}


def _mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def _matmul(x, w):
    return x @ w


def test_megatron_mlp_on_eight_devices():
    f = spmd.jit(_mlp, mesh=MESH8, in_shardings=(P(), P(None, "tp"), P("tp", None)), out_shardings=P())
    x, w1, w2 = _rand(8, 32), _rand(32, 64), _rand(64, 32)
    out = f(x, w1, w2).to_torch()
    ref = torch.relu(x.double() @ w1.double()) @ w2.double()
    assert out.shape == (8, 32) and out.dtype == torch.float32
    assert _rel_err(out, ref) < 1e-5
    text = f.lower(x, w1, w2).as_text("spmd-partition")
    assert "all-reduce(" in text and "all-gather(" not in text  # one all-reduce, nothing else moves


@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("side", ["ag", "rs"])
def test_windowed_einsum_on_eight_devices(side, bidirectional, streams):
    xs, ws, outs = SIDES[side]
    opts = spmd.CompileOptions(windowed_einsum="on", bidirectional=bidirectional, num_compute_streams=streams)
    f = spmd.jit(_matmul, mesh=MESH8, in_shardings=(xs, ws), out_shardings=outs, options=opts)
    x, w = _rand(32, 48), _rand(48, 32)
    lowered = f.lower(x, w)
    final = lowered.as_text(lowered.stages[-1])
    assert "collective-permute-start(" in final  # the ring really replaced the collective
    assert not {"all-gather", "reduce-scatter"} & _collectives(final)
    used = {int(s) for s in re.findall(r"stream_id=(\d+)", final)}
    assert used >= set(range(1, streams + 2))  # compute streams 1..n and the communication stream
    compiled = lowered.compile()
    out = compiled(x, w).to_torch()
    assert out.shape == (32, 32)
    assert _rel_err(out, x.double() @ w.double()) < 1e-5
    x2, w2 = _rand(32, 48), _rand(48, 32)  # fresh inputs through the cached executable
    again = compiled(x2, w2)
    assert again.sharding == spmd.NamedSharding(MESH8, outs)
    assert _rel_err(again.to_torch(), x2.double() @ w2.double()) < 1e-5


def _llama_check(model, mesh, plan, x, input_shardings=None):
    pm = parallelize(model, mesh, plan, input_shardings=input_shardings)
    out = pm(x).to_torch()
    with torch.no_grad():
        ref = model.double()(x.double())
        model.float()
    assert out.shape == x.shape
    assert _rel_err(out, ref) < 1e-4
    return pm


def test_llama_block_tp8():
    m = llama.llama_layers(small=True, seed=13, num_heads=8, num_kv_heads=8)  # hidden 64, 8 heads of 8
    pm = _llama_check(m, MESH8, plans.llama_plan(), _rand(2, 8, 64))
    assert pm.params["layers.0.self_attn.k_proj.weight"].shards[7].data.shape == (8, 64)
    assert "all-reduce" in _collectives(pm.lowered.as_text("spmd-partition"))


def test_llama_block_dp2_tp4_grouped_query():
    m = llama.llama_layers(small=True, seed=14, num_heads=8, num_kv_heads=4)  # GQA: 2 query heads per KV head
    mesh = spmd.Mesh.create({"dp": 2, "tp": 4}, devices="cpu:8")
    pm = _llama_check(m, mesh, plans.llama_plan(), _rand(4, 8, 64), input_shardings=(P("dp"),))
    assert pm.params["layers.0.mlp.down_proj.weight"].sharding.spec == P(None, "tp")


def test_predictions_for_tp4_and_tp8(tmp_path):
    import datetime

    from benchmarks import predict
    from spmd.passes.cost_model import BENCHMARK_SHAPES, H200_NVLINK

    assert predict.SHAPES == BENCHMARK_SHAPES
    rows = predict.predict()
    assert len(rows) == 2 * len(predict.SHAPES) * 2 and {r.tp for r in rows} == {4, 8}
    for r in rows:  # the pick is the fastest predicted variant whenever it decomposes
        p = r.decision.predicted_us
        assert all(v > 0 for v in p.values())
        if r.decision.decompose:
            assert p["bi" if r.decision.bidirectional else "uni"] == min(p.values()) < p["serial"]
    big = {(r.collective, r.tp): r.decision for r in rows if (r.m, r.k, r.n) == (8192, 12288, 49152)}
    assert all(d.decompose for d in big.values())  # the largest GEMM hides its communication at any tp
    text = predict.section(rows, "bf16", H200_NVLINK, datetime.date(2030, 1, 2))
    assert text.startswith(predict.HEADING + " (2030-01-02, cost model)")
    prose = " ".join(text.split())
    assert "Not run: no 4- or 8-GPU machine" in prose and "measured on 2×H200" in prose
    assert text.count("\nreduce-scatter ") == 12
    doc = tmp_path / "b.md"
    doc.write_text("# Benchmarks\n\n## Results\n")
    assert predict.append_section(doc, text) and not predict.append_section(doc, text)
    assert doc.read_text().count(predict.HEADING) == 1 and doc.read_text().startswith("# Benchmarks\n")
    with pytest.raises(ValueError, match="tps: expected ints >= 2"):
        predict.predict((1,))
