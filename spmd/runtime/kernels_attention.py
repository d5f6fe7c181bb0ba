"""Scaled dot-product attention with the backend chosen per shape and dtype by timing.

``F.scaled_dot_product_attention`` picks its CUDA backend (cuDNN, flash, memory-efficient or
math) by a fixed heuristic that is not tuned per shape: on an H200 MiniLM's bf16 attention
(12 heads of 32, key-padding mask) runs cuDNN's kernel and its float32 attention the
memory-efficient (cutlass) kernel at several times the FLOP floor. So, as XLA's and Inductor's
autotuners choose GEMM kernels, the first call of a key times every backend that accepts the
inputs and keeps the fastest (the gemv choice, ``spmd.runtime.kernels_gemv``, does the same):

- key: the GPU model (every GPU of one model in the process shares the choice: a replicated value
  is computed by the same kernel on each device), q / k / v shapes, strides and dtype, the mask's
  shape, strides and dtype (or none), is_causal, scale, and which backends PyTorch has enabled
  (``torch.backends.cuda.*_sdp_enabled``: a backend the user turned off is never a candidate);
- candidates: each enabled backend forced with ``torch.nn.attention.sdpa_kernel``, and, where
  Triton is installed, two kernels of spmd's own: for a decode step's attention (one query per
  sequence, 16-bit) ``split-kv``, the flash-decoding kernel of
  ``spmd.runtime.triton_decode_attention`` (SDPA's kernels run one program per (batch, head)
  there: 32 at batch 1 for Llama-2-7B), and for at most ``MAX_KEYS`` keys ``short-seq``, the
  one-pass kernel of ``spmd.runtime.triton_short_attention`` (an encoder's 128-token attention
  with heads of 32, where SDPA's kernels run far from the memory floor); one that
  raises for these inputs (no kernel for the dtype, head dim, mask or layout) is skipped, and so
  is one whose result disagrees with the math definition computed in float32 (float64 for
  float64 inputs) beyond ``TOLERANCE[dtype]`` (elementwise ``|out - ref| <= tol * (1 + |ref|)``,
  rows the reference leaves non-finite, fully masked rows, not compared);
- timing: each candidate captured in a CUDA graph and replayed with a cold L2, interleaved,
  median of ``_TIMED_CALLS`` (µs per call, the mask conversion kernels PyTorch adds included);
- the fastest wins unless PyTorch's own pick (``torch._fused_sdp_choice``) is within
  ``KEEP_DEFAULT_MARGIN``: then, and whenever nothing could be timed, the call runs exactly as
  before (no flags touched). Every choice is appended to ``DECISIONS`` and counted in
  ``spmd.metrics`` (``attention.choice.<backend>``; ``attention.choice.default`` where nothing
  could be timed, ``attention.choice_failed`` where the timing itself failed).

No timing inside a CUDA-graph capture: a capture of a key not chosen yet runs PyTorch's default
(``attention.capture_default``) and the next non-capturing call decides. ``sdpa_kernel`` only sets
process-global dispatch flags that PyTorch reads on the host when it picks the kernel, so a
capture under it records the chosen kernel; the flags are set and restored under one lock
(``_FLAGS_LOCK``), which every CUDA call here holds while it dispatches, so threads running
attention at once never see each other's flags.

CPU tensors, tensors under a tracing / fake-tensor dispatch mode, inputs that need gradients and
non-4-d inputs run ``F.scaled_dot_product_attention`` as before. ``SPMD_ATTENTION_CHOICE``:
``auto`` (default: timing as above), ``default`` (PyTorch's heuristic everywhere, no timing) or a
backend name in ``BACKENDS``, ``split-kv`` or ``short-seq`` (that backend wherever it accepts the
inputs, else the default; counted in ``attention.forced_unavailable``) for measurements. Any other value is a ValueError
naming the variable. ``override_mode(mode)`` sets the mode for one thread (a same-run A/B).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import _get_current_dispatch_mode

from spmd import metrics
from spmd.compile_lock import CAPTURE_LOCK
from spmd.runtime.kernel_timing import capture_each, cold_replay_us

Tensor = torch.Tensor
CHOICE_ENV = "SPMD_ATTENTION_CHOICE"
BACKENDS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
SPLIT_KV = "split-kv"  # spmd.runtime.triton_decode_attention: one query per sequence, keys split over programs
SHORT_SEQ = "short-seq"  # spmd.runtime.triton_short_attention: every key of a (batch, head) in one block
TRITON_KERNELS = (SPLIT_KV, SHORT_SEQ)
MODES = ("auto", "default", *BACKENDS, *TRITON_KERNELS)
#: float32: 1e-4, tight enough that a kernel computing in TF32 (about 1e-3) is never chosen for
#: float32 inputs, loose enough for 3xTF32 (PyTorch's memory-efficient kernel, ``short-seq``: ~1e-6)
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-4, torch.float64: 1e-7}
KEEP_DEFAULT_MARGIN = 0.03  # a candidate must beat PyTorch's own pick by more than 3% to replace it
MATH_MAX_SCORE_BYTES = 256 * 2**20  # math materialises float32 scores [B, H, Sq, Sk]: not a candidate beyond
_REFERENCE_MAX_BYTES = 512 * 2**20  # the float32 reference is computed on at most this much of the batch
_TIMED_CALLS = 7
_ENABLED = {
    "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
    "flash": torch.backends.cuda.flash_sdp_enabled,
    "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
    "math": torch.backends.cuda.math_sdp_enabled,
}
_NAMES = {backend.value: name for name, backend in BACKENDS.items()}
_FLAGS_LOCK = threading.RLock()  # re-entrant: a dispatch mode may call back into attention
_kinds: dict[torch.device, str] = {}
_choices: dict[tuple, str | None] = {}  # key -> backend to force, or None: PyTorch's default


@dataclass(frozen=True)
class Decision:
    """One timed choice, for reports.

    Fields: q / k shapes (``[B, H, S, D]``), dtype and mask shape / dtype (None without a mask)
    as strings and tuples; is_causal; ``default``: PyTorch's own pick (None if unknown);
    ``chosen``: the backend kept (None: nothing could be timed, the default runs); ``times_us``:
    (backend, median µs per call) of every timed candidate; ``skipped``: (backend, reason).
    """

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    dtype: str
    mask_shape: tuple[int, ...] | None
    mask_dtype: str | None
    is_causal: bool
    default: str | None
    chosen: str | None
    times_us: tuple[tuple[str, float], ...]
    skipped: tuple[tuple[str, str], ...]

    def line(self) -> str:
        """One line: the shapes, each candidate's µs, the skipped ones and the choice."""
        mask = f" mask {list(self.mask_shape)} {self.mask_dtype}" if self.mask_shape is not None else ""
        times = ", ".join(f"{n} {t:.1f} us" for n, t in self.times_us)
        skipped = "; skipped " + ", ".join(f"{n} ({why})" for n, why in self.skipped) if self.skipped else ""
        return (f"attention q {list(self.q_shape)} k {list(self.k_shape)} {self.dtype}{mask}"
                f"{' causal' if self.is_causal else ''}: {times}{skipped}; default {self.default}, "
                f"chosen {self.chosen}")


