"""benchmarks.small_allreduce: message shapes, the tables and a CPU dry run (no docs)."""

import json

import pytest

from benchmarks import small_allreduce


@pytest.mark.parametrize("size", [1024, 4096, 65536, 1 << 20, 100])
def test_shapes_cover_the_size(size):
    rows, width = small_allreduce._shape(size, 2)
    assert 1 <= rows <= 16 and width >= 8
    assert rows * width * 2 == max(size, 16) or size == 100


def test_table_rows_ratio_is_one_shot_over_nccl():
    rec = {"size_bytes": 4096, "comm_ring_us": 20.0, "comm_one_shot_us": 10.0, "graph_ring_us": 8.0,
           "graph_one_shot_us": None, "model_ring_us": 8.0, "model_one_shot_us": 13.0}
    assert small_allreduce.table_rows([rec]) == [["4096", "20.0", "10.0", "×0.50", "8.0", "n/a", "n/a", "8.0",
                                                  "13.0"]]
    symm = {"size_bytes": 4096, "tp": 2, "nccl_eager_us": 20.0, "symm_eager_us": 5.0, "nccl_graph_us": 9.0,
            "symm_graph_us": 4.5}
    row = small_allreduce.symm_rows([symm])[0]
    assert row[:7] == ["4096", "20.0", "5.0", "×0.25", "9.0", "4.5", "×0.50"]


def test_bad_flags():
    with pytest.raises(SystemExit):
        small_allreduce.parse_args(["--tp", "1"])
    with pytest.raises(SystemExit):
        small_allreduce.parse_args(["--sizes", "0"])


def test_cpu_dry_run(tmp_path, capsys):
    assert small_allreduce.main(["--device", "cpu", "--sizes", "1024", "--layers", "2", "--rounds", "1",
                                 "--reps", "2", "--warmup", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Small all-reduce" in out
    [rec] = json.loads((tmp_path / "small_allreduce_results.json").read_text())
    assert rec["errors"] == {}
    assert all(rec[k] > 0 for k in ("comm_ring_us", "comm_one_shot_us", "graph_ring_us", "graph_one_shot_us"))
