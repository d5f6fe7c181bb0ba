"""Per-device CUDA execution streams and events of one executable, created once.

Stream id 0 is the executable's own main stream on each device; ids >= 1 are extra compute
or communication streams (``assign-streams``). A call forks every stream from the main
stream at its start (after the main stream has waited for the caller's current stream and
the arguments' ready events) and joins them back into it at its end, as XLA's GPU executable
does around a thunk sequence. Because every stream starts each call behind the previous
call's join, memory freed at the end of a call (values, arena views) is reused only after
every stream is done with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class DeviceEnv:
    """One device's streams (by stream id), its join events (by event id), and fork/join events."""

    device: torch.device
    pid: int
    streams: dict[int, torch.cuda.Stream] = field(default_factory=dict)
    events: list[torch.cuda.Event] = field(default_factory=list)
    fork: torch.cuda.Event | None = None
    joins: dict[int, torch.cuda.Event] = field(default_factory=dict)
    caller: torch.cuda.Event | None = None

    @property
    def main(self) -> torch.cuda.Stream:
        return self.streams[0]


def create_envs(devices: Sequence[torch.device], pids: Sequence[int], stream_ids: Sequence[int],
                num_events: int) -> list[DeviceEnv]:
    """Streams for every id in ``stream_ids`` and ``num_events`` events, on each device."""
    envs = []
    for dev, pid in zip(devices, pids, strict=False):
        env = DeviceEnv(dev, pid)
        for sid in stream_ids:
            env.streams[sid] = torch.cuda.Stream(device=dev)
        with torch.cuda.device(dev):
            env.events = [torch.cuda.Event() for _ in range(num_events)]
            env.fork = torch.cuda.Event()
            env.caller = torch.cuda.Event()
            env.joins = {sid: torch.cuda.Event() for sid in stream_ids if sid != 0}
        envs.append(env)
    return envs


def begin(envs: Sequence[DeviceEnv], ready: Sequence[Sequence[torch.cuda.Event | None]] | None) -> list:
    """Start a call: main waits for the caller's stream and ``ready[k]`` events; fork the others.

    Returns the caller's current stream of each device (to restore with ``restore``).
    """
    callers = []
    for k, env in enumerate(envs):
        caller = torch.cuda.current_stream(env.device)
        callers.append(caller)
        main = env.main
        env.caller.record(caller)
        main.wait_event(env.caller)
        if ready is not None:
            for ev in ready[k]:
                if ev is not None:
                    main.wait_event(ev)
        if env.joins:
            env.fork.record(main)
            for sid in env.joins:
                env.streams[sid].wait_event(env.fork)
    return callers


def end(envs: Sequence[DeviceEnv]) -> list[torch.cuda.Event]:
    """Join every extra stream into main; return a new ready event per device, on main."""
    ready = []
    for env in envs:
        main = env.main
        for sid, ev in env.joins.items():
            ev.record(env.streams[sid])
            main.wait_event(ev)
        done = torch.cuda.Event()
        done.record(main)
        ready.append(done)
    return ready


def restore(callers: Sequence[torch.cuda.Stream], device_index: int) -> None:
    """Make the caller's streams current again, and the caller's current device."""
    for s in callers:
        torch.cuda.set_stream(s)
    torch.cuda.set_device(device_index)
