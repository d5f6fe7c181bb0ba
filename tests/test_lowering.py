"""``spmd.lowering``: the process-wide compile-cache key."""

import pytest
import torch

import spmd
from spmd import NamedSharding
from spmd import PartitionSpec as P


def _ident(x):
    return x * 2


def test_cache_key_tells_size_one_axes_apart():
    # On {tp: 1}, P() and P("tp") print alike in HLO text; the cache must still keep their
    # executables apart, so each output comes back with the sharding asked for (found by tests/fuzz).
    mesh = spmd.Mesh.create({"tp": 1}, devices="cpu:1")
    x = torch.randn(4, 6)
    for spec in (P(), P("tp"), P(None, "tp")):
        out = spmd.jit(_ident, mesh=mesh, in_shardings=P(), out_shardings=spec)(x)
        assert out.sharding == NamedSharding(mesh, spec)
        torch.testing.assert_close(out.to_torch(), x * 2)


def test_resharded_argument_on_a_size_one_axis_is_accepted():
    mesh = spmd.Mesh.create({"tp": 1}, devices="cpu:1")
    x = torch.randn(6, 7, 8, dtype=torch.float64)
    spmd.device_put(x, NamedSharding(mesh, P(None, "tp"))).reshard(NamedSharding(mesh, P()))  # fills the cache
    a = spmd.device_put(x, NamedSharding(mesh, P(None, "tp"))).reshard(NamedSharding(mesh, P("tp")))
    assert a.sharding == NamedSharding(mesh, P("tp"))
    f = spmd.jit(_ident, mesh=mesh, in_shardings=P("tp"), out_shardings=P())
    torch.testing.assert_close(f(a).to_torch(), x * 2)


@pytest.mark.parametrize("name", ["donate_argnums", "weight_argnums"])
def test_argnums_past_the_arguments_are_a_value_error(name):
    mesh = spmd.Mesh.create({"tp": 2}, devices="cpu:2")
    f = spmd.jit(_ident, mesh=mesh, in_shardings=(P(),), out_shardings=P(), **{name: (3,)})
    with pytest.raises(ValueError, match=rf"{name}: argument 3 does not exist; the function was called with 1 "):
        f(torch.randn(4, 6))


def test_a_shape_error_names_the_cause_first_and_prints_no_traceback(capfd):
    mesh = spmd.Mesh.create({"tp": 2}, devices="cpu:2")
    f = spmd.jit(lambda a, b: a @ b, mesh=mesh, in_shardings=(P(), P()), out_shardings=P())
    with pytest.raises(ValueError, match=r"tracing failed: a and b must have same reduction dim.*\(argument shapes "
                                         r"args\[0\]: \(4, 4\), args\[1\]: \(5, 4\)\)"):
        f(torch.randn(4, 4), torch.randn(5, 4))
    assert "Traceback" not in capfd.readouterr().err


def test_a_shape_error_quotes_the_first_and_last_argument_shapes_of_many():
    """A train step of a real model has hundreds of leaves: the message quoted every one (20 KB)."""
    mesh = spmd.Mesh.create({"tp": 2}, devices="cpu:2")
    params = {f"w{i}": torch.randn(2) for i in range(100)}
    f = spmd.jit(lambda p, a, b: a @ b + sum(p.values()).sum(), mesh=mesh)
    with pytest.raises(ValueError, match=r"tracing failed: .*args\[0\]\['w5'\]: \(2,\), \.\.\. 90 more \.\.\., "
                                         r"args\[0\]\['w96'\].*args\[2\]: \(5, 4\)\)$") as info:
        f(params, torch.randn(4, 4), torch.randn(5, 4))
    assert "'w6'" not in str(info.value) and len(str(info.value)) < 600


def test_an_arithmetic_error_while_tracing_is_a_value_error():
    """torch's decomposition of mse_loss's backward divides by the numel: an empty batch raised a bare
    ZeroDivisionError from inside PyTorch."""
    mesh = spmd.Mesh.create({"dp": 2}, devices="cpu:2")
    f = spmd.jit(lambda w, x: torch.func.grad(lambda w: torch.nn.functional.mse_loss(x @ w, x))(w), mesh=mesh,
                 in_shardings=(P(), P("dp")))
    with pytest.raises(ValueError, match=r"tracing failed: float division by zero \(argument shapes args\[0\]: "
                                         r"\(3, 3\), args\[1\]: \(0, 3\)\)"):
        f(torch.randn(3, 3), torch.randn(0, 3))


@pytest.mark.parametrize("out_shardings", [{"a": P()}, {"a": P(), "b": P("tp")}, 5, "tp"])
def test_out_shardings_that_is_no_spec_and_no_sequence_for_a_tuple_output_is_a_type_error(out_shardings):
    # a dict (or a str, an int) for a function returning a tuple was iterated as if it had one
    # entry per output: "'int' object is not iterable", or "one per argument ... called with 2 arguments"
    mesh = spmd.Mesh.create({"tp": 2}, devices="cpu:2")
    f = spmd.jit(lambda a: (a, a * 2), mesh=mesh, in_shardings=(P(),), out_shardings=out_shardings)
    with pytest.raises(TypeError, match=r"out_shardings: expected a PartitionSpec, NamedSharding, None or a "
                                        r"tuple / list with one entry per output \(the function returns a tuple "
                                        r"of 2\), got " + type(out_shardings).__name__):
        f(torch.randn(4, 4))
    ok = spmd.jit(lambda a: (a, a * 2), mesh=mesh, in_shardings=(P(),), out_shardings=[P(), P("tp")])(torch.ones(4, 4))
    assert ok[1].sharding == NamedSharding(mesh, P("tp"))
