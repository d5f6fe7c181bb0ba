"""CPU-only tests of the benchmark harness logic (timing, children, tables, baselines) with tiny shapes."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import cm_local, common, dispatch, reporting, summarize, workloads  # noqa: E402
from benchmarks import collective_matmul as cm  # noqa: E402

# ----------------------------------------------------------------------------- common: timing


def test_interleaved_runs_rounds_in_order_and_isolates_failures():
    calls: list[str] = []

    def make(name):
        return lambda: calls.append(name)

    def boom():
        calls.append("B")
        raise RuntimeError("kaput")

    res = common.interleaved({"A": make("A"), "B": boom, "C": make("C")}, ["cpu"], rounds=3, warmup=1, reps=2)
    # A: warm-up + 2 reps, B fails at its first warm-up call, C as A; B is skipped after round 1.
    assert calls == ["A"] * 3 + ["B"] + ["C"] * 3 + ["A"] * 3 + ["C"] * 3 + ["A"] * 3 + ["C"] * 3
    assert res["A"].ok and res["C"].ok and len(res["A"].round_ms) == 3
    assert not res["B"].ok and res["B"].median_ms is None and "kaput" in res["B"].error
    assert list(res) == ["A", "B", "C"]


def test_interleaved_takes_median_of_round_medians_after_combine():
    seq = iter([[1.0, 9.0, 2.0], [5.0, 5.0, 5.0], [3.0, 3.0, 4.0]])
    res = common.interleaved({"A": lambda: None}, ["cpu"], rounds=3, warmup=0, reps=3,
                             combine=lambda times: next(seq))
    assert res["A"].round_ms == (2.0, 5.0, 3.0)
    assert res["A"].median_ms == 3.0


def test_time_reps_cpu_and_errors():
    per_rep, wall = common.time_reps(lambda: sum(range(1000)), ["cpu"], 4)
    assert len(per_rep) == 4 and all(t > 0 for t in per_rep) and wall > 0
    with pytest.raises(ValueError, match="reps"):
        common.time_reps(lambda: None, ["cpu"], 0)
    with pytest.raises(ValueError, match="rounds"):
        common.interleaved({"A": lambda: None}, [], rounds=0)


def test_host_call_times_counts_calls_and_syncs():
    n = {"calls": 0, "syncs": 0}
    enq, thru, syn = common.host_call_times(lambda: n.__setitem__("calls", n["calls"] + 1),
                                            lambda: n.__setitem__("syncs", n["syncs"] + 1), calls=8, rounds=2,
                                            warmup=3)
    assert 0 < enq <= thru and syn > 0
    assert n["calls"] == 3 + 2 * (8 + 2)  # warm-up, then per round 8 enqueue-only + 8 // 4 synced
    assert n["syncs"] == 1 + 2 * (1 + 2)


def test_median_ratio():
    assert common.median([3.0, 1.0, 2.0]) == 2.0
    with pytest.raises(ValueError):
        common.median([])
    assert common.ratio(3.0, 2.0) == 1.5
    assert common.ratio(None, 2.0) is None and common.ratio(1.0, 0.0) is None


# ----------------------------------------------------------------------------- common: data


def test_fresh_randn_is_random_seeded_and_scaled():
    a = common.fresh_randn((64, 256), torch.bfloat16, "cpu", 1)
    b = common.fresh_randn((64, 256), torch.bfloat16, "cpu", 1)
    c = common.fresh_randn((64, 256), torch.bfloat16, "cpu", 2)
    assert a.dtype == torch.bfloat16 and a.shape == (64, 256)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a != 0).float().mean() > 0.99
    assert 0.5 / 16 < a.float().std() < 2.0 / 16  # default scale 1/sqrt(256)
    with pytest.raises(ValueError, match="positive"):
        common.fresh_randn((0, 3), torch.float32, "cpu", 1)


def test_rel_error():
    ref = torch.randn(10, 10)
    assert common.rel_error(ref, ref) == 0.0
    noisy = ref + 0.01 * ref.norm() / 10 * torch.randn(10, 10) / 1.0
    assert 0 < common.rel_error(noisy, ref) < 0.05
    bad = ref.clone()
    bad[0, 0] = float("nan")
    assert common.rel_error(bad, ref) == math.inf
    with pytest.raises(ValueError, match="shape"):
        common.rel_error(ref[:5], ref)


# ----------------------------------------------------------------------------- common: env, children


def test_required_env_and_child_env(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("XLA_FLAGS", "--foo")
    env = common.child_env({"EXTRA": "x"}, drop=["XLA_FLAGS"])
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["PYTHONUNBUFFERED"] == "1" and env["EXTRA"] == "x" and "XLA_FLAGS" not in env
    assert env["PYTHONPATH"].split(":")[0] == str(REPO)


def test_emit_and_parse_records(capsys):
    common.emit({"kind": "cm", "ms": 1.5})
    print("noise")
    print(common.JSON_PREFIX + "{not json")
    print("[rank0]:" + common.JSON_PREFIX + '{"rank": 0}')
    out = capsys.readouterr().out
    assert common.parse_records(out) == [{"kind": "cm", "ms": 1.5}, {"rank": 0}]


def test_run_child_collects_records_and_kills_on_timeout():
    code = ("from benchmarks import common; common.emit({'i': 1}); print('hello', flush=True); "
            "import time; time.sleep({s})")
    logged: list[str] = []
    ok = common.run_child("fast", [sys.executable, "-c", code.replace("{s}", "0")], 30, log=logged.append)
    assert ok.ok and ok.records == [{"i": 1}] and "[fast] hello" in logged
    slow = common.run_child("slow", [sys.executable, "-c", code.replace("{s}", "60")], 3, log=logged.append)
    assert slow.timed_out and not slow.ok and slow.records == [{"i": 1}] and slow.elapsed_s < 20
    bad = common.run_child("bad", [sys.executable, "-c", "raise SystemExit(3)"], 30, log=logged.append)
    assert bad.returncode == 3 and not bad.ok
    assert common.run_child("none", ["true"], 0.5).timed_out


# ----------------------------------------------------------------------------- common: reports


def test_markdown_table_and_row_set(tmp_path):
    table = reporting.markdown_table(["a", "b"], [["1", "2"]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 | 2 |"]
    with pytest.raises(ValueError, match="cells"):
        reporting.markdown_table(["a"], [["1", "2"]])
    doc = tmp_path / "docs" / "benchmarks.md"
    info = {"gpu_count": 2, "gpu": "NVIDIA H200", "torch": "2.11", "nccl": "2.28.3"}
    reporting.append_row_set(doc, "collective matmul", info, table)
    reporting.append_row_set(doc, "dispatch", info, "body two")
    text = doc.read_text()
    assert text.startswith("# Benchmarks")
    assert text.count("## ") == 2 and "— collective matmul" in text and "2× NVIDIA H200" in text
    assert text.index("collective matmul") < text.index("body two")


def test_plot_grouped_bars(tmp_path):
    pytest.importorskip("matplotlib")
    paths = [tmp_path / "a.png", tmp_path / "sub" / "b.png"]
    written = reporting.plot_grouped_bars(paths, [("t", ["s1", "s2"], {"v1": [1.1, None], "v2": [1.3, 2.0]})])
    assert written == paths
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


# ----------------------------------------------------------------------------- cm_local


def test_parse_shapes_and_divisibility():
    assert cm_local.parse_shapes("8,4,2; 16x8x4") == [(8, 4, 2), (16, 8, 4)]
    for bad in ("8,4", "8,a,2", "", "0,4,2"):
        with pytest.raises(ValueError, match="--shapes"):
            cm_local.parse_shapes(bad)
    cm_local.check_divisible((8, 4, 12), 4)
    with pytest.raises(ValueError, match="divide"):
        cm_local.check_divisible((8, 6, 4), 4)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_local_comm_cpu(tp):
    comm = cm_local.LocalComm(["cpu"] * tp)
    ins = [torch.randn(3, 5) for _ in range(tp)]
    outs = [torch.empty(3 * tp, 5) for _ in range(tp)]
    comm.all_gather(ins, outs)
    for o in outs:
        torch.testing.assert_close(o, torch.cat(ins))
    parts = [torch.randn(4 * tp, 5) for _ in range(tp)]
    rs = [torch.empty(4, 5) for _ in range(tp)]
    comm.reduce_scatter(parts, rs)
    total = sum(parts)
    for i, o in enumerate(rs):
        torch.testing.assert_close(o, total[4 * i: 4 * i + 4])


@pytest.mark.parametrize("side", ["ag", "rs"])
@pytest.mark.parametrize("tp", [2, 4])
def test_baselines_compute_the_product(side, tp):
    m, k, n = 16, 32, 24
    x = common.fresh_randn((m, k), torch.bfloat16, "cpu", common.fresh_seed(), scale=1.0)
    w = common.fresh_randn((k, n), torch.bfloat16, "cpu", common.fresh_seed())
    p = cm_local.make_problem(side, x, w, ["cpu"] * tp)
    if side == "ag":
        assert p.x_shards[0].shape == (m // tp, k) and p.w_shards[0].shape == (k, n // tp)
        assert p.out[0].shape == (m, n // tp)
    else:
        assert p.x_shards[0].shape == (m, k // tp) and p.w_shards[0].shape == (k // tp, n)
        assert p.out[0].shape == (m // tp, n)
    variants = cm_local.baseline_variants(p, cm_local.LocalComm(p.devices))
    assert list(variants) == ["compute", "comm", "serial"]
    for o in p.out:
        o.fill_(float("nan"))  # poison: the serial run must write every element
    variants["serial"]()
    got = cm_local.assemble_output(p, p.out)
    ref = x.float() @ w.float()
    assert got.shape == (m, n)
    assert common.rel_error(got, ref) < 1e-2


def test_make_problem_rejects_bad_side():
    with pytest.raises(ValueError, match="side"):
        cm_local.make_problem("xx", torch.randn(4, 4), torch.randn(4, 4), ["cpu"] * 2)


def _local_args(**kw) -> argparse.Namespace:
    argv = ["--device", "cpu", "--tp", "2", "--shapes", "16,8,8", "--rounds", "2", "--reps", "2", "--warmup", "1"]
    args = cm_local.finish_args(cm_local.build_parser().parse_args(argv))
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_local_run_records_baselines_and_marks_failing_spmd(monkeypatch, capsys):
    def broken(*a, **k):
        raise RuntimeError("windowed einsum not ready")

    monkeypatch.setattr(cm_local, "spmd_inputs", lambda p, devices: object())
    monkeypatch.setattr(cm_local, "spmd_variant", broken)
    args = _local_args(spmd_variants=["spmd:off", "spmd:auto"])
    records = cm_local.run(args, log=lambda s: None)
    by = {(r["side"], r["variant"]): r for r in records}
    for side in ("ag", "rs"):
        for v in ("compute", "comm", "serial"):
            assert by[(side, v)]["ms"] > 0 and by[(side, v)]["error"] is None
        assert by[(side, "serial")]["rel_err"] < 1e-2
        for v in ("spmd:off", "spmd:auto"):
            assert by[(side, v)]["ms"] is None and "not ready" in by[(side, v)]["error"]
    printed = common.parse_records(capsys.readouterr().out)
    assert sum(r["kind"] == "cm-done" for r in printed) == 2


def test_local_run_respects_budget(capsys):
    # a spent budget skips every shape after the first (the first always runs)
    args = _local_args(budget_s=0.0, no_spmd=True, shapes=[(16, 8, 8), (32, 8, 8)])
    records = cm_local.run(args, log=lambda s: None)
    assert {tuple(r["shape"]) for r in records} == {(16, 8, 8)}
    skipped = [r for r in common.parse_records(capsys.readouterr().out) if r["kind"] == "cm-skipped"]
    assert [tuple(r["shape"]) for r in skipped] == [(32, 8, 8)]


def test_events_suspect_and_join_ready_passthrough():
    ok = common.Measurement("a", 1.0, (1.0,), 1.1)
    missed = common.Measurement("a", 0.01, (0.01,), 2.0)
    assert not cm_local.events_suspect(ok) and cm_local.events_suspect(missed)
    assert not cm_local.events_suspect(None)
    marker = object()
    assert cm_local.join_ready(marker) is marker


def test_spmd_variant_table_is_complete():
    assert set(cm_local.SPMD_VARIANTS) >= {"spmd:off", "spmd:on-1s", "spmd:on-2s", "spmd:auto"}
    assert cm_local.SPMD_VARIANTS["spmd:off"]["windowed_einsum"] == "off"
    assert any(v.get("cuda_graphs") for v in cm_local.SPMD_VARIANTS.values())
    with pytest.raises(ValueError, match="--spmd-variants"):
        cm_local.finish_args(cm_local.build_parser().parse_args(["--device", "cpu", "--spmd-variants", "nope"]))


# ----------------------------------------------------------------------------- collective_matmul report


def _rec(source, side, shape, variant, ms, **kw):
    return {"kind": "cm", "source": source, "side": side, "shape": list(shape), "variant": variant, "ms": ms,
            "error": None, **kw}


SHAPE = (64, 32, 16)
RECORDS = [
    _rec("local", "ag", SHAPE, "compute", 2.0), _rec("local", "ag", SHAPE, "comm", 1.0),
    _rec("local", "ag", SHAPE, "serial", 3.0, rel_err=0.004),
    _rec("local", "ag", SHAPE, "spmd:auto", 2.2, rel_err=0.003),
    _rec("local", "ag", SHAPE, "spmd:off", 2.6, rel_err=0.5),
    {**_rec("local", "ag", SHAPE, "spmd:on-1s", None), "error": "KeyError: 1"},
    _rec("torch", "ag", SHAPE, "compute", 1.0), _rec("torch", "ag", SHAPE, "comm", 1.5),
    _rec("torch", "ag", SHAPE, "fused", 1.8),
    _rec("xla-windowed", "ag", SHAPE, "compute", 2.0), _rec("xla-windowed", "ag", SHAPE, "comm", 0.5),
    _rec("xla-windowed", "ag", SHAPE, "xla", 3.0, hlo={"collective-permute": 2}),
]


def test_limits_and_ratios_use_each_sources_own_limit():
    idx = cm.index_records(RECORDS)
    assert cm.limit_ms(idx, "local", "ag", SHAPE) == 2.0
    assert cm.limit_ms(idx, "torch", "ag", SHAPE) == 1.5
    assert cm.limit_ms(idx, "xla", "ag", SHAPE) is None
    r = cm.ratios(idx, "ag", [SHAPE])
    assert r["NCCL serial"] == [1.5] and r["spmd auto"] == [pytest.approx(1.1)]
    assert r["torch fused"] == [pytest.approx(1.2)] and r["XLA windowed"] == [1.5] and r["XLA"] == [None]


def test_side_table_cells_and_notes():
    idx = cm.index_records(RECORDS)
    headers, rows = cm.side_table(idx, "ag", [SHAPE])
    cells = dict(zip(headers, rows[0], strict=True))
    assert cells["M, K, N"] == "64, 32, 16" and cells["limit ms"] == "2.000"
    assert cells["NCCL serial"] == "3.000 ×1.50" and cells["spmd auto"] == "2.200 ×1.10"
    assert cells["spmd off"].endswith("WRONG") and cells["spmd on-1s"] == "n/a"
    assert "XLA" not in cells  # no record of the default-XLA source: no column
    text = "\n".join(cm.notes(idx, "ag"))
    assert "collective-permute 2" in text and "KeyError: 1" in text and "local/spmd:auto 3.0e-03" in text


def test_plan_children_env_and_commands():
    args = cm.finish_args(cm.build_parser().parse_args(["--device", "cpu", "--tp", "2", "--shapes", "8,8,8"]))
    kids = cm.plan_children(args, [(8, 8, 8)], no_spmd=True)
    assert set(kids) == set(cm.SHARES)
    assert "--no-spmd" in kids["local"][0] and "8,8,8" in kids["local"][0]
    assert "--nproc-per-node=2" in kids["torch"][0]
    # CPU: the XLA children see tp virtual host devices; the windowed one adds its flags
    assert kids["xla"][1] == {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    flags = kids["xla-windowed"][1]["XLA_FLAGS"].split()
    assert flags[0] == "--xla_force_host_platform_device_count=2" and "windowed_einsum_mib=0" in flags[1]
    gpu = cm.finish_args(cm.build_parser().parse_args(["--device", "cuda", "--tp", "2", "--shapes", "8,8,8"]))
    kids = cm.plan_children(gpu, [(8, 8, 8)])
    assert kids["xla"][1:] == ({}, ["XLA_FLAGS"])  # the caller's XLA_FLAGS are dropped on GPU
    assert kids["xla-windowed"][1:] == ({"XLA_FLAGS": cm.WINDOWED_XLA_FLAGS}, [])
    assert kids["xla"][0][kids["xla"][0].index("--device") + 1] == "cuda"


@pytest.mark.slow
def test_collective_matmul_end_to_end_on_cpu(tmp_path):
    doc = tmp_path / "benchmarks.md"
    cmd = [sys.executable, "-m", "benchmarks.collective_matmul", "--device", "cpu", "--tp", "2",
           "--shapes", "16,8,8", "--rounds", "1", "--reps", "1", "--warmup", "0", "--no-spmd",
           "--skip", "torch,xla,xla-windowed", "--out", str(tmp_path), "--doc", str(doc), "--budget-s", "600"]
    # the child's first shape runs whatever its budget (a loaded machine once skipped it); the generous
    # budget only bounds a hung child
    proc = subprocess.run(cmd, cwd=REPO, env=common.child_env(), capture_output=True, text=True, timeout=700)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "cm_results.json").read_text())
    assert results["children"][0]["name"] == "local" and results["children"][0]["ok"]
    assert {r["variant"] for r in results["records"] if r["kind"] == "cm"} == {"compute", "comm", "serial"}
    assert "matmul→reduce-scatter" in doc.read_text()
    _, rows = summarize.cm_rows(results)
    assert len(rows) == 2 and rows[0][3].startswith("×")


def test_the_first_shape_runs_even_when_the_budget_is_spent(capsys):
    """Only later shapes are skipped for the budget: a run that measures nothing is no benchmark."""
    args = cm_local.finish_args(cm_local.build_parser().parse_args(
        ["--device", "cpu", "--tp", "2", "--shapes", "16,8,8;32,8,8", "--rounds", "1", "--reps", "1",
         "--warmup", "0", "--no-spmd", "--budget-s", "0", "--sides", "rs"]))
    records = cm_local.run(args, log=lambda s: None)
    assert records and {tuple(r["shape"]) for r in records if r.get("kind") == "cm"} == {(16, 8, 8)}
    skipped = [line for line in capsys.readouterr().out.splitlines() if "cm-skipped" in line]
    assert len(skipped) == 1 and "[32, 8, 8]" in skipped[0]


# ----------------------------------------------------------------------------- dispatch and workloads


def test_workloads_match_plain_torch_math():
    x, w1, w2 = torch.randn(4, 8), torch.randn(8, 16), torch.randn(16, 8)
    torch.testing.assert_close(workloads.mlp2(x, w1, w2), torch.relu(x @ w1) @ w2)
    s, d = 6, 16
    args = [torch.randn(s, d)] + [torch.randn(d, d) / 4 for _ in range(4)] + [torch.randn(d, 32) / 4,
                                                                             torch.randn(32, d) / 6]
    out = workloads.block(*args)
    assert out.shape == (s, d) and torch.isfinite(out).all()
    # the attention part mixes rows: changing one row of x changes the others
    args2 = [args[0].clone(), *args[1:]]
    args2[0][0] += torch.randn(d)  # not a constant shift: layer norm would remove that
    assert not torch.allclose(workloads.block(*args2)[1:], out[1:])
    for wl in workloads.WORKLOADS.values():
        assert len(wl.shapes) == len(wl.specs)
        for shape, spec in zip(wl.shapes, wl.specs, strict=True):
            for dim, axis in zip(shape, spec, strict=False):
                assert axis is None or dim % 8 == 0


def test_dispatch_measure_and_table(capsys):
    args = argparse.Namespace(calls=4, rounds=1)
    good = dispatch.measure("spmd-eager", "add", lambda: None, lambda: None, args, {"rel_err": 0.0})
    bad = dispatch.measure("jax", "add", lambda: 1 / 0, lambda: None, args)
    assert good["enqueue_us"] > 0 and good["error"] is None and good["rel_err"] == 0.0
    assert bad["enqueue_us"] is None and "ZeroDivisionError" in bad["error"]
    headers, rows = dispatch.table([good, bad], ["add", "mlp"])
    assert headers[0] == "workload" and len(headers) == 3  # spmd eager, JAX
    assert rows[0][2] == "n/a" and rows[1] == ["mlp", "n/a", "n/a"]
    assert len(common.parse_records(capsys.readouterr().out)) == 2


def test_dispatch_parse_args_checks(capsys):
    for flag in ("--workloads", "--skip"):
        with pytest.raises(SystemExit) as exc:
            dispatch.parse_args(["--device", "cpu", flag, "nope"])
        assert exc.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


@pytest.mark.slow
def test_torch_eager_anchor_on_cpu():
    cmd = [sys.executable, "-m", "benchmarks.anchors.torch_eager", "--device", "cpu", "--workloads", "add",
           "--calls", "5", "--rounds", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=common.child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    recs = common.parse_records(proc.stdout)
    assert [r["source"] for r in recs] == ["torch-eager", "torch-compile", "torch-compile-ro"]
    for rec in recs:
        assert rec["workload"] == "add" and rec["synced_us"] > 0 and rec["error"] is None
        assert rec["rel_err_vs_eager"] < 1e-6


# ----------------------------------------------------------------------------- run_gpu.sh


def test_run_gpu_script_is_valid_bash_and_sets_the_env():
    script = REPO / "benchmarks" / "run_gpu.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for var in ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1",
                "XLA_PYTHON_CLIENT_PREALLOCATE=false", "PYTHONUNBUFFERED=1"):
        assert var in text
    proc = subprocess.run(["bash", str(script), "bogus"], capture_output=True, text=True, timeout=60,
                          env={**common.child_env(), "OUT": "/tmp/spmd_bench_out_test"})
    assert proc.returncode == 2 and "unknown stage" in proc.stdout


def test_hlo_op_counts_and_no_cp_marker():
    text = ("%cp = bf16[4,8] collective-permute(%x), source_target_pairs={{0,1},{1,0}}\n"
            "%s = (bf16[4,8]) collective-permute-start(%y)\n%ag = bf16[8,8] all-gather(%z), dimensions={0}\n")
    assert common.hlo_op_counts(text) == {"collective-permute": 2, "all-gather": 1, "reduce-scatter": 0,
                                          "all-reduce": 0}
    recs = [*RECORDS, _rec("local", "ag", SHAPE, "spmd:on-2s", 2.1, hlo={"collective-permute": 0})]
    _, rows = cm.side_table(cm.index_records(recs), "ag", [SHAPE])
    headers, _ = cm.side_table(cm.index_records(recs), "ag", [SHAPE])
    cells = dict(zip(headers, rows[0], strict=True))
    assert cells["spmd on-2s"].endswith("(no CP)") and not cells["XLA windowed"].endswith("(no CP)")


def test_summarize_handles_missing_files(tmp_path, capsys):
    assert summarize.main([str(tmp_path)]) == 0
    assert "cm_results.json: missing" in capsys.readouterr().out


def test_result_rel_error_shard_by_shard():
    spmd = pytest.importorskip("spmd")
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    x = torch.randn(8, 6)
    for spec in (spmd.PartitionSpec(None, "tp"), spmd.PartitionSpec("tp", None), spmd.PartitionSpec()):
        a = spmd.device_put(x, spmd.NamedSharding(mesh, spec))
        assert cm_local.result_rel_error(a, x) == 0.0
        noisy = x + 0.01 * torch.randn(8, 6)
        assert cm_local.result_rel_error(a, noisy) == pytest.approx(common.rel_error(x, noisy), rel=1e-4)


def test_anchor_modules_import_without_side_effects():
    import importlib

    for name in ("benchmarks.anchors.torch_symm_mem", "benchmarks.anchors.jax_xla", "benchmarks.anchors.torch_eager"):
        mod = importlib.import_module(name)
        assert callable(mod.main) and mod.__doc__


def test_jax_anchor_on_virtual_cpu_devices():
    pytest.importorskip("jax")
    env = common.child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"})
    cmd = [sys.executable, "-m", "benchmarks.anchors.jax_xla", "--bench", "cm", "--tp", "2", "--shapes", "16,8,8",
           "--rounds", "1", "--reps", "1", "--label", "xla"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = [r for r in common.parse_records(proc.stdout) if r["kind"] == "cm"]
    by = {(r["side"], r["variant"]): r for r in recs}
    assert set(by) == {(s, v) for s in ("ag", "rs") for v in ("compute", "comm", "xla")}
    assert all(r["ms"] > 0 for r in recs)
    assert by[("ag", "xla")]["rel_err"] < 1e-2 and by[("ag", "xla")]["hlo"]["all-gather"] >= 1
