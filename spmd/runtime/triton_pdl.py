"""Programmatic dependent launch (PDL) for spmd's Triton kernels, with an L2 prefetch of the weights.

Imported only where Triton is installed. On Hopper and later a kernel launched with the
programmatic-stream-serialisation attribute may start while the kernel before it on the stream
is still finishing (CUDA programming guide, "Programmatic Dependent Launch and
Synchronization"; PTX ``griddepcontrol``): the earlier kernel lets its dependents launch
(``gdc_launch_dependents``, called first by every program here), and the later one waits for it
to finish, with all its writes visible, at ``gdc_wait``. What a program does before its
``gdc_wait`` overlaps the previous kernel's last wave: here that is an L2 prefetch of the first
bytes of the weights it will stream (``prefetch.global.L2``), which reads nothing another
kernel writes into registers and moves no data a later load could see stale (the L2 is the
device's point of coherence). A decode step is a chain of memory-bound kernels, each with a
tail where few SMs still run and HBM idles; this fills those tails (TensorRT-LLM launches its
decode GEMV and attention kernels with PDL for the same reason).

Every kernel launched with PDL must call ``gdc_wait`` before touching anything an earlier
kernel wrote or reads, on every path: a kernel that skipped it could finish before its
predecessor and break the stream order of the kernels after it.

Results are bit-equal with and without it. ``SPMD_PDL`` (``pdl_env``): ``auto`` (default) uses
it for launches over one row only, ``1`` for every launch, ``0`` for none. Measured on one H200
(Llama-2-7B, 32 layers, bf16, docs/benchmarks.md 2026-12-02), without the prefetch: the batch-1
decode step took 3.714 ms with it against 3.787 ms without (same run, interleaved); on a chain of
one layer's kernels at batch 8 it lost (182.2 against 161.4 µs per layer), where the tile kernels
run several waves and the dependents' programs, launched early, wait on SMs the running kernel's
later waves need.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton
import triton.language as tl

from spmd.runtime.pdl_env import pdl_mode

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: enabled() is False
    gdc_launch_dependents = gdc_wait = None

#: Bytes of weights the programs of one launch prefetch into L2 in all before their ``gdc_wait``.
#: 0 (no prefetch): on a chain of Llama-2-7B decode-layer kernels (H200, bf16,
#: ``benchmarks/probe/pdl_chain.py``, 2026-12-02) 8 MiB per launch measured 118.0 µs per layer at
#: batch 1 and 184.9 at batch 8 against 116.1 and 182.2 with PDL alone.
PREFETCH_BUDGET_BYTES = 0
LINE_BYTES = 128
_local = threading.local()


@functools.cache
def _device_supports(index: int) -> bool:
    if gdc_wait is None:
        return False
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device, rows: int | None = None) -> bool:
    """Whether a launch on ``device`` over ``rows`` rows (a product's M, an attention's batch;
    None: unknown) uses PDL: ``SPMD_PDL`` is ``1``, or ``auto`` and ``rows == 1``; on a CUDA
    device of compute capability ≥ 9.0, with a Triton that has ``gdc_wait``, outside ``disabled()``.

    Raises ValueError for an ``SPMD_PDL`` not in ``pdl_env.VALUES``.
    """
    mode = pdl_mode()
    if mode == "0" or (mode == "auto" and rows != 1) or getattr(_local, "off", 0) or device.type != "cuda":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


@contextlib.contextmanager
def disabled():
    """Launches made in this thread inside the block do not use PDL (a benchmark's baseline)."""
    _local.off = getattr(_local, "off", 0) + 1
    try:
        yield
    finally:
        _local.off -= 1


def prefetch_lines(programs: int, rows_per_program: int, row_bytes: int) -> int:
    """128-byte lines each weight row of each program prefetches: ``PREFETCH_BUDGET_BYTES``
    shared over ``programs × rows_per_program`` rows, a power of two, at most the row's lines
    (0: no prefetch)."""
    per_row = PREFETCH_BUDGET_BYTES // max(1, programs * rows_per_program * LINE_BYTES)
    per_row = min(per_row, row_bytes // LINE_BYTES)
    return 0 if per_row < 1 else 1 << (per_row.bit_length() - 1)


@triton.jit
def prefetch_l2(ptrs):
    """Prefetch into L2 the line of every address in ``ptrs`` (any shape); no data is loaded."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows(row_ptrs, ELEMENT_BYTES: tl.constexpr, LINES: tl.constexpr):
    """Prefetch ``LINES`` 128-byte lines (a power of two, or 0: nothing) from each address in
    the 1-D ``row_ptrs`` onward."""
    if LINES > 0:
        step: tl.constexpr = 128 // ELEMENT_BYTES  # LINE_BYTES
        prefetch_l2(row_ptrs[:, None] + (tl.arange(0, LINES) * step)[None, :])


@triton.jit
def start(row_ptrs, ELEMENT_BYTES: tl.constexpr, LINES: tl.constexpr, PDL: tl.constexpr):
    """A PDL kernel's first statement: let the next kernel launch, prefetch ``LINES`` lines from
    each address in the 1-D ``row_ptrs`` (the starts of the weight rows this program streams),
    then wait for the previous kernel. Nothing when not ``PDL``."""
    if PDL:
        gdc_launch_dependents()
        prefetch_rows(row_ptrs, ELEMENT_BYTES, LINES)
        gdc_wait()
