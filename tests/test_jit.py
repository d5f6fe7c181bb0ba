"""``spmd.jit`` staging and caching, pytree and static arguments, and the metrics a call moves."""

from __future__ import annotations

import dataclasses
import enum
import os

import pytest
import torch

import spmd
from spmd import Mesh, NamedSharding, metrics
from spmd import PartitionSpec as P

MESH = Mesh.create(("tp",), devices="cpu:4")


def _counter(name: str) -> int:
    return metrics.counter(name).value


def _samples(name: str) -> int:
    return metrics.timer(name).total_samples


def _scale_add(x, y):
    return x * 3.0 + y


def test_cache_hits_and_misses():
    f = spmd.jit(_scale_add, mesh=MESH, in_shardings=P("tp"), out_shardings=P("tp"))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    miss, hit, compiles = _counter("compile_cache.miss"), _counter("compile_cache.hit"), _samples("compile")
    torch.testing.assert_close(f(x, y).to_torch(), x * 3 + y)
    assert (_counter("compile_cache.miss"), _counter("compile_cache.hit")) == (miss + 1, hit)
    f(torch.randn(8, 4), torch.randn(8, 4))
    assert (_counter("compile_cache.miss"), _counter("compile_cache.hit")) == (miss + 1, hit + 1)
    compiled_once = _samples("compile")
    assert compiled_once - compiles in (0, 1)  # 0 when another Jitted already compiled this module
    x2, y2 = torch.randn(12, 4), torch.randn(12, 4)
    torch.testing.assert_close(f(x2, y2).to_torch(), x2 * 3 + y2)
    assert _counter("compile_cache.miss") == miss + 2
    assert _samples("compile") == compiled_once + 1


def test_process_wide_cache_shares_the_executable_but_not_the_options():
    f = spmd.jit(_scale_add, mesh=MESH, in_shardings=P("tp"), out_shardings=P("tp"))
    g = spmd.jit(_scale_add, mesh=MESH, in_shardings=P("tp"), out_shardings=P("tp"), reshard_inputs=True)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    cf = f.lower(x, y).compile()
    hits = _counter("compile_cache.global_hit")
    cg = g.lower(x, y).compile()
    assert _counter("compile_cache.global_hit") == hits + 1
    assert cg.executable is cf.executable and cg.output_shardings == cf.output_shardings
    wrong = spmd.device_put(x, NamedSharding(MESH, P()))
    with pytest.raises(ValueError, match="reshard_inputs=True"):
        cf.execute_sharded([wrong, y])
    torch.testing.assert_close(cg.execute_sharded([wrong, y])[0].to_torch(), x * 3 + y)


def test_pytree_arguments_and_outputs():
    def fn(params, batch):
        h = batch["x"] @ params["w"] + params["b"]
        return {"h": h, "norm": (h * h).sum()}

    f = spmd.jit(fn, mesh=MESH, in_shardings=({"w": P(None, "tp"), "b": P("tp")}, {"x": P()}),
                 out_shardings={"h": P(None, "tp"), "norm": P()})
    w, b, x = torch.randn(6, 8), torch.randn(8), torch.randn(5, 6)
    out = f({"w": w, "b": b}, {"x": x})
    assert set(out) == {"h", "norm"} and out["h"].sharding.spec == P(None, "tp")
    h = x @ w + b
    torch.testing.assert_close(out["h"].to_torch(), h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["norm"].to_torch(), (h * h).sum(), rtol=1e-5, atol=1e-4)
    c = f.lower({"w": w, "b": b}, {"x": x}).compile()
    assert [s.name.split(": ")[1] for s in c.input_specs] == [
        "argument args[0]['w']", "argument args[0]['b']", "argument args[1]['x']"]
    with pytest.raises(ValueError, match=r"fn: arguments have structure"):
        c({"w": w}, {"x": x})


