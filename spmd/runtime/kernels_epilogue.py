"""A matrix product and its elementwise reader (``spmd.runtime.epilogue_fusion``) with the fastest
kernels for the shape, chosen by timing.

A linear layer followed by its activation (BERT's intermediate dense layer and GELU,
``[B·S, 4·D]``) runs as a GEMM that writes its result to HBM and an elementwise kernel that reads
it back and writes it again: on an H200 for MiniLM at batch 128 × 128 in bf16 the GELU
(~35 µs a layer) costs more than the GEMM (~28 µs). The candidates are

- ``cublas+act``: the two kernels the unfused ops ran (cuBLAS ``addmm`` / ``mm``, then the
  activation or the generated elementwise fusion): the default and the reference;
- ``triton-epilogue``: Inductor's Triton GEMM template, autotuned over its default block
  configurations (``max_autotune_gemm`` with only the Triton backend: cuBLAS is the other
  candidate already), with the elementwise op fused into the template's epilogue, compiled from
  the ATen graph of the pair (``torch._inductor.compile``). This is the epilogue fusion of
  Inductor's ``max-autotune`` mode and of XLA's Triton GEMM emitter.

As XLA's and Inductor's GEMM autotuners do, the generated candidate is checked once against the
pair's result (within a few 16-bit roundings) and both are timed on the device
(``spmd.runtime.kernel_timing``: CUDA-graph replays with a cold L2, interleaved, median); the
fastest is cached per (device, product and epilogue structure, operand shapes, strides, dtypes).
Used only where fusions run as generated kernels (``kernels_fusion.fusion_compiler``: CUDA-graph
warm-up and capture by default), for 16-bit and float32 products of at least ``MIN_FLOPS``, and
only when a warm-up (not a capture) can time the candidates: a call inside a capture runs the pair
and leaves the choice to the next warm-up. The first choice of a shape compiles and autotunes one
GEMM (seconds to tens of seconds; Inductor caches the autotuning on disk).

``SPMD_EPILOGUE_CHOICE``: ``off`` (default: always the pair) or ``auto`` (time the Triton
candidate). Off by default because on an H200 (torch 2.11, docs/benchmarks.md 2026-12-02) cuBLAS
plus the activation kernel won on both MiniLM shapes measured (bf16 16384x384x1536 with GELU:
73.8 µs against 93.2 for the best autotuned Triton template; float32 1024x384x1536: 42.1 against
82.7), after 14-50 s of autotuning at the first call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spmd import metrics
from spmd.runtime import kernels_fusion as kf
from spmd.runtime.kernel_timing import median_us_each, within_roundings

Tensor = torch.Tensor
Kernel = Callable[[list[Tensor], Tensor | None], Tensor]
Generated = Callable[[list[Tensor]], Tensor]
CHOICE_ENV = "SPMD_EPILOGUE_CHOICE"
CHOICES = ("auto", "off")
MIN_FLOPS = 2**24
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TIMED_CALLS = 9
#: Inductor config of the generated candidate: Triton GEMM templates only, their default search
#: space, the epilogue always fused (not benchmarked against a separate kernel: the pair is timed
#: here), every cast the pair makes kept (the product rounds to its dtype before the activation)
_AUTOTUNE_OPTIONS = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "TRITON",
                     "max_autotune_gemm_search_space": "DEFAULT", "max_autotune_pointwise": False,
                     "epilogue_fusion": True, "benchmark_epilogue_fusion": False,
                     "autotune_fallback_to_aten": False, "emulate_precision_casts": True}
_choices: dict[tuple, Generated | None] = {}


def choice_mode() -> str:
    """``SPMD_EPILOGUE_CHOICE`` (``off`` when unset); ValueError naming the variable otherwise."""
    mode = os.environ.get(CHOICE_ENV, "off") or "off"
    if mode not in CHOICES:
        raise ValueError(f"{CHOICE_ENV}: expected one of {CHOICES}, got {mode!r}")
    return mode


def autotune_options() -> dict[str, object]:
    """``_AUTOTUNE_OPTIONS`` restricted to the names this torch's ``torch._inductor.config`` has."""
    import torch._inductor.config as config

    return {k: v for k, v in _AUTOTUNE_OPTIONS.items() if hasattr(config, k)}


def make_kernel(pair: Kernel, traceable: Kernel, key: tuple, flops: int, product_dtype: torch.dtype,
                name: str) -> Kernel:
    """Kernel ``(operands, out) -> Tensor`` of a fused (product, elementwise op) pair.

    ``pair``: the two unfused kernels (the result everywhere the generated candidate is not used);
    ``traceable``: the same computation with the elementwise part op by op (what Inductor
    compiles); ``key``: the product's and the epilogue's structure (part of the cache key);
    ``flops``: 2·M·N·K of the product; ``product_dtype``: its dtype; ``name``: for reports.
    """
    worth = flops >= MIN_FLOPS and product_dtype in DTYPES

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        if worth and _eligible(ops):
            fused = _chosen(ops, pair, traceable, key, name)
            if fused is not None:
                r = fused(ops)
                return r if out is None else out.copy_(r)
        return pair(ops, out)
    return kernel


