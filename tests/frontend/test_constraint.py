"""with_sharding_constraint: eager identity, export to a Sharding custom call."""

from __future__ import annotations

import pytest
import torch

from spmd.frontend.constraint import decode_spec, encode_spec, normalize_spec, with_sharding_constraint
from spmd.frontend.torch_export import import_program
from spmd.ir.sharding import TensorSharding

from .helpers import run_entry


class _Spec:
    def __init__(self, *entries):
        self.spec = entries


def test_eager_returns_input_itself():
    x = torch.randn(4, 6)
    assert with_sharding_constraint(x, ("dp", None)) is x


def test_normalize_and_encode_round_trip():
    s = normalize_spec(_Spec("dp", ("tp", "sp")), 3)
    assert s == TensorSharding((("dp",), ("tp", "sp"), ()))
    assert decode_spec(encode_spec(s)) == s
    p = TensorSharding(((), ("tp",)), partial=("dp",))
    assert decode_spec(encode_spec(p)) == p
    with pytest.raises(ValueError, match="rank 1"):
        normalize_spec(("dp", None), 1)
    with pytest.raises(TypeError, match="dim 0"):
        normalize_spec((3,), 2)
    with pytest.raises(ValueError, match="malformed"):
        decode_spec("{not json")


def test_export_becomes_sharding_custom_call():
    def f(x, w):
        h = with_sharding_constraint(x @ w, _Spec("dp", "tp"))
        return torch.tanh(h)

    x, w = torch.randn(4, 8), torch.randn(8, 6)
    prog = import_program(f, (x, w))
    calls = [i for i in prog.module.entry.instructions if i.opcode == "custom-call"]
    assert len(calls) == 1
    c = calls[0]
    assert c.attrs["custom_call_target"] == "Sharding"
    assert c.sharding == TensorSharding((("dp",), ("tp",)))
    assert c.operands[0].opcode == "dot" and c.shape.dims == (4, 6)
    assert c.location.source_file.endswith("test_constraint.py")
    torch.testing.assert_close(run_entry(prog, [x, w])[0], torch.tanh(x @ w))


@pytest.mark.parametrize("make_spec, message", [
    (lambda P, NS, Mesh: P("zz"), "unknown mesh axis 'zz'"),
    (lambda P, NS, Mesh: P("tp", "tp"), "mesh axis 'tp' is used twice"),
    (lambda P, NS, Mesh: NS(Mesh.create(("dp",), devices="cpu:2"), P("dp")), "expected one on the jit mesh"),
])
def test_bad_constraint_fails_at_the_users_line(make_spec, message):
    import traceback

    import spmd
    from spmd import Mesh, NamedSharding
    from spmd import PartitionSpec as P

    spec = make_spec(P, NamedSharding, Mesh)

    def f(x):
        return spmd.with_sharding_constraint(x * 2, spec)

    with pytest.raises(ValueError, match=message) as info:
        spmd.jit(f, mesh=Mesh.create(("tp",), devices="cpu:2"))(torch.randn(4, 4))
    frames = traceback.extract_tb(info.value.__traceback__)
    assert any(fr.filename == __file__ and fr.name == "f" for fr in frames)