def test_static_arguments_are_part_of_the_key():
    f = spmd.jit(lambda x, k: x * k, mesh=MESH, in_shardings=(P("tp"), None))
    x = torch.randn(8, 2)
    torch.testing.assert_close(f(x, 2.0).to_torch(), x * 2)
    miss = _counter("compile_cache.miss")
    torch.testing.assert_close(f(x, 5.0).to_torch(), x * 5)
    assert _counter("compile_cache.miss") == miss + 1
    c = f.lower(x, 2.0).compile()
    with pytest.raises(ValueError, match=r"static argument leaf 1 is 3.0, compiled for 2.0"):
        c(x, 3.0)


def test_lower_exposes_stage_text():
    lowered = spmd.jit(lambda a, b: a @ b, mesh=MESH, in_shardings=(P(None, "tp"), P("tp")),
                       out_shardings=P()).lower(torch.randn(4, 8), torch.randn(8, 4))
    assert "all-reduce" in lowered.as_text("spmd-partition")
    with pytest.raises(ValueError, match=r"unknown stage 'nope'"):
        lowered.as_text("nope")
    c = lowered.compile()
    assert "all-reduce" in c.collectives_summary()


def test_every_metric_moves_when_it_should():
    f = spmd.jit(_scale_add, mesh=MESH, in_shardings=P("tp"), out_shardings=P("tp"), donate_argnums=0,
                 reshard_inputs=True)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    f(spmd.device_put(y, NamedSharding(MESH, P())), spmd.device_put(x, NamedSharding(MESH, P("tp"))))  # compile
    before = metrics.snapshot()

    def moved(kind: str, name: str) -> float:
        now = metrics.snapshot()[kind].get(name, {} if kind == "timers" else 0)
        old = before[kind].get(name, {} if kind == "timers" else 0)
        if kind == "timers":
            return now.get("total_samples", 0) - old.get("total_samples", 0)
        return now - old

    xa = spmd.device_put(x, NamedSharding(MESH, P()))      # one transfer of 128 bytes
    ya = spmd.device_put(y, NamedSharding(MESH, P("tp")))  # and another
    out = f(xa, ya)                                         # a cache hit, a reshard of xa, a donation
    value = out.to_torch()                                  # a wait and a transfer back
    torch.testing.assert_close(value, x * 3 + y)
    assert moved("counters", "transfer.to_device.bytes") == 2 * 8 * 4 * 4
    assert moved("timers", "transfer.to_device") == 2
    assert moved("counters", "compile_cache.hit") == 1 and moved("counters", "compile_cache.miss") == 0
    assert moved("timers", "compile") == 0
    assert moved("counters", "reshards") == 1 and moved("timers", "reshard") == 1
    assert moved("counters", "donations") == 1 and xa.is_deleted
    assert moved("timers", "execute") == 2  # the reshard program and f
    assert moved("timers", "wait_for_devices") == 1
    assert moved("timers", "transfer.from_device") == 1
    assert moved("counters", "transfer.from_device.bytes") == 8 * 4 * 4
    assert moved("counters", "output_shardings.computed") == 0


def test_report_snapshot_and_reset(monkeypatch):
    f = spmd.jit(_scale_add, mesh=MESH, in_shardings=P("tp"), out_shardings=P("tp"))
    f(torch.randn(8, 4), torch.randn(8, 4)).to_torch()
    text = metrics.report()
    for name in ("Metric: execute", "Metric: transfer.to_device", "Metric: wait_for_devices",
                 "Counter: transfer.to_device.bytes", "Percentiles: 1%="):
        assert name in text
    snap = metrics.snapshot()
    assert snap["timers"]["execute"]["total_samples"] >= 1 and set(snap) == {"counters", "timers"}
    metrics.reset()
    assert metrics.snapshot()["timers"] == {} and not any(metrics.snapshot()["counters"].values())
    f(torch.randn(8, 4), torch.randn(8, 4))
    assert metrics.snapshot()["timers"]["execute"]["total_samples"] == 1


