"""``spmd.Generator``: autoregressive decoding of a ``LlamaForCausalLM`` on a mesh with a sharded KV cache.

Two programs with static shapes, each compiled once and reused for every token:

- **prefill** ``(params, tokens [B, P], start [B], kv, rng, history) -> (token [B], kv, rng,
  history)``: the left-padded prompts (static length P) fill cache slots ``0 .. P-1`` and the
  first token is sampled;
- **decode** ``(params, token [B], slot [], start [B], kv, rng, history) -> (token [B], slot + 1,
  kv, rng, history)``: one token per sequence written at the device position ``slot``.

The KV cache (one ``(k, v)`` pair of ``ShardedArray``s per layer, [B, kv heads, max_seq,
head_dim]: batch over ``dp``, KV heads over ``tp``, replicated over ``tp`` when tp does not
divide the KV head count) and the sampler's random state are donated to each step and come back
as its outputs, and so is ``history`` (int64 [B, max new tokens], the sampled tokens). The sampled
token and the position stay on device and feed the next step: the host fetches ``history`` at
the end, or every ``stream_every`` steps.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from spmd import metrics
from spmd.array import device_put
from spmd.generation.checks import check_memory, positive_int
from spmd.generation.placement import place_params
from spmd.generation.sampling import Sampling, initial_rng_state, sample
from spmd.jit import jit
from spmd.mesh import Mesh
from spmd.models.llama_lm import LlamaForCausalLM
from spmd.models.plans import llama_lm_plan, resolve_plan
from spmd.passes.pipeline import CompileOptions
from spmd.sharding import NamedSharding, PartitionSpec

_TTFT = metrics.timer("generate.ttft")
_STEP = metrics.timer("generate.decode_step")
_TOKENS = metrics.counter("generate.tokens")


@dataclass(frozen=True)
class GenerationResult:
    """Tokens and timings of one ``Generator.generate`` call.

    Fields:
      tokens: int64 [num_prompts, max_new_tokens] (CPU), the new tokens of each prompt.
      ttft_s: seconds from the call to the first token on the host side of the device (prefill).
      decode_s: seconds of the decode steps (the remaining ``max_new_tokens - 1`` tokens), to
        the last token being ready.
      step_latencies_s: per decode step, in seconds, when ``timing=True`` (each step then waits
        for its token), else empty.
    """

    tokens: torch.Tensor
    ttft_s: float
    decode_s: float
    step_latencies_s: tuple[float, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput over all sequences: batch x (new tokens - 1) / decode_s (0 with one token)."""
        n = self.tokens.shape[0] * (self.tokens.shape[1] - 1)
        return n / self.decode_s if self.decode_s > 0 else 0.0


def _record(history: torch.Tensor, token: torch.Tensor, index) -> torch.Tensor:
    """``history`` int64 [B, T] with column ``index`` (int or int64 tensor []) set to ``token`` [B].

    The sampled tokens accumulate on device in one donated buffer, so the host holds no
    per-step output (a CUDA-graph runner then reuses its output sets instead of cloning them).
    """
    cols = torch.arange(history.shape[1], device=history.device)
    return torch.where(cols[None, :] == index, token[:, None], history)


def _axis(mesh: Mesh, name: str) -> str | None:
    return name if name in mesh.axis_names else None


def _zeros_cache(model: LlamaForCausalLM, max_batch: int, max_seq: int) -> torch.Tensor:
    """One zero K (or V) cache tensor [max_batch, kv heads, max_seq, head_dim] in the model's dtype (CPU).

    Raises ValueError naming max_batch / max_seq and the cache's size when it cannot be allocated.
    """
    shape, dtype = model.kv_shape(max_batch, max_seq), model.lm_head.weight.dtype
    try:
        return torch.zeros(shape, dtype=dtype)
    except (RuntimeError, MemoryError):
        total = 2 * model.config.num_layers * math.prod(shape) * dtype.itemsize
        raise ValueError(f"max_batch ({max_batch}), max_seq ({max_seq}): the KV cache (2 x {model.config.num_layers} "
                         f"layers x {list(shape)} {dtype}, {total / 2**30:,.1f} GiB) cannot be allocated; "
                         f"expected sizes whose cache fits in memory") from None


