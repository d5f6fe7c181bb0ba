"""spmd.parallelize: parameter placement, numerics against the unsharded module, collective summaries."""

import pytest
import torch

from spmd.mesh import Mesh
from spmd.models import gpt, llama, minilm, plans
from spmd.parallelize import ParallelModule, parallelize, ring_bytes_per_device, summarize_collectives
from spmd.sharding import PartitionSpec as P

SENTENCES = ("The cat sat on the warm windowsill.", "Interest rates rose again this quarter.",
             "A guitarist played on the corner.")


@pytest.fixture(scope="module")
def minilm_model():
    return minilm.load_model()


@pytest.fixture(scope="module")
def minilm_batch():
    return minilm.tokenize(minilm.load_tokenizer(), SENTENCES)


def test_parameters_are_placed_per_plan():
    m = gpt.gpt3_layers(small=True, seed=2)
    mesh = Mesh.create(("tp",), devices="cpu:4")
    pm = parallelize(m, mesh, plans.gpt_plan())
    assert isinstance(pm, ParallelModule)
    w = pm.params["layers.0.mlp.fc_in.weight"]
    assert tuple(w.shape) == (256, 64) and w.sharding.spec == P("tp")
    assert [tuple(s.data.shape) for s in w.shards] == [(64, 64)] * 4
    assert torch.equal(w.shards[1].data, m.layers[0].mlp.fc_in.weight[64:128])
    down = pm.params["layers.0.mlp.fc_out.weight"]
    assert torch.equal(down.shards[3].data, m.layers[0].mlp.fc_out.weight[:, 192:])
    assert torch.equal(pm.params["layers.0.ln_1.weight"].to_torch(), m.layers[0].ln_1.weight)
    assert "sharded over 'tp'" in repr(pm)


def test_parallelize_argument_errors():
    m = gpt.gpt3_layers(small=True)
    mesh = Mesh.create(("tp",), devices="cpu:2")
    with pytest.raises(TypeError, match="module"):
        parallelize(lambda x: x, mesh, plans.gpt_plan())
    with pytest.raises(TypeError, match="mesh"):
        parallelize(m, "cpu:2", plans.gpt_plan())
    with pytest.raises(ValueError, match="3 heads|heads"):
        parallelize(gpt.gpt3_layers(small=True, num_heads=2), Mesh.create(("tp",), devices="cpu:4"),
                    plans.gpt_plan())


def test_params_with_a_missing_or_unknown_name_are_a_value_error():
    """A removed entry used to fall back silently to the module's own (stale) tensor before the first call."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    pm = parallelize(m, Mesh.create(("tp",), devices="cpu:2"),
                     plans.Plan(rules=(("0", plans.ColwiseParallel()), ("2", plans.RowwiseParallel())), tp_axis="tp"))
    x = torch.randn(3, 4)
    bias = pm.params.pop("2.bias")
    with pytest.raises(ValueError, match=r"params: expected exactly the module's parameters; missing \['2.bias'\]"):
        pm(x)
    pm.params["2.bias"], pm.params["extra"] = bias, bias
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        pm(x)
    del pm.params["extra"]
    torch.testing.assert_close(pm(x).to_torch(), m(x).detach())


@pytest.mark.parametrize("n", [1, 2, 4])
def test_minilm_sharded_matches_unsharded(n, minilm_model, minilm_batch):
    mesh = Mesh.create(("tp",), devices=f"cpu:{n}")
    pm = parallelize(minilm_model, mesh, plans.bert_plan())
    out = pm(minilm_batch.input_ids, minilm_batch.attention_mask).to_torch()
    with torch.no_grad():
        ref = minilm_model(minilm_batch.input_ids, minilm_batch.attention_mask)
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=1)
    assert cos.min().item() >= 0.99999
    assert (out - ref).abs().max().item() <= 1e-4
    stats = {s.opcode: s for s in summarize_collectives(pm.lowered.as_text("spmd-partition"))}
    if n == 1:
        assert not stats
    else:  # one all-reduce (or reduce-scatter + all-gather) after each rowwise linear: 2 per layer
        assert sum(s.count for s in stats.values()) >= 12


@pytest.mark.parametrize("make,plan", [
    (lambda: gpt.gpt3_layers(2, small=True, seed=7), plans.gpt_plan()),
    (lambda: llama.llama_layers("llama3-70b", 1, small=True, seed=7), plans.llama_plan()),
])
def test_blocks_sharded_match_eager(make, plan):
    m = make()
    mesh = Mesh.create(("tp",), devices="cpu:2")
    pm = parallelize(m, mesh, plan)
    x = torch.randn(2, 8, 64)
    out = pm(x).to_torch()
    with torch.no_grad():
        ref = m(x)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    assert pm.compiled is not None and pm.compile_s > 0


def test_dp_tp_mesh_with_batch_sharded_inputs(minilm_model, minilm_batch):
    mesh = Mesh.create({"dp": 1, "tp": 2}, devices="cpu:2")
    pm = parallelize(minilm_model, mesh, plans.bert_plan(), input_shardings=(P("dp"), P("dp")))
    ids, mask = pm.place_inputs(minilm_batch.input_ids, minilm_batch.attention_mask)
    out = pm(ids, mask).to_torch()
    with torch.no_grad():
        ref = minilm_model(minilm_batch.input_ids, minilm_batch.attention_mask)
    assert (out - ref).abs().max().item() <= 1e-4


HLO = """HloModule m, num_partitions=4, mesh={tp=4}

