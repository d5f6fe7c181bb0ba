"""CPU tests of how the benchmark parents start their children and report the ones that fail:
JAX child environments, child-failure notes, usage errors for bad flags, probe ``--shapes``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import collective_matmul as cm  # noqa: E402
from benchmarks import common, dispatch, harness  # noqa: E402
from benchmarks.anchors import jax_xla  # noqa: E402
from benchmarks.probe import ablate, f32_gemm  # noqa: E402

TORCHRUN_TAIL = """Traceback (most recent call last):
  File "x.py", line 3, in <module>
[rank0]: AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'
W1130 12:26:52 api.py:1028] Sending process 14596 closing signal SIGTERM
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
benchmarks.anchors.torch_symm_mem FAILED
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


@pytest.fixture(autouse=True)
def _restore_environ(monkeypatch):
    """The entry points set :data:`common.REQUIRED_ENV` in ``os.environ``: undo that after each test."""
    for key, value in common.REQUIRED_ENV.items():
        monkeypatch.setenv(key, value)


def _dispatch_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    return dispatch.parse_args(["--device", "cpu", "--tp", "2", "--workloads", "add,mlp", "--calls", "2",
                                "--rounds", "1", "--out", str(tmp_path), "--doc", str(tmp_path / "doc.md"), *extra])


# ----------------------------------------------------------------------------- JAX child environment


