"""The ``fusion`` kernel: op-by-op interpreter, structure keys, compiler choice, Inductor and its fallback."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from hlo_helpers import FakeMesh
from hypothesis import HealthCheck, given, settings

from spmd import metrics
from spmd.ir.text import parse_module
from spmd.passes.assign_buffers import assign_buffers
from spmd.passes.assign_streams import AssignStreams
from spmd.passes.fuse_elementwise import FuseElementwise
from spmd.passes.schedule import Schedule
from spmd.runtime import kernels_fusion as kf
from spmd.runtime.executor import Executable
from spmd.runtime.kernels import compile_kernel
from tests.passes.test_fuse_elementwise import AFTER_ALL_REDUCE, dags, module, random_args

CPU = torch.device("cpu")
LN = 'custom_call_target="layer-norm", backend_config={"normalized_ndim":1,"eps":1e-05}'

# Two layers of the same scale + residual + LayerNorm + GELU chain after a dot, with different names.
TWO_LAYERS = module(
    ["x: f32[4,8]", "w: f32[8,8]", "b1: f32[8]", "b2: f32[8]"],
    [line.format(k=k, prev=prev)
     for k, prev in ((1, "%x"), (2, "%ln1"))
     for line in ("%d{k} = f32[4,8] dot({prev}, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}",
                  "%bb{k} = f32[4,8] broadcast(%b{k}), dimensions={{1}}",
                  "%s{k} = f32[4,8] multiply(%d{k}, %bb{k})",
                  "%r{k} = f32[4,8] add(%s{k}, {prev})",
                  "%n{k} = f32[4,8] custom-call(%r{k}), " + LN.replace("{", "{{").replace("}", "}}"),
                  '%ln{k} = f32[4,8] custom-call(%n{k}), custom_call_target="gelu"')]
    + ["ROOT %out = f32[4,8] dot(%ln2, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}"],
    "f32[4,8]")

FUSED_BY_HAND = """HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

%fused_computation (p0: f32[4,8], p1: f32[8]) -> f32[4,8] {
  %p0 = f32[4,8] parameter(0)
  %p1 = f32[8] parameter(1)
  %c = f32[] constant(0.5)
  %cb = f32[4,8] broadcast(%c), dimensions={}
  %pb = f32[4,8] broadcast(%p1), dimensions={1}
  %m = f32[4,8] multiply(%p0, %cb)
  %a = f32[4,8] add(%m, %pb)
  ROOT %ln = f32[4,8] custom-call(%a), custom_call_target="layer-norm", backend_config={"normalized_ndim":1,"eps":1e-05}
}