def test_bad_calls_and_outputs_get_clear_errors():
    import pytest as _pytest

    mesh = spmd.Mesh.create(("tp",), devices="cpu:4")
    x = torch.randn(8, 8)
    with _pytest.raises(ValueError, match="out_shardings has 2 entries, but the function returns 1 output"):
        spmd.jit(lambda a: a * 2, mesh=mesh, out_shardings=(P("tp"), P()))(x)
    with _pytest.raises(TypeError, match="must return tensors .* got NoneType"):
        spmd.jit(lambda a: None, mesh=mesh)(x)
    with _pytest.raises(TypeError, match="positional arguments only; got keyword argument"):
        spmd.jit(lambda a: a, mesh=mesh)(a=x)
    with _pytest.raises(TypeError, match="numpy|neither a tensor nor a hashable"):
        spmd.jit(lambda a: a, mesh=mesh)(x.numpy())
    f = spmd.jit(lambda a, s: a * s, mesh=mesh, in_shardings=(P("tp"), None))
    assert f(torch.arange(8), 2).to_torch().dtype == torch.int64
    assert f(torch.arange(8), 2.0).to_torch().dtype == torch.float32


@pytest.mark.parametrize("kw, err, match", [
    ({"cuda_graphs": 0}, TypeError, "cuda_graphs"),
    ({"merge_dots": "yes"}, TypeError, "merge_dots"),
    ({"fuse_attention": 1}, TypeError, "fuse_attention"),
    ({"num_compute_streams": 2.5}, TypeError, "num_compute_streams"),
    ({"num_compute_streams": True}, TypeError, "num_compute_streams"),
    ({"num_compute_streams": "2"}, TypeError, "num_compute_streams"),
    ({"num_compute_streams": 0}, ValueError, "num_compute_streams"),
    ({"dump_dir": 123}, TypeError, "dump_dir"),
    ({"windowed_einsum": "sometimes"}, ValueError, "windowed_einsum"),
])
def test_compile_options_are_checked_when_built(kw, err, match):
    with pytest.raises(err, match=match):
        spmd.CompileOptions(**kw)


def test_partial_out_shardings_are_refused_with_a_clear_error():
    mesh = Mesh.create({"tp": 2}, "cpu:2")
    f = spmd.jit(lambda a, b: a @ b, mesh=mesh, in_shardings=(P(None, "tp"), P("tp", None)),
                 out_shardings=NamedSharding(mesh, P(), partial=("tp",)))
    with pytest.raises(ValueError, match=r"out_shardings\[0\].*partial"):
        f(torch.randn(4, 4), torch.randn(4, 4))


# Matmuls with an empty M, N or K: (lhs shape, rhs shape, in_shardings, out_shardings).
EMPTY_MATMULS = [
    ((0, 8), (8, 8), (P("tp"), P(None, "tp")), P(None, "tp")),  # all-gather layout, M = 0
    ((0, 8), (8, 8), (P(None, "tp"), P("tp")), P("tp")),        # reduce-scatter layout, M = 0
    ((0, 8), (8, 8), (P("tp"), P()), P("tp")),                  # M sharded, nothing gathered
    ((4, 4), (4, 0), (P("tp"), P(None, "tp")), P(None, "tp")),  # all-gather layout, N = 0
    ((8, 8), (8, 0), (P(None, "tp"), P("tp")), P("tp")),        # reduce-scatter layout, N = 0
    ((8, 0), (0, 8), (P("tp"), P(None, "tp")), P(None, "tp")),  # all-gather layout, K = 0
    ((8, 0), (0, 8), (P(None, "tp"), P("tp")), P("tp")),        # reduce-scatter layout, K = 0
]


@pytest.mark.parametrize("options", [{"windowed_einsum": "auto"}, {"windowed_einsum": "on"},
                                     {"windowed_einsum": "on", "bidirectional": True}, {"windowed_einsum": "off"}])
@pytest.mark.parametrize("a, b, ins, out", EMPTY_MATMULS)
def test_matmul_with_an_empty_dimension_matches_torch(a, b, ins, out, options):
    x, w = torch.randn(*a), torch.randn(*b)
    f = spmd.jit(lambda p, q: p @ q, mesh=MESH, in_shardings=ins, out_shardings=out,
                 options=spmd.CompileOptions(**options))
    got = f(x, w).to_torch()
    assert got.shape == (a[0], b[1])
    torch.testing.assert_close(got, x @ w)
    assert "collective-permute" not in f.lower(x, w).as_text("windowed-einsum")


