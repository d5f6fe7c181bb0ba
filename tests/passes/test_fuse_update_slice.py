"""In-place dynamic-update-slice fusions (fuse-elementwise + multi-output-fusion): golden HLO text,
what must stay unfused, and the runtime's in-place kernel against the IR evaluator."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import torch
from expecttest import TestCase

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.text import parse_module, print_module
from spmd.passes.fuse_elementwise import FuseElementwise
from spmd.passes.multi_output_fusion import MultiOutputFusion
from spmd.runtime.executor import Executable
from tests.passes.fuse_elementwise_programs import module
from tests.passes.pass_checks import run_pass_checked
from tests.runtime.hlo_helpers import FakeMesh

# A decode step's cache writes: k rotated (multiply-add with cos rows), v a transposed view, both
# written at the same position (each write with its own copy of the position arithmetic).
KV_WRITE = module(
    ["ck: f32[2,2,8,4]", "cv: f32[2,2,8,4]", "k: f32[2,2,1,4]", "v: f32[2,1,2,4]", "cs: f32[2,1,4]", "pos: f32[]"],
    ["%cb = f32[2,2,1,4] broadcast(%cs), dimensions={0,2,3}",
     "%k1 = f32[2,2,1,4] multiply(%k, %cb)",
     "%k2 = f32[2,2,1,4] add(%k1, %k)",
     "%z = s64[] constant(0)",
     "%s = s64[] convert(%pos)",
     "%nk = f32[2,2,8,4] dynamic-update-slice(%ck, %k2, %z, %z, %s, %z)",
     "%vt = f32[2,2,1,4] transpose(%v), dimensions={0,2,1,3}",
     "%s2 = s64[] convert(%pos)",
     "%nv = f32[2,2,8,4] dynamic-update-slice(%cv, %vt, %z, %z, %s2, %z)",
     "ROOT %out = (f32[2,2,8,4], f32[2,2,8,4]) tuple(%nk, %nv)"],
    "(f32[2,2,8,4], f32[2,2,8,4])")

# With q: q and k are slices of one projection (x); q's rotary runs over [.., 2, 2] and is
# reshaped back to [.., 4], the k update's dims (multi-head attention).
QKV_WRITE = module(
    ["ck: f32[2,2,8,4]", "cv: f32[2,2,8,4]", "x: f32[2,2,1,8]", "v: f32[2,1,2,4]", "cs: f32[2,1,4]", "pos: f32[]"],
    ["%xq = f32[2,2,1,4] slice(%x), slice={[0:2], [0:2], [0:1], [0:4]}",
     "%xq5 = f32[2,2,1,2,2] reshape(%xq)",
     "%e = f32[2,2,1,2,2] exponential(%xq5)",
     "%q2 = f32[2,2,1,2,2] multiply(%e, %xq5)",
     "%qr = f32[2,2,1,4] reshape(%q2)",
     "%xk = f32[2,2,1,4] slice(%x), slice={[0:2], [0:2], [0:1], [4:8]}",
     "%cb = f32[2,2,1,4] broadcast(%cs), dimensions={0,2,3}",
     "%k1 = f32[2,2,1,4] multiply(%xk, %cb)",
     "%k2 = f32[2,2,1,4] add(%k1, %xk)",
     "%z = s64[] constant(0)",
     "%s = s64[] convert(%pos)",
     "%nk = f32[2,2,8,4] dynamic-update-slice(%ck, %k2, %z, %z, %s, %z)",
     "%vt = f32[2,2,1,4] transpose(%v), dimensions={0,2,1,3}",
     "%nv = f32[2,2,8,4] dynamic-update-slice(%cv, %vt, %z, %z, %s, %z)",
     "ROOT %out = (f32[2,2,1,4], f32[2,2,8,4], f32[2,2,8,4]) tuple(%qr, %nk, %nv)"],
    "(f32[2,2,1,4], f32[2,2,8,4], f32[2,2,8,4])")


def _fused(text: str) -> str:
    mod = parse_module(text)
    FuseElementwise().run(mod)
    return print_module(mod)


def _opcodes(mod) -> list[str]:
    return [i.opcode for i in mod.entry.instructions if i.opcode not in ("parameter", "constant")]


class TestGolden(TestCase):
    def test_cache_writes_absorb_their_producers(self):
        out, _ = run_pass_checked(FuseElementwise(), KV_WRITE)
        self.assertExpectedInline(out, """\
HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

%fused_computation (param_0: f32[2,1,2,4], param_1: f32[2,2,8,4], param_2: s64[], param_3: s64[]) -> f32[2,2,8,4] {
  %param_0 = f32[2,1,2,4] parameter(0)
  %param_1 = f32[2,2,8,4] parameter(1)
  %param_2 = s64[] parameter(2)
  %param_3 = s64[] parameter(3)
  %vt.1 = f32[2,2,1,4] transpose(%param_0), dimensions={0,2,1,3}
  ROOT %nv.1 = f32[2,2,8,4] dynamic-update-slice(%param_1, %vt.1, %param_2, %param_2, %param_3, %param_2)
}

%fused_computation.1 (param_0.1: f32[2,1,4], param_1.1: f32[2,2,1,4], param_2.1: f32[2,2,8,4], param_3.1: s64[], param_4: s64[]) -> f32[2,2,8,4] {
  %param_0.1 = f32[2,1,4] parameter(0)
  %param_1.1 = f32[2,2,1,4] parameter(1)
  %param_2.1 = f32[2,2,8,4] parameter(2)
  %param_3.1 = s64[] parameter(3)
  %param_4 = s64[] parameter(4)
  %cb.1 = f32[2,2,1,4] broadcast(%param_0.1), dimensions={0,2,3}
  %k1.1 = f32[2,2,1,4] multiply(%param_1.1, %cb.1)
  %k2.1 = f32[2,2,1,4] add(%k1.1, %param_1.1)
  ROOT %nk.1 = f32[2,2,8,4] dynamic-update-slice(%param_2.1, %k2.1, %param_3.1, %param_3.1, %param_4, %param_3.1)
}

ENTRY %main (ck: f32[2,2,8,4], cv: f32[2,2,8,4], k: f32[2,2,1,4], v: f32[2,1,2,4], cs: f32[2,1,4], pos: f32[]) -> (f32[2,2,8,4], f32[2,2,8,4]) {
  %ck = f32[2,2,8,4] parameter(0)
  %cv = f32[2,2,8,4] parameter(1)
  %k = f32[2,2,1,4] parameter(2)
  %v = f32[2,1,2,4] parameter(3)
  %cs = f32[2,1,4] parameter(4)
  %pos = f32[] parameter(5)
  %z = s64[] constant(0)
  %s = s64[] convert(%pos)
  %fusion.1 = f32[2,2,8,4] fusion(%cs, %k, %ck, %z, %s), calls=%fused_computation.1, kind=kLoop
  %fusion = f32[2,2,8,4] fusion(%v, %cv, %z, %s), calls=%fused_computation, kind=kLoop
  ROOT %out = (f32[2,2,8,4], f32[2,2,8,4]) tuple(%fusion.1, %fusion)
}
""")

    def test_both_cache_writes_become_one_fusion(self):
        out, mod = run_pass_checked(MultiOutputFusion(), _fused(KV_WRITE))
        assert _opcodes(mod).count("fusion") == 1
        self.assertExpectedInline(out, """\
HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

