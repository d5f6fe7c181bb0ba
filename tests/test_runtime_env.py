"""The runtime's environment variables are checked when a program is compiled, on any mesh."""

import pytest
import torch

import spmd
from spmd import PartitionSpec as P


@pytest.mark.parametrize("var,value", [("SPMD_FUSION_COMPILER", "bogus"), ("SPMD_P2P_ALL_REDUCE_MAX_BYTES", "abc"),
                                       ("SPMD_P2P_ALL_REDUCE_MAX_BYTES", "-1"), ("SPMD_EPILOGUE_CHOICE", "on"),
                                       ("SPMD_ATTENTION_CHOICE", "bogus"), ("SPMD_PDL", "2"), ("SPMD_PDL", "on"),
                                       ("SPMD_VERIFY", "maybe"), ("SPMD_VERIFY", "true")])
@pytest.mark.parametrize("fuse", [True, False])
def test_bad_environment_variable_fails_the_first_call(monkeypatch, var, value, fuse):
    monkeypatch.setenv(var, value)
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    f = spmd.jit(lambda a: a * 2 + 1, mesh=mesh, in_shardings=P("tp"), out_shardings=P("tp"),
                 options=spmd.CompileOptions(fuse_elementwise=fuse))
    with pytest.raises(ValueError, match=var):
        f(torch.randn(4, 3))


def test_donate_argnums_none_and_bad_types():
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    f = spmd.jit(lambda a: a + 1, mesh=mesh, in_shardings=P("tp"), out_shardings=P("tp"), donate_argnums=None)
    x = torch.randn(4, 3)
    torch.testing.assert_close(f(x).to_torch(), x + 1)
    with pytest.raises(TypeError, match="donate_argnums"):
        spmd.jit(lambda a: a, mesh=mesh, donate_argnums=1.0)


def test_as_text_stage_must_be_a_name():
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    low = spmd.jit(lambda a: a + 1, mesh=mesh, in_shardings=P("tp"), out_shardings=P("tp")).lower(torch.randn(4, 3))
    with pytest.raises(TypeError, match="stage"):
        low.as_text(3)
    assert "fusion" not in low.as_text("fuse-elementwise")  # one add: nothing to fuse