# Linear layers (bias add fused with the matmul) with an empty M, K or N, and an einsum over an
# empty batch dim: (x shape, weight [N, K] shape, in_shardings).
EMPTY_LINEARS = [
    ((0, 8), (4, 8), P()),           # M = 0
    ((8, 0), (4, 0), P()),           # K = 0: the result is the bias broadcast
    ((8, 8), (0, 8), P()),           # N = 0
    ((2, 0, 8), (4, 8), P()),        # 3-d x with an empty sequence dim
    ((0, 8), (8, 8), (P(), P("tp"), P("tp"))),  # column-parallel, M = 0
]


@pytest.mark.parametrize("xs, ws, ins", EMPTY_LINEARS)
def test_linear_with_an_empty_dimension_matches_torch(xs, ws, ins):
    x, w, b = torch.randn(*xs), torch.randn(*ws), torch.randn(ws[0])
    f = spmd.jit(torch.nn.functional.linear, mesh=MESH, in_shardings=ins, out_shardings=P())
    torch.testing.assert_close(f(x, w, b).to_torch(), torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("ins", [P(), (P("tp"), P())])
def test_einsum_over_an_empty_batch_dim(ins):
    x, w = torch.randn(0, 4, 8), torch.randn(8, 4)
    f = spmd.jit(lambda p, q: torch.einsum("bmk,kn->bmn", p, q), mesh=MESH, in_shardings=ins, out_shardings=P())
    assert f(x, w).to_torch().shape == (0, 4, 4)


@pytest.mark.parametrize("value", ["yes", 1, None, 0.0])
def test_reshard_inputs_must_be_a_bool(value):
    with pytest.raises(TypeError, match=rf"reshard_inputs must be True or False, got {type(value).__name__} "):
        spmd.jit(_scale_add, mesh=MESH, reshard_inputs=value)


@pytest.mark.parametrize("kw, match", [
    ({"bidirectional": "yes"}, "bidirectional must be True, False or None, got str 'yes'"),
    ({"verify": 1}, "verify must be True, False or None, got int 1"),
    ({"fuse_elementwise": None}, "fuse_elementwise must be True or False, got NoneType None"),
    ({"cuda_graphs": "auto"}, "cuda_graphs must be True, False or None, got str 'auto'"),
])
def test_bool_options_name_the_option_and_the_value(kw, match):
    with pytest.raises(TypeError, match=match):
        spmd.CompileOptions(**kw)


def test_dump_dir_must_not_be_a_file(tmp_path, monkeypatch):
    afile = tmp_path / "passwd"
    afile.write_text("x")
    for bad in (str(afile), afile, str(afile / "below")):
        with pytest.raises(ValueError, match=r"dump_dir: expected a directory path, got .*an existing file"):
            spmd.CompileOptions(dump_dir=bad)
    options = spmd.CompileOptions(dump_dir=str(tmp_path / "new" / "dir"))  # created when dumping
    spmd.jit(_scale_add, mesh=MESH, options=options)(torch.randn(4, 2), torch.randn(4, 2))
    assert any((tmp_path / "new" / "dir").iterdir())
    monkeypatch.setenv("SPMD_DUMP", str(afile))
    f = spmd.jit(lambda a: a * 5.0, mesh=MESH)
    with pytest.raises(ValueError, match=r"SPMD_DUMP: expected a directory path, got .*an existing file"):
        f(torch.randn(4, 3))


def test_an_unwritable_dump_dir_is_a_value_error():
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux /proc, where no user can create a directory")
    f = spmd.jit(_scale_add, mesh=MESH, options=spmd.CompileOptions(dump_dir="/proc/spmd-no-such-dir/d"))
    with pytest.raises(ValueError, match=r"dump_dir / SPMD_DUMP: cannot write the stage dumps"):
        f(torch.randn(4, 2), torch.randn(4, 2))


def test_bool_options_accept_no_numpy_bools():
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"merge_dots must be True or False, got numpy\.bool"):
        spmd.CompileOptions(merge_dots=np.True_)


def _matmul(a, b):
    return a @ b


