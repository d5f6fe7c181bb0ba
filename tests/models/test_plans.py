"""Sharding plans: pattern matching, resolution to PartitionSpecs, and the errors users see."""

import pytest
import torch
from torch import nn

from spmd.ir.sharding import MeshShape
from spmd.mesh import Mesh
from spmd.models import gpt, llama, plans
from spmd.models.bert import BertConfig, BertSentenceEncoder
from spmd.sharding import PartitionSpec as P

TP4 = MeshShape(("tp",), (4,))


@pytest.fixture(scope="module")
def bert():
    with torch.device("meta"):
        return BertSentenceEncoder(BertConfig(num_hidden_layers=2))


def test_bert_plan_megatron_layout(bert):
    specs = plans.resolve_plan(bert, TP4, plans.bert_plan())
    assert list(specs) == [n for n, _ in bert.named_parameters()]
    layer = "encoder.layer.1."
    for proj in ("query", "key", "value"):
        assert specs[f"{layer}attention.self.{proj}.weight"] == P("tp")
        assert specs[f"{layer}attention.self.{proj}.bias"] == P("tp")
    assert specs[f"{layer}attention.output.dense.weight"] == P(None, "tp")
    assert specs[f"{layer}attention.output.dense.bias"] == P()
    assert specs[f"{layer}intermediate.dense.weight"] == P("tp")
    assert specs[f"{layer}output.dense.weight"] == P(None, "tp")
    assert specs[f"{layer}output.dense.bias"] == P()
    assert specs[f"{layer}output.LayerNorm.weight"] == P()
    assert specs["embeddings.word_embeddings.weight"] == P()
    assert sum(1 for s in specs.values() if s != P()) == 2 * 10  # q,k,v (w+b), attn out w, ffn in (w+b), ffn out w


def test_star_is_one_segment():
    assert plans._segment_match("encoder.layer.3.output.dense", "encoder.layer.*.output.dense")
    assert not plans._segment_match("encoder.layer.3.attention.output.dense", "encoder.layer.*.output.dense")
    assert plans._segment_match("layers.0.mlp.up_proj", "layers.*.mlp.{gate_proj,up_proj}")
    assert not plans._segment_match("layers.0.mlp.down_proj", "layers.*.mlp.{gate_proj,up_proj}")


def test_heads_not_divisible_names_module_sizes_and_axis(bert):
    with pytest.raises(ValueError) as e:
        plans.resolve_plan(bert, MeshShape(("tp",), (8,)), plans.bert_plan())
    msg = str(e.value)
    assert "encoder.layer.0.attention.self.query" in msg and "12 heads" in msg and "'tp' of size 8" in msg


def test_ffn_not_divisible():
    m = gpt.gpt3_layers(small=True, num_heads=4, ffn_size=90, device="meta")
    with pytest.raises(ValueError, match=r"layers.0.mlp.fc_in: 90 features .* size 4"):
        plans.resolve_plan(m, TP4, plans.gpt_plan())


def test_llama_gqa_kv_heads_must_divide():
    m = llama.llama_layers("llama3-70b", device="meta")  # 64 heads, 8 KV heads
    specs = plans.resolve_plan(m, MeshShape(("dp", "tp"), (2, 8)), plans.llama_plan())
    assert specs["layers.0.self_attn.k_proj.weight"] == P("tp")
    assert specs["layers.0.mlp.down_proj.weight"] == P(None, "tp")
    with pytest.raises(ValueError, match=r"k_proj: 8 heads .* size 16"):
        plans.resolve_plan(m, MeshShape(("tp",), (16,)), plans.llama_plan())


def test_sequence_parallel_norms_are_replicated():
    m = llama.llama_layers(small=True, device="meta")
    specs = plans.resolve_plan(m, MeshShape(("tp",), (2,)), plans.llama_plan(sequence_parallel=True))
    assert specs["layers.0.input_layernorm.weight"] == P()
    assert specs["layers.0.self_attn.q_proj.weight"] == P("tp")


def test_pattern_matching_nothing_is_an_error():
    m = llama.llama_layers(small=True, device="meta")
    with pytest.raises(ValueError, match=r"pattern\(s\) \['layers.\*.attn"):
        plans.resolve_plan(m, MeshShape(("tp",), (2,)), plans.gpt_plan())


def test_unknown_axis_and_bad_types():
    m = gpt.gpt3_layers(small=True, device="meta")
    with pytest.raises(ValueError, match="mesh axis 'tp' is not in the mesh"):
        plans.resolve_plan(m, MeshShape(("x",), (2,)), plans.gpt_plan())
    with pytest.raises(TypeError, match="plan"):
        plans.resolve_plan(m, TP4, {"layers.*": plans.ColwiseParallel()})
    with pytest.raises(TypeError, match="rules"):
        plans.Plan((("layers.*", "colwise"),))