def _eligible(ops: list[Tensor]) -> bool:
    """CUDA operands, the choice not switched off, and generated kernels allowed for this call."""
    if not ops[0].is_cuda or choice_mode() == "off":
        return False
    mode = kf.fusion_compiler(ops[0].device)
    return mode == "inductor" or (mode == "graphs" and kf._graph_call())


def _chosen(ops: list[Tensor], pair: Kernel, traceable: Kernel, key: tuple, name: str) -> Generated | None:
    """The cached choice for these operands (None: the pair); decided now outside a capture."""
    full = (ops[0].device, key, *((tuple(t.shape), t.stride(), t.dtype) for t in ops))
    if full not in _choices:
        if torch.cuda.is_current_stream_capturing():
            return None  # no timing inside a capture: the pair, and decide at the next warm-up
        _choices[full] = _choose(ops, pair, traceable, name)
    return _choices[full]


def _inductor(traceable: Kernel, ops: list[Tensor]) -> Generated:
    """The pair traced to ATen (``make_fx``) and compiled by Inductor with ``autotune_options``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda *args: traceable(list(args), None))(*ops)
    compiled = torch._inductor.compile(gm, list(ops), options=autotune_options())

    def generated(ops: list[Tensor]) -> Tensor:
        r = compiled(*ops)
        return r[0] if isinstance(r, (tuple, list)) else r
    return generated


def _checked(build: Callable[[], Generated], ops: list[Tensor], want: Tensor) -> Generated | None:
    """The built kernel if it compiles, runs and matches ``want`` (the pair's result) within a few
    16-bit roundings of its largest magnitude; else None."""
    try:
        kernel = build()
        got = kernel(ops)
        torch.cuda.synchronize(ops[0].device)
    except Exception:  # noqa: BLE001 - any compiler or launch failure drops the candidate
        return None
    if got.shape != want.shape or got.dtype != want.dtype or got.stride() != want.stride():
        return None  # the runtime's readers expect the layout the pair returns
    if not within_roundings(got, want):
        return None
    return kernel


def _choose(ops: list[Tensor], pair: Kernel, traceable: Kernel, name: str) -> Generated | None:
    """The fastest correct candidate on this device, or None where the pair is fastest."""
    with kf.COMPILE_LOCK, torch.no_grad(), metrics.timer("epilogue.compile"):
        want = pair(ops, None)  # also compiles the pair's own generated fusion, outside any capture
        start = time.perf_counter()
        fused = _checked(lambda: _inductor(traceable, ops), ops, want)
        compile_s = time.perf_counter() - start
    shapes = tuple(tuple(t.shape) for t in ops)
    if fused is None:
        metrics.counter("epilogue.fallback").inc()
        DECISIONS.append(Decision(name, shapes, str(want.dtype), (("cublas+act", float("nan")),), "cublas+act",
                                  compile_s))
        return None
    names = ("cublas+act", "triton-epilogue")
    times = _median_us((lambda ops: pair(ops, None), fused), ops)
    best = min(range(len(times)), key=times.__getitem__)
    DECISIONS.append(Decision(name, shapes, str(want.dtype), tuple(zip(names, times, strict=True)), names[best],
                              compile_s))
    metrics.counter("epilogue.pair" if best == 0 else "epilogue.generated").inc()
    return None if best == 0 else fused


@dataclass(frozen=True)
class Decision:
    """One timed choice: the fused ops' names, operand shapes, result dtype, each candidate's median
    µs (name, µs; ``nan`` where only the pair was left), the chosen candidate and the seconds the
    generated candidate took to compile, autotune and check."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    times_us: tuple[tuple[str, float], ...]
    chosen: str
    compile_s: float

    def time_us(self, candidate: str) -> float:
        """The median µs of ``candidate`` (``nan`` if it was not timed)."""
        return dict(self.times_us).get(candidate, float("nan"))

    def summary(self) -> str:
        """One report line: the ops, shapes, the chosen candidate, every candidate's µs, compile s."""
        times = ", ".join(f"{n} {t:.1f}" for n, t in self.times_us)
        shapes = " ".join("x".join(map(str, s)) for s in self.shapes)
        return (f"epilogue {self.name} [{shapes}] {self.dtype}: {self.chosen} ({times} us; "
                f"generated candidate built in {self.compile_s:.1f} s)")


DECISIONS: list[Decision] = []  # every choice made in this process, in order (for reports)


def _median_us(kernels: tuple[Generated, ...], ops: list[Tensor]) -> tuple[float, ...]:
    """Median µs of one call of each kernel as a CUDA graph replay with a cold L2, interleaved
    (``spmd.runtime.kernel_timing``); a kernel that cannot be captured times as infinity."""
    return median_us_each([lambda k=k: k(ops) for k in kernels], ops[0].device, _TIMED_CALLS)
