"""Argument checks shared by the generation entry points (``Generator``, ``generate``, ``reference_generate``)."""

from __future__ import annotations

import math
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


#: Peak host memory of a Generator on virtual CPU devices, in units of its placed KV cache (every
#: device's shards together): the cache, the zero tensor it is filled from, and the new caches of
#: a prefill or decode step before the donated ones are freed. Measured 3.2-3.5 (cpu:1, dp=2 x tp=2
#: and tp=4 with the cache replicated over tp, a 0.76 GiB cache).
CPU_CACHE_FACTOR = 3.5


def check_memory(mesh, cfg, kv_shape: tuple[int, ...], itemsize: int, max_batch: int, prefill_len: int,
                 max_seq: int, dp: str | None, tp: str | None) -> None:
    """ValueError when a Generator's KV cache or prefill cannot fit in the memory available,
    checked before anything is allocated, placed or compiled (a cache larger than the host's memory
    used to end in the kernel's out-of-memory kill, a long prompt in the allocator's error).

    The cache is ``2 x num_layers`` tensors ``kv_shape`` of ``itemsize`` bytes, batch sharded over
    ``dp``, KV heads over ``tp`` where ``tp`` divides them (else replicated over ``tp``). On CUDA
    each device must hold its shards plus its prefill (``prefill_bytes``) in the free memory of the
    mesh's first local device; virtual CPU devices share the host's memory, so there every
    device's shards times ``CPU_CACHE_FACTOR`` and every device's prefill add up.

    Raises:
      ValueError: naming max_batch and max_seq when the cache alone does not fit, else naming
        prefill_len when the cache and the prefill together do not; expected vs available GiB.
    """
    dp_size = mesh.axis_size(dp) if dp else 1
    tp_size = mesh.axis_size(tp) if tp else 1
    replicas = tp_size if tp and cfg.num_kv_heads % tp_size else 1
    cache = 2 * cfg.num_layers * math.prod(kv_shape) * itemsize * replicas  # all devices together
    device = (mesh.local_devices or mesh.devices)[0]
    cpu = device.type == "cpu"
    n = len(mesh.devices)
    cache_need = CPU_CACHE_FACTOR * cache if cpu else cache / n
    b = -(-max_batch // dp_size)  # sequences per device
    prefill = prefill_bytes(cfg, b, prefill_len, max_seq) * (n if cpu else 1)
    have = available_bytes(device)
    where = "each GPU" if not cpu else f"{n} virtual CPU devices" if n > 1 else "the host"
    if cache_need > have:
        copies = f", replicated {replicas} times" if replicas > 1 else ""
        raise ValueError(
            f"max_batch ({max_batch}), max_seq ({max_seq}): the KV cache (2 x {cfg.num_layers} layers x "
            f"{list(kv_shape)}, {cache / replicas / 2**30:,.1f} GiB{copies}) needs about "
            f"{cache_need / 2**30:,.1f} GiB on {where}"
            f"{f' ({CPU_CACHE_FACTOR}x the cache while a step runs)' if cpu else ''}, more than the "
            f"{have / 2**30:,.1f} GiB available; expected a smaller max_batch or max_seq")
    if cache_need + prefill > have:
        raise ValueError(
            f"prefill_len: a prefill of {prefill_len} tokens needs about {prefill / 2**30:,.1f} GiB (attention scores "
            f"and mask float32 [{b}, 1, {prefill_len}, {max_seq}] twice on {'each of ' if cpu and n > 1 else ''}"
            f"{where}, plus activations) beside the KV cache's {cache_need / 2**30:,.1f} GiB, more than the "
            f"{have / 2**30:,.1f} GiB available; expected a shorter prefill_len (or a smaller max_batch / "
            f"max_seq{', or fewer mesh devices' if cpu and n > 1 else ''})")


def prefill_bytes(cfg, batch: int, prefill_len: int, max_seq: int) -> int:
    """Bytes one device's prefill of ``batch`` sequences holds at its peak: its attention scores and
    mask over the whole cache, float32 ``[batch, 1, prefill_len, max_seq]``, about twice (measured
    on CPU: the heads' scores are never all materialised at once), plus float32 activations
    ``[batch, prefill_len, 4 x hidden + 3 x ffn]``."""
    acts = batch * prefill_len * (4 * cfg.hidden_size + 3 * cfg.ffn_size) * 4
    return 2 * batch * prefill_len * max_seq * 4 + acts
