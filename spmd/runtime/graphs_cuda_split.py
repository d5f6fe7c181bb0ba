"""One CUDA graph per device for programs whose devices meet only inside NCCL kernels.

``spmd.runtime.graphs_cuda`` captures all local GPUs into one graph: the capture starts on
device 0 and follows event dependencies into every other device, which peer copies and
cross-device joins need. A graph over several devices completes as a whole, though, and the
next replay starts only after that: between two replays of the transformer block on 2xH200,
device 0 idled 15-19 µs. When every collective of a program is an NCCL kernel
(``CudaCommunicator.nccl_only``: all-gather, reduce-scatter, all-reduce), the devices need no
CUDA-level dependency at all -- NCCL's kernels wait for their peers in device memory -- so each
device's streams are captured into a graph of their own, all captures open at once while the
program is issued (the NCCL group calls span them), and a call replays each device's graph on
that device's current stream. Each device then runs its replays back to back:
``benchmarks/probe/split_graphs.py`` measured 58.0 against 69.9 µs per replay of three
GEMM + all-reduce steps over two GPUs.

Each device's graph takes its own private memory pool (the runner's shared pool id serves the
one-graph capture). Per call (``launch_split``), on the caller's current stream of every device: wait for the
arguments' ready events, copy staged arguments into the static inputs, replay that device's
graph. The outputs are ordered on the callers' streams like eager PyTorch results.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from spmd.runtime import streams as st
from spmd.runtime.executor import issue_segment_gpu
from spmd.runtime.graphs_donation import place_donor_outputs
from spmd.runtime.thunks import CollectiveThunk, Segment

Tensor = torch.Tensor
#: Two captures are open at once in one thread; "relaxed" lets each proceed while the other is open.
SPLIT_CAPTURE_MODE = "relaxed"


def splittable(executable: Any, program: Any) -> bool:
    """Whether ``program`` of ``executable`` may be captured as one graph per device.

    True for several local devices whose collectives are all ``nccl_only``; False for one
    device, a communicator without ``nccl_only`` (CPU, torch.distributed) or any peer copy.
    """
    comm = getattr(executable, "_comm", None)
    if len(executable.devices) < 2 or not hasattr(comm, "nccl_only"):
        return False
    return all(comm.nccl_only(t.spec) for t in program.thunks if isinstance(t, CollectiveThunk))


def capture_split(backend: Any, program: Any, steps: list, call: Any, foreign: set[int]) -> Any:
    """Capture every device's streams into its own graph; returns a ``CudaCaptured``.

    Raises RuntimeError (from PyTorch / CUDA / NCCL) for an operation that cannot be captured;
    every capture that was opened is then closed.
    """
    from spmd.runtime.graphs_cuda import CudaCaptured

    envs = backend.envs
    backend.synchronize()
    device_index = torch.cuda.current_device()
    callers = [torch.cuda.current_stream(env.device) for env in envs]
    graphs = [torch.cuda.CUDAGraph() for _ in envs]
    events: list[Any] = []  # fork / join events, kept alive with the graphs as in the one-graph capture
    opened: list[int] = []
    try:
        for k, (env, graph) in enumerate(zip(envs, graphs, strict=True)):
            with torch.cuda.device(env.device):  # a graph captures its device's current stream
                torch.cuda.set_stream(env.main)
                graph.capture_begin(capture_error_mode=SPLIT_CAPTURE_MODE)
            opened.append(k)
        try:
            outputs = backend._issue_split(program, steps, call, foreign, events)
        except BaseException:
            _abort(envs, graphs, opened)
            raise
        for k in list(opened):
            opened.remove(k)
            with torch.cuda.device(envs[k].device):
                torch.cuda.set_stream(envs[k].main)
                graphs[k].capture_end()
    except BaseException:
        _abort(envs, graphs, opened)
        raise
    finally:
        st.restore(callers, device_index)
    return CudaCaptured(graphs[0], outputs, events, device_graphs=graphs)


def issue_steps(backend: Any, program: Any, steps: list, call: Any, foreign: set[int]) -> list[list[Tensor]]:
    """Issue the program's steps on every device (streams already forked); return its outputs.

    Outputs must be graph-owned memory: an output aliasing ``foreign`` storage (arguments,
    constants, the arena) is cloned -- except an output written into a donated parameter's
    static buffer (``call.donors``, ``spmd.runtime.graphs_donation``), which is that buffer.
    Every device's current stream is its main stream after.
    """
    envs, ex = backend.envs, backend.ex
    for step in steps:
        if isinstance(step, Segment):
            for k, env in enumerate(envs):
                issue_segment_gpu(step.thunks, call.vals[k], call.views[k], env)
        else:
            ex._collective(step, call)
    for env in envs:
        torch.cuda.set_stream(env.main)
    outputs = ex._outputs(program, call)
    donors = call.donors
    for j, per in enumerate(outputs):
        if j in donors:
            continue
        for k, t in enumerate(per):
            if t.untyped_storage().data_ptr() in foreign:
                per[k] = t.clone()
    place_donor_outputs(outputs, donors)
    return outputs


def issue_split(backend: Any, program: Any, steps: list, call: Any, foreign: set[int],
                events: list[Any]) -> list[list[Tensor]]:
    """Fork each device's streams from its main stream, issue the thunks, join them back.

    The events made for the forks and joins are appended to ``events``.
    """
    envs = backend.envs
    for env in envs:
        fork = torch.cuda.Event()
        fork.record(env.main)
        events.append(fork)
        for s in env.streams.values():
            if s != env.main:
                s.wait_event(fork)
    outputs = issue_steps(backend, program, steps, call, foreign)
    for env in envs:
        for s in env.streams.values():
            if s != env.main:
                ev = torch.cuda.Event()
                ev.record(s)
                env.main.wait_event(ev)
                events.append(ev)
    return outputs


def _abort(envs: list, graphs: list, opened: list[int]) -> None:
    """End the captures still open after a failure (best effort: they may be invalidated)."""
    for k in list(opened):
        opened.remove(k)
        with contextlib.suppress(Exception), torch.cuda.device(envs[k].device):
            torch.cuda.set_stream(envs[k].main)
            graphs[k].capture_end()


def launch_split(streams: list[Any], captured: Any, copies: list[list[tuple[Tensor, Tensor]]],
                 ready: list[list[Any]], copy_in: Any, wait: Any) -> None:
    """Per device: wait for the arguments, copy staged arguments in, replay its graph on its stream."""
    current = _get_device()
    for k, sk in enumerate(streams):
        for ev in ready[k]:
            wait(ev, sk)
        if copies[k]:
            copy_in(copies[k], sk if ready[k] else None)
        _set_device(sk.device_index)  # a graph replays on the current stream of the current device
        captured.device_graphs[k].replay()
    _set_device(current)


_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_set_device = getattr(torch._C, "_cuda_setDevice", None) or torch.cuda.set_device
