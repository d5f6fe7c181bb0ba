"""``spmd.lowering``: the process-wide compile-cache key."""

import re
from typing import NamedTuple

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


_MESH = spmd.Mesh.create({"tp": 2}, devices="cpu:2")


class _Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def test_a_namedtuple_argument_takes_a_namedtuple_of_specs():
    # used to fail in lowering._align: "Pair.__new__() missing 1 required positional argument: 'b'"
    f = spmd.jit(lambda p: _Pair(p.a + p.b, p.a * p.b), mesh=_MESH, in_shardings=(_Pair(P("tp"), P()),),
                 out_shardings=_Pair(P(), P("tp")))
    a, b = torch.randn(8), torch.randn(8)
    out = f(_Pair(a, b))
    assert isinstance(out, _Pair) and out.b.sharding.spec == P("tp")
    torch.testing.assert_close(out.a.to_torch(), a + b)
    torch.testing.assert_close(out.b.to_torch(), a * b)
    assert [s.sharding.spec for s in f.lower(_Pair(a, b)).compile().input_specs] == [P("tp"), P()]


def test_a_sharding_tree_mismatch_names_the_argument_and_the_spec():
    x = torch.ones(4)
    f = spmd.jit(lambda d: d["a"], mesh=_MESH, in_shardings=({"a": P(), "b": P()},))
    with pytest.raises(ValueError, match=re.escape(
            "args[0]: the sharding tree does not match the argument: the argument is a dict with keys ['a'], "
            "but in_shardings[0] is a dict with keys ['a', 'b']")):
        f({"a": x})
    g = spmd.jit(lambda x: (x, x), mesh=_MESH, out_shardings=(P(), {"a": P()}))
    with pytest.raises(ValueError, match=re.escape(
            "output 1: the sharding tree does not match the output: the output is a single value, but "
            "out_shardings[1] is a dict with keys ['a']")):
        g(x)
    h = spmd.jit(lambda x: {"a": x}, mesh=_MESH, out_shardings=({"a": P()},))  # one output: out_shardings is its tree
    with pytest.raises(ValueError, match=re.escape(
            "output 0: the sharding tree does not match the output: the output is a dict with keys ['a'], but "
            "out_shardings is a tuple of 1")):
        h(x)


def test_static_key_tells_apart_what_equality_confuses():
    from spmd.lowering import static_key

    nan = float("nan")
    assert static_key(nan) == static_key(float("nan")) and hash(static_key(nan)) == hash(static_key(float("nan")))
    assert static_key(0.0) != static_key(-0.0)
    assert len({static_key(1), static_key(1.0), static_key(True)}) == 3
    assert static_key((1, 2.0)) != static_key((1.0, 2.0))
    assert static_key(complex(0.0, nan)) == static_key(complex(0.0, nan))
    assert static_key(slice(1, None)) == static_key(slice(1, None))
    assert static_key(frozenset({1, 2})) == static_key(frozenset({2, 1}))


@pytest.mark.parametrize("train", [True, False])
def test_a_module_that_updates_its_buffers_in_forward_is_named(train):
    # used to be torch.export's "Constant lifted_tensor_0 is mutated in the forward method. Pls register
    # it as buffer" (spmd.jit compiles a module's buffers in as constants)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train(train)
    f = spmd.jit(model, mesh=_MESH, in_shardings=(P("tp"),), out_shardings=P())
    if train:
        with pytest.raises(ValueError, match=r"Sequential: the function updates a module buffer \(or another tensor "
                                             r"it captures\) in place \(here BatchNorm1d '1' updates its running "
                                             r"statistics in training mode\); .* Call module.eval\(\)"):
            f(torch.randn(8, 4))
    else:  # eval mode traces; batch norm itself has no conversion: the error names the op
        with pytest.raises(TypeError, match=r"unsupported operation aten._native_batch_norm_legit_no_training"):
            f(torch.randn(8, 4))


def test_a_function_that_updates_a_captured_tensor_is_named():
    state = torch.zeros(4)

    def count(x):
        state.add_(1)
        return x * 2

    with pytest.raises(ValueError, match=r"count: the function updates a module buffer \(or another tensor it "
                                         r"captures\) in place \(e.g. BatchNorm's running statistics"):
        spmd.jit(count, mesh=_MESH)(torch.ones(4))