%fused_computation.2 (param_0.2: f32[2,1,4], param_1.2: f32[2,2,1,4], param_2.2: f32[2,2,8,4], param_3.2: s64[], param_4.1: s64[], param_5: f32[2,1,2,4], param_6: f32[2,2,8,4]) -> (f32[2,2,8,4], f32[2,2,8,4]) {
  %param_0.2 = f32[2,1,4] parameter(0)
  %param_1.2 = f32[2,2,1,4] parameter(1)
  %param_2.2 = f32[2,2,8,4] parameter(2)
  %param_3.2 = s64[] parameter(3)
  %param_4.1 = s64[] parameter(4)
  %cb.1.1 = f32[2,2,1,4] broadcast(%param_0.2), dimensions={0,2,3}
  %k1.1.1 = f32[2,2,1,4] multiply(%param_1.2, %cb.1.1)
  %k2.1.1 = f32[2,2,1,4] add(%k1.1.1, %param_1.2)
  %nk.1.1 = f32[2,2,8,4] dynamic-update-slice(%param_2.2, %k2.1.1, %param_3.2, %param_3.2, %param_4.1, %param_3.2)
  %param_5 = f32[2,1,2,4] parameter(5)
  %param_6 = f32[2,2,8,4] parameter(6)
  %vt.1.1 = f32[2,2,1,4] transpose(%param_5), dimensions={0,2,1,3}
  %nv.1.1 = f32[2,2,8,4] dynamic-update-slice(%param_6, %vt.1.1, %param_3.2, %param_3.2, %param_4.1, %param_3.2)
  ROOT %tuple = (f32[2,2,8,4], f32[2,2,8,4]) tuple(%nk.1.1, %nv.1.1)
}

ENTRY %main (ck: f32[2,2,8,4], cv: f32[2,2,8,4], k: f32[2,2,1,4], v: f32[2,1,2,4], cs: f32[2,1,4], pos: f32[]) -> (f32[2,2,8,4], f32[2,2,8,4]) {
  %ck = f32[2,2,8,4] parameter(0)
  %cv = f32[2,2,8,4] parameter(1)
  %k = f32[2,2,1,4] parameter(2)
  %v = f32[2,1,2,4] parameter(3)
  %cs = f32[2,1,4] parameter(4)
  %pos = f32[] parameter(5)
  %z = s64[] constant(0)
  %s = s64[] convert(%pos)
  %fusion.2 = (f32[2,2,8,4], f32[2,2,8,4]) fusion(%cs, %k, %ck, %z, %s, %v, %cv), calls=%fused_computation.2, kind=kLoop
  %get-tuple-element = f32[2,2,8,4] get-tuple-element(%fusion.2), index=0
  %get-tuple-element.1 = f32[2,2,8,4] get-tuple-element(%fusion.2), index=1
  ROOT %out = (f32[2,2,8,4], f32[2,2,8,4]) tuple(%get-tuple-element, %get-tuple-element.1)
}
""")

    def test_a_sibling_reshaped_to_the_update_dims_joins_the_cache_writes(self):
        fused = _fused(QKV_WRITE)
        assert _opcodes(parse_module(fused)).count("fusion") == 3
        out, mod = run_pass_checked(MultiOutputFusion(), fused)
        assert _opcodes(mod).count("fusion") == 1 and "reshape" not in _opcodes(mod)
        self.assertExpectedInline(out, """\
HloModule m, num_partitions=1, mesh={tp=1}, is_partitioned=true

%fused_computation.4 (param_0.3: f32[2,2,1,8], param_1.2: f32[2,1,4], param_2.2: f32[2,2,8,4], param_3.2: s64[], param_4.1: s64[], param_5: f32[2,1,2,4], param_6: f32[2,2,8,4]) -> (f32[2,2,1,4], f32[2,2,8,4], f32[2,2,8,4]) {
  %param_0.3 = f32[2,2,1,8] parameter(0)
  %xq.1.1.1 = f32[2,2,1,4] slice(%param_0.3), slice={[0:2:1], [0:2:1], [0:1:1], [0:4:1]}
  %xq5.1.1.1 = f32[2,2,1,2,2] reshape(%xq.1.1.1)
  %e.1.1.1 = f32[2,2,1,2,2] exponential(%xq5.1.1.1)
  %q2.1.1.1 = f32[2,2,1,2,2] multiply(%e.1.1.1, %xq5.1.1.1)
  %qr.1.1 = f32[2,2,1,4] reshape(%q2.1.1.1)
  %param_1.2 = f32[2,1,4] parameter(1)
  %param_2.2 = f32[2,2,8,4] parameter(2)
  %param_3.2 = s64[] parameter(3)
  %param_4.1 = s64[] parameter(4)
  %xk.1.1 = f32[2,2,1,4] slice(%param_0.3), slice={[0:2:1], [0:2:1], [0:1:1], [4:8:1]}
  %cb.1.1 = f32[2,2,1,4] broadcast(%param_1.2), dimensions={0,2,3}
  %k1.1.1 = f32[2,2,1,4] multiply(%xk.1.1, %cb.1.1)
  %k2.1.1 = f32[2,2,1,4] add(%k1.1.1, %xk.1.1)
  %nk.1.1 = f32[2,2,8,4] dynamic-update-slice(%param_2.2, %k2.1.1, %param_3.2, %param_3.2, %param_4.1, %param_3.2)
  %param_5 = f32[2,1,2,4] parameter(5)
  %param_6 = f32[2,2,8,4] parameter(6)
  %vt.1.1 = f32[2,2,1,4] transpose(%param_5), dimensions={0,2,1,3}
  %nv.1.1 = f32[2,2,8,4] dynamic-update-slice(%param_6, %vt.1.1, %param_3.2, %param_3.2, %param_4.1, %param_3.2)
  ROOT %tuple = (f32[2,2,1,4], f32[2,2,8,4], f32[2,2,8,4]) tuple(%qr.1.1, %nk.1.1, %nv.1.1)
}

