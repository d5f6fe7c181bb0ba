"""Donated arguments of CUDA-graph replays: an output written into a donated buffer IS its static input.

When the caller donates parameter ``i`` (``donate_argnums``) and the program's donation plan
writes output ``j`` into that parameter's buffer (``spmd.runtime.donation``,
``Program.output_donors``: the KV cache of a decode step, updated by a dynamic-update-slice;
parameters and optimizer state of a training step), the ``GraphRunner`` captures the donated
program variant with parameter ``i``'s static input buffer ``S`` as that buffer: a replay
updates ``S`` in place and output ``j`` is ``S`` itself, handed to the caller without a copy
(XLA's input/output aliasing of a donated buffer, kept across replays). The caller's next call
passes that output back as the donated argument; its address is ``S``, so nothing is staged
(the steady state of decoding and training). An argument at another address (the first graph
call, or a caller passing another tensor) is copied into ``S`` once, as for any staged argument.

The no-overwrite rule: a replay writes ``S``, so ``S`` may be written only when the caller gave
it up. Passing ``S`` as the donated argument does that (a donated array is dead after the call).
When another tensor is donated while a live array (or view) still holds ``S``, from an earlier
call's output, the call runs eagerly instead (``Executable.run`` with the donation, writing the
given tensor's buffer), counted as ``cuda_graphs.eager_call.donated_buffer_held``. Liveness is
read from storage use counts, as for the runner's rotating output sets; an aliased output never
rotates (every output set's graph writes the same ``S``) and is not part of any set's liveness.

Staging is counted: ``cuda_graphs.staged.copies`` / ``cuda_graphs.staged.bytes`` in
``spmd.metrics`` (and ``GraphRunner.staged_copies`` / ``staged_bytes`` per runner) count the
argument copies into static buffers that replays needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd import metrics

Tensor = torch.Tensor
STAGED_COPIES = metrics.counter("cuda_graphs.staged.copies")
STAGED_BYTES = metrics.counter("cuda_graphs.staged.bytes")
DONOR_HELD = metrics.counter("cuda_graphs.eager_call.donated_buffer_held")
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def aliased_outputs(program: Any) -> dict[int, int]:
    """Output index -> donated parameter index whose buffer the program writes that output into.

    Empty where no output is (no donation, or no donated buffer fits an output: shapes, dtypes
    and readers decide, see ``spmd.runtime.donation.plan_donation``), and where this PyTorch
    has no storage use counts (the no-overwrite rule cannot be checked: donation is then not
    aliased in graphs).
    """
    if _use_count is None:
        return {}
    return {j: i for j, i in enumerate(getattr(program, "output_donors", ())) if i >= 0}


class DonorBuffers:
    """The static input buffers of the donated parameters that outputs are written into.

    Args:
      aliased: output index -> donated parameter index (``aliased_outputs``), not empty.
      buffers: per parameter index among ``aliased``'s values, its static buffers per local
        device: freshly allocated and referenced only by the runner when this is made (their
        storage use counts now are the baseline that means "no caller holds it").
    """

    def __init__(self, aliased: dict[int, int], buffers: dict[int, Sequence[Tensor]]) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self.aliased = dict(aliased)
        self.outputs = frozenset(aliased)
        self.params = frozenset(aliased.values())
        self._refs = {i: [StorageWeakRef(t.untyped_storage()).cdata for t in buffers[i]] for i in self.params}
        self._baseline = {i: [_use_count(r) for r in refs] for i, refs in self._refs.items()}

    def free(self, i: int) -> bool:
        """No tensor or view of parameter ``i``'s static buffers is alive outside the runner."""
        return all(_use_count(r) <= b for r, b in zip(self._refs[i], self._baseline[i], strict=True))


def order_after(ready: Sequence[Any], devices: Sequence[Any]) -> None:
    """The caller's current stream of each device waits for ``ready[k]`` (CUDA events or None).

    After an eager call that may have written a donated static buffer on the executable's own
    streams: a later copy into that buffer, issued on the caller's stream, comes after it.
    """
    for ev, dev in zip(ready, devices, strict=False):
        if ev is not None:
            torch.cuda.current_stream(dev).wait_event(ev)


def donor_views(program: Any, static_args: Sequence[Sequence[Tensor]]) -> dict[int, list[Tensor]]:
    """Output index -> the per-device static buffers it is written into (``output_donors``)."""
    return {j: list(static_args[i]) for j, i in enumerate(program.output_donors) if i >= 0}


def call_views(program: Any, views: list[list[Tensor]], static_args: Sequence[Sequence[Tensor]]) -> list[list[Tensor]]:
    """Per device, the arena views followed by the donated static buffers (``Program.donated_params``)."""
    if not program.donated_params:
        return views
    return [v + [static_args[i][k] for i in program.donated_params] for k, v in enumerate(views)]


def place_donor_outputs(outputs: list[list[Tensor]], donors: dict[int, list[Tensor]]) -> None:
    """Make each aliased output its donated static buffer (in place on ``outputs``).

    The plan writes them there already; a kernel that returned another tensor instead gets its
    result copied into the buffer (``cuda_graphs.donated_output_copied``: correct, one copy).
    """
    for j, bufs in donors.items():
        per = outputs[j]
        for k, (t, buf) in enumerate(zip(per, bufs, strict=True)):
            if t.data_ptr() != buf.data_ptr() or t.stride() != buf.stride():
                buf.copy_(t)
                metrics.counter("cuda_graphs.donated_output_copied").inc()
            per[k] = buf
