"""views: which layout-changing instructions run as views (golden lists), and the bytes they free."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

from expecttest import TestCase

from spmd.ir.text import parse_module
from spmd.passes.assign_buffers import assign_buffers
from spmd.passes.views import (
    FOLD_MAX_NUMEL,
    VIEW_OPCODES,
    analyze_views,
    reads_strided,
    view_instructions,
    view_result_strides,
)
from spmd.runtime import lower as lower_mod

# The block workload of benchmarks/workloads.py on 2 devices after the pipeline (shardings and
# metadata stripped): the program the lowering of tests/runtime/test_views_runtime.py counts.
BLOCK_2DEV = """HloModule block, num_partitions=2, mesh={tp=2}, is_partitioned=true

%add.f32 (add.f32.lhs: f32[], add.f32.rhs: f32[]) -> f32[] {
  %add.f32.lhs = f32[] parameter(0)
  %add.f32.rhs = f32[] parameter(1)
  ROOT %add.f32.out = f32[] add(%add.f32.lhs, %add.f32.rhs)
}

ENTRY %main (x: f32[128,512], wq: f32[512,256], wk: f32[512,256], wv: f32[512,256], wo: f32[256,512], w1: f32[512,1024], w2: f32[1024,512]) -> f32[128,512] {
  %x = f32[128,512] parameter(0)
  %wq = f32[512,256] parameter(1)
  %wk = f32[512,256] parameter(2)
  %wv = f32[512,256] parameter(3)
  %wo = f32[256,512] parameter(4)
  %w1 = f32[512,1024] parameter(5)
  %w2 = f32[1024,512] parameter(6)
  %layer_norm = f32[128,512] custom-call(%x), custom_call_target="layer-norm", backend_config={"normalized_ndim":1,"eps":1e-05}, stream_id=0
  %matmul = f32[128,256] dot(%layer_norm, %wq), lhs_contracting_dims={1}, rhs_contracting_dims={0}, stream_id=0
  %reshape = f32[128,4,64] reshape(%matmul), stream_id=0
  %transpose = f32[4,128,64] transpose(%reshape), dimensions={1,0,2}, stream_id=0
  %matmul_1 = f32[128,256] dot(%layer_norm, %wk), lhs_contracting_dims={1}, rhs_contracting_dims={0}, stream_id=0
  %reshape_1 = f32[128,4,64] reshape(%matmul_1), stream_id=0
  %transpose_1 = f32[4,128,64] transpose(%reshape_1), dimensions={1,0,2}, stream_id=0
  %matmul_2 = f32[128,256] dot(%layer_norm, %wv), lhs_contracting_dims={1}, rhs_contracting_dims={0}, stream_id=0
  %reshape_2 = f32[128,4,64] reshape(%matmul_2), stream_id=0
  %transpose_2 = f32[4,128,64] transpose(%reshape_2), dimensions={1,0,2}, stream_id=0
  %transpose_3 = f32[4,64,128] transpose(%transpose_1), dimensions={0,2,1}, stream_id=0
  %matmul_3 = f32[4,128,128] dot(%transpose, %transpose_3), lhs_batch_dims={0}, rhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_contracting_dims={1}, stream_id=0
  %div = f32[] constant(8.0), stream_id=0
  %div.1 = f32[4,128,128] broadcast(%div), dimensions={}, stream_id=0
  %div.2 = f32[4,128,128] divide(%matmul_3, %div.1), stream_id=0
  %softmax = f32[4,128,128] custom-call(%div.2), custom_call_target="softmax", backend_config={"dim":2}, stream_id=0
  %matmul_4 = f32[4,128,64] dot(%softmax, %transpose_2), lhs_batch_dims={0}, rhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_contracting_dims={1}, stream_id=0
  %transpose_4 = f32[128,4,64] transpose(%matmul_4), dimensions={1,0,2}, stream_id=0
  %reshape_3 = f32[128,256] reshape(%transpose_4), stream_id=0
  %matmul_5 = f32[128,512] dot(%reshape_3, %wo), lhs_contracting_dims={1}, rhs_contracting_dims={0}, stream_id=0
  %all-reduce = f32[128,512] all-reduce(%matmul_5), to_apply=%add.f32, replica_groups={{0,1}}, stream_id=0
  %add = f32[128,512] add(%x, %all-reduce), stream_id=0
  %layer_norm_1 = f32[128,512] custom-call(%add), custom_call_target="layer-norm", backend_config={"normalized_ndim":1,"eps":1e-05}, stream_id=0
  %matmul_6 = f32[128,1024] dot(%layer_norm_1, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, stream_id=0
  %gelu = f32[128,1024] custom-call(%matmul_6), custom_call_target="gelu", backend_config={"approximate":"none"}, stream_id=0
  %matmul_7 = f32[128,512] dot(%gelu, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, stream_id=0
  %all-reduce.1 = f32[128,512] all-reduce(%matmul_7), to_apply=%add.f32, replica_groups={{0,1}}, stream_id=0
  ROOT %add_1 = f32[128,512] add(%add, %all-reduce.1), stream_id=0
}
"""
SUM = """%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

"""


def _module(params: list[str], body: list[str], result: str, p: int = 2, prefix: str = "") -> str:
    """A partitioned module text: ``params`` are 'name: shape', ``body`` the lines after the parameters."""
    lines = [f"%{n} = {s} parameter({k})" for k, (n, s) in enumerate(x.split(": ") for x in params)]
    text = "\n".join(f"  {ln}" for ln in [*lines, *body])
    return (f"HloModule m, num_partitions={p}, mesh={{tp={p}}}, is_partitioned=true\n\n{prefix}"
            f"ENTRY %main ({', '.join(params)}) -> {result} {{\n{text}\n}}\n")


def _describe(text: str) -> str:
    """One line per reshape / transpose / broadcast / slice: view (with its strides) or copy."""
    module = parse_module(text)
    a = analyze_views(module)
    lines = []
    for inst in module.entry.instructions:
        if inst.opcode in VIEW_OPCODES:
            kind = f"view strides={a.strides[inst.name]}" if inst.name in a.views else "copy"
            lines.append(f"{inst.name} ({inst.opcode}): {kind}")
    return "\n".join(lines)


X = "x: f32[8,12]"


class GoldenTest(TestCase):
    def test_block_two_devices(self):
        self.assertExpectedInline(_describe(BLOCK_2DEV), """\
reshape (reshape): view strides=(256, 64, 1)
transpose (transpose): view strides=(64, 256, 1)
reshape_1 (reshape): view strides=(256, 64, 1)
transpose_1 (transpose): view strides=(64, 256, 1)
reshape_2 (reshape): view strides=(256, 64, 1)
transpose_2 (transpose): view strides=(64, 256, 1)
transpose_3 (transpose): view strides=(64, 1, 256)
div.1 (broadcast): view strides=(0, 0, 0)
transpose_4 (transpose): view strides=(64, 8192, 1)
reshape_3 (reshape): copy""")

    def test_reshape_of_contiguous_value_is_a_view(self):
        self.assertExpectedInline(_describe(_module([X], [
            "%a = f32[8,12] negate(%x)",
            "%r = f32[2,4,12] reshape(%a)",
            "ROOT %e = f32[2,4,12] exponential(%r)"], "f32[2,4,12]")), """\
r (reshape): view strides=(48, 12, 1)""")

    def test_reshape_of_a_transposed_view_is_a_copy(self):
        self.assertExpectedInline(_describe(_module([X], [
            "%a = f32[8,12] negate(%x)",
            "%t = f32[12,8] transpose(%a), dimensions={1,0}",
            "%r = f32[96] reshape(%t)",
            "ROOT %e = f32[96] exponential(%r)"], "f32[96]")), """\
t (transpose): view strides=(1, 12)
r (reshape): copy""")

    def test_reshape_that_splits_a_transposed_dim_stays_a_view(self):
        self.assertExpectedInline(_describe(_module([X], [
            "%a = f32[8,12] negate(%x)",
            "%t = f32[12,8] transpose(%a), dimensions={1,0}",
            "%r = f32[3,4,8] reshape(%t)",
            "ROOT %e = f32[3,4,8] exponential(%r)"], "f32[3,4,8]")), """\
t (transpose): view strides=(1, 12)
r (reshape): view strides=(4, 1, 12)""")

    def test_transpose_feeding_an_all_reduce_is_a_copy(self):
        self.assertExpectedInline(_describe(_module([X], [
            "%a = f32[8,12] negate(%x)",
            "%t = f32[12,8] transpose(%a), dimensions={1,0}",
            "%ar = f32[12,8] all-reduce(%t), to_apply=%sum, replica_groups={{0,1}}",
            "ROOT %e = f32[12,8] exponential(%ar)"], "f32[12,8]", prefix=SUM)), """\
t (transpose): copy""")

    def test_view_feeding_root_is_a_copy(self):
        self.assertExpectedInline(_describe(_module([X], [
            "%a = f32[8,12] negate(%x)",
            "%t = f32[12,8] transpose(%a), dimensions={1,0}",
            "%r = f32[96] reshape(%a)",
            "ROOT %out = (f32[12,8], f32[96]) tuple(%t, %r)"], "(f32[12,8], f32[96])")), """\
t (transpose): copy
r (reshape): copy""")
        self.assertExpectedInline(_describe(_module([X], [
            "%a = f32[8,12] negate(%x)",
            "ROOT %r = f32[96] reshape(%a)"], "f32[96]")), """\
r (reshape): copy""")

    def test_broadcast_of_a_constant_feeding_divide_is_a_view(self):
        self.assertExpectedInline(_describe(_module(["x: f32[64,64]"], [
            "%c = f32[] constant(8.0)",
            "%b = f32[64,64] broadcast(%c), dimensions={}",
            "%small = f32[8,8] broadcast(%c), dimensions={}",
            "%d = f32[64,64] divide(%x, %b)",
            "%s = f32[8,8] slice(%d), slice={[0:8:1], [0:8:1]}",
            "ROOT %m = f32[8,8] multiply(%s, %small)"], "f32[8,8]")), """\
b (broadcast): view strides=(0, 0)
small (broadcast): copy
s (slice): view strides=(64, 1)""")  # %small is folded at lowering time (persistent), not a view

    def test_dynamic_update_slice_reads_a_view_update_but_never_updates_a_view(self):
        self.assertExpectedInline(_describe(_module([X, "y: f32[12,8]"], [
            "%zero = s32[] constant(0)",
            "%a = f32[8,12] negate(%x)",
            "%t = f32[12,8] transpose(%a), dimensions={1,0}",
            "%u = f32[12,8] dynamic-update-slice(%t, %y, %zero, %zero)",
            "%t2 = f32[12,8] transpose(%a), dimensions={1,0}",
            "%v = f32[12,8] dynamic-update-slice(%y, %t2, %zero, %zero)",
            "ROOT %r = f32[12,8] add(%u, %v)"], "f32[12,8]")), """\
t (transpose): copy
t2 (transpose): view strides=(1, 12)""")

    def test_async_start_and_collective_permute_operands_are_copies(self):
        body = """%body (p: f32[12,8], q: f32[8,12]) -> f32[12,12] {
  %p = f32[12,8] parameter(0)
  %q = f32[8,12] parameter(1)
  ROOT %d = f32[12,12] dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

"""
        self.assertExpectedInline(_describe(_module([X], [
            "%a = f32[8,12] negate(%x)",
            "%t = f32[12,8] transpose(%a), dimensions={1,0}",
            "%s = ((f32[12,8], f32[8,12]), f32[12,12]) async-start(%t, %x), calls=%body, stream_id=1",
            "%t2 = f32[12,8] transpose(%a), dimensions={1,0}",
            "%cp = (f32[12,8], f32[12,8]) collective-permute-start(%t2), source_target_pairs={{0,1},{1,0}}, stream_id=2",
            "%cpd = f32[12,8] collective-permute-done(%cp), stream_id=2",
            "%d = f32[12,12] async-done(%s), stream_id=1",
            "%e = f32[12,8] exponential(%cpd)",
            "ROOT %r = (f32[12,12], f32[12,8]) tuple(%d, %e)"], "(f32[12,12], f32[12,8])", prefix=body)), """\
t (transpose): copy
t2 (transpose): copy""")

    def test_view_chains(self):
        self.assertExpectedInline(_describe(_module(["x: f32[16,12]", "w: f32[4,5]"], [
            "%a = f32[16,12] negate(%x)",
            "%r = f32[4,4,12] reshape(%a)",
            "%t = f32[12,4,4] transpose(%r), dimensions={2,1,0}",
            "%s = f32[6,4,4] slice(%t), slice={[0:12:2], [0:4:1], [0:4:1]}",
            "%d = f32[6,4,5] dot(%s, %w), lhs_contracting_dims={2}, rhs_contracting_dims={0}",
            "%s2 = f32[4,12] slice(%a), slice={[0:8:2], [0:12:1]}",
            "%r2 = f32[48] reshape(%s2)",
            "%r3 = f32[2,2,12] reshape(%s2)",
            "%e2 = f32[48] exponential(%r2)",
            "%e3 = f32[2,2,12] exponential(%r3)",
            "ROOT %out = (f32[6,4,5], f32[48], f32[2,2,12]) tuple(%d, %e2, %e3)"],
            "(f32[6,4,5], f32[48], f32[2,2,12])")), """\
r (reshape): view strides=(48, 12, 1)
t (transpose): view strides=(1, 12, 48)
s (slice): view strides=(2, 12, 48)
s2 (slice): view strides=(24, 1)
r2 (reshape): copy
r3 (reshape): view strides=(48, 24, 1)""")

    def test_reshape_of_an_output_or_a_parameter_slice_has_no_known_layout(self):
        self.assertExpectedInline(_describe(_module([X], [
            "%a = f32[8,12] negate(%x)",
            "%r = f32[96] reshape(%a)",
            "%t = f32[12,8] transpose(%a), dimensions={1,0}",
            "%ps = f32[4,12] slice(%x), slice={[0:4:1], [0:12:1]}",
            "%cp = (f32[4,12], f32[4,12]) collective-permute-start(%ps), source_target_pairs={{0,1},{1,0}}, stream_id=2",
            "%cpd = f32[4,12] collective-permute-done(%cp), stream_id=2",
            "%pr = f32[48] reshape(%ps)",
            "%e = f32[96] exponential(%r)",
            "%f = f32[12,8] exponential(%t)",
            "%g = f32[48] exponential(%pr)",
            "%h = f32[4,12] exponential(%cpd)",
            "ROOT %out = (f32[8,12], f32[96], f32[12,8], f32[48], f32[4,12]) tuple(%a, %e, %f, %g, %h)"],
            "(f32[8,12], f32[96], f32[12,8], f32[48], f32[4,12])")), """\
r (reshape): copy
t (transpose): view strides=None
ps (slice): copy
pr (reshape): copy""")

    def test_custom_calls(self):
        self.assertExpectedInline(_describe(_module([X], [
            "%a = f32[8,12] negate(%x)",
            "%t = f32[12,8] transpose(%a), dimensions={1,0}",
            "%t2 = f32[12,8] transpose(%a), dimensions={1,0}",
            '%s = f32[12,8] custom-call(%t), custom_call_target="softmax", backend_config={"dim":1}',
            '%c = f32[12,8] custom-call(%t2), custom_call_target="Sharding"',
            "ROOT %r = f32[12,8] add(%s, %c)"], "f32[12,8]")), """\
t (transpose): view strides=(1, 12)
t2 (transpose): copy""")


def test_views_get_no_bytes_and_keep_their_source_live():
    """%t views %a; %a stays live until %t's last reader, so %b and %c cannot take its bytes."""
    m = parse_module(_module(["x: f32[64,64]"], [
        "%a = f32[64,64] negate(%x)",
        "%t = f32[64,64] transpose(%a), dimensions={1,0}",
        "%b = f32[64,64] exponential(%x)",
        "%c = f32[64,64] negate(%b)",
        "%d = f32[64,64] add(%t, %c)",
        "ROOT %r = f32[64,64] exponential(%d)"], "f32[64,64]"))
    assert view_instructions(m) == {"t"}
    ba = assign_buffers(m)
    assert "t" not in ba.offsets_bytes
    assert ba.offsets_bytes["a"] not in (ba.offsets_bytes["b"], ba.offsets_bytes["c"])
    # a and b are dead at %d's write; %c is read in place by %d (an add over its last access)
    assert ba.offsets_bytes["d"] in (ba.offsets_bytes["a"], ba.offsets_bytes["b"], ba.offsets_bytes["c"])


def test_view_read_on_an_unjoined_stream_keeps_its_source_live():
    """%d reads %a through %t on stream 1, never joined back before %b / %c on stream 0."""
    m = parse_module(_module(["x: f32[64,64]", "w: f32[64,64]"], [
        "%a = f32[64,64] negate(%x), stream_id=0",
        "%t = f32[64,64] transpose(%a), dimensions={1,0}, stream_id=0",
        "%d = f32[64,64] dot(%t, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, stream_id=1",
        "%b = f32[64,64] exponential(%x), stream_id=0",
        "%c = f32[64,64] negate(%b), stream_id=0",
        "%e = f32[64,64] exponential(%c), stream_id=0",
        "ROOT %r = (f32[64,64], f32[64,64]) tuple(%d, %e), stream_id=0"], "(f32[64,64], f32[64,64])"))
    ba = assign_buffers(m)
    assert "t" not in ba.offsets_bytes
    assert ba.offsets_bytes["a"] not in (ba.offsets_bytes["b"], ba.offsets_bytes["c"])


def test_dynamic_update_slice_is_not_in_place_over_a_viewed_value():
    m = parse_module(_module(["x: f32[64,64]", "y: f32[8,64]"], [
        "%zero = s32[] constant(0)",
        "%a = f32[64,64] negate(%x)",
        "%t = f32[64,64] transpose(%a), dimensions={1,0}",
        "%u = f32[64,64] dynamic-update-slice(%a, %y, %zero, %zero)",
        "%s = f32[64,64] add(%u, %t)",
        "ROOT %r = f32[64,64] exponential(%s)"], "f32[64,64]"))
    ba = assign_buffers(m)
    assert ba.offsets_bytes["u"] != ba.offsets_bytes["a"]


def test_rules():
    assert FOLD_MAX_NUMEL == lower_mod.FOLD_MAX_NUMEL
    m = parse_module(BLOCK_2DEV)
    insts = {i.name: i for i in m.entry.instructions}
    assert reads_strided(insts["matmul_3"], 0) and reads_strided(insts["softmax"], 0)
    assert not reads_strided(insts["all-reduce"], 0)
    assert view_result_strides(insts["reshape_3"], (64, 8192, 1)) is None
    assert view_result_strides(insts["reshape_3"], (2048, 64, 1)) == (2048, 1)  # rows of a wider buffer
    assert view_result_strides(insts["reshape_3"], (256, 64, 1)) == (256, 1)