@pytest.mark.parametrize("bad, what", [
    ([1.0, 2.0], "list"), (None, "NoneType"), ("w", "str"),
    ([torch.randn(8, 8), 2.0], r"list with float at args\[1\]\[1\]"),
    ({"w": torch.randn(8, 8), "k": None}, r"dict with NoneType at args\[1\]\['k'\]"),
])
def test_a_non_tensor_argument_given_a_sharding_is_named(bad, what):
    f = spmd.jit(_matmul, mesh=MESH, in_shardings=(P("tp"), P(None, "tp")), out_shardings=P(None, "tp"))
    msg = rf"_matmul: argument 1: expected a torch.Tensor or spmd.ShardedArray \(or a pytree of them\), got {what}$"
    with pytest.raises(TypeError, match=msg):
        f(torch.randn(8, 8), bad)


@pytest.mark.parametrize("bad, what", [([1.0, 2.0], "list"), (None, "NoneType")])
def test_a_non_tensor_argument_that_fails_tracing_is_named(bad, what):
    """Without a sharding of its own the argument is static; the function's TypeError then names it."""
    for f in (spmd.jit(_matmul, mesh=MESH), spmd.jit(_matmul, mesh=MESH, in_shardings=P())):
        with pytest.raises(TypeError, match=rf"_matmul: argument 1: expected a torch.Tensor .*, got {what} ") as e:
            f(torch.randn(8, 8), bad)
        assert "FakeTensor" not in str(e.value)


def test_pytrees_of_tensors_and_static_leaves_keep_working():
    x, w, b = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8)
    f = spmd.jit(lambda a, ps: a @ ps[0] + ps[1], mesh=MESH, in_shardings=(P("tp"), [P(None, "tp"), P("tp")]))
    torch.testing.assert_close(f(x, [w, b]).to_torch(), x @ w + b)
    g = spmd.jit(lambda a, ps: a @ ps["w"] * ps["k"], mesh=MESH, in_shardings=(P("tp"), {"w": P(), "k": None}))
    torch.testing.assert_close(g(x, {"w": w, "k": 3.0}).to_torch(), x @ w * 3.0)
    h = spmd.jit(lambda a, k: a * k, mesh=MESH, in_shardings=P("tp"))  # one spec for all: 2.0 stays static
    torch.testing.assert_close(h(x, 2.0).to_torch(), x * 2.0)
    with pytest.raises(TypeError, match=r"the function raised TypeError while tracing: .*'Tensor' and 'list'"):
        spmd.jit(_matmul, mesh=MESH)(x, [w])  # a list of tensors where the function wants one tensor


def test_a_sharded_array_hits_the_entry_of_a_tensor_call_with_the_same_layout():
    f = spmd.jit(_scale_add, mesh=MESH, in_shardings=(P("tp"), None), out_shardings=P("tp"))
    x, y = torch.randn(8, 3), torch.randn(8, 3)
    f(x, y)
    miss, hit = _counter("compile_cache.miss"), _counter("compile_cache.hit")
    out = f(spmd.device_put(x, NamedSharding(MESH, P("tp"))), spmd.device_put(y, NamedSharding(MESH, P())))
    assert (_counter("compile_cache.miss"), _counter("compile_cache.hit")) == (miss, hit + 1)
    torch.testing.assert_close(out.to_torch(), x * 3 + y)
    g = spmd.jit(_scale_add, mesh=MESH)  # and the other way round, without in_shardings
    g(spmd.device_put(x, NamedSharding(MESH, P())), spmd.device_put(y, NamedSharding(MESH, P())))
    miss, hit = _counter("compile_cache.miss"), _counter("compile_cache.hit")
    torch.testing.assert_close(g(x, y).to_torch(), x * 3 + y)
    assert (_counter("compile_cache.miss"), _counter("compile_cache.hit")) == (miss, hit + 1)


def test_an_array_of_another_sharding_than_in_shardings_keeps_its_own_entry():
    f = spmd.jit(_scale_add, mesh=MESH, in_shardings=(P("tp"), P()), out_shardings=P("tp"))
    x, y = torch.randn(8, 3), torch.randn(8, 3)
    f(x, y)
    with pytest.raises(ValueError, match=r"argument args\[0\]: expected sharding"):
        f(spmd.device_put(x, NamedSharding(MESH, P())), y)


