"""``spmd generate`` on virtual CPU devices: the report and bad flags."""

import pytest
import torch

from spmd import metrics
from spmd.cli import main


def test_generate_small_on_tp2_prints_the_report(capsys):
    before = metrics.counter("compile_cache.miss").value
    assert main(["generate", "--small", "--mesh", "tp=2", "--device", "cpu", "--max-new-tokens", "12",
                 "--batch", "2", "--prompt-len", "5"]) == 0
    out = capsys.readouterr().out
    for text in ("TTFT ms", "tokens/s", "p50 ms", "p99 ms", "2 KV heads", "first sequence's tokens"):
        assert text in out
    assert metrics.counter("compile_cache.miss").value - before == 2  # warm-up and timed run share programs
    assert metrics.timer("generate.decode_step").total_samples == 11


def test_generate_with_one_shot_all_reduces(capsys):
    marked = metrics.counter("select-all-reduce.one_shot")
    before = marked.value
    assert main(["generate", "--small", "--mesh", "tp=2", "--device", "cpu", "--max-new-tokens", "4",
                 "--prompt-len", "3", "--small-all-reduce", "on"]) == 0
    assert "tokens/s" in capsys.readouterr().out
    assert marked.value > before


@pytest.mark.parametrize(("args", "expected"), [
    (["--max-new-tokens", "0"], "--max-new-tokens: expected >= 1"),
    (["--temperature", "0"], "--temperature: expected a finite float"),
    (["--temperature", "1", "--top-p", "1.5"], "--top-p: expected a float in (0, 1] or None, got 1.5"),
    (["--temperature", "1", "--top-k", "0"], "--top-k: expected an int >= 1 or None, got 0"),
    (["--top-k", "5"], "--top-k / --top-p need a --temperature (no --temperature means greedy)"),
    (["--seed", str(2**64)], "--seed: expected an int in"),
    (["--mesh", "tp=3"], "not divisible"),
    (["--max-new-tokens", str(10**12)], f"--batch 1, --prompt-len 16, --max-new-tokens {10**12}: max_batch (1), "),
    (["--mesh", "tp=1,pp=2"], "--mesh: axis 'pp' is not used by spmd generate"),
    (["--dump", __file__], "--dump: expected a directory path"),
])
def test_bad_flags_are_one_line_errors(capsys, args, expected):
    assert main(["generate", "--small", "--device", "cpu", "--mesh", "tp=1", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spmd: error:") and expected in err and "Traceback" not in err


def test_prefill_too_large_for_memory_fails_before_compiling(capsys, monkeypatch):
    # was: 65 s, ~20 GB, then a raw "DefaultCPUAllocator: can't allocate memory" (--prompt-len 100000)
    from spmd.generation import checks

    monkeypatch.setattr(checks, "available_bytes", lambda device: 64 * 2**20)
    before = metrics.counter("compile_cache.miss").value
    args = ["generate", "--small", "--device", "cpu", "--max-new-tokens", "2"]
    assert main([*args, "--prompt-len", "2048", "--mesh", "tp=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spmd: error: --prompt-len: a prefill of 2048 tokens needs about 0.1 GiB")
    assert "\n" not in err.strip()
    assert "float32 [1, 1, 2048, 2049] twice on each of 2 virtual CPU devices" in err
    assert "more than the 0.1 GiB available" in err and "fewer --mesh devices" in err
    assert metrics.counter("compile_cache.miss").value == before  # nothing was compiled
    assert main([*args, "--prompt-len", "256"]) == 0  # 2 x 256 x 257 x 4 bytes fits


def test_available_bytes_of_the_host_is_positive():
    from spmd.generation import checks

    assert checks.available_bytes(torch.device("cpu")) > 2**20