def _prompt_rows(prompts):
    """A 2-d tensor or numpy array of prompts as a list of its rows (1-d tensors); another
    tensor as None (rejected by the caller); other values as given."""
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        return [torch.from_numpy(np.ascontiguousarray(row)) for row in prompts]
    if isinstance(prompts, torch.Tensor):
        return list(prompts) if prompts.dim() == 2 else None
    return prompts


def _check_prompt_type(i: int, p) -> None:
    """TypeError unless prompt ``i`` is a sequence of token ids (a list / tuple, or a 1-d tensor
    or numpy array)."""
    if isinstance(p, np.ndarray):
        if p.ndim != 1:
            raise TypeError(f"prompts[{i}]: expected a 1-d array of token ids, got a {p.ndim}-d array")
    elif isinstance(p, torch.Tensor):
        if p.dim() != 1:
            raise TypeError(f"prompts[{i}]: expected a 1-d tensor of token ids, got a {p.dim()}-d tensor")
        if p.device.type == "meta":
            raise TypeError(f"prompts[{i}]: expected a tensor of token ids with data, got a tensor on the meta device")
    elif not isinstance(p, Sequence) or isinstance(p, (str, bytes, bytearray)):
        raise TypeError(f"prompts[{i}]: expected a sequence of int token ids (a list or a 1-d int tensor), "
                        f"got {type(p).__name__}")