ENTRY %main (x: f32[8,16], w: f32[16,8]) -> f32[8,32] {
  %x = f32[8,16] parameter(0), sharding={replicated}
  %w = f32[16,8] parameter(1), sharding={devices=[1,4]<=[4]}
  %d = f32[8,8] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar = f32[8,8] all-reduce(%d), replica_groups={{0,1},{2,3}}, to_apply=%add
  %ag = f32[8,32] all-gather(%ar), replica_groups={{0,1,2,3}}, dimensions={1}
  %cp = bf16[4] collective-permute(%p), source_target_pairs={{0,1},{1,2}}
  %rs = (f32[8,8], f32[2,8]) all-gather-start(%ar), replica_groups=[1,4]<=[4], dimensions={0}
  %rsd = f32[32,8] all-gather-done(%rs)
  ROOT %t = f32[8,32] copy(%ag)
}
"""


def test_summarize_collectives_counts_and_ring_bytes():
    stats = {s.opcode: s for s in summarize_collectives(HLO)}
    assert set(stats) == {"all-gather", "all-reduce", "collective-permute"}
    assert stats["all-reduce"].count == 1
    assert stats["all-reduce"].bytes_per_device == 2 * 256 * 1 // 2  # group of 2, operand 256 B
    assert stats["all-gather"].count == 2
    assert stats["all-gather"].bytes_per_device == 256 * 3 + 256 * 3
    assert stats["collective-permute"].bytes_per_device == 8  # unknown operand: its own bf16[4]


def test_ring_bytes():
    assert ring_bytes_per_device("reduce-scatter", 1000, 4) == 750
    assert ring_bytes_per_device("all-reduce", 1000, 1) == 0
    assert ring_bytes_per_device("all-to-all", 800, 8) == 700


@pytest.mark.parametrize("make,plan", [
    (lambda: gpt.gpt3_layers(2, small=True, seed=8), plans.gpt_plan(sequence_parallel=True)),
    (lambda: llama.llama_layers("llama3-70b", 1, small=True, seed=8), plans.llama_plan(sequence_parallel=True)),
])
def test_sequence_parallel_blocks_match_eager(make, plan):
    m = make()
    pm = parallelize(m, Mesh.create(("tp",), devices="cpu:2"), plan)
    x = torch.randn(2, 16, 64)
    out = pm(x)
    with torch.no_grad():
        ref = m(x)
    assert torch.allclose(out.to_torch(), ref, atol=1e-4, rtol=1e-4)
    text = pm.lowered.as_text("import")
    assert text.count("Sharding") >= 6  # constraints pinned on norms, colwise and rowwise outputs
    assert not any(s._forward_hooks or s._forward_pre_hooks for s in m.modules())  # hooks removed after tracing


def test_a_call_with_another_number_of_inputs_than_input_shardings_names_the_inputs():
    mesh = Mesh.create({"tp": 1}, devices="cpu:1")
    pm = parallelize(torch.nn.Linear(4, 4), mesh, plans.Plan(rules=()), input_shardings=(P(),))
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"inputs: expected 1 \(one per entry of input_shardings\), got 2"):
        pm(x, x)
    with pytest.raises(ValueError, match=r"inputs: expected 1 \(one per entry of input_shardings\), got 0"):
        pm()
    torch.testing.assert_close(pm(x).to_torch(), pm.module(x))


def test_one_spec_for_input_shardings_is_a_type_error_that_shows_the_tuple():
    """PartitionSpec is a tuple: P() used to pass as zero specs and fail at the call with 'expected 0'."""
    mesh = Mesh.create({"tp": 1}, devices="cpu:1")
    with pytest.raises(TypeError, match=r"input_shardings: expected a tuple of specs \(one per input\), got one "
                                        r"PartitionSpec; write \(.*,\) for a single input"):
        parallelize(torch.nn.Linear(4, 4), mesh, plans.Plan(rules=()), input_shardings=P())



def test_a_list_for_input_shardings_is_a_type_error_as_documented():
    mesh = Mesh.create({"tp": 1}, devices="cpu:1")
    with pytest.raises(TypeError, match=r"input_shardings: expected a tuple of specs \(one per input\), got list; "
                                        r"write \(P\(\),\)"):
        parallelize(torch.nn.Linear(4, 4), mesh, plans.Plan(rules=()), input_shardings=[P()])


class _DictInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, d):
        return self.proj(d["x"]) + d["y"]


def test_a_list_or_dict_input_reaches_the_argument_checks_or_runs():
    """A list input used to fail while keying the compile cache (TypeError: unhashable type: 'list');
    a module whose forward takes a dict of tensors runs."""
    mesh = Mesh.create({"tp": 1}, devices="cpu:1")
    pm = parallelize(torch.nn.Linear(4, 4), mesh, plans.Plan(rules=()))
    with pytest.raises(TypeError, match=r"Linear: argument 1: expected a torch.Tensor or spmd.ShardedArray .*got list"):
        pm([1.0] * 4)
    pd = parallelize(_DictInput(), mesh, plans.Plan(rules=()))
    d = {"x": torch.randn(2, 4), "y": torch.randn(2, 4)}
    torch.testing.assert_close(pd(d).to_torch(), pd.module(d))
    d2 = {"x": torch.randn(3, 4), "y": torch.randn(3, 4)}  # another shape: its own compiled program
    torch.testing.assert_close(pd(d2).to_torch(), pd.module(d2))