@pytest.mark.parametrize("rules, match", [
    ("up", r"rules: expected a sequence of \(str pattern, ParallelStyle\) pairs, got str 'up'"),
    (5, r"rules: expected a sequence of .* pairs, got int 5"),
    ({"0": plans.Replicate()}, r"rules: expected a sequence of .* pairs, got dict \{'0': Replicate"),
])
def test_rules_not_a_sequence_of_pairs_is_named_whole(rules, match):
    with pytest.raises(TypeError, match=match):
        plans.Plan(rules=rules)
    with pytest.raises(TypeError, match="tp_axis: expected a mesh axis name"):
        plans.Plan((), tp_axis=3)
    plan = plans.Plan([("0", plans.Replicate())])  # a list is kept as a tuple: the plan stays hashable
    assert plan == plans.Plan((("0", plans.Replicate()),)) and hash(plan) == hash(plans.Plan(plan.rules))


def test_param_fqn_patterns_and_first_match_wins():
    m = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    plan = plans.Plan((("0.bias", plans.Replicate()), ("0", plans.ColwiseParallel()),
                       ("1", plans.RowwiseParallel())), "tp")
    specs = plans.resolve_plan(m, Mesh.create(("tp",), devices="cpu:2"), plan)
    assert specs == {"0.weight": P("tp"), "0.bias": P(), "1.weight": P(None, "tp"), "1.bias": P()}


def test_heads_unit_needs_head_dim():
    m = nn.Sequential(nn.Linear(8, 16))
    with pytest.raises(ValueError, match=r"0: style ColwiseParallel\(unit='heads'\) needs the head size: set a "
                                         r"head_dim attribute \(or num_heads with hidden_size / embed_dim\) on '0'"):
        plans.resolve_plan(m, TP4, plans.Plan((("0", plans.ColwiseParallel(unit="heads")),)))


class _Attention(nn.Module):
    """A user's attention module: q/k/v/o projections, the head count as an attribute (no head_dim)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, width_attr: str | None = "hidden_size"):
        super().__init__()
        self.num_heads = heads
        if width_attr:
            setattr(self, width_attr, hidden)
        hd = hidden // heads
        self.q_proj, self.o_proj = nn.Linear(hidden, heads * hd), nn.Linear(heads * hd, hidden)
        self.k_proj, self.v_proj = nn.Linear(hidden, kv_heads * hd), nn.Linear(hidden, kv_heads * hd)


HEAD_PLAN = plans.Plan((("{q_proj,k_proj,v_proj}", plans.ColwiseParallel(unit="heads")),
                        ("o_proj", plans.RowwiseParallel(unit="heads"))))


@pytest.mark.parametrize("width_attr", ["hidden_size", "embed_dim", None])
def test_heads_unit_infers_the_head_size_from_the_head_count(width_attr):
    m = _Attention(64, 8, 8, width_attr)
    specs = plans.resolve_plan(m, TP4, HEAD_PLAN)
    assert specs["q_proj.weight"] == P("tp") and specs["o_proj.weight"] == P(None, "tp")
    with pytest.raises(ValueError, match=r"8 heads \(dim 0 of q_proj.weight\) are not divisible by mesh axis "
                                         r"'tp' of size 16"):
        plans.resolve_plan(m, MeshShape(("tp",), (16,)), HEAD_PLAN)


def test_heads_unit_counts_kv_heads_with_the_model_width():
    """With hidden_size the head size is 64 / 8 = 8, so k_proj [16, 64] has 2 heads: tp=4 is refused."""
    m = _Attention(64, 8, 2)
    with pytest.raises(ValueError, match=r"2 heads \(dim 0 of k_proj.weight\)"):
        plans.resolve_plan(m, TP4, HEAD_PLAN)
    assert plans.resolve_plan(m, MeshShape(("tp",), (2,)), HEAD_PLAN)["k_proj.weight"] == P("tp")


def test_heads_unit_reads_torch_multihead_attention():
    m = nn.Sequential(nn.MultiheadAttention(32, 4))
    plan = plans.Plan((("0.out_proj", plans.RowwiseParallel(unit="heads")),))
    assert plans.resolve_plan(m, TP4, plan)["0.out_proj.weight"] == P(None, "tp")


def test_activation_layouts_only_with_sequence_parallel():
    m = gpt.gpt3_layers(small=True, device="meta")
    assert plans.activation_layouts(m, plans.gpt_plan()) == []
    layouts = dict((n, (i, o)) for n, i, o in plans.activation_layouts(m, plans.gpt_plan(sequence_parallel=True)))
    assert layouts["layers.0.ln_1"] == (1, 1)
    assert layouts["layers.0.attn.q_proj"] == (None, -1)
    assert layouts["layers.0.attn.out_proj"] == (None, 1)
    assert layouts["layers.0.mlp.fc_out"] == (None, 1)
    assert "layers.0.attn" not in layouts


@pytest.mark.parametrize("style", [plans.ColwiseParallel, plans.RowwiseParallel, plans.SequenceParallel,
                                   plans.Replicate])
@pytest.mark.parametrize("unit", ["bogus", "Heads", "", None])
def test_unknown_unit_is_refused(style, unit):
    with pytest.raises(ValueError, match=rf"{style.__name__}: unit must be one of \('features', 'heads'\), got"):
        style(unit=unit)
    assert style(unit="heads").unit == "heads" and style().unit == "features"
