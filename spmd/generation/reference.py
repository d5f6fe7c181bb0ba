"""The eager PyTorch reference of ``spmd.Generator``: the same module, programs and sampler, on one device."""

from __future__ import annotations

import torch

from spmd.generation.checks import positive_int
from spmd.generation.sampling import Sampling, initial_rng_state, sample
from spmd.models.llama_lm import LlamaForCausalLM


def _check(model: LlamaForCausalLM, tokens, start, max_new_tokens, max_seq, sampling) -> None:
    """TypeError / ValueError naming the argument of ``reference_generate``, expected vs got."""
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"model: expected a spmd.models.llama_lm.LlamaForCausalLM, got {type(model).__name__}")
    for name, t, dims in (("tokens", tokens, 2), ("start", start, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype != torch.int64:
            got = f"{t.dtype} [{', '.join(map(str, t.shape))}]" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name}: expected an int64 tensor of {dims} dims, got {got}")
    b, p = tokens.shape
    if p < 1 or start.shape[0] != b:
        raise ValueError(f"tokens / start: expected tokens [B, P] with P >= 1 and start [B], got tokens "
                         f"{list(tokens.shape)} and start {list(start.shape)}")
    vocab = model.config.vocab_size
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"tokens: expected ids in [0, {vocab}), got {int(tokens.min())}..{int(tokens.max())}")
    if b and (int(start.min()) < 0 or int(start.max()) >= p):
        raise ValueError(f"start: expected slots in [0, {p}) (P = tokens.shape[1]), got "
                         f"{int(start.min())}..{int(start.max())}")
    max_new_tokens, max_seq = positive_int("max_new_tokens", max_new_tokens), positive_int("max_seq", max_seq)
    if p + max_new_tokens - 1 > max_seq:
        raise ValueError(f"max_seq: a prefill of {p} and {max_new_tokens} new tokens need {p + max_new_tokens - 1} "
                         f"cache positions, got max_seq={max_seq}")
    if sampling is not None and not isinstance(sampling, Sampling):
        raise TypeError(f"sampling: expected a spmd.generation.Sampling or None, got {type(sampling).__name__}")


@torch.no_grad()
def reference_generate(model: LlamaForCausalLM, tokens: torch.Tensor, start: torch.Tensor, max_new_tokens: int,
                       max_seq: int, sampling: Sampling | None = None) -> tuple[torch.Tensor, tuple]:
    """Greedy or sampled decoding in plain PyTorch eager, step for step as ``Generator.generate``.

    Args:
      model: the model (its parameters' device and dtype are used).
      tokens: int64 [B, P] left-padded prompts; start: int64 [B] first slot of each sequence
        (``Generator.pad_prompts`` makes both).
      max_new_tokens: >= 1; max_seq: cache slots (P + max_new_tokens - 1 <= max_seq).
      sampling: a ``Sampling`` (default greedy); the same seed draws the same random numbers.
    Returns:
      (int64 [B, max_new_tokens] new tokens, the final KV cache: one ``(k, v)`` per layer).
    Raises:
      TypeError: model, tokens, start, sizes or sampling of the wrong type (tokens / start must
        be int64 tensors of 2 / 1 dims). ValueError: sizes < 1, P + max_new_tokens - 1 > max_seq,
        start not [B] or outside [0, P), token ids outside the vocabulary.
    """
    _check(model, tokens, start, max_new_tokens, max_seq, sampling)
    max_new_tokens, max_seq = int(max_new_tokens), int(max_seq)
    sampling = Sampling() if sampling is None else sampling
    dev = model.lm_head.weight.device
    b, p = tokens.shape
    tokens, start = tokens.to(dev), start.to(dev)
    kv = model.empty_kv(b, max_seq)
    rng = initial_rng_state(b, model.config.vocab_size, sampling.seed).to(dev)
    logits, kv = model(tokens, 0, start, kv)
    token, rng = sample(logits, rng, sampling)
    out = [token]
    slot = torch.tensor(p, dtype=torch.int64, device=dev)
    for _ in range(1, max_new_tokens):
        logits, kv = model(token[:, None], slot, start, kv)
        token, rng = sample(logits, rng, sampling)
        out.append(token)
        slot = slot + 1
    return torch.stack(out, dim=1), kv
