"""One-shot all-reduce through PyTorch's symmetric memory, for one process per GPU.

``torch.ops.symm_mem.one_shot_all_reduce`` (``torch.distributed._symmetric_memory``, PyTorch's
port of the one-shot kernel of TensorRT-LLM / vLLM's custom all-reduce) runs one kernel per rank
that reads every peer's copy of a *symmetric* buffer (allocated with ``symm_mem.empty`` and
mapped into every rank with ``symm_mem.rendezvous``) over NVLink and synchronizes through signal
pads in device memory: no host synchronization and no stream event, so it can be captured into a
CUDA graph. Its requirements: CUDA tensors on a P2P-connected (NVLink) node, a process group of
the ranks, a sum, floating dtypes (float32, bfloat16, float16 here), and the input in a
rendezvoused symmetric buffer -- each one-shot all-reduce therefore copies its operand into a
preallocated buffer (one per replica group, shape and dtype). Every rank runs the same kernel,
so every rank holds the same bits.

``SymmetricOneShot`` allocates and rendezvouses those buffers at construction, walking the
program's collectives in program order (``rendezvous`` is collective: every rank does the same
calls in the same order). Where symmetric memory is missing (a CPU/gloo group, an old PyTorch,
``SPMD_SYMM_MEM=0``) or its set-up fails, ``DistributedCommunicator`` runs one-shot all-reduces
as process-group all-reduces (NCCL): same result up to the reduction order, a warning says why.
The single-process backends (``spmd.runtime.comm.one_shot``) cannot use it: a rendezvous needs
one rank per GPU.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from spmd.runtime.comm.one_shot import is_one_shot
from spmd.runtime.thunks import CollectiveSpec

Tensor = torch.Tensor
SYMM_MEM_ENV = "SPMD_SYMM_MEM"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def symm_mem_supported(device: torch.device) -> str:
    """Why symmetric memory cannot serve one-shot all-reduces on ``device`` ("" when it can)."""
    if os.environ.get(SYMM_MEM_ENV, "1") == "0":
        return f"{SYMM_MEM_ENV}=0"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"device {device} is not a CUDA device"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return f"torch.distributed._symmetric_memory is missing ({e})"
    if not hasattr(symm_mem, "empty") or not hasattr(symm_mem, "rendezvous"):
        return "this PyTorch's symmetric memory has no empty / rendezvous"
    if not hasattr(getattr(torch.ops, "symm_mem", None), "one_shot_all_reduce"):
        return "torch.ops.symm_mem.one_shot_all_reduce is missing"
    return ""


def eligible(spec: CollectiveSpec) -> bool:
    """Whether the symmetric-memory kernel can run ``spec``: a non-empty one-shot sum of a supported dtype."""
    return is_one_shot(spec) and spec.reduce_op == "add" and spec.dtype in DTYPES and math.prod(spec.out_dims) > 0


class SymmetricOneShot:
    """Symmetric buffers of the program's one-shot all-reduces, for this process's device.

    Args:
      pid: this process's partition id (global rank).
      specs: the program's collectives in program order.
      groups: sorted replica group -> its process group.
      device: this process's CUDA device.
    ``self.reason`` is "" when ready, else why every one-shot all-reduce falls back to the
    process group (``run`` then returns None).
    """

    def __init__(self, pid: int, specs: Sequence[CollectiveSpec], groups: Mapping[tuple[int, ...], Any],
                 device: torch.device) -> None:
        self.pid = pid
        self._bufs: dict[tuple, tuple[Tensor, str]] = {}
        wanted = [s for s in specs if eligible(s)]
        self.reason = symm_mem_supported(device) if wanted else "no one-shot all-reduce"
        if wanted and not self.reason:
            self._set_up(wanted, groups, device)
        if wanted and self.reason:
            warnings.warn(f"one-shot all-reduces run as process-group all-reduces: {self.reason}", stacklevel=2)

    def _set_up(self, wanted: Sequence[CollectiveSpec], groups: Mapping[tuple[int, ...], Any],
                device: torch.device) -> None:
        """Allocate and rendezvous one symmetric buffer per (group, shape, dtype); on failure set ``reason``."""
        try:
            for spec in wanted:
                group = next(g for g in spec.groups if self.pid in g)
                key = (tuple(sorted(group)), tuple(spec.out_dims), spec.dtype)
                if key not in self._bufs:
                    name = groups[key[0]].group_name
                    self._bufs[key] = (symmetric_buffer(spec.out_dims, spec.dtype, device, name), name)
        except Exception as e:  # noqa: BLE001 -- any failure of the optional fast path falls back to NCCL
            self._bufs.clear()
            self.reason = f"symmetric-memory set-up failed: {type(e).__name__}: {e}"

    def run(self, spec: CollectiveSpec, x: Tensor) -> Tensor | None:
        """The all-reduced ``x`` (fresh), or None when ``spec`` has no symmetric buffer (fall back)."""
        group = next((g for g in spec.groups if self.pid in g), ())
        entry = self._bufs.get((tuple(sorted(group)), tuple(spec.out_dims), spec.dtype))
        if entry is None:
            return None
        return one_shot_sum(*entry, x)


def symmetric_buffer(dims: Sequence[int], dtype: torch.dtype, device: torch.device, group_name: str) -> Tensor:
    """A ``dims`` / ``dtype`` symmetric-memory tensor on ``device``, rendezvoused over ``group_name``.

    Collective: every rank of the group must call it in the same order. Raises what PyTorch raises.
    """
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before PyTorch 2.9, deprecated after
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
    buf = symm_mem.empty(math.prod(dims), dtype=dtype, device=device)  # flat: 0-d shapes too
    symm_mem.rendezvous(buf, group_name)
    return buf.view(tuple(dims))


def one_shot_sum(buf: Tensor, group_name: str, x: Tensor) -> Tensor:
    """Sum of ``x`` over the ranks of ``group_name`` through the symmetric buffer ``buf`` (same shape and
    dtype as ``x``), a fresh tensor; the same bits on every rank.

    ``one_shot_all_reduce_copy_out`` (recent PyTorch) copies ``x`` into ``buf`` inside the kernel;
    older versions copy first, then reduce ``buf``.
    """
    ops = torch.ops.symm_mem
    if hasattr(ops, "one_shot_all_reduce_copy_out"):
        out = torch.empty(x.shape, dtype=x.dtype, device=buf.device)
        ops.one_shot_all_reduce_copy_out(buf, x, "sum", group_name, out)
        return out
    buf.copy_(x)
    return ops.one_shot_all_reduce(buf, "sum", group_name)