def test_jax_child_env_cpu_and_gpu():
    assert harness.jax_child_env("cpu", 4) == (
        {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, [])
    extra, drop = harness.jax_child_env("cpu", 2, "--xla_foo=1")
    assert extra["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2 --xla_foo=1" and drop == []
    assert harness.jax_child_env("cuda", 8) == ({}, ["XLA_FLAGS"])
    assert harness.jax_child_env("cuda", 8, "--xla_foo=1") == ({"XLA_FLAGS": "--xla_foo=1"}, [])
    with pytest.raises(ValueError, match="device"):
        harness.jax_child_env("tpu", 2)


def test_dispatch_children_get_workloads_device_and_seed(tmp_path):
    kids = dispatch.plan_children(_dispatch_args(tmp_path, "--seed", "7"))
    assert set(kids) == set(dispatch.SHARES)
    for cmd, _, _ in kids.values():
        opts = dict(zip(cmd, cmd[1:], strict=False))
        assert opts["--workloads"] == "add,mlp" and opts["--device"] == "cpu" and opts["--seed"] == "7"
        assert opts["--tp"] == "2"
    assert kids["jax"][1]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert kids["jax"][1]["JAX_PLATFORMS"] == "cpu" and kids["spmd"][2] == ["XLA_FLAGS"]
    assert all("--seed" not in cmd for cmd, _, _ in dispatch.plan_children(_dispatch_args(tmp_path)).values())


def test_cpu_jax_child_sees_tp_devices(tmp_path, monkeypatch):
    """The JAX child of ``dispatch --device cpu --tp 2`` runs on 2 virtual host devices, whatever
    XLA_FLAGS the caller has."""
    pytest.importorskip("jax")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    args = _dispatch_args(tmp_path, "--skip", "torch-eager,spmd", "--workloads", "add")
    records, status = dispatch.run_children(args, common.Deadline(120))
    assert [s["name"] for s in status] == ["jax"] and status[0]["ok"], status
    meta = [r for r in records if r["kind"] == "meta"]
    assert meta and meta[0]["devices"] == ["cpu:0", "cpu:1"]
    assert [(r["workload"], r["error"]) for r in records if r["kind"] == "dispatch"] == [("add", None)]


def test_jax_anchor_local_devices():
    jax = pytest.importorskip("jax")
    assert len(jax_xla.local_devices("cpu", 1)) == 1
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=64"):
        jax_xla.local_devices("cpu", 64)
    if not any(d.platform == "gpu" for d in jax.devices()):
        with pytest.raises(ValueError, match="--device cuda: JAX has no gpu devices"):
            jax_xla.local_devices("cuda", 1)


# ----------------------------------------------------------------------------- failure notes


def test_error_line_skips_launcher_banners():
    assert common.error_line(TORCHRUN_TAIL).startswith("[rank0]: AttributeError: module 'torch._C'")
    assert common.error_line("working\nstill working\n") == "still working"
    assert common.last_line(f"a line\n{common.JSON_PREFIX}{{}}\n=====\n\n") == "a line"
    assert common.error_line("") == ""


def test_child_failure_notes_say_how_and_why():
    res = [common.ChildResult("a", [{"x": 1}], 0, False, 1.0, "fine"),
           common.ChildResult("b", [], 1, False, 2.0, TORCHRUN_TAIL, common.error_line(TORCHRUN_TAIL)),
           common.ChildResult("c", [], None, True, 30.04, "round 1/5 done\n"),
           common.ChildResult("d", [], -11, False, 3.0, ""),
           harness.not_run("e", "SIGTERM received")]
    status = [harness.child_status(r) for r in res]
    assert status[0]["error"] is None and status[0]["tail"] == "" and status[1]["records"] == 0
    notes = harness.child_failure_notes(status)
    assert notes == ["child b failed (exit code 1): [rank0]: AttributeError: module 'torch._C' has no attribute "
                     "'_cuda_setDevice'",
                     "child c failed (timed out after 30.0 s): round 1/5 done",
                     "child d failed (exit code -11, signal 11): no output",
                     "child e failed (not run): not started: SIGTERM received"]


def test_run_child_error_is_the_exception_line():
    code = "print('BENCH_JSON {}'); raise ValueError('--tp: asked for 2 devices, JAX sees 1')"
    res = common.run_child("jax", [sys.executable, "-c", code], 30, log=lambda s: None)
    assert res.returncode == 1 and res.error == "ValueError: --tp: asked for 2 devices, JAX sees 1"


def test_dispatch_reports_failed_children(tmp_path, monkeypatch, capsys):
    """A child that fails before its first record keeps its column (n/a cells) and, like one that
    times out, gets a note in the printed notes, the JSON and the docs row set."""
    ok = {"kind": "dispatch", "source": "torch-eager", "workload": "add", "enqueue_us": 1.0,
          "throughput_us": 1.5, "synced_us": 2.0, "error": None}
    crash = "Traceback (most recent call last):\nValueError: --tp: asked for 2 devices, JAX sees 1\n"
    results = {"torch-eager": common.ChildResult("torch-eager", [ok], 0, False, 1.0, ""),
               "spmd": common.ChildResult("spmd", [], None, True, 42.0, "compiling mlp\n", "compiling mlp"),
               "jax": common.ChildResult("jax", [], 1, False, 2.0, crash, common.error_line(crash))}
    monkeypatch.setattr(common, "run_child", lambda name, cmd, box, env: results[name])
    args = _dispatch_args(tmp_path)
    records, status = dispatch.run_children(args, common.Deadline(100))
    dispatch.report(records, status, args, {})
    headers, rows = dispatch.table(records, args.workloads, ["torch-eager", "spmd-eager", "spmd-graphs", "jax"])
    assert len(headers) == 5 and rows[0][1:] == ["1.0 / 1.5 / 2.0", "n/a", "n/a", "n/a"]
    jax_note = "child jax failed (exit code 1): ValueError: --tp: asked for 2 devices, JAX sees 1"
    spmd_note = "child spmd failed (timed out after 42.0 s): compiling mlp"
    out = capsys.readouterr().out
    assert jax_note in out and spmd_note in out and "JAX jit" in out and "spmd graphs" in out
    saved = json.loads((tmp_path / "dispatch_results.json").read_text())
    assert jax_note in saved["notes"] and spmd_note in saved["notes"]
    assert [c["error"] for c in saved["children"]] == [None, "compiling mlp", jax_note.split(": ", 1)[1]]
    doc = (tmp_path / "doc.md").read_text()
    assert f"- {jax_note}" in doc and f"- {spmd_note}" in doc
    assert "| add | 1.0 / 1.5 / 2.0 | n/a | n/a | n/a |" in doc


def test_dispatch_exits_1_when_nothing_was_measured(tmp_path, monkeypatch, capsys):
    crash = "ValueError: no devices\n"
    failed = lambda name, cmd, box, env: common.ChildResult(name, [], 1, False, 1.0, crash, crash.strip())  # noqa: E731
    monkeypatch.setattr(common, "run_child", failed)
    monkeypatch.setattr(dispatch.reporting, "hardware_info", lambda: {})
    argv = ["--device", "cpu", "--tp", "2", "--workloads", "add", "--out", str(tmp_path)]
    assert dispatch.main(argv) == 1
    assert "no variant was measured" in capsys.readouterr().err
    ok = {"kind": "dispatch", "source": "jax", "workload": "add", "enqueue_us": 1.0, "throughput_us": 1.0,
          "synced_us": 1.0, "error": None}
    monkeypatch.setattr(common, "run_child", lambda name, cmd, box, env: common.ChildResult(name, [ok], 0, False,
                                                                                             1.0, ""))
    assert dispatch.main(argv) == 0


def test_dispatch_children_after_sigterm_are_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "terminated", lambda: True)
    monkeypatch.setattr(common, "run_child", lambda *a, **k: pytest.fail("no child may start after SIGTERM"))
    _, status = dispatch.run_children(_dispatch_args(tmp_path), common.Deadline(100))
    assert [s["name"] for s in status] == list(dispatch.SHARES)
    assert all("not run" in n for n in harness.child_failure_notes(status))


def test_collective_matmul_reports_failed_children(tmp_path, capsys):
    args = cm.parse_args(["--device", "cpu", "--tp", "2", "--shapes", "16,8,8", "--no-spmd", "--out",
                          str(tmp_path), "--doc", str(tmp_path / "doc.md")])
    local = [{"kind": "cm", "source": "local", "side": side, "shape": [16, 8, 8], "variant": v, "ms": 1.0,
              "error": None} for side in ("ag", "rs") for v in ("compute", "comm", "serial")]
    crash = "Traceback (most recent call last):\nRuntimeError: XLA compile failed\n"
    status = [harness.child_status(common.ChildResult("local", local, 0, False, 1.0, "")),
              harness.child_status(common.ChildResult("xla", [], 1, False, 2.0, crash, common.error_line(crash)))]
    results = cm.report(local, status, args, {})
    note = "child xla failed (exit code 1): RuntimeError: XLA compile failed"
    assert results["notes"]["children"] == [note]
    out = capsys.readouterr().out
    assert note in out
    for side in ("ag", "rs"):
        headers, rows = cm.side_table(cm.index_records(local), side, [(16, 8, 8)],
                                      [c for s in status for c in cm.source_columns(s["name"], args)])
        cells = dict(zip(headers, rows[0], strict=True))
        assert cells["XLA"] == "n/a" and "torch fused" not in cells and "spmd auto" not in cells
    doc = (tmp_path / "doc.md").read_text()
    assert f"- {note}" in doc and doc.count("| NCCL serial | XLA |") == 2
    assert json.loads((tmp_path / "cm_results.json").read_text())["children"][1]["error"].startswith("RuntimeError")


def test_source_columns_follow_the_options():
    args = cm.parse_args(["--device", "cpu", "--shapes", "16,8,8", "--spmd-variants", "spmd:off"])
    assert cm.source_columns("local", args) == [("local", "serial"), ("local", "spmd:off")]
    assert cm.source_columns("local-again", args) == cm.source_columns("local", args)
    assert cm.source_columns("torch", args) == [("torch", "serial"), ("torch", "fused")]
    assert cm.source_columns("xla-windowed", args) == [("xla-windowed", "xla")]


# ----------------------------------------------------------------------------- usage errors


def _usage_error(capsys, fn, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        fn(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("flag", "allowed", "given"), [("--skip", "torch-eager, spmd, jax", "spmd,bogus"),
                                                        ("--workloads", "add, mlp, block, minilm", "add,bogus")])
def test_dispatch_bad_flags_are_usage_errors(capsys, flag, allowed, given):
    err = _usage_error(capsys, dispatch.parse_args, ["--device", "cpu", flag, given])
    assert f"argument {flag}: expected comma-separated names from {allowed}; got {given!r}" in err
    assert "(unknown: bogus)" in err and "Traceback" not in err


def test_collective_matmul_bad_flags_are_usage_errors(capsys):
    err = _usage_error(capsys, cm.parse_args, ["--device", "cpu", "--skip", "bogus"])
    assert "argument --skip: expected comma-separated names from local, torch, xla, xla-windowed; got 'bogus'" in err
    assert "--sides: expected a subset of ('ag', 'rs'), got ['up']" in _usage_error(
        capsys, cm.parse_args, ["--device", "cpu", "--sides", "up"])
    assert "--spmd-variants" in _usage_error(capsys, cm.parse_args, ["--device", "cpu", "--spmd-variants", "x"])


@pytest.mark.parametrize(("flag", "value", "expected"), [("--calls", "0", "an integer >= 1"),
                                                        ("--rounds", "-1", "an integer >= 1"),
                                                        ("--budget-s", "-5", "a number of seconds >= 0"),
                                                        ("--reserve-s", "x", "a number of seconds >= 0")])
def test_dispatch_counts_and_budgets_are_checked(capsys, flag, value, expected):
    err = _usage_error(capsys, dispatch.parse_args, ["--device", "cpu", flag, value])
    assert f"argument {flag}: expected {expected}, got {value!r}" in err


def test_collective_matmul_rejects_a_dtype_its_anchors_do_not_run(capsys):
    err = _usage_error(capsys, cm.parse_args, ["--device", "cpu", "--dtype", "int8"])
    assert "argument --dtype" in err and "bfloat16" in err and "'int8'" in err


def test_anchor_and_probe_bad_flags_are_usage_errors(capsys):
    err = _usage_error(capsys, jax_xla.main, ["--bench", "dispatch", "--workloads", "bogus"])
    assert "argument --workloads" in err and "add, mlp, block, minilm" in err
    err = _usage_error(capsys, ablate.main, ["--variants", "full,bogus"])
    assert "argument --variants" in err and "no-merge-dots" in err and "'full,bogus'" in err
    assert "argument --workloads" in _usage_error(capsys, ablate.main, ["--workloads", ""])


@pytest.mark.parametrize(("module", "names"), [(dispatch, dispatch.SHARES), (cm, cm.SHARES)])
def test_help_lists_valid_skip_names(capsys, module, names):
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"children to skip, of: {', '.join(names)}" in text


# ----------------------------------------------------------------------------- probe --shapes


def test_f32_gemm_shapes_type():
    assert f32_gemm.parse_gemm_shapes("1,2,3; 4 ,5,6") == [(1, 2, 3), (4, 5, 6)]
    assert len(f32_gemm.parse_gemm_shapes(f32_gemm.DEFAULT_SHAPES)) == 7
    for bad in ("1,2", "1,0,3", "a,b,c", "", "1,2,3;", "1,2,3,4", "-1,2,3", "1.5,2,3"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integers"):
            f32_gemm.parse_gemm_shapes(bad)


def test_f32_gemm_bad_shapes_is_a_usage_error_and_help_keeps_bullets(capsys):
    err = _usage_error(capsys, f32_gemm.main, ["--shapes", "1,2"])
    assert "argument --shapes: expected 'm,k,n;m,k,n;...' with positive integers, got '1,2'" in err
    for main, line in ((f32_gemm.main, "\n* ``torch-tf32``: "), (ablate.main, "\nUsage: ``python3 -m")):
        with pytest.raises(SystemExit):
            main(["--help"])
        assert line in capsys.readouterr().out  # bullets and paragraphs kept, not run together
