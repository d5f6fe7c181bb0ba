"""A small GPT language model on Python standard-library text, for ``python -m spmd train``.

Corpus: the source files of a fixed list of standard-library modules (every machine with Python
has them), tokenized with the all-MiniLM-L6-v2 WordPiece tokenizer and mapped onto a compact
vocabulary of its ``vocab_size - 1`` most frequent tokens plus one "other" id (so the embedding
and the output layer stay small).

Model: token + position embeddings, ``spmd.models.gpt`` decoder layers (names match
``gpt_plan``), a final LayerNorm and an output layer tied to the token embedding. The token
lookup is a one-hot matmul (the TPU formulation of an embedding; its gradient is a dot), and the
loss is cross-entropy written as ``-(log_softmax(logits) * one_hot(targets)).sum(-1).mean()``.
"""

from __future__ import annotations

import collections
import os
import sysconfig

import torch
import torch.nn.functional as F
from torch import nn

from spmd.models.gpt import GPTConfig, GPTLayer

__all__ = ["TinyGPT", "load_corpus", "batch_at", "lm_loss"]

STDLIB_MODULES = ("textwrap", "string", "glob", "fnmatch", "shlex", "bisect", "heapq", "queue", "calendar",
                  "statistics", "difflib", "functools", "contextlib", "dataclasses", "argparse", "enum")


def load_corpus(vocab_size: int, model_dir=None) -> tuple[torch.Tensor, list[str]]:
    """Token ids (int64, 1-d) of the stdlib corpus in a compact vocabulary, and its token strings.

    Raises ValueError when the tokenizer files are missing (see ``spmd.models.minilm``).
    """
    from spmd.models.minilm import load_tokenizer

    tok = load_tokenizer(model_dir)
    lib = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in STDLIB_MODULES:
        path = os.path.join(lib, f"{name}.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
    ids = [i for enc in tok.encode_batch(texts, add_special_tokens=False) for i in enc.ids]
    common = [i for i, _ in collections.Counter(ids).most_common(vocab_size - 1)]
    remap = {old: new for new, old in enumerate(common)}
    other = vocab_size - 1
    words = [tok.id_to_token(i) for i in common] + ["<other>"]
    return torch.tensor([remap.get(i, other) for i in ids], dtype=torch.int64), words


def batch_at(tokens: torch.Tensor, step: int, batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """The batch of ``step``: ``batch`` random windows of ``seq + 1`` tokens (a function of seed and step,
    so a resumed run sees the same batches). Returns ``{"ids": [B, S], "targets": [B, S]}`` int64.
    Raises ValueError unless ``seq + 1`` is shorter than ``tokens`` (a window must fit)."""
    if seq + 1 >= tokens.numel():
        raise ValueError(f"seq: a window of seq + 1 tokens must be shorter than the corpus ({tokens.numel()} tokens), "
                         f"got seq={seq}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
    windows = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
    return {"ids": windows[:, :-1].contiguous(), "targets": windows[:, 1:].contiguous()}


def _one_hot(ids: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    return (ids.unsqueeze(-1) == torch.arange(n, device=ids.device)).to(dtype)


class TinyGPT(nn.Module):
    """GPT LM. forward(ids: int64 [B, S]) -> logits float [B, S, vocab_size]."""

    def __init__(self, vocab_size: int, seq_len: int, hidden: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        cfg = GPTConfig(hidden_size=hidden, num_heads=heads, ffn_size=4 * hidden, num_layers=layers)
        self.vocab_size = vocab_size
        self.tok_emb = nn.Parameter(torch.randn(vocab_size, hidden) * 0.02)
        self.pos_emb = nn.Parameter(torch.randn(seq_len, hidden) * 0.02)
        self.layers = nn.ModuleList(GPTLayer(cfg) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = _one_hot(ids, self.vocab_size, self.tok_emb.dtype) @ self.tok_emb + self.pos_emb[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.ln_f(x) @ self.tok_emb.T


def lm_loss(apply, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy (natural log) of ``apply(batch["ids"])`` against ``batch["targets"]``."""
    logits = apply(batch["ids"])
    logp = F.log_softmax(logits, dim=-1)
    return -(logp * _one_hot(batch["targets"], logits.shape[-1], logp.dtype)).sum(-1).mean()
