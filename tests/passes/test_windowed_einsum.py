"""windowed-einsum: golden HLO text, and numerics equal to the non-decomposed program."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase

from spmd.ir.evaluate import evaluate_spmd
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module
from spmd.passes.windowed_einsum import WindowedEinsum

ADD = """%add (a: {t}[], b: {t}[]) -> {t}[] {{
  %a = {t}[] parameter(0)
  %b = {t}[] parameter(1)
  ROOT %s = {t}[] add(%a, %b)
}}

"""


def _header(p: int, mesh: str | None) -> str:
    return f"HloModule m, num_partitions={p}, mesh={mesh or '{tp=' + str(p) + '}'}, is_partitioned=true\n\n"


def _groups(groups) -> str:
    return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"


def ag_module(kind: str, p: int, c: int, t: str = "f32", k: int = 6, n: int = 5, groups=None, mesh=None) -> str:
    """all-gather (chunk ``c`` rows per device) feeding a dot; ``kind`` = lhs | rhs | batch | qkv."""
    g = _groups(groups or [list(range(p))])
    gp = len((groups or [list(range(p))])[0])
    m = gp * c
    if kind in ("lhs", "qkv"):
        params = [f"x: {t}[{c},{k}]", f"w: {t}[{k},{n}]"]
        body = [f"%x = {t}[{c},{k}] parameter(0)", f"%w = {t}[{k},{n}] parameter(1)",
                f"%ag = {t}[{m},{k}] all-gather(%x), dimensions={{0}}, replica_groups={g}"]
        dot = "lhs_contracting_dims={1}, rhs_contracting_dims={0}"
        if kind == "lhs":
            body.append(f"ROOT %d = {t}[{m},{n}] dot(%ag, %w), {dot}")
            return _wrap(p, mesh, params, body, f"{t}[{m},{n}]")
        params.append(f"v: {t}[{k},3]")
        body += [f"%v = {t}[{k},3] parameter(2)",
                 f"%q = {t}[{m},{n}] dot(%ag, %w), {dot}",
                 f"%kk = {t}[{m},3] dot(%ag, %v), {dot}",
                 f"%e = {t}[{m},{n}] exponential(%q)",
                 f"%vv = {t}[{m},{n}] dot(%ag, %w), {dot}",
                 f"ROOT %out = ({t}[{m},{n}], {t}[{m},3], {t}[{m},{n}]) tuple(%e, %kk, %vv)"]
        return _wrap(p, mesh, params, body, f"({t}[{m},{n}], {t}[{m},3], {t}[{m},{n}])")
    if kind == "rhs":
        params = [f"y: {t}[{n},{k}]", f"x: {t}[{k},{c}]"]
        body = [f"%y = {t}[{n},{k}] parameter(0)", f"%x = {t}[{k},{c}] parameter(1)",
                f"%ag = {t}[{k},{m}] all-gather(%x), dimensions={{1}}, replica_groups={g}",
                f"ROOT %d = {t}[{n},{m}] dot(%y, %ag), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}"]
        return _wrap(p, mesh, params, body, f"{t}[{n},{m}]")
    assert kind == "batch"
    params = [f"x: {t}[{c},3,{k}]", f"y: {t}[{m},{k},{n}]"]
    body = [f"%x = {t}[{c},3,{k}] parameter(0)", f"%y = {t}[{m},{k},{n}] parameter(1)",
            f"%ag = {t}[{m},3,{k}] all-gather(%x), dimensions={{0}}, replica_groups={g}",
            f"ROOT %d = {t}[{m},3,{n}] dot(%ag, %y), lhs_batch_dims={{0}}, rhs_batch_dims={{0}}, "
            "lhs_contracting_dims={2}, rhs_contracting_dims={1}"]
    return _wrap(p, mesh, params, body, f"{t}[{m},3,{n}]")


def rs_module(kind: str, p: int, c: int, t: str = "f32", k: int = 6, n: int = 5, groups=None, mesh=None) -> str:
    """dot feeding a reduce-scatter (``c`` rows per device); ``kind`` = lhs | rhs | batch."""
    gl = groups or [list(range(p))]
    g, m = _groups(gl), len(gl[0]) * c
    a = f"to_apply=%add, replica_groups={g}"
    if kind in ("lhs", "rhs"):
        dims = (m, n) if kind == "lhs" else (n, m)
        out = (c, n) if kind == "lhs" else (n, c)
        params = [f"x: {t}[{dims[0]},{k}]", f"w: {t}[{k},{dims[1]}]"]
        body = [f"%x = {t}[{dims[0]},{k}] parameter(0)", f"%w = {t}[{k},{dims[1]}] parameter(1)",
                f"%d = {t}[{dims[0]},{dims[1]}] dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}",
                f"ROOT %rs = {t}[{out[0]},{out[1]}] reduce-scatter(%d), dimensions={{{0 if kind == 'lhs' else 1}}}, {a}"]
        return _header(p, mesh) + ADD.format(t=t) + _wrap(p, mesh, params, body, f"{t}[{out[0]},{out[1]}]", False)
    params = [f"x: {t}[{m},3,{k}]", f"y: {t}[{m},{k},{n}]"]
    body = [f"%x = {t}[{m},3,{k}] parameter(0)", f"%y = {t}[{m},{k},{n}] parameter(1)",
            f"%d = {t}[{m},3,{n}] dot(%x, %y), lhs_batch_dims={{0}}, rhs_batch_dims={{0}}, "
            "lhs_contracting_dims={2}, rhs_contracting_dims={1}",
            f"ROOT %rs = {t}[{c},3,{n}] reduce-scatter(%d), dimensions={{0}}, {a}"]
    return _header(p, mesh) + ADD.format(t=t) + _wrap(p, mesh, params, body, f"{t}[{c},3,{n}]", False)


def _wrap(p, mesh, params, body, result, header=True) -> str:
    text = f"ENTRY %main ({', '.join(params)}) -> {result} {{\n" + "".join(f"  {b}\n" for b in body) + "}\n"
    return (_header(p, mesh) + text) if header else text


def random_args(module, scale: float = 1.0) -> list[list[torch.Tensor]]:
    """Fresh random per-device parameters (never zeros)."""
    out = []
    for _ in range(module.num_partitions):
        out.append([(torch.randn(pp.shape.dims) * scale + 0.1).to(pp.shape.torch_dtype)
                    for pp in module.entry.parameters])
    return out


def check_numerics(text: str, bidirectional: bool, expect_rewrite: bool = True):
    """Run the pass, verify, and compare every device's outputs to the original program's."""
    ref_mod, mod = parse_module(text), parse_module(text)
    args = random_args(ref_mod)
    want = evaluate_spmd(ref_mod, args)
    WindowedEinsum(mode="on", bidirectional=bidirectional).run(mod)
    verify_module(mod)
    ops = [i.opcode for i in mod.entry.instructions]
    assert ("collective-permute" in ops) == expect_rewrite
    assert ("all-gather" not in ops and "reduce-scatter" not in ops) == expect_rewrite
    got = evaluate_spmd(mod, args)
    tol = 1e-5 if ref_mod.entry.parameters[0].shape.dtype == "f32" else 1e-2
    for w_out, g_out in zip(want, got, strict=True):
        for d, (w, g) in enumerate(zip(w_out, g_out, strict=True)):
            assert g.shape == w.shape and g.dtype == w.dtype
            if tol == 1e-5:
                err = (g.double() - w.double()).abs().max() / w.double().abs().max()
            else:  # bf16: both sides round every partial sum; compare norms, not the worst element
                err = (g.double() - w.double()).norm() / w.double().norm()
            assert err < tol, f"device {d}: relative error {err}"
    return mod


# --------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("kind", ["lhs", "rhs", "batch"])
def test_all_gather_numerics(kind, bidirectional, p):
    check_numerics(ag_module(kind, p, c=7 if kind != "batch" else 3), bidirectional)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("kind", ["lhs", "rhs", "batch"])
def test_reduce_scatter_numerics(kind, bidirectional, p):
    check_numerics(rs_module(kind, p, c=7 if kind != "batch" else 3), bidirectional)


@pytest.mark.parametrize("t", ["f32", "bf16"])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("p", [2, 4])
def test_many_rows_per_device(p, bidirectional, t):
    """Chunks of > 1024 rows that are not powers of two, f32 and bf16."""
    check_numerics(ag_module("lhs", p, c=1030, t=t, k=24, n=20), bidirectional)
    check_numerics(rs_module("lhs", p, c=1030, t=t, k=24, n=20), bidirectional)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_bf16_on_eight_devices(bidirectional):
    check_numerics(ag_module("rhs", 8, c=1027, t="bf16", k=16, n=12), bidirectional)
    check_numerics(rs_module("batch", 8, c=5, t="bf16", k=16, n=12), bidirectional)


@pytest.mark.parametrize("axis", ["tp", "dp"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_two_dim_mesh(axis, bidirectional):
    """Replica groups of a {dp=2,tp=3} mesh: rings of 3 (tp) or of 2 (dp) devices."""
    groups = [[0, 1, 2], [3, 4, 5]] if axis == "tp" else [[0, 3], [1, 4], [2, 5]]
    mesh = "{dp=2,tp=3}"
    mod = check_numerics(ag_module("lhs", 6, c=5, groups=groups, mesh=mesh), bidirectional)
    assert any(i.opcode == "constant" and i.shape.dims == (6,) for i in mod.entry.instructions)
    check_numerics(rs_module("rhs", 6, c=5, groups=groups, mesh=mesh), bidirectional)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_one_ring_for_several_dots(bidirectional):
    p = 4
    mod = check_numerics(ag_module("qkv", p, c=5), bidirectional)
    permutes = [i for i in mod.entry.instructions if i.opcode == "collective-permute"]
    assert len(permutes) == (p - 1) * (2 if bidirectional else 1)
    dots = [i for i in mod.entry.instructions if i.opcode == "dot"]
    assert len(dots) == 3 * p * (2 if bidirectional else 1)


def test_bidirectional_chunk_of_one_row_falls_back_to_unidirectional():
    mod = check_numerics(ag_module("lhs", 3, c=1), True)
    assert sum(i.opcode == "collective-permute" for i in mod.entry.instructions) == 2


def test_contracted_gather_is_left_alone():
    text = _header(2, None) + """ENTRY %main (x: f32[4,3], w: f32[6,5]) -> f32[4,5] {
  %x = f32[4,3] parameter(0)
  %w = f32[6,5] parameter(1)
  %ag = f32[4,6] all-gather(%x), dimensions={1}, replica_groups={{0,1}}
  ROOT %d = f32[4,5] dot(%ag, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    mod = parse_module(text)
    WindowedEinsum(mode="on").run(mod)
    assert print_module(mod) == text


def test_all_gather_with_a_non_dot_user_is_left_alone():
    text = ag_module("lhs", 2, 4).replace("ROOT %d = f32[8,5] dot(%ag, %w), lhs_contracting_dims={1}, "
                                          "rhs_contracting_dims={0}",
                                          "%d = f32[8,5] dot(%ag, %w), lhs_contracting_dims={1}, "
                                          "rhs_contracting_dims={0}\n  %n = f32[8,6] negate(%ag)\n"
                                          "  ROOT %t = (f32[8,5], f32[8,6]) tuple(%d, %n)")
    text = text.replace("-> f32[8,5]", "-> (f32[8,5], f32[8,6])")
    mod = parse_module(text)
    WindowedEinsum(mode="on").run(mod)
    assert print_module(mod) == text


def test_mode_off_and_errors():
    text = ag_module("lhs", 2, 4)
    mod = parse_module(text)
    WindowedEinsum(mode="off").run(mod)
    assert print_module(mod) == text
    with pytest.raises(ValueError, match="mode"):
        WindowedEinsum(mode="sometimes")
    unpart = parse_module(text.replace(", is_partitioned=true", ""))
    with pytest.raises(ValueError, match="not partitioned"):
        WindowedEinsum().run(unpart)


def test_auto_follows_the_cost_model():
    """Tiny GEMMs stay serial; a GEMM-heavy bf16 site on 2×H200 is decomposed."""
    small = parse_module(ag_module("lhs", 2, 4, t="bf16"))
    WindowedEinsum(mode="auto").run(small)
    assert not any(i.opcode == "collective-permute" for i in small.entry.instructions)
    big = parse_module(ag_module("lhs", 2, 4096, t="bf16", k=12288, n=24576))
    WindowedEinsum(mode="auto").run(big)
    verify_module(big)
    assert sum(i.opcode == "collective-permute" for i in big.entry.instructions) >= 1
    big_rs = parse_module(rs_module("lhs", 2, 4096, t="bf16", k=6144, n=49152))
    WindowedEinsum(mode="auto").run(big_rs)
    assert not any(i.opcode == "reduce-scatter" for i in big_rs.entry.instructions)


# Sites whose dot has no elements in M (chunk c = 0), N (n = 0) or the contraction (k = 0).
EMPTY_SITES = [("ag", "lhs", 0, 6, 5), ("ag", "lhs", 2, 6, 0), ("ag", "lhs", 2, 0, 5), ("ag", "rhs", 0, 6, 5),
               ("ag", "batch", 0, 6, 5), ("ag", "qkv", 0, 6, 5), ("ag", "qkv", 2, 0, 5),
               ("rs", "lhs", 0, 6, 5), ("rs", "rhs", 2, 6, 0), ("rs", "lhs", 2, 0, 5), ("rs", "batch", 0, 6, 5)]


@pytest.mark.parametrize("bidirectional", [None, False, True])
@pytest.mark.parametrize("mode", ["auto", "on"])
@pytest.mark.parametrize("side, kind, c, k, n", EMPTY_SITES)
def test_a_dot_with_no_elements_is_never_windowed(side, kind, c, k, n, mode, bidirectional):
    """Nothing to overlap: an empty gathered chunk, result or operand leaves the site as it is."""
    text = (ag_module if side == "ag" else rs_module)(kind, 4, c, k=k, n=n)
    mod = parse_module(text)
    WindowedEinsum(mode=mode, bidirectional=bidirectional).run(mod)
    verify_module(mod)
    assert print_module(mod) == text


# --------------------------------------------------------------------------- golden text
class GoldenTest(TestCase):
    def _run(self, text: str, bidirectional: bool) -> str:
        mod = parse_module(text)
        WindowedEinsum(mode="on", bidirectional=bidirectional).run(mod)
        verify_module(mod)
        out = print_module(mod)
        self.assertEqual(print_module(parse_module(out)), out)
        return out.split("ENTRY", 1)[1]

    def test_all_gather_p2_uni(self):
        self.assertExpectedInline(self._run(ag_module("lhs", 2, 4), False), """\
 %main (x: f32[4,6], w: f32[6,5]) -> f32[8,5] {
  %x = f32[4,6] parameter(0)
  %w = f32[6,5] parameter(1)
  %pid = u32[] partition-id()
  %pid.s32 = s32[] convert(%pid)
  %f32.0 = f32[] constant(0.0)
  %d.init = f32[8,5] broadcast(%f32.0), dimensions={}
  %c4 = s32[] constant(4)
  %ag.off0 = s32[] multiply(%pid.s32, %c4)
  %ag.chunk1 = f32[4,6] collective-permute(%x), source_target_pairs={{0,1},{1,0}}
  %d.0 = f32[4,5] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":0}
  %zero = s32[] constant(0)
  %d.acc0 = f32[8,5] dynamic-update-slice(%d.init, %d.0, %ag.off0, %zero)
  %c1 = s32[] constant(1)
  %ag.off1.sum = s32[] add(%pid.s32, %c1)
  %c2 = s32[] constant(2)
  %ag.off1.idx = s32[] remainder(%ag.off1.sum, %c2)
  %ag.off1 = s32[] multiply(%ag.off1.idx, %c4)
  %d.1 = f32[4,5] dot(%ag.chunk1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":1}
  ROOT %d = f32[8,5] dynamic-update-slice(%d.acc0, %d.1, %ag.off1, %zero)
}
""")

    def test_all_gather_p4_bi(self):
        self.assertExpectedInline(self._run(ag_module("lhs", 4, 4), True), """\
 %main (x: f32[4,6], w: f32[6,5]) -> f32[16,5] {
  %x = f32[4,6] parameter(0)
  %w = f32[6,5] parameter(1)
  %pid = u32[] partition-id()
  %pid.s32 = s32[] convert(%pid)
  %ag.cw0 = f32[2,6] slice(%x), slice={[0:2:1], [0:6:1]}
  %ag.ccw0 = f32[2,6] slice(%x), slice={[2:4:1], [0:6:1]}
  %f32.0 = f32[] constant(0.0)
  %d.init = f32[16,5] broadcast(%f32.0), dimensions={}
  %c4 = s32[] constant(4)
  %ag.off0 = s32[] multiply(%pid.s32, %c4)
  %c2 = s32[] constant(2)
  %ag.off0h = s32[] add(%ag.off0, %c2)
  %ag.cw1 = f32[2,6] collective-permute(%ag.cw0), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %ag.ccw1 = f32[2,6] collective-permute(%ag.ccw0), source_target_pairs={{0,3},{1,0},{2,1},{3,2}}
  %d.cw0 = f32[2,5] dot(%ag.cw0, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":0}
  %zero = s32[] constant(0)
  %d.cwacc0 = f32[16,5] dynamic-update-slice(%d.init, %d.cw0, %ag.off0, %zero)
  %d.ccw0 = f32[2,5] dot(%ag.ccw0, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":0}
  %d.ccwacc0 = f32[16,5] dynamic-update-slice(%d.cwacc0, %d.ccw0, %ag.off0h, %zero)
  %c3 = s32[] constant(3)
  %ag.off3.sum = s32[] add(%pid.s32, %c3)
  %ag.off3.idx = s32[] remainder(%ag.off3.sum, %c4)
  %ag.off3 = s32[] multiply(%ag.off3.idx, %c4)
  %c1 = s32[] constant(1)
  %ag.off1.sum = s32[] add(%pid.s32, %c1)
  %ag.off1.idx = s32[] remainder(%ag.off1.sum, %c4)
  %ag.off1 = s32[] multiply(%ag.off1.idx, %c4)
  %ag.off1h = s32[] add(%ag.off1, %c2)
  %ag.cw2 = f32[2,6] collective-permute(%ag.cw1), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %ag.ccw2 = f32[2,6] collective-permute(%ag.ccw1), source_target_pairs={{0,3},{1,0},{2,1},{3,2}}
  %d.cw1 = f32[2,5] dot(%ag.cw1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":1}
  %d.cwacc1 = f32[16,5] dynamic-update-slice(%d.ccwacc0, %d.cw1, %ag.off3, %zero)
  %d.ccw1 = f32[2,5] dot(%ag.ccw1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":1}
  %d.ccwacc1 = f32[16,5] dynamic-update-slice(%d.cwacc1, %d.ccw1, %ag.off1h, %zero)
  %ag.off2.sum = s32[] add(%pid.s32, %c2)
  %ag.off2.idx = s32[] remainder(%ag.off2.sum, %c4)
  %ag.off2 = s32[] multiply(%ag.off2.idx, %c4)
  %ag.off2h = s32[] add(%ag.off2, %c2)
  %ag.cw3 = f32[2,6] collective-permute(%ag.cw2), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %ag.ccw3 = f32[2,6] collective-permute(%ag.ccw2), source_target_pairs={{0,3},{1,0},{2,1},{3,2}}
  %d.cw2 = f32[2,5] dot(%ag.cw2, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":2}
  %d.cwacc2 = f32[16,5] dynamic-update-slice(%d.ccwacc1, %d.cw2, %ag.off2, %zero)
  %d.ccw2 = f32[2,5] dot(%ag.ccw2, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":2}
  %d.ccwacc2 = f32[16,5] dynamic-update-slice(%d.cwacc2, %d.ccw2, %ag.off2h, %zero)
  %ag.off3h = s32[] add(%ag.off3, %c2)
  %d.cw3 = f32[2,5] dot(%ag.cw3, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":3}
  %d.cwacc3 = f32[16,5] dynamic-update-slice(%d.ccwacc2, %d.cw3, %ag.off1, %zero)
  %d.ccw3 = f32[2,5] dot(%ag.ccw3, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":3}
  ROOT %d = f32[16,5] dynamic-update-slice(%d.cwacc3, %d.ccw3, %ag.off3h, %zero)
}
""")

    def test_reduce_scatter_p2_bi(self):
        self.assertExpectedInline(self._run(rs_module("lhs", 2, 4), True), """\
 %main (x: f32[8,6], w: f32[6,5]) -> f32[4,5] {
  %x = f32[8,6] parameter(0)
  %w = f32[6,5] parameter(1)
  %pid = u32[] partition-id()
  %pid.s32 = s32[] convert(%pid)
  %c1 = s32[] constant(1)
  %rs.off1.sum = s32[] add(%pid.s32, %c1)
  %c2 = s32[] constant(2)
  %rs.off1.idx = s32[] remainder(%rs.off1.sum, %c2)
  %c4 = s32[] constant(4)
  %rs.off1 = s32[] multiply(%rs.off1.idx, %c4)
  %zero = s32[] constant(0)
  %d.cwlhs0 = f32[2,6] dynamic-slice(%x, %rs.off1, %zero), dynamic_slice_sizes={2,6}
  %d.cw0 = f32[2,5] dot(%d.cwlhs0, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":0}
  %rs.off1h = s32[] add(%rs.off1, %c2)
  %d.ccwlhs0 = f32[2,6] dynamic-slice(%x, %rs.off1h, %zero), dynamic_slice_sizes={2,6}
  %d.ccw0 = f32[2,5] dot(%d.ccwlhs0, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":0}
  %rs.cwrecv1 = f32[2,5] collective-permute(%d.cw0), source_target_pairs={{0,1},{1,0}}
  %rs.off0 = s32[] multiply(%pid.s32, %c4)
  %d.cwlhs1 = f32[2,6] dynamic-slice(%x, %rs.off0, %zero), dynamic_slice_sizes={2,6}
  %d.cw1 = f32[2,5] dot(%d.cwlhs1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":1,"accumulate":true}
  %rs.cwacc1 = f32[2,5] add(%d.cw1, %rs.cwrecv1)
  %rs.ccwrecv1 = f32[2,5] collective-permute(%d.ccw0), source_target_pairs={{0,1},{1,0}}
  %rs.off0h = s32[] add(%rs.off0, %c2)
  %d.ccwlhs1 = f32[2,6] dynamic-slice(%x, %rs.off0h, %zero), dynamic_slice_sizes={2,6}
  %d.ccw1 = f32[2,5] dot(%d.ccwlhs1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":1,"accumulate":true}
  %rs.ccwacc1 = f32[2,5] add(%d.ccw1, %rs.ccwrecv1)
  %f32.0 = f32[] constant(0.0)
  %rs.init = f32[4,5] broadcast(%f32.0), dimensions={}
  %rs.cwout = f32[4,5] dynamic-update-slice(%rs.init, %rs.cwacc1, %zero, %zero)
  ROOT %rs = f32[4,5] dynamic-update-slice(%rs.cwout, %rs.ccwacc1, %c2, %zero)
}
""")

    def test_reduce_scatter_p4_uni(self):
        self.assertExpectedInline(self._run(rs_module("lhs", 4, 2), False), """\
 %main (x: f32[8,6], w: f32[6,5]) -> f32[2,5] {
  %x = f32[8,6] parameter(0)
  %w = f32[6,5] parameter(1)
  %pid = u32[] partition-id()
  %pid.s32 = s32[] convert(%pid)
  %c3 = s32[] constant(3)
  %rs.off3.sum = s32[] add(%pid.s32, %c3)
  %c4 = s32[] constant(4)
  %rs.off3.idx = s32[] remainder(%rs.off3.sum, %c4)
  %c2 = s32[] constant(2)
  %rs.off3 = s32[] multiply(%rs.off3.idx, %c2)
  %zero = s32[] constant(0)
  %d.lhs0 = f32[2,6] dynamic-slice(%x, %rs.off3, %zero), dynamic_slice_sizes={2,6}
  %d.0 = f32[2,5] dot(%d.lhs0, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":0}
  %rs.recv1 = f32[2,5] collective-permute(%d.0), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %rs.off2.sum = s32[] add(%pid.s32, %c2)
  %rs.off2.idx = s32[] remainder(%rs.off2.sum, %c4)
  %rs.off2 = s32[] multiply(%rs.off2.idx, %c2)
  %d.lhs1 = f32[2,6] dynamic-slice(%x, %rs.off2, %zero), dynamic_slice_sizes={2,6}
  %d.1 = f32[2,5] dot(%d.lhs1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":1}
  %rs.acc1 = f32[2,5] add(%d.1, %rs.recv1)
  %rs.recv2 = f32[2,5] collective-permute(%rs.acc1), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %c1 = s32[] constant(1)
  %rs.off1.sum = s32[] add(%pid.s32, %c1)
  %rs.off1.idx = s32[] remainder(%rs.off1.sum, %c4)
  %rs.off1 = s32[] multiply(%rs.off1.idx, %c2)
  %d.lhs2 = f32[2,6] dynamic-slice(%x, %rs.off1, %zero), dynamic_slice_sizes={2,6}
  %d.2 = f32[2,5] dot(%d.lhs2, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":2}
  %rs.acc2 = f32[2,5] add(%d.2, %rs.recv2)
  %rs.recv3 = f32[2,5] collective-permute(%rs.acc2), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %rs.off0 = s32[] multiply(%pid.s32, %c2)
  %d.lhs3 = f32[2,6] dynamic-slice(%x, %rs.off0, %zero), dynamic_slice_sizes={2,6}
  %d.3 = f32[2,5] dot(%d.lhs3, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"windowed_einsum":3}
  ROOT %rs = f32[2,5] add(%d.3, %rs.recv3)
}
""")