ENTRY %main (x: f32[4,8], v: f32[8]) -> f32[4,8] {
  %x = f32[4,8] parameter(0)
  %v = f32[8] parameter(1)
  ROOT %f = f32[4,8] fusion(%x, %v), kind=kLoop, calls=%fused_computation
}
"""


def _fused(text: str, **options):
    mod = parse_module(text)
    FuseElementwise(**options).run(mod)
    return mod


def _fusions(mod) -> list:
    return [i for i in mod.entry.instructions if i.opcode == "fusion"]


def _operands(inst, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape.dims, generator=gen) + 0.1 for o in inst.operands]


def _body_key(text: str) -> tuple:
    return kf.structure_key(_fusions(parse_module(text))[0].attrs["calls"])


@pytest.fixture
def fresh_cache(monkeypatch):
    """An empty process-wide compile cache and log-once set."""
    monkeypatch.setattr(kf, "_cache", {})
    monkeypatch.setattr(kf, "_logged", set())


def _counter(name: str) -> int:
    return metrics.counter(name).value


# --------------------------------------------------------------------------- the interpreter
def _executable(mod, n: int):
    AssignStreams().run(mod)
    Schedule().run(mod)
    return Executable(mod, FakeMesh(mod.mesh), assign_buffers(mod))


def _run_equal(text: str, bitwise: bool = True, **options) -> None:
    """The program with and without fusions, scheduled, buffered and run on CPU: equal bit for bit
    (``bitwise``), else within float32 rounding: where a bias add stays with its dot in one
    program (the runtime's addmm, accumulating from the bias) and runs after the GEMM in the other
    (the add taken into an elementwise fusion), the sums round in another order."""
    plain, fused = parse_module(text), _fused(text, **options)
    n = plain.num_partitions
    args = random_args(plain, seed=3)
    per_param = [[args[d][i] for d in range(n)] for i in range(len(args[0]))]
    want, _ = _executable(plain, n).run(per_param)
    got, _ = _executable(fused, n).run(per_param)
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w, g, strict=True):
            if not bitwise:
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, equal_nan=True)
                continue
            assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_fused_programs_equal_unfused_kernels_bit_for_bit():
    _run_equal(AFTER_ALL_REDUCE)
    _run_equal(TWO_LAYERS)
    assert len(_fusions(_fused(TWO_LAYERS))) == 2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_random_dags_run_by_the_executor_equal_unfused(text):
    _run_equal(text, bitwise=" dot(" not in text, min_kernels=1)


def test_a_bias_add_taken_from_its_dot_equals_the_addmm_within_rounding():
    """Regression (found by the random DAGs): ``(x @ w + v) + v`` fused as a plain GEMM and one
    elementwise kernel rounds differently from the unfused program's addmm, by one float32 ulp."""
    text = """HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

ENTRY %main (x: f32[3,4], v: f32[4], w: f32[4,4]) -> (f32[3,4]) {
  %x = f32[3,4] parameter(0)
  %v = f32[4] parameter(1)
  %w = f32[4,4] parameter(2)
  %d = f32[3,4] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %b0 = f32[3,4] broadcast(%v), dimensions={1}
  %a0 = f32[3,4] add(%d, %b0)
  %b1 = f32[3,4] broadcast(%v), dimensions={1}
  %a1 = f32[3,4] add(%a0, %b1)
  ROOT %out = (f32[3,4]) tuple(%a1)
}
"""
    assert len(_fusions(_fused(text, min_kernels=1))) == 1
    _run_equal(text, bitwise=False, min_kernels=1)


def test_kernel_takes_any_strides_and_writes_into_out():
    f = _fusions(parse_module(FUSED_BY_HAND))[0]
    kernel = compile_kernel(f, CPU)
    x, v = _operands(f)
    want = kernel([x, v], None)
    assert want.is_contiguous()
    assert torch.equal(kf.interpreter(f.attrs["calls"], CPU)(x, v), want)
    xt = x.t().contiguous().t()  # same values, column-major strides
    assert xt.stride() != x.stride() and torch.equal(kernel([xt, v], None), want)
    out = torch.empty(4, 8)
    assert kernel([x, v], out) is out and torch.equal(out, want)


# --------------------------------------------------------------------------- structure keys
def test_structure_key_is_equal_for_two_layers_and_ignores_names():
    a, b = (i.attrs["calls"] for i in _fusions(_fused(TWO_LAYERS)))
    assert [i.name for i in a.instructions] != [i.name for i in b.instructions]
    assert kf.structure_key(a) == kf.structure_key(b)
    hash(kf.structure_key(a))


@pytest.mark.parametrize("old,new", [
    ("constant(0.5)", "constant(0.25)"),
    ('"eps":1e-05', '"eps":1e-06'),
    ("%m = f32[4,8] multiply(%p0, %cb)", "%m = f32[4,8] divide(%p0, %cb)"),
    ("add(%m, %pb)", "add(%pb, %m)"),
])
def test_structure_key_differs_when_a_constant_attribute_or_opcode_differs(old, new):
    assert old in FUSED_BY_HAND
    assert _body_key(FUSED_BY_HAND) != _body_key(FUSED_BY_HAND.replace(old, new))


def test_structure_key_ignores_instruction_names():
    renamed = FUSED_BY_HAND.replace("%m ", "%mul ").replace("(%m,", "(%mul,").replace("%cb", "%scale")
    assert "%mul = " in renamed and "%scale" in renamed
    assert _body_key(FUSED_BY_HAND) == _body_key(renamed)


# --------------------------------------------------------------------------- SPMD_FUSION_COMPILER
@pytest.mark.parametrize("value,cpu,cuda", [
    (None, "eager", "graphs"), ("", "eager", "graphs"), ("auto", "eager", "graphs"),
    ("inductor", "inductor", "inductor"), ("eager", "eager", "eager"),
])
def test_fusion_compiler_choices(monkeypatch, value, cpu, cuda):
    if value is None:
        monkeypatch.delenv(kf.COMPILER_ENV, raising=False)
    else:
        monkeypatch.setenv(kf.COMPILER_ENV, value)
    assert kf.fusion_compiler(CPU) == cpu
    assert kf.fusion_compiler(torch.device("cuda", 0)) == cuda


@pytest.mark.parametrize("value", ["triton", "Inductor", "1"])
def test_bad_fusion_compiler_names_the_variable(monkeypatch, value, fresh_cache):
    monkeypatch.setenv("SPMD_FUSION_COMPILER", value)
    with pytest.raises(ValueError, match="SPMD_FUSION_COMPILER") as err:
        kf.fusion_compiler(CPU)
    assert repr(value) in str(err.value)
    f = _fusions(parse_module(FUSED_BY_HAND))[0]
    with pytest.raises(ValueError, match="SPMD_FUSION_COMPILER"):
        compile_kernel(f, CPU)(_operands(f), None)


# --------------------------------------------------------------------------- compilation and its fallback
def test_a_compile_failure_falls_back_to_the_interpreter(monkeypatch, fresh_cache, caplog):
    monkeypatch.setenv(kf.COMPILER_ENV, "inductor")

    def failing(fn, ops):
        raise RuntimeError("no compiler here\nsecond line")

    monkeypatch.setattr(kf, "_inductor", failing)
    a, b = _fusions(_fused(TWO_LAYERS))
    before = _counter("fusion.fallback.RuntimeError")
    with caplog.at_level(logging.WARNING, logger="spmd"):
        for inst in (a, b):
            ops = _operands(inst)
            got = compile_kernel(inst, CPU)(ops, None)
            assert torch.equal(got, kf.interpreter(inst.attrs["calls"], CPU)(*ops))
    # the second layer's fusion has the same structure: the failure is remembered, not retried
    assert _counter("fusion.fallback.RuntimeError") == before + 1
    warnings = [r.getMessage() for r in caplog.records if "op by op" in r.getMessage()]
    assert warnings == ["fusion: running op by op (RuntimeError: no compiler here)"]
    assert len(kf._cache) == 1


def _has_cxx() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.slow
@pytest.mark.skipif(not _has_cxx(), reason="Inductor on CPU needs a C++ compiler")
def test_inductor_on_cpu_matches_the_interpreter_and_shares_compiles(monkeypatch, fresh_cache):
    monkeypatch.setenv(kf.COMPILER_ENV, "inductor")
    a, b = _fusions(_fused(TWO_LAYERS))
    last = _fusions(parse_module(FUSED_BY_HAND))[0]
    hits, fallbacks = _counter("fusion.compile_cache.hit"), _fallbacks()
    for k, inst in enumerate((a, b, last)):
        ops = _operands(inst, seed=k)
        want = kf.interpreter(inst.attrs["calls"], CPU)(*ops)
        torch.testing.assert_close(compile_kernel(inst, CPU)(ops, None), want, rtol=1e-5, atol=1e-5)
    assert _counter("fusion.compile_cache.hit") == hits + 1  # layer 2 reuses layer 1's compiled kernel
    assert len(kf._cache) == 2 and _fallbacks() == fallbacks


def _fallbacks() -> int:
    return sum(v for k, v in metrics.snapshot()["counters"].items() if k.startswith("fusion.fallback."))


# --------------------------------------------------------------------------- donation
DONATED = """HloModule m, num_partitions=2, mesh={x=2}, is_partitioned=true

ENTRY %main (x: f32[64,8], g: f32[64,8]) -> f32[64,8] {
  %x = f32[64,8] parameter(0)
  %g = f32[64,8] parameter(1)
  %c = f32[] constant(0.9)
  %cb = f32[64,8] broadcast(%c), dimensions={}
  %s = f32[64,8] multiply(%x, %cb)
  %t = f32[64,8] tanh(%g)
  ROOT %u = f32[64,8] subtract(%s, %t)
}
"""


def test_a_donated_argument_updated_by_a_fused_chain_reuses_its_buffer():
    plain, fused = parse_module(DONATED), _fused(DONATED)
    assert [i.opcode for i in fused.entry.instructions if i.opcode not in ("parameter", "constant")] \
        == ["broadcast", "fusion"] or len(_fusions(fused)) == 1
    ex = Executable(fused, FakeMesh(fused.mesh))
    args = [[torch.randn(64, 8) for _ in range(2)] for _ in range(2)]
    want, _ = Executable(plain, FakeMesh(plain.mesh)).run([[t.clone() for t in a] for a in args])
    outs, _ = ex.run(args, donated=frozenset({0}))
    for d in range(2):
        assert outs[0][d].data_ptr() == args[0][d].data_ptr()
        assert torch.equal(outs[0][d], want[0][d])


def test_graphs_mode_compiles_only_for_graph_warmup(monkeypatch, fresh_cache):
    """Under "graphs" (the CUDA default) an eager call runs op by op; inside ``graph_warmup`` (the
    call before a CUDA graph capture) the fusion compiles and runs its generated kernel."""
    monkeypatch.setattr(kf, "fusion_compiler", lambda device: "graphs")
    compiled_for = []

    def fake_compile(structure, eager, ops):
        compiled_for.append(len(ops))
        return lambda *a: eager(*a) * 1.0

    monkeypatch.setattr(kf, "_compile", fake_compile)
    (inst,) = _fusions(parse_module(FUSED_BY_HAND))
    kernel = compile_kernel(inst, CPU)
    ops = _operands(inst)
    want = kf.interpreter(inst.attrs["calls"], CPU)(*ops)
    torch.testing.assert_close(kernel(ops, None), want)
    assert compiled_for == []
    with kf.graph_warmup():
        assert kf._graph_call()
        torch.testing.assert_close(kernel(ops, None), want)
    assert not kf._graph_call()
    assert compiled_for == [len(ops)]


@pytest.mark.slow
@pytest.mark.skipif(not _has_cxx(), reason="Inductor on CPU needs a C++ compiler")
def test_inductor_on_a_cpu_thread_pool_compiles_once_and_keeps_casts(monkeypatch, fresh_cache):
    """Four CPU devices run their shards on a thread pool: one Inductor compile serves them all,
    and a float32 -> float16 -> float32 round trip rounds as in eager PyTorch."""
    monkeypatch.setenv(kf.COMPILER_ENV, "inductor")
    import spmd

    mesh = spmd.Mesh.create(("tp",), devices="cpu:4")
    x = torch.randn(4096, 256)  # large enough for the CPU executor's thread pool

    def f(a):
        return (a * 3).half().float() - a * 3

    hits, fallbacks = _counter("fusion.compile_cache.hit"), _fallbacks()
    y = spmd.jit(f, mesh=mesh, in_shardings=spmd.PartitionSpec("tp"), out_shardings=spmd.PartitionSpec("tp"))(x)
    assert torch.equal(y.to_torch(), f(x))
    assert _counter("fusion.compile_cache.hit") == hits + 3
    assert _fallbacks() == fallbacks


# --------------------------------------------------------------------------- writing into the arena buffer
def test_a_generated_kernel_writes_into_out_without_a_copy(monkeypatch, fresh_cache):
    """With an ``out`` buffer that overlaps no operand, the fusion compiles a writer that stores into
    ``out`` (no fresh result plus ``out.copy_``); an ``out`` overlapping an operand keeps the copy."""
    monkeypatch.setattr(kf, "fusion_compiler", lambda device: "inductor")
    into_calls, plain_calls = [], []

    def fake_into(fn, ops, out):
        into_calls.append(len(ops))
        return lambda *a: a[-1].copy_(fn(*a[:-1]))

    def fake_compile(structure, eager, ops):
        plain_calls.append(len(ops))
        return eager

    monkeypatch.setattr(kf, "_inductor_into", fake_into)
    monkeypatch.setattr(kf, "_compile", fake_compile)
    (inst,) = _fusions(parse_module(FUSED_BY_HAND))
    kernel = compile_kernel(inst, CPU)
    ops = _operands(inst)
    want = kf.interpreter(inst.attrs["calls"], CPU)(*ops)
    arena = torch.empty(want.numel() * 2 + 16, dtype=want.dtype)
    out = arena[16:16 + want.numel()].view(want.shape)
    assert kernel(ops, out) is out and torch.equal(out, want)
    assert into_calls == [len(ops)] and plain_calls == []
    kernel(ops, out)  # cached: no second compile
    assert into_calls == [len(ops)]
    # an operand living in the same bytes as out: computed into a fresh tensor, then copied
    aliased = [arena[16:16 + ops[0].numel()].view(ops[0].shape).copy_(ops[0]), *ops[1:]]
    want2 = kf.interpreter(inst.attrs["calls"], CPU)(*aliased)
    assert kernel(aliased, out) is out and torch.equal(out, want2) and plain_calls == [len(ops)]


def test_byte_spans_of_views_of_one_storage():
    base = torch.zeros(100)
    a, b, c = base[0:10], base[10:20], base[5:15]
    assert not kf._overlaps(a, [b]) and kf._overlaps(a, [c]) and kf._overlaps(b, [c])
    t = base[:20].view(4, 5).t()  # strided view spans 20 floats
    assert kf._overlaps(t, [base[19:20]]) and not kf._overlaps(t, [base[20:30]])


@pytest.mark.slow
@pytest.mark.skipif(not _has_cxx(), reason="Inductor on CPU needs a C++ compiler")
def test_inductor_writer_stores_into_out_on_cpu(monkeypatch, fresh_cache):
    monkeypatch.setenv(kf.COMPILER_ENV, "inductor")
    a, _ = _fusions(_fused(TWO_LAYERS))
    ops = _operands(a)
    want = kf.interpreter(a.attrs["calls"], CPU)(*ops)
    out = torch.full_like(want, float("nan"))
    ptr = out.data_ptr()
    assert compile_kernel(a, CPU)(ops, out) is out and out.data_ptr() == ptr
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert any(k[0] == "into" for k in kf._cache)


def test_pointwise_parameters_of_fused_bodies():
    (upd,) = _fusions(_fused(DONATED))  # x * 0.9 - tanh(g): both operands read element for element
    assert {0, 1} <= kf.pointwise_parameters(upd.attrs["calls"])
    a, _ = _fusions(_fused(TWO_LAYERS))  # scale, residual, LayerNorm: the norm reads whole rows
    body = a.attrs["calls"]
    assert len(kf.pointwise_parameters(body)) < len(body.parameters)


def test_an_update_stored_over_its_pointwise_operand_skips_the_copy(monkeypatch, fresh_cache):
    """An optimizer-style update whose buffer is its own (donated) operand, read only element for
    element, is written by the generated kernel in place; the value equals the op-by-op one."""
    monkeypatch.setattr(kf, "fusion_compiler", lambda device: "inductor")
    into = []

    def fake_into(fn, ops, out):
        into.append(1)
        return lambda *a: a[-1].copy_(fn(*a[:-1]))

    monkeypatch.setattr(kf, "_inductor_into", fake_into)
    monkeypatch.setattr(kf, "_compile", lambda structure, eager, ops: pytest.fail("took the copy path"))
    (inst,) = _fusions(_fused(DONATED))
    ops = _operands(inst)
    x = ops[0]
    want = kf.interpreter(inst.attrs["calls"], CPU)(x.clone(), *ops[1:])
    assert compile_kernel(inst, CPU)(ops, x) is x and into == [1]
    assert torch.equal(x, want)