class Generator:
    """Prefill and decode programs for ``model`` on ``mesh``, with a preallocated sharded KV cache.

    Args:
      model: a ``spmd.models.llama_lm.LlamaForCausalLM`` (its parameters are copied to the mesh
        once, sharded by ``llama_lm_plan`` over mesh axis ``"tp"`` when the mesh has one; Generators
        of one unchanged model on one mesh share that copy, see ``spmd.generation.placement``).
        The Generator keeps that copy: later updates of the model (in place under
        ``torch.no_grad()``, ``load_state_dict``) are not seen by it; build a new Generator for
        new weights. Writes that bypass PyTorch's version counter (``p.data.mul_(2)``,
        ``p.numpy()``) are not detected: a Generator built after one may reuse the old copy.
      mesh: the device mesh; axis ``"dp"`` (if present) splits the batch, ``"tp"`` the heads;
        other axes are allowed only with size 1.
      max_batch: sequences in the cache (prompts beyond it are a ValueError; fewer are padded).
      max_seq: cache slots per sequence (prompt length + new tokens - 1 must fit).
      prefill_len: the static (left-padded) prompt length P of the prefill program, <= max_seq.
      options: ``CompileOptions`` of both programs.
    Raises:
      TypeError: model, mesh or options of the wrong type, sizes that are not ints (numpy integers
        are ints). ValueError: sizes < 1, prefill_len > max_seq,
        a KV cache or a prefill too large for the memory available (naming max_batch / max_seq or
        prefill_len: ``checks.check_memory``), a mesh axis other than dp / tp of size > 1, or a plan
        that does not fit the mesh (see ``llama_lm_plan``).
    """

    def __init__(self, model: LlamaForCausalLM, mesh: Mesh, *, max_batch: int, max_seq: int, prefill_len: int,
                 options: CompileOptions | None = None) -> None:
        if not isinstance(model, LlamaForCausalLM):
            raise TypeError(f"model: expected a spmd.models.llama_lm.LlamaForCausalLM, got {type(model).__name__}")
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh: expected a spmd.Mesh, got {type(mesh).__name__}")
        max_batch, max_seq, prefill_len = (positive_int(name, v) for name, v in (
            ("max_batch", max_batch), ("max_seq", max_seq), ("prefill_len", prefill_len)))
        if options is not None and not isinstance(options, CompileOptions):
            raise TypeError(f"options: expected a spmd.CompileOptions or None, got {type(options).__name__}")
        if prefill_len > max_seq:
            raise ValueError(f"prefill_len: expected <= max_seq ({max_seq}), got {prefill_len}")
        unused = [a for a, n in zip(mesh.axis_names, mesh.axis_sizes, strict=True) if a not in ("dp", "tp") and n > 1]
        if unused:
            raise ValueError(f"mesh: axes {unused} are not used by spmd.Generator; expected axes dp and/or tp "
                             f"(other axes only of size 1), got {mesh!r}")
        self.model, self.mesh = model, mesh
        self.max_batch, self.max_seq, self.prefill_len = max_batch, max_seq, prefill_len
        # the parameters are weight_argnums of both programs: merged Q/K/V and gate/up weights
        # are concatenated once per weight version (hoist-weights), not on every step
        self.options = options or CompileOptions()
        cfg = model.config
        self.dp, tp = _axis(mesh, "dp"), _axis(mesh, "tp")
        tp_size = mesh.axis_size(tp) if tp else 1
        check_memory(mesh, cfg, tuple(model.kv_shape(max_batch, max_seq)), model.lm_head.weight.dtype.itemsize,
                     max_batch, prefill_len, max_seq, self.dp, tp)
        zeros = _zeros_cache(model, max_batch, max_seq)
        if tp:
            specs = resolve_plan(model, mesh, llama_lm_plan(cfg.num_kv_heads, tp_size, tp))
        else:
            specs = {fqn: PartitionSpec() for fqn, _ in model.named_parameters()}
        self.param_specs = specs
        # placed once per model, mesh and plan: Generators of one model share the device weights
        self._placed = place_params(model, {fqn: NamedSharding(mesh, s) for fqn, s in specs.items()})
        self.params = dict(self._placed.arrays)
        kv_heads_axis = tp if tp and cfg.num_kv_heads % tp_size == 0 else None
        self.kv_sharding = NamedSharding(mesh, PartitionSpec(self.dp, kv_heads_axis, None, None))
        self._batch = NamedSharding(mesh, PartitionSpec(self.dp))
        self._batch2 = NamedSharding(mesh, PartitionSpec(self.dp, None))
        self._repl = NamedSharding(mesh, PartitionSpec())
        self.kv = tuple((device_put(zeros, self.kv_sharding), device_put(zeros, self.kv_sharding))
                        for _ in range(cfg.num_layers))
        self._programs: dict[Sampling, tuple] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ programs
    def _kv_specs(self):
        return tuple((self.kv_sharding, self.kv_sharding) for _ in self.kv)

    def programs(self, sampling: Sampling) -> tuple:
        """The (prefill, decode) ``Jitted`` pair for ``sampling`` (the seed does not matter)."""
        key = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, 0)
        if key not in self._programs:
            self._programs[key] = self._build(key)
        return self._programs[key]

    def _build(self, sampling: Sampling) -> tuple:
        model, first = self.model, self.prefill_len - 1

        def prefill(params, tokens, start, kv, rng, history):
            logits, kv = torch.func.functional_call(model, params, (tokens, 0, start, kv))
            token, rng = sample(logits, rng, sampling)
            return token, kv, rng, _record(history, token, 0)

        def decode(params, token, slot, start, kv, rng, history):
            logits, kv = torch.func.functional_call(model, params, (token[:, None], slot, start, kv))
            token, rng = sample(logits, rng, sampling)
            return token, slot + 1, kv, rng, _record(history, token, slot - first)

        kv, b, b2, r = self._kv_specs(), self._batch, self._batch2, self._repl
        pre = jit(prefill, mesh=self.mesh, in_shardings=(None, b2, b, kv, b2, b2), out_shardings=(b, kv, b2, b2),
                  donate_argnums=(3, 4, 5), weight_argnums=0, options=self.options)
        dec = jit(decode, mesh=self.mesh, in_shardings=(None, b, r, b, kv, b2, b2), out_shardings=(b, r, kv, b2, b2),
                  donate_argnums=(4, 5, 6), weight_argnums=0, options=self.options)
        return pre, dec

    # ------------------------------------------------------------------ inputs
    def _check_prompts(self, prompts) -> list[list[int]]:
        prompts = _prompt_rows(prompts)
        if not isinstance(prompts, Sequence) or isinstance(prompts, str) or not prompts:
            raise TypeError("prompts: expected a non-empty list of token-id sequences (lists or 1-d int tensors)")
        if len(prompts) > self.max_batch:
            raise ValueError(f"prompts: {len(prompts)} prompts exceed the cache's batch (max_batch={self.max_batch})")
        out = []
        vocab = self.model.config.vocab_size
        for i, p in enumerate(prompts):
            _check_prompt_type(i, p)
            ids = p.tolist() if isinstance(p, (torch.Tensor, np.ndarray)) else list(p)
            if not ids:
                raise ValueError(f"prompts[{i}]: empty prompt; expected at least one token")
            bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
            if bad is not None:
                raise TypeError(f"prompts[{i}]: expected int token ids, got {type(bad).__name__} {bad!r}")
            ids = [int(t) for t in ids]  # numpy integers as Python ints
            if len(ids) > self.prefill_len:
                raise ValueError(f"prompts[{i}]: {len(ids)} tokens exceed prefill_len ({self.prefill_len}, "
                                 f"max_seq {self.max_seq})")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"prompts[{i}]: token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
            out.append(ids)
        return out

    def _check_new_tokens(self, max_new_tokens) -> None:
        max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
        last = self.prefill_len + max_new_tokens - 1
        if last > self.max_seq:
            raise ValueError(f"max_new_tokens: {max_new_tokens} new tokens after a prefill of {self.prefill_len} "
                             f"need {last} cache positions, past the cache's max_seq ({self.max_seq})")

    def pad_prompts(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded int64 tokens [max_batch, prefill_len] and starts int64 [max_batch] (CPU).

        Missing sequences up to ``max_batch`` are one-token prompts (token 0), dropped from results.
        """
        tokens = torch.zeros(self.max_batch, self.prefill_len, dtype=torch.int64)
        start = torch.full((self.max_batch,), self.prefill_len - 1, dtype=torch.int64)
        for b, ids in enumerate(prompts):
            tokens[b, self.prefill_len - len(ids):] = torch.tensor(ids, dtype=torch.int64)
            start[b] = self.prefill_len - len(ids)
        return tokens, start

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, max_new_tokens: int, sampling: Sampling | None = None, *, timing: bool = False,
                 stream_every: int = 0, on_tokens: Callable[[torch.Tensor], None] | None = None,
                 progress: Callable[[int], None] | None = None) -> GenerationResult:
        """Generate ``max_new_tokens`` tokens for each prompt.

        Args:
          prompts: list of token-id sequences (lists of ints, numpy ints included, or 1-d int tensors or
            numpy arrays), each 1 .. ``prefill_len`` tokens, at most ``max_batch`` of them; or an int
            tensor or numpy array [B, S].
          max_new_tokens: int >= 1; ``prefill_len + max_new_tokens - 1 <= max_seq``.
          sampling: a ``Sampling`` (default greedy).
          timing: wait for every decode step's token and record its latency (``step_latencies_s``
            and the ``spmd.metrics`` timer ``generate.decode_step``); otherwise steps are only
            enqueued and the host waits once at the end.
          stream_every / on_tokens: call ``on_tokens(int64 [num_prompts, n])`` with each chunk of
            ``stream_every`` new tokens as it is ready (0: no streaming).
          progress: called with the number of tokens generated so far after each step.
        Returns:
          A ``GenerationResult``.
        Raises:
          TypeError / ValueError: bad prompts (empty, too long, too many, not sequences of ids,
          ids outside the vocabulary), ``max_new_tokens`` not an int (TypeError), < 1 or past the
          cache, ``sampling`` not a
          Sampling, a non-bool ``timing``, ``stream_every`` not an int (TypeError) or < 0,
          ``on_tokens`` / ``progress`` not callable, ``on_tokens`` with ``stream_every=0``.
          Nothing runs and the cache is untouched when an argument is rejected.
        Thread-safe: calls from several threads run one after the other (they share the cache).
        """
        sampling = Sampling() if sampling is None else sampling
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling: expected a spmd.generation.Sampling, got {type(sampling).__name__}")
        ids = self._check_prompts(prompts)
        self._check_new_tokens(max_new_tokens)
        max_new_tokens = int(max_new_tokens)  # a numpy integer too
        if isinstance(stream_every, bool) or not isinstance(stream_every, numbers.Integral):
            raise TypeError(f"stream_every: expected an int >= 0, got {type(stream_every).__name__} {stream_every!r}")
        if stream_every < 0:
            raise ValueError(f"stream_every: expected an int >= 0, got {stream_every!r}")
        stream_every = int(stream_every)
        if not isinstance(timing, bool):
            raise TypeError(f"timing: expected True or False, got {type(timing).__name__} {timing!r}")
        for name, fn in (("on_tokens", on_tokens), ("progress", progress)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name}: expected a callable or None, got {type(fn).__name__}")
        if on_tokens is not None and stream_every == 0:
            raise ValueError("on_tokens: given with stream_every=0 (no streaming), so it would never be called; "
                             "expected stream_every >= 1 (tokens per call) or no on_tokens")
        with self._lock:  # one generation at a time: each step donates and replaces the shared cache
            return self._generate(ids, max_new_tokens, sampling, timing, stream_every, on_tokens, progress)

    def _generate(self, ids, max_new_tokens, sampling, timing, stream_every, on_tokens, progress) -> GenerationResult:
        prefill, decode = self.programs(sampling)
        tokens, start = self.pad_prompts(ids)
        # greedy decoding reads no random numbers: a [B, 1] placeholder keeps the program signature
        lanes = 1 if sampling.greedy else self.model.config.vocab_size
        rng = device_put(initial_rng_state(self.max_batch, lanes, sampling.seed), self._batch2)
        history = device_put(torch.zeros(self.max_batch, self.max_seq - self.prefill_len + 1, dtype=torch.int64),
                             self._batch2)
        n = len(ids)
        t0 = time.perf_counter()
        tokens = device_put(tokens, self._batch2)
        start = device_put(start, self._batch)
        token, self.kv, rng, history = prefill(self.params, tokens, start, self.kv, rng, history)
        token.block_until_ready()
        ttft = time.perf_counter() - t0
        _TTFT.record(ttft)
        fetched, lat, done = [], [], 0
        slot = device_put(torch.tensor(self.prefill_len, dtype=torch.int64), self._repl)
        t1 = time.perf_counter()
        for i in range(1, max_new_tokens):
            ts = time.perf_counter()
            token, slot, self.kv, rng, history = decode(self.params, token, slot, start, self.kv, rng, history)
            if timing:
                token.block_until_ready()
                lat.append(time.perf_counter() - ts)
                _STEP.record(lat[-1])
            if stream_every and on_tokens is not None and i + 1 - done >= stream_every:
                fetched.append(history.to_torch()[:n, done:i + 1])
                on_tokens(fetched[-1])
                done = i + 1
            if progress is not None:
                progress(i + 1)
        final = history.to_torch()[:n, :max_new_tokens]
        decode_s = time.perf_counter() - t1
        if stream_every and on_tokens is not None and done < max_new_tokens:
            on_tokens(final[:, done:])
        _TOKENS.inc(n * max_new_tokens)
        return GenerationResult(final, ttft, decode_s if max_new_tokens > 1 else 0.0, tuple(lat))

    def kv_cache(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The cache's global values (CPU tensors), one ``(k, v)`` pair per layer."""
        return tuple((k.to_torch(), v.to_torch()) for k, v in self.kv)