DECISIONS: list[Decision] = []  # every choice made in this process, in order (for reports)


_override = threading.local()


def choice_mode() -> str:
    """The mode of this thread's innermost ``override_mode``, else ``SPMD_ATTENTION_CHOICE``
    (``auto`` if unset): one of ``MODES``; ValueError naming the variable for any other value."""
    mode = getattr(_override, "mode", None) or os.environ.get(CHOICE_ENV, "auto") or "auto"
    if mode not in MODES:
        raise ValueError(f"{CHOICE_ENV}: expected one of {MODES}, got {mode!r}")
    return mode


@contextlib.contextmanager
def override_mode(mode: str) -> Iterator[None]:
    """Within (this thread): attention calls run in ``mode`` (one of ``MODES``) whatever
    ``SPMD_ATTENTION_CHOICE`` says; for same-process comparisons (a program warmed up and captured
    under ``override_mode("default")`` keeps PyTorch's kernels in its CUDA graph). ValueError for
    an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"attention choice mode: expected one of {MODES}, got {mode!r}")
    previous = getattr(_override, "mode", None)
    _override.mode = mode
    try:
        yield
    finally:
        _override.mode = previous


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float | None) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)``
    with the backend chosen for this key (module docstring).

    q ``[B, H, Sq, D]``, k ``[B, H, Sk, D]``, v ``[B, H, Sk, Dv]``, mask broadcastable to
    ``[B, H, Sq, Sk]`` (bool: True = attend; float: added to the scores); any floating dtype; the
    result ``[B, H, Sq, Dv]`` in q's dtype. Errors are PyTorch's for inputs no backend accepts.
    """
    if not _on_gpu(q):  # CPU: as before
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    mode = choice_mode()
    if mode == "default" or not _can_time(q, k, v, mask):
        return _default(q, k, v, mask, is_causal, scale)
    if mode != "auto":
        return _forced(mode, q, k, v, mask, is_causal, scale)
    key = _key(q, k, v, mask, is_causal, scale)
    try:
        name = _choices[key]
    except KeyError:
        if _capturing():  # no timing inside a capture: decide at the next call
            metrics.counter("attention.capture_default").inc()
            name = None
        else:
            name = _decide(key, q, k, v, mask, is_causal, scale)
    if name is None:
        return _default(q, k, v, mask, is_causal, scale)
    return run_backend(name, q, k, v, mask, is_causal, scale)


