"""Argument checks shared by the generation entry points (``Generator``, ``generate``, ``reference_generate``)."""

from __future__ import annotations

import numbers
import os

import torch


def positive_int(name: str, value) -> int:
    """``value`` as a Python int (numpy integers included).

    Raises:
      TypeError: naming ``name``, for a non-integer (bools included), expected vs got.
      ValueError: naming ``name``, for a value below 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)


def available_bytes(device: torch.device) -> int:
    """Free memory of CUDA ``device``, or of the host for ``cpu`` (psutil's available memory where
    psutil is installed, else the physical total)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil  # noqa: PLC0415

        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_prefill_memory(mesh, hidden_size: int, ffn_size: int, max_batch: int, prefill_len: int,
                         max_seq: int, dp: str | None) -> None:
    """ValueError naming ``prefill_len`` when the prefill program cannot fit in memory (checked
    before anything compiles, so a too-long prompt stops at once instead of in the allocator).

    Per device the prefill holds its attention scores and mask over the whole cache, float32
    ``[max_batch / dp, 1, prefill_len, max_seq]``, about twice (measured on CPU: the heads' scores
    are never all materialised at once), plus float32 activations ``[max_batch / dp, prefill_len,
    4 x hidden + 3 x ffn]``. A mesh's virtual CPU devices share the host's memory, so on CPU their
    needs add up; on CUDA the mesh's first local device is asked.
    """
    b = -(-max_batch // (mesh.axis_size(dp) if dp else 1))
    acts = b * prefill_len * (4 * hidden_size + 3 * ffn_size) * 4
    device = (mesh.local_devices or mesh.devices)[0]
    n = len(mesh.devices) if device.type == "cpu" else 1
    need, have = n * (2 * b * prefill_len * max_seq * 4 + acts), available_bytes(device)
    if need > have:
        where = "each GPU" if device.type == "cuda" else f"each of {n} virtual CPU devices" if n > 1 else "the host"
        raise ValueError(
            f"prefill_len: a prefill of {prefill_len} tokens needs about {need / 2**30:,.1f} GiB (attention scores "
            f"and mask float32 [{b}, 1, {prefill_len}, {max_seq}] twice on {where}, plus activations), more than "
            f"the {have / 2**30:,.1f} GiB available; expected a shorter prefill_len (or a smaller max_batch / "
            f"max_seq{', or fewer mesh devices' if n > 1 else ''})")
