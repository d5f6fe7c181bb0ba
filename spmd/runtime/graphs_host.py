"""``HostReplayBackend``: a CUDA graph's binding and aliasing semantics on CPU meshes.

``GraphRunner(executable, options, backend=HostReplayBackend(executable))`` runs the runner's
logic (binding, output sets, liveness, recapture) without a GPU, for tests and debugging.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.runtime.graphs_donation import donor_views

Tensor = torch.Tensor


class _HostCaptured:
    """A "graph" of ``HostReplayBackend``: re-issues the program, writes the static outputs.

    ``aliased``: outputs that are donated parameters' static buffers (updated in place).
    """

    def __init__(self, executable: Any, static_args: list[list[Tensor]], outputs: list[list[Tensor]],
                 donated: frozenset[int] = frozenset(), aliased: frozenset[int] = frozenset()) -> None:
        self.executable, self.static_args, self.outputs = executable, static_args, outputs
        self.donated, self.aliased = donated, aliased

    def replay(self) -> None:
        fresh, _ = self.executable.run(self.static_args, donated=self.donated)
        for per_static, per_fresh in zip(self.outputs, fresh, strict=True):
            for s, f in zip(per_static, per_fresh, strict=True):
                if s.data_ptr() != f.data_ptr():  # an output written into its donated buffer is in place
                    s.copy_(f)

    def close(self) -> None:
        self.outputs = []


class HostReplayBackend:
    """A backend for CPU meshes with the binding and aliasing semantics of a CUDA graph.

    "Capture" fixes static output buffers; "replay" runs the executable eagerly on the
    static arguments (adopted tensors are read by reference, as a graph does) and writes
    the results into the static outputs. It lets the runner's logic be tested and debugged
    without a GPU; it saves no time.
    """

    def __init__(self, executable: Any) -> None:
        self.executable = executable
        self.num_launches = 0

    def fork(self) -> HostReplayBackend:
        """A backend of the same executable with no captures (``GraphRunner.fork``)."""
        return type(self)(self.executable)

    def synchronize(self) -> None:
        """Nothing to wait for on the host."""

    def capture(self, static_args: list[list[Tensor]], donated: frozenset[int] = frozenset()) -> _HostCaptured:
        """Static outputs shaped like one eager run's outputs.

        With ``donated``, replays run the donated program variant: an output it writes into a
        donated parameter's buffer is that static buffer (as ``CudaGraphBackend.capture``).
        The "capture" run itself is donation-free, so it writes no static argument.
        """
        outs, _ = self.executable.run(static_args)
        statics = [[o.clone() for o in per] for per in outs]
        donors = donor_views(self.executable._variant(frozenset(donated))[0], static_args) if donated else {}
        for j, bufs in donors.items():
            statics[j] = bufs
        return _HostCaptured(self.executable, static_args, statics, frozenset(donated), frozenset(donors))

    def launch(self, captured: _HostCaptured, copies: list[list[tuple[Tensor, Tensor]]],
               ready: list[list[Any]], clone: bool) -> tuple[list[list[Tensor]], list[Any]]:
        """Copy staged arguments in, replay, hand out clones or aliases of the static outputs."""
        for per in copies:
            for dst, src in per:
                dst.copy_(src)
        captured.replay()
        self.num_launches += 1
        keep = captured.aliased
        outs = [[t.clone() if clone and j not in keep else t.detach() for t in per]
                for j, per in enumerate(captured.outputs)]
        return outs, [None] * len(self.executable.devices)

    def close(self) -> None:
        """Nothing to release."""
