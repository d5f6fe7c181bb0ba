"""benchmarks/train.py dry run on the CPU: every variant measured, a markdown row set appended with --doc."""

from benchmarks.train import main, parse_args


def test_cpu_small_dry_run_appends_a_row_set(tmp_path, capsys):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    argv = ["--device", "cpu", "--small", "--model", "gpt3", "--layers", "1", "--rounds", "1", "--steps", "1",
            "--warmup", "1", "--doc", str(doc)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n") and "### Training step, gpt3 x1 layers, batch 1 x 16, float32" in text
    rows = [line for line in out.splitlines() if line.startswith("| eager") or line.startswith("| spmd")]
    assert len(rows) == 2 and all(float(r.split("|")[2]) > 0 for r in rows)


def test_cpu_defaults_skip_torch_compile():
    args = parse_args(["--device", "cpu", "--small"])
    assert args.variants == ["eager", "spmd"] and args.seq == 16 and args.batch == 1


def test_cpu_spmd_math_variant_runs_beside_the_fused_one(capsys):
    argv = ["--device", "cpu", "--small", "--model", "llama2-7b", "--layers", "1", "--rounds", "1", "--steps", "1",
            "--warmup", "1", "--variants", "spmd,spmd-math"]
    assert main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| spmd")]
    assert [r.split("|")[1].strip() for r in rows] == ["spmd", "spmd-math"]
    assert all(float(r.split("|")[2]) > 0 for r in rows)
