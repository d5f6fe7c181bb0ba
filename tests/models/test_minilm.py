"""all-MiniLM-L6-v2: our BERT module against sentence-transformers, loader and tokenizer errors."""

import pytest
import torch

from spmd.models import minilm
from spmd.models.bert import BertConfig

SENTENCES = (
    "A man is playing a guitar on the street corner.",
    "Borrowing costs went up after the monetary policy meeting.",
    "Tensor parallelism splits each weight matrix across several accelerators, which then exchange partial sums.",
)


@pytest.fixture(scope="module")
def model():
    return minilm.load_model()


@pytest.fixture(scope="module")
def tokenizer():
    return minilm.load_tokenizer()


def test_matches_sentence_transformers(model, tokenizer):
    batch = minilm.tokenize(tokenizer, SENTENCES)
    with torch.no_grad():
        ours = model(batch.input_ids, batch.attention_mask)
    ref = minilm.reference_embeddings(SENTENCES)
    assert ours.shape == ref.shape == (3, 384)
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=1)
    assert cos.min().item() >= 0.99999
    assert (ours - ref).abs().max().item() <= 1e-4
    assert torch.allclose(ours.norm(dim=1), torch.ones(3), atol=1e-5)


def test_extra_padding_changes_nothing(model, tokenizer):
    short = minilm.tokenize(tokenizer, SENTENCES)
    long = minilm.tokenize(tokenizer, SENTENCES, seq_len=short.input_ids.shape[1] + 13)
    with torch.no_grad():
        a = model(short.input_ids, short.attention_mask)
        b = model(long.input_ids, long.attention_mask)
    assert (a - b).abs().max().item() <= 1e-5


def test_paraphrases_are_closer_than_unrelated(model, tokenizer):
    s = minilm.DEMO_SENTENCES
    batch = minilm.tokenize(tokenizer, s)
    with torch.no_grad():
        e = model(batch.input_ids, batch.attention_mask)
    assert (e[0] @ e[1]) > (e[0] @ e[2]) + 0.2  # guitar/guitar vs guitar/interest rates
    assert len(s) >= 16 and len(set(s)) == len(s)


def test_tokenize_pads_with_zeros_and_checks_seq_len(tokenizer):
    batch = minilm.tokenize(tokenizer, ["hello world", "a much longer sentence than the first one"], seq_len=20)
    assert batch.input_ids.shape == batch.attention_mask.shape == (2, 20)
    n0 = int(batch.attention_mask[0].sum())
    assert batch.input_ids[0, 0].item() == 101 and batch.input_ids[0, n0 - 1].item() == 102  # [CLS] ... [SEP]
    assert batch.input_ids[0, n0:].eq(0).all()
    with pytest.raises(ValueError, match="seq_len"):
        minilm.tokenize(tokenizer, ["a much longer sentence than the first one"], seq_len=3)
    with pytest.raises(ValueError, match="sentences"):
        minilm.tokenize(tokenizer, [])


def test_truncates_to_max_seq_len(tokenizer):
    batch = minilm.tokenize(tokenizer, ["word " * 600])
    assert batch.input_ids.shape[1] == minilm.MAX_SEQ_LEN
    assert batch.input_ids[0, -1].item() == 102


def test_model_dir_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="lacks config.json"):
        minilm.find_model_dir(tmp_path)
    monkeypatch.setenv(minilm.ENV_VAR, str(tmp_path))
    with pytest.raises(ValueError, match="SPMD_MINILM_DIR"):
        minilm.find_model_dir()


def test_env_var_dir_with_fp16_weights(tmp_path, monkeypatch, model, tokenizer):
    from safetensors.torch import save_file

    src = minilm.find_model_dir()
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    save_file({k: v.half() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    monkeypatch.setenv(minilm.ENV_VAR, str(tmp_path))
    half = minilm.load_model()
    assert next(half.parameters()).dtype == torch.float32
    batch = minilm.tokenize(tokenizer, SENTENCES)
    with torch.no_grad():
        cos = torch.nn.functional.cosine_similarity(half(*batch.__dict__.values()), model(*batch.__dict__.values()))
    assert cos.min().item() > 0.999


def test_config_rejects_other_activation():
    with pytest.raises(ValueError, match="hidden_act"):
        BertConfig.from_dict({"hidden_act": "relu"})
    with pytest.raises(ValueError, match="divisible"):
        BertConfig(hidden_size=100, num_attention_heads=12)


def test_torch_export_traces_one_graph(model, tokenizer):
    batch = minilm.tokenize(tokenizer, SENTENCES[:2])
    ep = torch.export.export(model, (batch.input_ids, batch.attention_mask))
    out = ep.module()(batch.input_ids, batch.attention_mask)
    with torch.no_grad():
        assert torch.allclose(out, model(batch.input_ids, batch.attention_mask), atol=1e-6)


def _tiny_model_dir(path):
    """A loadable model directory without the real files: a tiny BERT config, its weights and a tokenizer."""
    import json

    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from spmd.models.bert import BertSentenceEncoder

    cfg = {"vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
           "intermediate_size": 16, "max_position_embeddings": 16}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(BertSentenceEncoder(BertConfig.from_dict(cfg)).state_dict(), str(path / "model.safetensors"))
    Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(path / "tokenizer.json"))
    return path


def test_bad_files_in_model_dir_name_the_file(tmp_path):
    d = _tiny_model_dir(tmp_path)
    minilm.load_model(d), minilm.load_tokenizer(d)  # the directory as built loads
    (d / "model.safetensors").write_bytes(b"\x01\x02\x03")  # was a raw SafetensorError: header too small
    with pytest.raises(ValueError, match=r"model\.safetensors: expected a safetensors checkpoint.*header too small"):
        minilm.load_model(d)
    (d / "tokenizer.json").write_text("{}")  # was a raw Exception: Model missing.
    with pytest.raises(ValueError, match=r"tokenizer\.json: expected a Hugging Face tokenizers file.*Model missing"):
        minilm.load_tokenizer(d)
    (d / "config.json").write_text('{"hidden_size": 8\n')  # truncated: was a message naming no file
    with pytest.raises(ValueError, match=r"config\.json: expected valid JSON"):
        minilm.load_model(d)
    (d / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"config\.json: expected a JSON object, got list"):
        minilm.load_model(d)
