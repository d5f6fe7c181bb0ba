"""benchmarks.decode: bytes per step, the table and a CPU dry run (spmd and eager, no docs)."""

import os

import pytest
import torch

from benchmarks import decode
from spmd.models.llama_lm import llama_lm


def test_step_bytes_counts_weights_but_the_embedding_and_the_whole_cache():
    model = llama_lm(small=True, dtype=torch.bfloat16, device="meta")
    cfg = model.config
    weights = sum(p.numel() * 2 for n, p in model.named_parameters() if not n.startswith("embed_tokens"))
    cache = 2 * cfg.num_layers * 3 * cfg.num_kv_heads * 40 * cfg.head_dim * 2
    assert decode.step_bytes(model, 3, 40) == weights + cache


def test_table_rows_ratios_against_torch_compile():
    rec = dict(batch=1, ttft_ms=10.0, step_ms=2.0, tokens_per_s=500.0, gbps=100.0, hbm_frac=0.5, peak_gib=None,
               same_tokens=1.0, error=None)
    rows = decode.table_rows([{**rec, "variant": "spmd", "tokens_per_s": 750.0},
                              {**rec, "variant": "torch.compile"}, {"variant": "eager", "batch": 1, "error": "x"}])
    assert rows[0][:4] == ["1", "spmd", "750.0", "×1.50"] and rows[1][3] == "×1.00"
    assert rows[2] == ["1", "eager"] + ["n/a"] * 8


def test_bad_flags():
    with pytest.raises(SystemExit):
        decode.parse_args(["--rounds", "0"])


def test_cpu_small_dry_run(capsys):
    assert decode.main(["--device", "cpu", "--small", "--batch", "2", "--rounds", "1", "--warmup-rounds", "1",
                        "--new-tokens", "6", "--variants", "spmd", "eager", "--no-doc"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "spmd" in out and "eager" in out and "failed" not in out


def test_the_pdl_variants_are_asked_for_and_leave_spmd_pdl_as_it_was(capsys, monkeypatch):
    assert decode.parse_args([]).variants == list(decode.DEFAULT_VARIANTS)
    monkeypatch.delenv("SPMD_PDL", raising=False)
    assert decode.main(["--device", "cpu", "--small", "--batch", "1", "--rounds", "1", "--warmup-rounds", "0",
                        "--new-tokens", "4", "--variants", "spmd", "spmd-no-pdl", "spmd-pdl", "--no-doc"]) == 0
    out = capsys.readouterr().out
    assert "spmd-no-pdl" in out and "spmd-pdl" in out and "failed" not in out
    assert "SPMD_PDL" not in os.environ
