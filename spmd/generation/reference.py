"""The eager PyTorch reference of ``spmd.Generator``: the same module, programs and sampler, on one device."""

from __future__ import annotations

import torch

from spmd.generation.sampling import Sampling, initial_rng_state, sample
from spmd.models.llama_lm import LlamaForCausalLM


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
    """
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
