"""One-shot all-reduces with one process per device (``spmd.runtime.comm.symmetric``): PyTorch's
symmetric-memory kernel where it is available (2 GPUs, NCCL), else a clean fall back to the process
group's all-reduce (gloo on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hlo_helpers import FakeMesh
from programs import collective

from spmd.ir.evaluate import evaluate_spmd
from spmd.runtime.comm.symmetric import SYMM_MEM_ENV, SymmetricOneShot, eligible, symm_mem_supported
from spmd.runtime.executor import Executable, RuntimeOptions
from spmd.runtime.thunks import CollectiveSpec


def _spec(dtype=torch.float32, op="add", algorithm="one-shot") -> CollectiveSpec:
    return CollectiveSpec("all-reduce", groups=((0, 1),), reduce_op=op, out_dims=(4, 3), dtype=dtype,
                          algorithm=algorithm)


def test_support_reasons(monkeypatch):
    monkeypatch.setenv(SYMM_MEM_ENV, "0")
    assert symm_mem_supported(torch.device("cuda", 0)) == f"{SYMM_MEM_ENV}=0"
    monkeypatch.delenv(SYMM_MEM_ENV)
    assert "not a CUDA device" in symm_mem_supported(torch.device("cpu"))


def test_eligible_specs():
    assert eligible(_spec()) and eligible(_spec(torch.bfloat16))
    assert not eligible(_spec(algorithm="ring"))
    assert not eligible(_spec(op="maximum"))  # the kernel only sums
    assert not eligible(_spec(torch.float64)) and not eligible(_spec(torch.int32))
    empty = CollectiveSpec("all-reduce", groups=((0, 1),), out_dims=(0, 3), algorithm="one-shot")
    scalar = CollectiveSpec("all-reduce", groups=((0, 1),), out_dims=(), algorithm="one-shot")
    assert not eligible(empty) and eligible(scalar)


def test_falls_back_without_symmetric_memory():
    none = SymmetricOneShot(0, [_spec(algorithm="ring")], {}, torch.device("cpu"))
    assert none.reason == "no one-shot all-reduce" and none.run(_spec(), torch.ones(4, 3)) is None
    with pytest.warns(UserWarning, match="not a CUDA device"):
        cpu = SymmetricOneShot(0, [_spec()], {}, torch.device("cpu"))
    assert cpu.run(_spec(), torch.ones(4, 3)) is None


def _one_shot_module(n: int, dtype: str = "f32"):
    module = collective("all-reduce", f"x={n}", n, (4, 3), (4, 3))
    for inst in module.entry.instructions:
        if inst.opcode == "all-reduce":
            inst.attrs["backend_config"] = {"algorithm": "one-shot"}
    return module


def _worker(rank: int, world: int, init: str, backend: str) -> None:
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    platform = "cuda" if backend == "nccl" else "cpu"
    if platform == "cuda":
        torch.cuda.set_device(rank)
    try:
        module = _one_shot_module(world)
        mesh = FakeMesh(module.mesh, platform)
        ex = Executable(module, mesh, options=RuntimeOptions(distributed=True))
        reason = ex._comm.one_shot.reason
        assert (reason == "") is (platform == "cuda"), f"symmetric memory: {reason!r}"
        for k in range(3):  # the same symmetric buffer serves every call
            g = torch.Generator().manual_seed(50 + k)
            full = [torch.randn(4, 3, generator=g) for _ in range(world)]
            outs, ready = ex.run([[full[rank].to(mesh.devices[rank])]])
            if ready[0] is not None:
                ready[0].synchronize()
            ref = evaluate_spmd(module, [[full[p]] for p in range(world)])
            torch.testing.assert_close(outs[0][0].cpu(), ref[0][rank], rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_gloo_processes_fall_back_to_the_process_group(tmp_path):
    mp.spawn(_worker, args=(2, f"file://{tmp_path}/store", "gloo"), nprocs=2, join=True)


@pytest.mark.gpu(count=2)
def test_nccl_processes_use_symmetric_memory(tmp_path):
    mp.spawn(_worker, args=(2, f"file://{tmp_path}/store", "nccl"), nprocs=2, join=True)