def test_a_process_wide_cache_hit_names_its_own_output_shardings():
    """Over a mesh axis of size 1, P("tp", None) and P(None, "tp") give the same module text."""
    mesh = Mesh.create(("tp",), devices="cpu:1")
    x = torch.randn(4, 6)
    for spec in (P(None, "tp"), P("tp", None)):
        f = spmd.jit(lambda x: x + 1, mesh=mesh, out_shardings=spec)
        assert f(x).sharding == NamedSharding(mesh, spec)
    arr = spmd.device_put(x, NamedSharding(mesh, P()))
    for spec in (P(None, "tp"), P("tp", None)):
        assert arr.reshard(NamedSharding(mesh, spec)).sharding == NamedSharding(mesh, spec)


def test_an_unhashable_non_tensor_argument_is_named():
    # a numpy array used to fail with "argument of type ndarray is neither a tensor nor a hashable
    # static value", naming no argument, even where in_shardings gave that argument a sharding
    import numpy as np

    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")

    def f(a, b):
        return a * 2

    with pytest.raises(TypeError, match=r"f: argument 1: expected a torch.Tensor or spmd.ShardedArray .* got ndarray"):
        spmd.jit(f, mesh=mesh, in_shardings=(P(), P()))(torch.ones(2), np.ones(3))
    with pytest.raises(TypeError, match=r"f: argument args\[1\]\['x'\]\[1\]: a non-tensor argument is compiled in "
                                        r"as a constant, so it must be an immutable value \(.*\); got ndarray "
                                        r"\(convert it with torch.from_numpy\)"):
        spmd.jit(f, mesh=mesh)(torch.ones(2), {"x": [1, np.ones(2)]})
    assert torch.equal(spmd.jit(f, mesh=mesh)(torch.ones(2), {"x": [1, 2]}).to_torch(), torch.full((2,), 2.0))


class _Holder:
    def __init__(self, x):
        self.x = x


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    shift: tuple = (1, 2)
    color: enum.Enum | None = None


@dataclasses.dataclass
class _MutableConfig:
    scale: float


@dataclasses.dataclass(frozen=True)
class _TensorConfig:
    w: torch.Tensor


class _Color(enum.Enum):
    RED = 1
    BLUE = 2


@pytest.mark.parametrize("bad, got", [
    (_Holder(torch.ones(4)), "_Holder"),
    (_MutableConfig(2.0), r"_MutableConfig \(a dataclass must be @dataclass\(frozen=True\) of such values\)"),
    (_TensorConfig(torch.ones(4)), "_TensorConfig holding a Tensor"),
    (_Config(2.0, (1, torch.ones(1))), "_Config holding a Tensor"),
    (torch.nn.Linear(4, 4), "Linear"),
    ({1, 2}, "set"),
])
def test_a_static_argument_that_may_hide_a_tensor_is_a_type_error(bad, got):
    """A tensor inside an object used to be compiled in as a constant: a later call with the object's
    tensor replaced (``o.x = torch.zeros(4)``) returned the old values instead of eager's."""
    f = spmd.jit(lambda x, d: x * 2, mesh=MESH)
    msg = (r"<lambda>: argument args\[1\]: a non-tensor argument is compiled in as a constant, so it must be an "
           rf"immutable value \(None, bool, int, float, .*\); got {got}\. Pass tensors as arguments")
    with pytest.raises(TypeError, match=msg):
        f(torch.ones(4), bad)
    with pytest.raises(TypeError, match=msg):
        f.lower(torch.ones(4), bad)
    assert not f._cache


def test_the_object_holding_a_tensor_from_the_report_is_rejected():
    g = spmd.jit(lambda d: d.x * 2, mesh=MESH)
    with pytest.raises(TypeError, match=r"args\[0\]: a non-tensor argument .* got _Holder"):
        g(_Holder(torch.ones(4)))
    # the tensor passed as an argument (here in a dict) is read at every call
    h = spmd.jit(lambda d: d["x"] * 2, mesh=MESH)
    assert torch.equal(h({"x": torch.ones(4)}).to_torch(), torch.full((4,), 2.0))
    assert torch.equal(h({"x": torch.zeros(4)}).to_torch(), torch.zeros(4))


