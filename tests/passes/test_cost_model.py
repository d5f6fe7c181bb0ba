"""Cost model: predictions, the decision rule, profiles on disk, the benchmark table."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spmd.passes import cost_model as cm
from spmd.passes.cost_model import (
    BENCHMARK_SHAPES,
    H200_NVLINK,
    GemmShape,
    MachineProfile,
    decide,
    format_table,
    load_profile,
    predict_table,
)


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 1 << 15), k=st.integers(1, 1 << 15), n=st.integers(1, 1 << 16), p=st.integers(2, 16),
       coll=st.sampled_from(["all-gather", "reduce-scatter"]), dtype=st.sampled_from(["bf16", "f32"]),
       margin=st.floats(0.0, 0.3))
def test_never_decomposes_where_predicted_slower(m, k, n, p, coll, dtype, margin):
    d = decide(GemmShape(m, k, n), p, dtype, H200_NVLINK, collective=coll, margin=margin)
    t = d.predicted_us
    assert all(v > 0 for v in t.values())
    best = min(t["uni"], t["bi"])
    assert d.decompose == (best < t["serial"] * (1 - margin))
    if d.decompose:
        assert d.bidirectional == (t["bi"] < t["uni"])
        assert d.num_compute_streams in (1, 2)


def test_big_gemms_decompose_small_ones_do_not():
    big = decide(GemmShape(8192, 12288, 49152 // 2), 2, "bf16", H200_NVLINK)
    assert big.decompose
    assert big.predicted_us["serial"] == pytest.approx(6200 + 440 + 150, rel=0.1)  # ~GEMM + all-gather
    tiny = decide(GemmShape(512, 512, 512), 8, "bf16", H200_NVLINK)
    assert not tiny.decompose
    huge_margin = decide(GemmShape(8192, 12288, 24576), 2, "bf16", H200_NVLINK, margin=0.5)
    assert not huge_margin.decompose


def test_bidirectional_pays_off_on_a_ring_with_full_duplex_links():
    """On a non-switched ring whose links carry twice the bandwidth both ways, bi halves transfer time."""
    ring = dataclasses.replace(H200_NVLINK, switched=False, link_gbps_unidirectional=50.0,
                               link_gbps_bidirectional=100.0, collective_gbps=45.0)
    d = decide(GemmShape(8192, 8192, 8192), 4, "bf16", ring)
    assert d.decompose and d.bidirectional
    assert decide(GemmShape(8192, 8192, 8192), 4, "bf16", H200_NVLINK).bidirectional is False


@pytest.mark.parametrize("coll", ["all-gather", "reduce-scatter"])
@pytest.mark.parametrize("empty", [GemmShape(0, 8, 8), GemmShape(8, 0, 8), GemmShape(8, 8, 0), GemmShape(0, 0, 0)])
def test_empty_gemms_are_never_decomposed(empty, coll):
    """A GEMM with an empty m, k or n has nothing to overlap, alone or sharing a ring with a big one."""
    d = decide(empty, 4, "bf16", H200_NVLINK, collective=coll, margin=0.0)
    assert not d.decompose and d.num_compute_streams == 1
    assert all(v >= 0 and v != float("inf") for v in d.predicted_us.values())
    big = GemmShape(8192, 12288, 24576)
    assert decide(big, 2, "bf16", H200_NVLINK, collective=coll).decompose
    assert not decide([big, empty], 2, "bf16", H200_NVLINK, collective=coll).decompose
    assert cm.gemm_us(0, 0.0, 64.0, "bf16", H200_NVLINK) == pytest.approx(64.0 / (H200_NVLINK.hbm_gbps * 1e3))


def test_errors():
    with pytest.raises(ValueError, match="p must be"):
        decide(GemmShape(8, 8, 8), 1, "bf16", H200_NVLINK)
    with pytest.raises(ValueError, match="collective"):
        decide(GemmShape(8, 8, 8), 2, "bf16", H200_NVLINK, collective="all-to-all")
    with pytest.raises(ValueError, match="dtype 'f64'"):
        decide(GemmShape(8, 8, 8), 2, "f64", H200_NVLINK)
    with pytest.raises(ValueError, match="MachineProfile"):
        MachineProfile.from_json('{"device_name": "x"}')


def test_predict_table_covers_the_benchmark_shapes():
    rows = predict_table()
    assert len(rows) == 2 * len(BENCHMARK_SHAPES) * 3
    assert {(r.m, r.k, r.n) for r in rows} == set(BENCHMARK_SHAPES)
    assert {r.tp for r in rows} == {2, 4, 8}
    text = format_table(rows)
    assert text.splitlines()[0].split()[:3] == ["collective", "M,K,N", "tp"]
    assert len(text.splitlines()) == len(rows) + 1
    # GEMM-heavy shapes decompose on 2×H200; the 4096^3 one at TP=8 is too small to gain
    pick = {(r.collective, r.m, r.k, r.n, r.tp): r.decision.decompose for r in rows}
    assert pick[("all-gather", 8192, 12288, 49152, 2)]
    assert not pick[("all-gather", 4096, 4096, 4096, 8)]


def test_profile_json_round_trip_and_cache(tmp_path, monkeypatch):
    assert MachineProfile.from_json(H200_NVLINK.to_json()) == H200_NVLINK
    calls = []
    fake = dataclasses.replace(H200_NVLINK, device_name="fake")

    def measure(device):
        calls.append(device)
        return fake

    monkeypatch.setattr(cm, "measure_profile", measure)
    assert load_profile("cpu", cache_dir=tmp_path) == fake
    assert load_profile("cpu", cache_dir=tmp_path) == fake
    assert calls == ["cpu"]  # measured once, then read from the JSON cache
    (path,) = tmp_path.glob("profile-*.json")
    assert "torch" in path.name
    path.write_text("not json")
    assert load_profile("cpu", cache_dir=tmp_path) == fake and calls == ["cpu", "cpu"]


def test_measure_cpu_profile():
    prof = cm.measure_profile("cpu")
    assert prof.gemm_tflops["f32"] > 0 and prof.link_gbps_unidirectional > 0 and prof.launch_us > 0
    with pytest.raises(ValueError, match="device"):
        cm.measure_profile("tpu")
