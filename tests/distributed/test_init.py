"""Single-process checks of ``spmd.distributed``: no run, bad arguments, multi-process ``Mesh`` fields."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd import Mesh
from spmd.distributed.init import TIMEOUT_ENV, _timeout
from spmd.ir.sharding import MeshShape
from spmd.runtime.comm.multiprocess import REDUCE_ENV, reduce_mode


def test_a_plain_process_is_a_run_of_one():
    assert not spmd.distributed.is_initialized()
    assert spmd.distributed.process_index() == 0 and spmd.distributed.process_count() == 1
    mesh = Mesh.create({"x": 2}, devices="cpu:2")
    assert not mesh.is_multi_process and mesh.local_pids == (0, 1) and mesh.process_count == 1


def test_initialize_without_a_launcher_is_a_clear_error(monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="torchrun environment"):
        spmd.distributed.initialize()
    with pytest.raises(ValueError, match="timeout_s: expected a positive finite number of seconds, got -1"):
        spmd.distributed.initialize(timeout_s=-1)
    with pytest.raises(TypeError, match="backend: expected a str"):
        spmd.distributed.initialize(backend=3)


@pytest.mark.parametrize("text", ["-5", "0", "abc", "nan", "inf"])
def test_bad_timeout_environment_variable_is_named(monkeypatch, text):
    monkeypatch.setenv(TIMEOUT_ENV, text)
    with pytest.raises(ValueError, match=f"SPMD_DISTRIBUTED_TIMEOUT_S: expected a positive finite number of seconds, "
                                         f"got '{text}'"):
        _timeout(None)
    assert _timeout(7) == 7.0  # an explicit timeout_s wins over the variable
    monkeypatch.setenv(TIMEOUT_ENV, "12.5")
    assert _timeout(None) == 12.5
    with pytest.raises(ValueError, match="timeout_s: expected a positive finite number of seconds, got inf"):
        _timeout(float("inf"))


def test_a_fully_addressable_array_gathers_to_its_value():
    mesh = Mesh.create({"x": 2}, devices="cpu:2")
    value = torch.randn(4, 3)
    a = spmd.device_put(value, spmd.NamedSharding(mesh, spmd.PartitionSpec("x")))
    assert a.is_fully_addressable
    torch.testing.assert_close(spmd.distributed.process_allgather(a), value, rtol=0, atol=0)
    b = spmd.distributed.make_array_from_callback((4, 3), a.sharding, lambda index: value[index])
    torch.testing.assert_close(b.to_torch(), value, rtol=0, atol=0)
    with pytest.raises(TypeError, match="data_callback: expected a torch.Tensor"):
        spmd.distributed.make_array_from_callback((4, 3), a.sharding, lambda index: 1.0)


def test_multi_process_mesh_fields_are_checked():
    shape = MeshShape(("dp", "tp"), (2, 2))
    mesh = Mesh(shape, "cpu", (0, 1, 0, 1), (0, 0, 1, 1))
    assert mesh.is_multi_process and mesh.process_count == 2
    assert repr(mesh) == "Mesh({'dp': 2, 'tp': 2}, devices=2 processes x cpu:0-1)"
    assert mesh != Mesh(shape, "cpu", (0, 1, 2, 3))
    with pytest.raises(ValueError, match="distinct \\(process, device\\) pairs"):
        Mesh(shape, "cpu", (0, 0, 1, 1), (0, 0, 1, 1))
    with pytest.raises(ValueError, match="process_ids: expected one non-negative rank per partition"):
        Mesh(shape, "cpu", (0, 1, 0, 1), (0, 0, 1))


def test_reduce_mode_is_checked(monkeypatch):
    monkeypatch.delenv(REDUCE_ENV, raising=False)
    assert reduce_mode(local_is_cuda=False) == "gather" and reduce_mode(local_is_cuda=True) == "reduce"
    monkeypatch.setenv(REDUCE_ENV, "ring")
    with pytest.raises(ValueError, match="SPMD_DISTRIBUTED_REDUCE: expected 'gather' or 'reduce', got 'ring'"):
        reduce_mode(local_is_cuda=False)


def test_a_group_spmd_created_is_destroyed_at_exit(tmp_path):
    """Exiting with a gloo group alive could abort in gloo's threads at interpreter teardown; the
    group ``initialize`` created is destroyed by an exit handler (the process exits 0)."""
    import subprocess
    import sys

    code = (
        "import torch.distributed as dist\n"
        "from spmd.distributed import init\n"
        f"init.initialize('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        "assert dist.is_initialized()\n"
        "init._shutdown_at_exit()\n"
        "assert not dist.is_initialized()\n"
        "init._shutdown_at_exit()  # a second call (the registered one at exit) is a no-op\n"
        "init.initialize('gloo', init_method='file://" + str(tmp_path) + "/store2', rank=0, world_size=1)\n"
        "print('joined')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "joined", run.stderr[-2000:]
    assert "terminate called" not in run.stderr