def test_immutable_static_arguments_work_and_key_the_cache():
    import numpy as np

    def fn(x, cfg, color, dtype, s, n, tag):
        y = x[s] * cfg.scale + cfg.shift[1] + n
        y = y * (2 if color is _Color.RED else 3)
        return (y if tag == "keep" else -y).to(dtype)

    f = spmd.jit(fn, mesh=MESH)
    x = torch.arange(8.0)
    args = (_Config(1.5), _Color.BLUE, torch.float64, slice(1, 5), np.float32(0.5), "keep")
    torch.testing.assert_close(f(x, *args).to_torch(), fn(x, *args))
    miss = _counter("compile_cache.miss")
    f(x, _Config(1.5), _Color.BLUE, torch.float64, slice(1, 5), np.float32(0.5), "keep")  # equal values: a hit
    assert _counter("compile_cache.miss") == miss
    other = (_Config(1.5, (1, 3)), _Color.RED, torch.float32, slice(0, 4), np.float32(0.5), "flip")
    torch.testing.assert_close(f(x, *other).to_torch(), fn(x, *other))
    assert _counter("compile_cache.miss") == miss + 1
    sample = spmd.jit(lambda x, s: x / s.temperature, mesh=MESH)  # spmd's own frozen dataclass
    torch.testing.assert_close(sample(x, spmd.Sampling(temperature=0.5)).to_torch(), x / 0.5)


def test_a_nan_static_argument_matches_itself():
    # used to fail on the first call: "static argument leaf 1 is nan, compiled for nan" (nan != nan)
    f = spmd.jit(lambda x, n: x * n, mesh=MESH)
    assert torch.isnan(f(torch.ones(4), float("nan")).to_torch()).all()
    miss = _counter("compile_cache.miss")
    assert torch.isnan(f(torch.ones(4), float("nan")).to_torch()).all()  # another nan object: a hit
    assert _counter("compile_cache.miss") == miss
    c = f.lower(torch.ones(4), float("nan")).compile()
    assert torch.isnan(c(torch.ones(4), float("nan")).to_torch()).all()
    with pytest.raises(ValueError, match=r"static argument leaf 1 is 1.0, compiled for nan"):
        c(torch.ones(4), 1.0)


def test_signed_zero_and_int_float_bool_static_arguments_compile_apart():
    # 0.0 == -0.0 and 1 == 1.0 == True, but the programs differ: -0.0 and 0.0 used to share one
    # entry, so 1 / (x * -0.0) returned +inf after a call with 0.0
    f = spmd.jit(lambda x, k: 1 / (x * k), mesh=MESH)
    x = torch.ones(4)
    for k in (0.0, -0.0, 0.0):
        assert torch.equal(f(x, k).to_torch(), 1 / (x * k))
    g = spmd.jit(lambda x, k: x // 2 * k, mesh=MESH)
    xi = torch.arange(4)
    for k in (1, 1.0, True):
        out = g(xi, k).to_torch()
        assert out.dtype == (xi // 2 * k).dtype and torch.equal(out, xi // 2 * k)
    c = f.lower(x, 0.0).compile()
    with pytest.raises(ValueError, match=r"static argument leaf 1 is -0.0, compiled for 0.0"):
        c(x, -0.0)


def test_a_function_is_a_static_argument():
    mesh = Mesh.create({"x": 1}, devices="cpu:1")
    f = spmd.jit(lambda x, act: act(x), mesh=mesh)
    x = torch.randn(5)
    assert torch.equal(f(x, torch.relu).to_torch(), torch.relu(x))
    assert torch.equal(f(x, torch.tanh).to_torch(), torch.tanh(x))  # another function: another program
    with pytest.raises(TypeError, match=r"args\[1\].*holding a Tensor"):  # its tensor would go stale
        f(x, torch.ones(5).mul)
