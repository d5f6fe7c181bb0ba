"""The static race checker on lowered windowed-einsum programs (GPU lowering, checked on CPU)."""

from __future__ import annotations

import itertools

import pytest
import torch

import spmd
import spmd.runtime.lower as lower_mod
from spmd import Mesh
from spmd import PartitionSpec as P
from spmd.passes.assign_buffers import assign_buffers
from spmd.runtime.hazards import find_hazards
from spmd.runtime.thunks import KernelThunk, WaitEventThunk

SPECS = {"ag": ((P("tp", None), P(None, "tp")), P(None, "tp")),
         "rs": ((P(None, "tp"), P("tp", None)), P("tp", None))}


def _module(side: str, n: int, shape: tuple[int, int, int], streams: int | None, bidir: bool | None):
    mesh = Mesh.create(("tp",), devices=f"cpu:{n}")
    ins, out = SPECS[side]
    f = spmd.jit(lambda x, w: x @ w, mesh=mesh, in_shardings=ins, out_shardings=out,
                 options=spmd.CompileOptions(windowed_einsum="on", num_compute_streams=streams,
                                             bidirectional=bidir, cuda_graphs=False))
    m, k, nn = shape
    args = [spmd.device_put(torch.randn(a, b), spmd.NamedSharding(mesh, s))
            for (a, b), s in zip(((m, k), (k, nn)), ins, strict=True)]
    return f.lower(*args).result.module


def _gpu_program(module, n: int, fuse: bool = True):
    return lower_mod.lower(module, [torch.device("cpu")] * n, list(range(n)), assign_buffers(module), gpu=True,
                           fuse=fuse)


# (64, 32, 64): the partitioner all-gathers the weights (column blocks); (64, 32, 256): x (row blocks)
CASES = list(itertools.product(("ag", "rs"), (2, 4), ((64, 32, 64), (64, 32, 256)), (1, 2, 3), (False, True)))


@pytest.mark.parametrize("side, n, shape, streams, bidir", CASES)
@pytest.mark.parametrize("fuse", [True, False])
def test_windowed_einsum_programs_are_race_free(side, n, shape, streams, bidir, fuse):
    program = _gpu_program(_module(side, n, shape, streams, bidir), n, fuse)
    assert any(t.stream_id not in (0,) for t in program.thunks if isinstance(t, KernelThunk))
    assert find_hazards(program) == []


def test_dropping_a_wait_is_reported():
    program = _gpu_program(_module("rs", 2, (64, 32, 256), 1, False), 2)
    waits = [k for k, t in enumerate(program.thunks) if isinstance(t, WaitEventThunk)]
    assert waits
    for k in waits:
        thunks = program.thunks[:k] + program.thunks[k + 1:]
        racy = lower_mod.Program(**{**program.__dict__, "thunks": thunks})
        hazards = find_hazards(racy)
        assert hazards, f"removing {program.thunks[k].name} went unnoticed"
        assert all(h.kind in ("read-after-write", "write-after-read", "write-after-write") for h in hazards)


def test_async_unit_waits_before_its_first_op(monkeypatch):
    """Regression: all-gather of weights on two compute streams raced on reused arena bytes.

    The second partial dot (stream 2) wrote the arena bytes the first one (stream 1) still
    used, because its wait for the accumulator came only after it; the buffer assignment
    assumes an async computation starts after all its operands are ready.
    """
    module = _module("ag", 2, (64, 32, 64), 2, False)
    assert find_hazards(_gpu_program(module, 2, fuse=False)) == []
    joins = lower_mod.stream_joins

    def without_units(ops):
        for op in ops:
            op.extra.pop("unit", None)
        return joins(ops)

    monkeypatch.setattr(lower_mod, "stream_joins", without_units)
    hazards = find_hazards(_gpu_program(_module("ag", 2, (64, 32, 64), 2, False), 2, fuse=False))
    assert any(h.location[0] == "arena" for h in hazards), hazards


def test_unrecorded_event_is_an_error():
    program = _gpu_program(_module("ag", 2, (64, 32, 256), 1, False), 2)
    bad = lower_mod.Program(**{**program.__dict__, "thunks": [WaitEventThunk("w", 1, 99), *program.thunks]})
    with pytest.raises(ValueError, match="event 99"):
        find_hazards(bad)
