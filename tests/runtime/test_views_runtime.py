"""Views at run time: numerics against single-device PyTorch, the race checker, kernel counts, outputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import spmd
import spmd.passes.assign_buffers as ab_mod
import spmd.runtime.lower as lower_mod
from benchmarks.workloads import WORKLOADS, make_inputs
from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.text import parse_module
from spmd.mesh import Mesh
from spmd.passes.assign_buffers import assign_buffers
from spmd.passes.assign_streams import AssignStreams
from spmd.passes.schedule import Schedule
from spmd.passes.views import view_instructions
from spmd.passes.windowed_einsum import WindowedEinsum
from spmd.runtime import aliasing
from spmd.runtime.executor import Executable
from spmd.runtime.hazards import find_hazards
from spmd.runtime.thunks import CollectiveThunk, KernelThunk
from tests.passes.test_views import BLOCK_2DEV, _module
from tests.passes.test_windowed_einsum import ag_module, rs_module
from tests.runtime.programs import windowed_all_gather_dot

P = spmd.PartitionSpec
DEVICES = (2, 4, 8)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    err = (got.double() - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), err


def _block_jit(n: int, sequence_parallel: bool, fusions: bool = True):
    """The block workload over tp=n; with ``sequence_parallel``, x and the output split by rows
    and every all-gather→dot / dot→reduce-scatter a windowed einsum on streams."""
    wl = WORKLOADS["block"]
    mesh = spmd.Mesh.create({"tp": n}, f"cpu:{n}")
    specs = [P(*s) for s in wl.specs]
    out, kw = P(), {} if fusions else {"merge_dots": False, "fuse_attention": False, "fuse_elementwise": False}
    options = spmd.CompileOptions(**kw)
    if sequence_parallel:
        specs[0], out = P("tp", None), P("tp", None)
        options = spmd.CompileOptions(windowed_einsum="on", cuda_graphs=False, **kw)
    return wl, spmd.jit(wl.fn, mesh=mesh, in_shardings=tuple(specs), out_shardings=out, options=options)


def _gpu_program(module, n: int, buffers=None):
    buffers = assign_buffers(module) if buffers is None else buffers
    return lower_mod.lower(module, [torch.device("cpu")] * n, list(range(n)), buffers, gpu=True)


def _run(module, args: list[list[torch.Tensor]], calls: int = 2) -> list[list[list[torch.Tensor]]]:
    """Run ``module`` on n virtual CPU devices with its buffer assignment; ``args[d][i]`` per device."""
    n = module.num_partitions
    ex = Executable(module, Mesh.create(("tp",), devices=f"cpu:{n}"), assign_buffers(module))
    per_param = [[args[d][i] for d in range(n)] for i in range(len(args[0]))]
    return [ex.run(per_param)[0] for _ in range(calls)]


# --------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("fusions", [False, True])
def test_block_matches_float64_pytorch(n, sequence_parallel, fusions):
    """With and without merge-dots / fuse-attention / fuse-elementwise (which leave fewer layout ops to view)."""
    wl, f = _block_jit(n, sequence_parallel, fusions)
    lowered = f.lower(*make_inputs(wl, "cpu", 0))
    assert len(view_instructions(lowered.result.module)) >= (3 if fusions else 8)  # simplify composes k's transposes
    for seed in (11, 12):  # fresh inputs per call: the arena is reused
        xs = make_inputs(wl, "cpu", seed)
        want = wl.fn(*[x.double() for x in xs])
        _close(f(*xs).to_torch(), want)


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("side, shape", [("ag", (64, 32, 64)), ("ag", (64, 32, 256)), ("rs", (64, 32, 256))])
def test_windowed_matmul_matches_float64_pytorch(n, side, shape):
    ins = {"ag": (P("tp", None), P(None, "tp")), "rs": (P(None, "tp"), P("tp", None))}[side]
    out = P(None, "tp") if side == "ag" else P("tp", None)
    mesh = spmd.Mesh.create({"tp": n}, f"cpu:{n}")
    f = spmd.jit(lambda x, w: torch.exp((x @ w).reshape(x.shape[0], -1, 8).transpose(0, 1)),
                 mesh=mesh, in_shardings=ins, out_shardings=P(), options=spmd.CompileOptions(windowed_einsum="on"))
    m, k, nn = shape
    x, w = torch.randn(m, k) + 0.1, torch.randn(k, nn) + 0.1
    want = torch.exp((x.double() @ w.double()).reshape(m, -1, 8).transpose(0, 1))
    _close(f(x, w).to_torch(), want)
    g = spmd.jit(lambda x, w: x @ w, mesh=mesh, in_shardings=ins, out_shardings=out,
                 options=spmd.CompileOptions(windowed_einsum="on"))
    _close(g(x, w).to_torch(), x.double() @ w.double())


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("async_dot", [False, True])
def test_windowed_all_gather_program_matches_float64_pytorch(n, async_dot):
    module = windowed_all_gather_dot(n, async_dot=async_dot)
    xs = [torch.randn(4, 16) + 0.1 for _ in range(n)]
    w = torch.randn(16, 8) + 0.1
    want = torch.cat(xs).double() @ w.double()
    for outs in _run(module, [[x, w] for x in xs]):
        for d in range(n):
            _close(outs[0][d], want)


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("text_of", [lambda n, t: ag_module("qkv", n, 5, t=t, k=16, n=12),
                                     lambda n, t: rs_module("lhs", n, 5, t=t, k=16, n=12)])
def test_windowed_pass_programs_match_float64(n, text_of):
    ref, mod = parse_module(text_of(n, "f64")), parse_module(text_of(n, "f32"))
    args = [[torch.randn(p.shape.dims) + 0.1 for p in mod.entry.parameters] for _ in range(n)]
    want = evaluate_spmd(ref, [[a.double() for a in per] for per in args])
    for pss in (WindowedEinsum(mode="on", bidirectional=True), AssignStreams(), Schedule()):
        pss.run(mod)
    for outs in _run(mod, args):
        for j, per in enumerate(want):
            for d, w in enumerate(per):
                _close(outs[j][d], w)


# --------------------------------------------------------------------------- race checker
@pytest.mark.parametrize("n", DEVICES)
def test_lowered_programs_with_views_are_race_free(n):
    wl, f = _block_jit(n, sequence_parallel=True)
    module = f.lower(*make_inputs(wl, "cpu", 0)).result.module
    program = _gpu_program(module, n)
    stream_of = {t.out: t.stream_id for t in program.thunks if isinstance(t, KernelThunk)}
    cross = [t for t in program.thunks if isinstance(t, KernelThunk) and t.out in program.view_slots
             and stream_of.get(t.ins[0], t.stream_id) != t.stream_id]
    assert cross, "expected views of values written on another stream"
    assert find_hazards(program) == []
    assert find_hazards(_gpu_program(parse_module(BLOCK_2DEV), 2)) == []


def _cross_stream_view_module():
    """%d (stream 1) reads %a through the view %t; stream 0 writes %b, %c meanwhile, never joined."""
    return parse_module(_module(["x: f32[64,64]", "w: f32[64,64]"], [
        "%a = f32[64,64] negate(%x), stream_id=0",
        "%t = f32[64,64] transpose(%a), dimensions={1,0}, stream_id=0",
        "%d = f32[64,64] dot(%t, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, stream_id=1",
        "%b = f32[64,64] exponential(%x), stream_id=0",
        "%c = f32[64,64] negate(%b), stream_id=0",
        "%e = f32[64,64] exponential(%c), stream_id=0",
        "ROOT %r = (f32[64,64], f32[64,64]) tuple(%d, %e), stream_id=0"], "(f32[64,64], f32[64,64])"))


def test_shrinking_a_view_source_live_range_is_a_reported_race():
    module = _cross_stream_view_module()
    ba = assign_buffers(module)
    program = _gpu_program(module, 2, ba)
    assert program.view_slots and find_hazards(program) == []
    # %a's bytes handed to %b as if %a died at the view op: %d on stream 1 may still read them
    offsets = {**ba.offsets_bytes, "b": ba.offsets_bytes["a"]}
    bad = _gpu_program(_cross_stream_view_module(), 2, dataclasses.replace(ba, offsets_bytes=offsets))
    hazards = find_hazards(bad)
    assert any(h.location[0] == "arena" and {h.first, h.second} == {"d", "b"} for h in hazards), hazards


def test_assignment_without_the_view_rule_is_a_reported_race(monkeypatch):
    """assign-buffers treating views as ordinary values (their source dead at the view op) races."""
    module = _cross_stream_view_module()
    monkeypatch.setattr(ab_mod, "view_instructions", lambda m: frozenset())
    ba = assign_buffers(module)
    monkeypatch.undo()
    assert ba.offsets_bytes["b"] == ba.offsets_bytes["a"] and "t" in ba.offsets_bytes
    offsets = {k: v for k, v in ba.offsets_bytes.items() if k != "t"}  # the lowering makes %t a view again
    hazards = find_hazards(_gpu_program(module, 2, dataclasses.replace(ba, offsets_bytes=offsets)))
    assert any(h.location[0] == "arena" for h in hazards), hazards


# --------------------------------------------------------------------------- kernels and outputs
def _kernels_per_call(program) -> int:
    return sum(1 for t in program.thunks if isinstance(t, CollectiveThunk)
               or (isinstance(t, KernelThunk) and t.out not in program.view_slots))


def test_block_kernel_count_drops(monkeypatch):
    program = _gpu_program(parse_module(BLOCK_2DEV), 2)
    assert _kernels_per_call(program) == 17  # the MLP's dot and GELU are one op (epilogue_fusion)
    assert len(program.view_slots) == 9
    monkeypatch.setattr(ab_mod, "view_instructions", lambda m: frozenset())
    monkeypatch.setattr(aliasing, "view_instructions", lambda m: frozenset())
    before = _gpu_program(parse_module(BLOCK_2DEV), 2)
    assert _kernels_per_call(before) == 26 and not before.view_slots
    assert len(before.arena_views) - len(program.arena_views) == 9  # views have no arena buffer
    assert before.arena_size_bytes >= program.arena_size_bytes


@pytest.mark.parametrize("root", ["reshape(%a)", "slice(%a), slice={[0:64:1], [0:64:1]}"])
def test_output_viewing_the_arena_is_copied(root):
    """An output returned as a view of arena bytes would change when the next call reuses them."""
    shape = "f32[4096]" if root.startswith("reshape") else "f32[64,64]"
    module = parse_module(_module(["x: f32[64,64]"], [
        "%a = f32[64,64] negate(%x)", f"ROOT %r = {shape} {root}"], shape))
    ex = Executable(module, Mesh.create(("tp",), devices="cpu:2"), assign_buffers(module))
    # copied once, by the op itself (it materializes: %a's bytes may be reused within the call)
    assert ex.program.output_clone == (False,)
    x = [torch.randn(64, 64) for _ in range(2)]
    first = ex.run([x])[0][0][0]
    kept = first.clone()
    ex.run([[t * 2 for t in x]])
    assert torch.equal(first, kept)


def test_in_place_update_fusion_skips_a_viewed_buffer():
    """Without a buffer assignment, fusion (a) may update %acc in place; %t (a view of it) is read later."""
    module = parse_module(_module(["x: f32[8,16]", "w: f32[16,16]"], [
        "%zero = s32[] constant(0)",
        "%acc = f32[16,16] negate(%w)",
        "%t = f32[16,16] transpose(%acc), dimensions={1,0}",
        "%d = f32[8,16] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "%u = f32[16,16] dynamic-update-slice(%acc, %d, %zero, %zero)",
        "%s = f32[16,16] add(%u, %t)",
        "ROOT %r = f32[16,16] exponential(%s)"], "f32[16,16]"))
    args = [[torch.randn(8, 16), torch.randn(16, 16)] for _ in range(2)]
    want = evaluate_spmd(module, args)
    for buffers in (None, assign_buffers(module)):
        ex = Executable(module, Mesh.create(("tp",), devices="cpu:2"), buffers)
        assert ex.program.view_slots
        outs, _ = ex.run([[a[i] for a in args] for i in range(2)])
        for d in range(2):
            torch.testing.assert_close(outs[0][d], want[0][d])


@pytest.mark.parametrize("body", [
    ["%a = f32[8,8] negate(%x)", "%t = f32[8,8] transpose(%x), dimensions={1,0}",
     "%b = f32[8,8] add(%t, %a)", "ROOT %r = (f32[8,8], f32[8,8]) tuple(%a, %b)"],
    ["%t = f32[8,8] transpose(%x), dimensions={1,0}", "%n = f32[8,8] negate(%t)",
     "ROOT %r = (f32[8,8], f32[8,8]) tuple(%n, %n)"],
])
def test_donated_parameter_read_through_a_view_is_not_overwritten(body):
    """Writing an output into donated %x is unsafe while a view of %x is still to be read (or is
    the writer's own operand: an in-place transposed write would read what it overwrote)."""
    module = parse_module(_module(["x: f32[8,8]"], body, "(f32[8,8], f32[8,8])"))
    ex = Executable(module, Mesh.create(("tp",), devices="cpu:2"), assign_buffers(module))
    x = [torch.randn(8, 8) + 0.1 for _ in range(2)]
    want = evaluate_spmd(module, [[t.clone()] for t in x])
    outs, _ = ex.run([x], donated=frozenset({0}))
    assert ex._variant(frozenset({0}))[0].view_slots
    for j in range(2):
        for d in range(2):
            torch.testing.assert_close(outs[j][d], want[j][d])


def test_view_kernels_share_memory_and_match_the_copy_kernels():
    from spmd.runtime.kernels import compile_kernel, compile_view_kernel

    module = parse_module(_module(["x: f32[8,12]"], [
        "%r = f32[2,4,12] reshape(%x)",
        "%t = f32[12,8] transpose(%x), dimensions={1,0}",
        "%b = f32[3,8,12] broadcast(%x), dimensions={1,2}",
        "%s = f32[4,6] slice(%x), slice={[0:8:2], [3:9:1]}",
        "ROOT %n = f32[8,12] negate(%x)"], "f32[8,12]"))
    x = torch.randn(8, 12)
    for inst in module.entry.instructions:
        if inst.opcode in ("reshape", "transpose", "broadcast", "slice"):
            got = compile_view_kernel(inst)([x], None)
            assert got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), inst.name
            out = torch.empty(inst.shape.dims)
            assert torch.equal(got, compile_kernel(inst)([x], out))
    with pytest.raises(ValueError, match="no view kernel"):
        compile_view_kernel(module.entry.root)