def generate(model: LlamaForCausalLM, mesh: Mesh, prompts, max_new_tokens: int, sampling: Sampling | None = None, *,
             max_seq: int | None = None, options: CompileOptions | None = None) -> GenerationResult:
    """One-shot ``Generator(...).generate(...)``: the cache is sized for these prompts.

    ``prefill_len`` is the longest prompt, ``max_batch`` the number of prompts, ``max_seq``
    (default) ``prefill_len + max_new_tokens - 1``. Raises as ``Generator`` and ``Generator.generate``
    (``max_new_tokens`` / ``max_seq`` not an int: TypeError; below 1 or too small a cache: ValueError).
    For many calls, build a ``Generator`` once: its programs are compiled once.
    """
    prompts = _prompt_rows(prompts)
    if not isinstance(prompts, Sequence) or isinstance(prompts, str) or not prompts:
        raise TypeError("prompts: expected a non-empty list of token-id sequences (lists or 1-d int tensors)")
    for i, p in enumerate(prompts):
        _check_prompt_type(i, p)
    prefill_len = max(max(len(p) for p in prompts), 1)
    max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
    max_seq = None if max_seq is None else positive_int("max_seq", max_seq)
    if max_seq is not None and max_seq < prefill_len + max_new_tokens - 1:
        raise ValueError(f"max_seq: the longest prompt ({prefill_len} tokens) and {max_new_tokens} new tokens need "
                         f"{prefill_len + max_new_tokens - 1} cache positions, got max_seq={max_seq}")
    max_seq = prefill_len + max_new_tokens - 1 if max_seq is None else max_seq
    gen = Generator(model, mesh, max_batch=len(prompts), max_seq=max_seq, prefill_len=prefill_len, options=options)
    return gen.generate(prompts, max_new_tokens, sampling)
