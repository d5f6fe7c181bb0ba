"""Fine-tuning all-MiniLM-L6-v2 with in-batch negatives on Python standard-library (signature, docstring) pairs.

Pairs: for every public function with a docstring in a fixed list of standard-library modules,
(``module.name(signature)``, the docstring's first paragraph). The loss is the multiple
negatives ranking loss of sentence-transformers (Henderson et al., "Efficient Natural Language
Response Suggestion for Smart Reply", 2017): cross-entropy of the scaled cosine-similarity
matrix between the two sides' embeddings, the matching pair being the target class of each row.
"""

from __future__ import annotations

import importlib
import inspect

import torch
import torch.nn.functional as F

__all__ = ["load_pairs", "pair_batch_at", "contrastive_loss"]

MODULES = ("textwrap", "string", "glob", "fnmatch", "shlex", "bisect", "heapq", "statistics", "difflib",
           "functools", "os.path", "json", "shutil", "base64", "calendar", "random", "copy", "keyword")
SCALE = 20.0  # sentence-transformers MultipleNegativesRankingLoss default


def load_pairs() -> list[tuple[str, str]]:
    """(signature text, docstring paragraph) pairs, in a fixed order."""
    pairs = []
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            doc = inspect.getdoc(fn)
            if name.startswith("_") or not doc:
                continue
            try:
                sig = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            pairs.append((f"{mod_name}.{name}{sig}"[:200], doc.split("\n\n")[0].replace("\n", " ")[:300]))
    return pairs


def _encode(tokenizer, texts: list[str], seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    from spmd.models.minilm import tokenize

    b = tokenize(tokenizer, texts)
    ids, mask = b.input_ids[:, :seq], b.attention_mask[:, :seq]
    pad = seq - ids.shape[1]
    return F.pad(ids, (0, pad)), F.pad(mask, (0, pad))


def pair_batch_at(pairs, tokenizer, step: int, batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """The batch of ``step`` (a function of seed and step): ``batch`` distinct pairs, both sides
    tokenized to ``seq`` tokens. Returns int64 ``a_ids``, ``a_mask``, ``b_ids``, ``b_mask`` of [B, S]."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    pick = torch.randperm(len(pairs), generator=g)[:batch].tolist()
    a_ids, a_mask = _encode(tokenizer, [pairs[i][0] for i in pick], seq)
    b_ids, b_mask = _encode(tokenizer, [pairs[i][1] for i in pick], seq)
    return {"a_ids": a_ids, "a_mask": a_mask, "b_ids": b_ids, "b_mask": b_mask}


def contrastive_loss(apply, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """In-batch negatives loss: cross_entropy(SCALE · cos(a_i, b_j), i). ``apply`` gives unit embeddings."""
    a = apply(batch["a_ids"], batch["a_mask"])
    b = apply(batch["b_ids"], batch["b_mask"])
    scores = a @ b.T * SCALE
    return F.cross_entropy(scores, torch.arange(scores.shape[0]))
