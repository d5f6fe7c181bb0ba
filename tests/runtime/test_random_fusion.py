"""A fusion holding the ``random`` custom call (dropout, randn + x) gives the same values when
PyTorch Inductor generates its kernel as op by op (CPU C++ code generation; slow: it compiles).
Each mode runs in its own process (the compiled executables and fusion kernels are cached)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

_SCRIPT = """
import sys, torch, torch.nn.functional as F
import spmd
from spmd import Mesh, PartitionSpec as P, metrics
def program(x):
    return F.dropout(x, 0.3, training=True) * 2, torch.randn_like(x) + x, torch.rand_like(x)
f = spmd.jit(program, mesh=Mesh.create(("tp",), devices="cpu:2"), in_shardings=P("tp"))
x = torch.randn(64, 40, generator=torch.Generator().manual_seed(1))
torch.manual_seed(0)
torch.save([o.to_torch() for o in f(x)] + [metrics.timer("fusion.compile").total_samples], sys.argv[1])
"""


def _run(tmp_path, compiler: str) -> list:
    path = tmp_path / f"{compiler}.pt"
    env = {**os.environ, "SPMD_FUSION_COMPILER": compiler, "PYTHONPATH": os.getcwd()}
    subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], env=env, check=True, timeout=900)
    return torch.load(path)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor's CPU code generation needs a C++ compiler")
def test_inductor_fused_random_equals_op_by_op(tmp_path):
    *eager, eager_compiles = _run(tmp_path, "eager")
    *compiled, compiles = _run(tmp_path, "inductor")
    assert eager_compiles == 0 and compiles > 0
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