ENTRY %main (ck: f32[2,2,8,4], cv: f32[2,2,8,4], x: f32[2,2,1,8], v: f32[2,1,2,4], cs: f32[2,1,4], pos: f32[]) -> (f32[2,2,1,4], f32[2,2,8,4], f32[2,2,8,4]) {
  %ck = f32[2,2,8,4] parameter(0)
  %cv = f32[2,2,8,4] parameter(1)
  %x = f32[2,2,1,8] parameter(2)
  %v = f32[2,1,2,4] parameter(3)
  %cs = f32[2,1,4] parameter(4)
  %pos = f32[] parameter(5)
  %z = s64[] constant(0)
  %s = s64[] convert(%pos)
  %fusion.4 = (f32[2,2,1,4], f32[2,2,8,4], f32[2,2,8,4]) fusion(%x, %cs, %ck, %z, %s, %v, %cv), calls=%fused_computation.4, kind=kLoop
  %get-tuple-element = f32[2,2,1,4] get-tuple-element(%fusion.4), index=0
  %get-tuple-element.1 = f32[2,2,8,4] get-tuple-element(%fusion.4), index=1
  %get-tuple-element.2 = f32[2,2,8,4] get-tuple-element(%fusion.4), index=2
  ROOT %out = (f32[2,2,1,4], f32[2,2,8,4], f32[2,2,8,4]) tuple(%get-tuple-element, %get-tuple-element.1, %get-tuple-element.2)
}
""")


def test_update_of_a_dot_is_left_to_the_runtime_peephole():
    text = module(
        ["c: f32[2,8,4]", "x: f32[2,1,3]", "w: f32[3,4]", "pos: f32[]"],
        ["%d = f32[2,1,4] dot(%x, %w), lhs_contracting_dims={2}, rhs_contracting_dims={0}",
         "%z = s64[] constant(0)",
         "%s = s64[] convert(%pos)",
         "ROOT %n = f32[2,8,4] dynamic-update-slice(%c, %d, %z, %s, %z)"],
        "f32[2,8,4]")
    out, _ = run_pass_checked(FuseElementwise(), text)
    assert "fusion" not in out


def test_an_update_of_an_intermediate_value_stays_in_the_arena():
    # buffer assignment runs it in place over its operand; a fusion would copy the whole buffer
    text = KV_WRITE.replace("%nk = f32[2,2,8,4] dynamic-update-slice(%ck, %k2, %z, %z, %s, %z)",
                            "%ckn = f32[2,2,8,4] negate(%ck)\n  %nk = f32[2,2,8,4] dynamic-update-slice(%ckn, %k2, %z, %z, %s, %z)")
    _, mod = run_pass_checked(FuseElementwise(), text)
    updates = [i for i in mod.entry.instructions if i.opcode == "dynamic-update-slice"]
    assert [i.name for i in updates] == ["nk", "nv"]  # and nv, a view update, has no fusing sibling


def test_a_view_update_without_a_fusing_sibling_stays_unfused():
    text = KV_WRITE.replace("%nk = f32[2,2,8,4] dynamic-update-slice(%ck, %k2, %z, %z, %s, %z)",
                            "%nk = f32[2,2,8,4] dynamic-update-slice(%ck, %k, %z, %z, %s, %z)")
    out, mod = run_pass_checked(FuseElementwise(), text)
    assert _opcodes(mod).count("dynamic-update-slice") == 2 and "fusion" not in out


def test_updates_at_different_positions_stay_apart():
    text = KV_WRITE.replace("%s2 = s64[] convert(%pos)", "%s2 = s64[] constant(3)").replace(
        "%vt = f32[2,2,1,4] transpose(%v), dimensions={0,2,1,3}",
        "%vn = f32[2,1,2,4] negate(%v)\n  %vt = f32[2,2,1,4] transpose(%vn), dimensions={0,2,1,3}")
    fused = _fused(text)
    assert _opcodes(parse_module(fused)).count("fusion") == 2
    out, _ = run_pass_checked(MultiOutputFusion(), fused)
    assert out == fused


def _executable(text: str):
    from spmd.passes.assign_buffers import assign_buffers
    from spmd.passes.assign_streams import AssignStreams
    from spmd.passes.schedule import Schedule

    mod = parse_module(text)
    for p in (FuseElementwise(), MultiOutputFusion(), AssignStreams(), Schedule()):
        p.run(mod)
    return mod, Executable(mod, FakeMesh(mod.mesh), assign_buffers(mod))


def _args(mod, pos: float, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p in mod.entry.parameters:
        if p.name == "pos":
            out.append(torch.tensor(pos))
        else:
            out.append(torch.randn(p.shape.dims, generator=gen) + 0.1)
    return out


def test_donated_caches_are_updated_in_place_by_one_kernel():
    from spmd.runtime.thunks import MultiOutputKernelThunk

    plain = parse_module(KV_WRITE)
    mod, ex = _executable(KV_WRITE)
    for pos, seed in ((3.0, 0), (7.9, 1), (-2.0, 2), (40.0, 3)):  # past either end: clamped starts
        args = _args(plain, pos, seed)
        want = [w[0] for w in evaluate_spmd(plain, [[a.clone() for a in args]])]
        per_param = [[a] for a in args]
        ptrs = [args[0].data_ptr(), args[1].data_ptr()]
        got, _ = ex.run(per_param, donated=frozenset({0, 1}))
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w, g[0])
        assert [g[0].data_ptr() for g in got] == ptrs  # written over the donated caches
    program = max(ex._variants.items(), key=lambda kv: len(kv[0]))[1][0]
    fused = [t for t in program.thunks if isinstance(t, MultiOutputKernelThunk)]
    assert len(fused) == 1 and "dynamic-update-slice" not in _opcodes(mod)


def test_undonated_caches_and_a_cache_read_by_its_own_update_keep_their_values():
    # the k update reads the cache it writes (a slice of it): the kernel computes it before storing
    text = KV_WRITE.replace(
        "%k2 = f32[2,2,1,4] add(%k1, %k)",
        "%old = f32[2,2,1,4] slice(%ck), slice={[0:2], [0:2], [5:6], [0:4]}\n  %k2 = f32[2,2,1,4] add(%k1, %old)")
    plain = parse_module(text)
    mod, ex = _executable(text)
    assert _opcodes(mod).count("fusion") == 1
    for donated in (frozenset(), frozenset({0, 1})):
        for pos in (5.0, 2.0):
            args = _args(plain, pos, seed=4)
            want = [w[0] for w in evaluate_spmd(plain, [[a.clone() for a in args]])]
            keep = [a.clone() for a in args]
            got, _ = ex.run([[a] for a in args], donated=donated)
            for w, g in zip(want, got, strict=True):
                assert torch.equal(w, g[0])
            if not donated:
                assert all(torch.equal(a, b) for a, b in zip(args, keep, strict=True))
