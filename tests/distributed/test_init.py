"""Single-process checks of ``spmd.distributed``: no run, bad arguments, multi-process ``Mesh`` fields."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from launch import free_port

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


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"rank": 5, "world_size": 2}, ValueError, "rank: expected 0 <= rank < world_size = 2, got 5"),
    ({"rank": -3, "world_size": 2}, ValueError, "rank: expected an int >= 0, got -3"),
    ({"rank": 0, "world_size": 0}, ValueError, "world_size: expected an int >= 1 (the number of processes), got 0"),
    ({"rank": "0", "world_size": 2}, TypeError, "rank: expected an int, got str '0'"),
    ({"rank": 0, "world_size": 2.0}, TypeError, "world_size: expected an int, got float 2.0"),
    ({"rank": 0}, ValueError, "world_size: init_method tcp:// needs rank= and world_size=, got world_size=None"),
    ({"rank": 0, "world_size": 1, "backend": "bogus"}, ValueError, "backend: expected one of the backends available "
                                                                   "here ['gloo'"),
    ({"init_method": "bogus://x", "rank": 0, "world_size": 1}, ValueError,
     "init_method: expected a URL starting with one of ['tcp://', 'file://', 'env://'], got 'bogus://x'"),
    ({"init_method": 5, "rank": 0, "world_size": 1}, TypeError, "init_method: expected a str"),
    ({"rank": 0, "world_size": 1, "backend": "tpu:gloo"}, ValueError,
     "got 'tpu:gloo' ('tpu' is no such device)"),  # the device list is torch's, which plugins extend
    ({"init_method": "file:///nonexistent-dir/x", "rank": 0, "world_size": 1}, ValueError,
     "init_method: expected a file:// path in an existing directory, got 'file:///nonexistent-dir/x'"),
])
def test_initialize_arguments_are_checked_before_the_rendezvous(kwargs, error, message):
    """A bad rank or world size used to reach torch.distributed's rendezvous (C++ stack dumps, a
    DistNetworkError after the timeout); a bad backend or URL scheme a raw RuntimeError."""
    kwargs = {"init_method": f"tcp://127.0.0.1:{free_port()}", **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        spmd.distributed.initialize(timeout_s=5, **kwargs)
    assert not dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="NCCL is available where CUDA is")
def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match=r"backend: expected one of the backends available here \['gloo'.*got 'nccl' "
                                         r"\('nccl' is (not built into this PyTorch|not available here)"):
        spmd.distributed.initialize("nccl", 5, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert not dist.is_initialized()


def test_global_shape_that_does_not_fit_is_a_value_error_naming_it():
    """``global_shape`` of another rank than ``local_data`` used to fail an assertion in ``shard_dims``."""
    mesh = Mesh.create({"tp": 2}, devices="cpu:2")
    sharding = spmd.NamedSharding(mesh, spmd.PartitionSpec("tp"))
    make = spmd.distributed.make_array_from_process_local_data
    with pytest.raises(ValueError, match=re.escape("global_shape: expected 2 dims, as local_data (shape [4, 4]; "
                                                   "partition spec P('tp')), got [4] (1 dims)")):
        make(sharding, torch.randn(4, 4), global_shape=(4,))
    with pytest.raises(ValueError, match=re.escape("global_shape: expected non-negative dims, got (4, -4)")):
        make(sharding, torch.randn(4, 4), global_shape=(4, -4))
    with pytest.raises(ValueError, match=re.escape("local_data: expected at least 2 dims (one per entry of the "
                                                   "partition spec P('tp', None)), got shape [4]")):
        make(spmd.NamedSharding(mesh, spmd.PartitionSpec("tp", None)), torch.randn(4))
    torch.testing.assert_close(make(sharding, torch.ones(4, 4), global_shape=[4, 4]).to_torch(), torch.ones(4, 4))


@pytest.mark.parametrize(("args", "message"), [
    (("44", None), "global_shape: expected a tuple of ints such as (8, 4), got str '44'"),
    ((4, None), "global_shape: expected a tuple of ints such as (8, 4), got int 4"),
    (((4, 3.0), None), "global_shape: expected a tuple of ints, got (4, 3.0)"),
    (((4, 3), 5), "data_callback: expected a callable index -> torch.Tensor, got int 5"),
])
def test_make_array_from_callback_argument_types_are_named(args, message):
    mesh = Mesh.create({"x": 2}, devices="cpu:2")
    shape, callback = args
    sharding = spmd.NamedSharding(mesh, spmd.PartitionSpec("x"))
    with pytest.raises(TypeError, match=re.escape(message)):
        spmd.distributed.make_array_from_callback(shape, sharding, callback or (lambda index: torch.zeros(4, 3)[index]))
    with pytest.raises(ValueError, match=re.escape("global_shape: expected non-negative dims, got (-4, 3)")):
        spmd.distributed.make_array_from_callback((-4, 3), sharding, lambda index: torch.zeros(4, 3)[index])


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


def test_a_rendezvous_that_does_not_complete_is_a_distributed_timeout_error():
    """One of two processes (or two processes with one rank) never completes the rendezvous: the
    store's timeout used to reach the user as torch's DistStoreError."""
    with pytest.raises(spmd.distributed.DistributedTimeoutError,
                       match="initialize: not every process joined within 2 s"):
        spmd.distributed.initialize(timeout_s=2, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=2)
    assert not dist.is_initialized()


def test_launcher_rank_and_world_size_win_and_a_second_env_run_is_refused(monkeypatch):
    """Under a launcher, a world_size or rank other than its WORLD_SIZE / RANK is a ValueError (each
    process used to run alone); a second run of a process on the launcher's store is refused (its
    ended run's connection keys are still there: a peer that leaves later made the rendezvous fail)."""
    monkeypatch.setattr(spmd.distributed.init, "_ENV_RUNS", [0])  # no env:// run of this process before
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=re.escape("world_size: the launcher set WORLD_SIZE=1, got world_size=2")):
        spmd.distributed.initialize(timeout_s=5, world_size=2)
    assert not dist.is_initialized()
    spmd.distributed.initialize(timeout_s=5)
    spmd.distributed.shutdown()
    with pytest.raises(ValueError, match="init_method: this process already left a run"):
        spmd.distributed.initialize(timeout_s=5)
    assert not dist.is_initialized()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    assert spmd.distributed.initialize(timeout_s=5, init_method=init_method, rank=0, world_size=1).world_size == 1
    spmd.distributed.shutdown()


def test_a_default_group_created_after_importing_spmd_is_not_held_by_torch_defaults():
    """``torch.distributed.nn.functional`` evaluates ``group=group.WORLD`` at import; imported after the
    caller's ``init_process_group`` (``torch.export`` imports it), it held the group, whose gloo threads
    then outlived it and could abort the process at exit. ``import spmd`` imports it first."""
    code = (
        "import spmd, torch.distributed as d\n"
        f"d.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "import torch.distributed.nn.functional as F\n"
        "held = [n for n, f in vars(F).items() if callable(f) and any(isinstance(v, d.ProcessGroup)\n"
        "        for v in getattr(f, '__defaults__', None) or ())]\n"
        "d.destroy_process_group()\n"
        "print('held', held)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "held []" in out.stdout, (out.stdout, out.stderr[-2000:])