OUTPUT_SLICE_OF_REUSED_BYTES = """HloModule r, num_partitions=4, mesh={tp=4}, is_partitioned=true

ENTRY %main (x: f32[40,40], w: f32[40,40]) -> (f32[40,40], f32[40,40]) {
  %x = f32[40,40] parameter(0)
  %w = f32[40,40] parameter(1)
  %n0 = f32[40,40] negate(%x), stream_id=0
  %sl4 = f32[40,40] slice(%n0), slice={[0:40:1], [0:40:1]}, stream_id=0
  %n7 = f32[40,40] negate(%w), stream_id=0
  %a8 = f32[40,40] add(%x, %n7), stream_id=0
  ROOT %out = (f32[40,40], f32[40,40]) tuple(%sl4, %a8), stream_id=0
}
"""


def test_output_slice_is_materialized_before_its_source_bytes_are_reused():
    """%sl4 (an output, so not a view for the buffer assignment) slices %n0, whose arena bytes
    %n7 reuses: the slice kernel must copy, not return a view (found by the random-program test)."""
    module = parse_module(OUTPUT_SLICE_OF_REUSED_BYTES)
    ba = assign_buffers(module)
    assert ba.offsets_bytes["n0"] == ba.offsets_bytes["n7"]  # the reuse that makes a view wrong
    program = _gpu_program(module, 4, ba)
    assert find_hazards(program) == []
    args = [[torch.randn(40, 40) for _ in range(2)] for _ in range(4)]
    want = evaluate_spmd(module, args)
    for outs in _run(module, args):
        for j, per in enumerate(want):
            for d, w in enumerate(per):
                torch.testing.assert_close(outs[j][d], w)


def test_materializing_copies_only_results_that_share_an_operand():
    x = torch.randn(4, 4)
    ident = aliasing.materializing(lambda ops, out: ops[0][:, :2])
    fresh = aliasing.materializing(lambda ops, out: ops[0] + 1)
    r = ident([x], None)
    assert r.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    torch.testing.assert_close(r, x[:, :2])
    y = fresh([x], None)
    torch.testing.assert_close(y, x + 1)
