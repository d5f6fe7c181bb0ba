"""Token sampling on device, traceable by ``spmd.jit`` and runnable in eager: greedy, temperature, top-k, top-p.

Sampling is the exponential race of gpt-fast (PyTorch-Labs, 2023): with ``q ~ Exp(1)`` drawn
independently per vocabulary entry, ``argmax(probs / q)`` is a sample from ``probs`` (the
Gumbel-max trick in multiplicative form). The uniform numbers come from a counter-free
multiplicative congruential generator kept as device state (Park & Miller, "Random number
generators: good ones are hard to find", CACM 1988, with the multiplier 48271 of Park, Miller
and Stockmeyer, 1993): ``state <- state * 48271 mod (2^31 - 1)``, one independent lane per
(sequence, vocabulary entry), seeded from ``Sampling.seed``. The state is an input and an output
of the compiled step, so a sampled step runs with no host work and replays in a CUDA graph; the
eager reference draws exactly the same numbers.

Top-k keeps the logits at least as large as the k-th largest (``torch.topk``); top-p (nucleus,
Holtzman et al., "The Curious Case of Neural Text Degeneration", ICLR 2020) keeps the smallest
set of largest probabilities whose mass reaches p (``torch.sort`` + ``torch.cumsum``); ties at the
threshold are all kept.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

RNG_MODULUS = 2**31 - 1
RNG_MULTIPLIER = 48271
_MIN_TEMPERATURE = torch.finfo(torch.float32).tiny  # logits are divided in float32


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.

    Fields:
      temperature: None for greedy (argmax; ties go to the lowest token id), else a float > 0
        (at least float32's smallest normal number, ~1.18e-38) dividing the logits.
      top_k: None, or an int >= 1: sample among the k largest logits (needs a temperature).
      top_p: None, or a float in (0, 1]: sample from the nucleus of mass p (needs a temperature).
      seed: int seed of the random state, in [-2^63, 2^64) (``torch.Generator.manual_seed``'s range).
    Raises:
      ValueError: a temperature below ~1.18e-38 (0 and negatives included) or not finite, top_k < 1,
        top_p outside (0, 1], top_k or top_p without a temperature, a seed outside [-2^63, 2^64).
      TypeError: a field of the wrong type.
    numpy scalars are accepted and stored as Python ``int`` / ``float`` (so are ints for the
    float fields).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self._check()
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("seed", int)):
            if getattr(self, name) is not None:  # numpy scalars as Python numbers: hashable keys, plain reprs
                object.__setattr__(self, name, kind(getattr(self, name)))

    def _check(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, numbers.Real):
                raise TypeError(f"temperature: expected a float > 0 or None (greedy), got {type(t).__name__}")
            t = float(t)
            if not (math.isfinite(t) and t >= _MIN_TEMPERATURE):
                raise ValueError(f"temperature: expected a finite float >= {_MIN_TEMPERATURE:.4g} (float32's smallest "
                                 f"normal number; None means greedy), got {t}")
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, numbers.Integral):
                raise TypeError(f"top_k: expected an int >= 1 or None, got {type(k).__name__}")
            k = int(k)
            if k < 1:
                raise ValueError(f"top_k: expected an int >= 1 or None, got {k}")
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, numbers.Real):
                raise TypeError(f"top_p: expected a float in (0, 1] or None, got {type(p).__name__}")
            p = float(p)
            if not 0 < p <= 1:
                raise ValueError(f"top_p: expected a float in (0, 1] or None, got {p}")
        if t is None and (k is not None or p is not None):
            raise ValueError("top_k / top_p need a temperature (temperature=None means greedy)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise TypeError(f"seed: expected an int, got {type(self.seed).__name__}")
        if not -(2**63) <= int(self.seed) < 2**64:
            raise ValueError(f"seed: expected an int in [-2**63, 2**64) (torch.Generator.manual_seed), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature is None


def initial_rng_state(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """int64 [batch, vocab] random state, each lane in [1, 2^31 - 2], from ``seed`` (CPU tensor)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, RNG_MODULUS, (batch, vocab), generator=gen, dtype=torch.int64)


def argmax_first(x: torch.Tensor) -> torch.Tensor:
    """Index of the largest entry of the last dim, the lowest on ties (as ``torch.argmax``). [..., V] -> int64 [...]."""
    v = x.shape[-1]
    top = x.amax(-1, keepdim=True)
    ids = torch.arange(v, device=x.device)
    return torch.where(x == top, ids, v).amin(-1)


def _top_p_threshold(probs: torch.Tensor, p: float) -> torch.Tensor:
    """[B, V] probs -> [B, 1]: the smallest probability kept by nucleus sampling of mass ``p``."""
    sorted_probs = torch.sort(probs, dim=-1, descending=True).values
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the strictly larger entries
    return torch.where(before < p, sorted_probs, torch.inf).amin(-1, keepdim=True)


def sample(logits: torch.Tensor, rng: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens from float logits [B, V] and the random state int64 [B, V].

    Returns (tokens int64 [B], the advanced state int64 [B, V]); greedy leaves the state as it is.
    """
    if sampling.greedy:
        return argmax_first(logits), rng
    rng = (rng * RNG_MULTIPLIER) % RNG_MODULUS
    u = (rng.float() * (1.0 / RNG_MODULUS)).clamp(1e-12, 1.0 - 2.0**-24)  # uniform in (0, 1)
    q = -torch.log(u)  # Exp(1)
    logits = logits.float()
    # shifted so the largest logit is 0: a small temperature sends the others to -inf, never the
    # largest to inf (inf - inf is NaN in the softmax, and a NaN row samples no valid token)
    logits = (logits - logits.amax(-1, keepdim=True)) / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = torch.where(logits < kth, -torch.inf, logits)
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p is not None and sampling.top_p < 1:
        probs = torch.where(probs < _top_p_threshold(probs, sampling.top_p), 0.0, probs)
    return argmax_first(probs / q), rng