def _default(q, k, v, mask, is_causal, scale) -> Tensor:
    """PyTorch's own backend pick, never under another thread's forced flags."""
    with _FLAGS_LOCK:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


def run_backend(name: str, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                scale: float | None) -> Tensor:
    """SDPA with only backend ``name`` (a key of ``BACKENDS``) enabled, or one of spmd's Triton
    kernels (``TRITON_KERNELS``); PyTorch's RuntimeError ("No available kernel") where it does not
    accept these inputs (a RuntimeError too where a Triton kernel does not). Capture-safe: the
    flags act on the host dispatch only."""
    if name.split(":")[0] in TRITON_KERNELS:
        if not _triton_eligible(name, q, k, v, mask, is_causal):
            raise RuntimeError(f"{name}: no kernel for these inputs")
        if name == SPLIT_KV:
            from spmd.runtime import triton_decode_attention

            return triton_decode_attention.attention(q, k, v, mask, scale)
        from spmd.runtime import triton_short_attention

        return triton_short_attention.attention(q, k, v, mask, is_causal, scale, _short_config(name))
    with _FLAGS_LOCK, sdpa_kernel([BACKENDS[name]]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


def _on_gpu(q: Tensor) -> bool:
    return q.is_cuda


def _triton_eligible(name: str, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> bool:
    """Triton is installed and kernel ``name``'s ``eligible`` holds for these CUDA inputs (for a
    ``short-seq:MxW`` name, with that configuration among the shape's ``configs``)."""
    if not q.is_cuda or q.dim() != 4 or (name == SPLIT_KV and q.shape[2] != 1):
        return False
    try:
        if name == SPLIT_KV:
            from spmd.runtime import triton_decode_attention as kernel
        else:
            from spmd.runtime import triton_short_attention as kernel
    except ImportError:
        return False
    if not kernel.eligible(q, k, v, mask, is_causal):
        return False
    config = _short_config(name) if name != SPLIT_KV else None
    return config is None or config in kernel.configs(q, k, v)


def _short_config(name: str) -> tuple[int, int] | None:
    """``short-seq:64x4`` -> (64, 4): the queries per program and warps a candidate name carries
    (None for plain ``short-seq``: the kernel's default for the shape)."""
    _, _, config = name.partition(":")
    if not config:
        return None
    m, _, w = config.partition("x")
    return int(m), int(w)


def _triton_candidates(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> tuple[str, ...]:
    """The Triton kernels these inputs can run, ``short-seq`` once per usable configuration."""
    names: tuple[str, ...] = ()
    if _triton_eligible(SPLIT_KV, q, k, v, mask, is_causal):
        names += (SPLIT_KV,)
    if _triton_eligible(SHORT_SEQ, q, k, v, mask, is_causal):
        from spmd.runtime import triton_short_attention

        names += tuple(f"{SHORT_SEQ}:{m}x{w}" for m, w in triton_short_attention.configs(q, k, v))
    return names


def _can_time(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    """Plain 4-d tensors outside any tracing mode and not needing gradients."""
    if q.dim() != 4:
        return False
    tensors = (q, k, v) if mask is None else (q, k, v, mask)
    if any(type(t) is not torch.Tensor for t in tensors):
        return False  # fake / functional tensors of a trace
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return _get_current_dispatch_mode() is None


def _capturing() -> bool:
    """A CUDA graph capture on this thread's current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _forced(name: str, q, k, v, mask, is_causal, scale) -> Tensor:
    try:
        return run_backend(name, q, k, v, mask, is_causal, scale)
    except RuntimeError:  # the forced backend has no kernel for these inputs
        metrics.counter("attention.forced_unavailable").inc()
        return _default(q, k, v, mask, is_causal, scale)


def _layout(t: Tensor | None) -> tuple:
    return () if t is None else (tuple(t.shape), t.stride(), t.dtype)


def _key(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float | None) -> tuple:
    with _FLAGS_LOCK:  # not while another thread holds its forced flags
        enabled = tuple(name for name, on in _ENABLED.items() if on())
    enabled += _triton_candidates(q, k, v, mask, is_causal)
    return (_device_kind(q.device), _layout(q), _layout(k), _layout(v), _layout(mask), bool(is_causal), scale,
            enabled)


def _device_kind(device: torch.device) -> str:
    """The GPU model of ``device``: one choice for all GPUs of a model in this process, so that a
    value replicated over devices is computed by the same kernel, bit for bit, on each of them."""
    kind = _kinds.get(device)
    if kind is None:
        kind = _kinds[device] = f"{device.type}:{torch.cuda.get_device_name(device)}" if device.type == "cuda" \
            else device.type
    return kind


def _decide(key: tuple, q, k, v, mask, is_causal, scale) -> str | None:
    """Time the candidates once for ``key`` (under ``CAPTURE_LOCK``: no other thread captures or
    synchronises meanwhile), cache the backend to force (None: PyTorch's default) and return it."""
    with CAPTURE_LOCK:
        if key in _choices:
            return _choices[key]
        try:
            decision = decide(q, k, v, mask, is_causal, scale, candidates=key[-1])
        except Exception:  # noqa: BLE001 - timing failed (out of memory for the L2 flush): keep PyTorch's pick
            metrics.counter("attention.choice_failed").inc()
            _choices[key] = None
            return None
        DECISIONS.append(decision)
        metrics.counter(f"attention.choice.{decision.chosen or 'default'}").inc()
        name = None if decision.chosen in (None, decision.default) else decision.chosen
        _choices[key] = name
        return name


def decide(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float | None,
           candidates: Sequence[str] = tuple(BACKENDS)) -> Decision:
    """Time ``candidates`` (backend names) on these CUDA inputs now (nothing cached) and return
    the ``Decision``. Shapes as ``sdpa``; synchronises the device. Used by ``sdpa`` and by
    ``benchmarks/probe/attention_choice.py``."""
    names = [n for n in candidates if n != "math" or _score_bytes(q, k) <= MATH_MAX_SCORE_BYTES]
    device = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with device, torch.no_grad(), metrics.timer("attention.choose"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch warns why each rejecting backend cannot run
        run = partial(_run_named, q=q, k=k, v=v, mask=mask, is_causal=is_causal, scale=scale)
        default = _default_name(q, k, v, mask, is_causal, scale)
        chosen, times, skipped = choose(names, run, lambda: _reference(q, k, v, mask, is_causal, scale),
                                        partial(_median_us, device=q.device), TOLERANCE.get(q.dtype, 1e-2),
                                        default)
    too_big = tuple(("math", "scores too large") for n in candidates if n == "math" and n not in names)
    return Decision(tuple(q.shape), tuple(k.shape), str(q.dtype).removeprefix("torch."),
                    None if mask is None else tuple(mask.shape),
                    None if mask is None else str(mask.dtype).removeprefix("torch."),
                    bool(is_causal), default, chosen, times, skipped + too_big)


def choose(names: Sequence[str], run: Callable[[str], Tensor], reference: Callable[[], Tensor],
           time_us: Callable[[list[Callable[[], Tensor]]], list[float | None]], tolerance: float,
           default: str | None = None) -> tuple[str | None, tuple[tuple[str, float], ...], tuple[tuple[str, str], ...]]:
    """The selection, independent of devices: run each of ``names`` once (``run(name)``; an
    exception skips it), compare with ``reference()`` (``[n, ...]``, the first ``n`` rows of the
    result; disagreeing beyond ``tolerance`` skips it), time the rest together
    (``time_us(callables)``: µs per call each, None where one cannot be timed) and keep the
    fastest; ``default`` is kept unless beaten by more than ``KEEP_DEFAULT_MARGIN``.

    Returns (chosen name or None when none could be timed, ((name, µs), ...), ((name, reason), ...)).
    """
    ref = reference()
    agreeing, skipped = [], []
    for name in names:
        try:
            out = run(name)
        except Exception as e:  # noqa: BLE001 - a backend without a kernel for these inputs
            skipped.append((name, f"raises {type(e).__name__}"))
            continue
        error = _disagreement(out, ref, tolerance)
        if error is not None:
            skipped.append((name, f"disagrees by {error:.3g}"))
            continue
        agreeing.append(name)
    measured = time_us([partial(run, n) for n in agreeing]) if agreeing else []
    times = tuple((n, float(t)) for n, t in zip(agreeing, measured) if t is not None and math.isfinite(t))
    skipped += [(n, "not timed") for n, t in zip(agreeing, measured) if t is None or not math.isfinite(t)]
    if not times:
        return None, times, tuple(skipped)
    chosen, best = min(times, key=lambda nt: nt[1])
    default_us = dict(times).get(default)
    if default_us is not None and best >= default_us * (1 - KEEP_DEFAULT_MARGIN):
        chosen = default
    return chosen, times, tuple(skipped)


def _disagreement(out: Tensor, ref: Tensor, tolerance: float) -> float | None:
    """None if ``out``'s first ``len(ref)`` rows agree with ``ref``, else the worst excess error
    (inf for a shape mismatch or a non-finite value where ``ref`` is finite)."""
    if out.dim() != ref.dim() or tuple(out.shape[1:]) != tuple(ref.shape[1:]) or out.shape[0] < ref.shape[0]:
        return math.inf
    got = out[: ref.shape[0]].to(ref.dtype)
    finite = torch.isfinite(ref)
    excess = torch.where(finite, (got - ref).abs() - tolerance * (1 + ref.abs()), torch.zeros_like(ref))
    worst = excess.max().item() if excess.numel() else 0.0
    if math.isnan(worst) or worst > 0:
        return math.inf if math.isnan(worst) else worst
    return None


def _run_named(name: str, q, k, v, mask, is_causal, scale) -> Tensor:
    return run_backend(name, q, k, v, mask, is_causal, scale)


def _score_bytes(q: Tensor, k: Tensor) -> int:
    return math.prod(q.shape[:-1]) * k.shape[-2] * 4


def _reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
               scale: float | None) -> Tensor:
    """The math definition in float32 (float64 for float64 inputs) of the first batch rows that
    fit ``_REFERENCE_MAX_BYTES`` of scores (at least one): ``[n, H, Sq, Dv]``."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = max(1, min(q.shape[0], _REFERENCE_MAX_BYTES // max(1, _score_bytes(q[:1], k))))
    q, k, v = (t[:rows].to(dtype) if t.shape[0] > 1 else t.to(dtype) for t in (q, k, v))
    if mask is not None:
        if mask.dim() == 4 and mask.shape[0] > 1:
            mask = mask[:rows]
        mask = mask if mask.dtype == torch.bool else mask.to(dtype)
    return run_backend("math", q, k, v, mask, is_causal, scale)


def _default_name(q, k, v, mask, is_causal, scale) -> str | None:
    """The backend PyTorch's heuristic picks for these inputs, or None where it cannot say."""
    try:
        with _FLAGS_LOCK:
            return _NAMES.get(int(torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal, scale=scale)))
    except (RuntimeError, TypeError, AttributeError):
        return None


def _median_us(calls: list[Callable[[], Tensor]], device: torch.device) -> list[float | None]:
    """Median µs of one call of each of ``calls`` as the runtime runs it (a CUDA graph replay),
    interleaved, each with a cold L2, as ``kernels_gemv`` times (``spmd.runtime.kernel_timing``).
    A call that cannot be captured gets None."""
    return cold_replay_us(capture_each(calls, device), device, _TIMED_CALLS)
