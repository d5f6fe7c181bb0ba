"""benchmarks/one_gpu.py: a CPU dry run of one row, the table's ratios, and bad flags."""

from __future__ import annotations

import json

import pytest

from benchmarks import one_gpu


def test_small_dry_run_measures_and_checks_numerics(tmp_path):
    rc = one_gpu.main(["--device", "cpu", "--small", "--rows", "llama2-2l-bf16-1x1", "--variants",
                       "eager,spmd,spmd-no-merge,matmul-only", "--rounds", "1", "--reps", "2", "--out", str(tmp_path),
                       "--doc", str(tmp_path / "b.md")])
    assert rc == 0
    data = json.loads((tmp_path / "one_gpu_results.json").read_text())
    (rec,) = data["records"]
    assert rec["row"] == "llama2-2l-bf16-1x1" and rec["ms"]["spmd"] > 0 and rec["ms"]["eager"] > 0
    # spmd and eager agree with the float64 run to bf16 accuracy
    assert rec["rel_err"]["spmd"] < 2e-2 and rec["rel_err"]["eager"] < 2e-2
    assert rec["rel_err"]["spmd-no-merge"] < 2e-2 and rec["ms"]["spmd-no-merge"] > 0
    assert rec["flops"] > 0 and rec["floor_ms"] > 0
    assert rec["ms"]["matmul-only"] > 0 and "matmul-only" not in rec["rel_err"]  # an anchor: random operands
    assert "one GPU vs torch.compile" in (tmp_path / "b.md").read_text()


def test_table_ratios():
    rec = {"row": "r", "ms": {"spmd": 1.0, "compile-ro": 2.0, "compile": 4.0, "eager": 8.0}, "floor_ms": 0.5}
    headers, rows = one_gpu.table([rec], ["eager", "compile", "compile-ro", "spmd"])
    cells = dict(zip(headers, rows[0], strict=True))
    assert cells["spmd ÷ compile-ro"] == "×0.50" and cells["spmd ÷ compile"] == "×0.25"
    assert cells["spmd ÷ floor"] == "×2.00"
    assert cells["compile-ro ÷ matmul-only"] == "n/a"
    rec["ms"]["matmul-only"] = 1.6
    cells = dict(zip(headers, one_gpu.table([rec], ["eager", "compile", "compile-ro", "spmd"])[1][0], strict=True))
    assert cells["compile-ro ÷ matmul-only"] == "×1.25"


@pytest.mark.parametrize("flag", ["--rows", "--variants"])
def test_unknown_names_are_usage_errors(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        one_gpu.parse_args(["--device", "cpu", flag, "bogus"])
    assert exc.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
