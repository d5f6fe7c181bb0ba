"""MiniLM of the JAX anchor (benchmarks/anchors/jax_minilm.py): NumPy math vs the PyTorch model, shardings, child."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import common, workloads  # noqa: E402
from benchmarks.anchors import jax_minilm as jm  # noqa: E402
from spmd.ir.sharding import MeshShape  # noqa: E402
from spmd.models.bert import BertConfig, BertSentenceEncoder  # noqa: E402
from spmd.models.common import init_random_  # noqa: E402
from spmd.models.plans import bert_plan, resolve_plan  # noqa: E402

SMALL = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=96, max_position_embeddings=64, layer_norm_eps=1e-5)


def _batch(cfg: BertConfig, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for b in range(1, batch):  # row 0 unpadded, then ever shorter rows
        mask[b, seq - 3 * b:] = 0
    return ids, mask


def _numpy_vs_torch(model: BertSentenceEncoder, ids: torch.Tensor, mask: torch.Tensor) -> float:
    with torch.no_grad():
        ref = model(ids, mask)
    params = {k: v.detach().numpy() for k, v in model.named_parameters()}
    out = jm.sentence_embeddings(jm.numpy_ops(), params, ids.numpy().astype(np.int32),
                                 mask.numpy().astype(np.int32), jm.EncoderDims.from_config(model.config))
    assert out.dtype == np.float32 and out.shape == tuple(ref.shape)
    return common.rel_error(torch.from_numpy(out), ref)


@pytest.mark.parametrize("cfg", [BertConfig(), SMALL], ids=["minilm", "small"])
def test_numpy_minilm_matches_torch_model(cfg):
    seed = common.fresh_seed()
    model = init_random_(BertSentenceEncoder(cfg), seed).eval()
    ids, mask = _batch(cfg, 3, 16, seed)
    assert _numpy_vs_torch(model, ids, mask) < 1e-5


def test_numpy_minilm_ignores_padded_tokens_and_returns_unit_rows():
    seed = common.fresh_seed()
    model = init_random_(BertSentenceEncoder(SMALL), seed).eval()
    ids, mask = _batch(SMALL, 3, 12, seed)
    ops, dims = jm.numpy_ops(), jm.EncoderDims.from_config(SMALL)
    params = {k: v.detach().numpy() for k, v in model.named_parameters()}
    m = mask.numpy().astype(np.int32)
    a = jm.sentence_embeddings(ops, params, ids.numpy().astype(np.int32), m, dims)
    other = np.where(m == 1, ids.numpy(), (ids.numpy() + 7) % SMALL.vocab_size).astype(np.int32)
    b = jm.sentence_embeddings(ops, params, other, m, dims)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, rtol=1e-5)


def test_numpy_minilm_on_the_workload_case():
    case = workloads.minilm_case("cpu", common.fresh_seed(), batch=2, seq=16)
    params, ids, mask = jm.case_arrays(case)
    assert ids.dtype == np.int32 and mask.dtype == np.int32 and mask.min() == 0
    out = jm.sentence_embeddings(jm.numpy_ops(), params, ids, mask, jm.case_dims(case.real_weights))
    with torch.no_grad():
        ref = case.fn(case.params, case.input_ids, case.attention_mask)
    assert common.rel_error(torch.from_numpy(out), ref) < 1e-5


def test_jax_param_specs_follow_bert_plan():
    model = BertSentenceEncoder(SMALL)
    specs = jm.jax_param_specs(resolve_plan(model, MeshShape(("tp",), (2,)), bert_plan("tp")), "tp", "x")
    assert set(specs) == {k for k, _ in model.named_parameters()}
    layer = "encoder.layer.1"
    for n in ("query", "key", "value"):
        assert specs[f"{layer}.attention.self.{n}.weight"] == ("x",)
        assert specs[f"{layer}.attention.self.{n}.bias"] == ("x",)
    assert specs[f"{layer}.attention.output.dense.weight"] == (None, "x")
    assert specs[f"{layer}.attention.output.dense.bias"] == ()
    assert specs[f"{layer}.intermediate.dense.weight"] == ("x",)
    assert specs[f"{layer}.intermediate.dense.bias"] == ("x",)
    assert specs[f"{layer}.output.dense.weight"] == (None, "x")
    assert specs[f"{layer}.output.dense.bias"] == ()
    assert specs[f"{layer}.output.LayerNorm.weight"] == ()
    assert specs["embeddings.word_embeddings.weight"] == ()
    with pytest.raises(ValueError, match="names axes"):
        jm.jax_param_specs({"w": ("dp", None)}, "tp", "x")


def _jax_child(tp: int) -> list[dict]:
    env = common.child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"})
    cmd = [sys.executable, "-m", "benchmarks.anchors.jax_xla", "--bench", "dispatch", "--tp", str(tp),
           "--workloads", "minilm", "--calls", "2", "--rounds", "1", "--label", "jax"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [r for r in common.parse_records(proc.stdout) if r["kind"] == "dispatch"]


def test_jax_anchor_minilm_on_two_virtual_cpu_devices():
    pytest.importorskip("jax")
    [rec] = _jax_child(2)
    assert rec["workload"] == "minilm" and rec["source"] == "jax" and rec["error"] is None
    assert rec["enqueue_us"] > 0 and rec["synced_us"] > 0 and rec["rel_err_vs_f32"] < 1e-6
    assert rec["rel_err_vs_torch"] < 1e-5
    assert rec["hlo"]["all-reduce"] == 2 * BertConfig().num_hidden_layers  # one per rowwise linear


def test_jax_anchor_minilm_failure_is_an_na_record():
    pytest.importorskip("jax")
    [rec] = _jax_child(8)  # 12 heads do not split 8 ways
    assert rec["workload"] == "minilm" and rec["enqueue_us"] is None and "not divisible" in rec["error"]
