"""select-all-reduce: golden HLO text per mode, the size threshold, eligibility, the cost-model decision."""
# ruff: noqa: E501  (golden HLO text lines are long)

from __future__ import annotations

import dataclasses

import pytest

import spmd
from spmd.ir.text import parse_module
from spmd.passes.all_reduce_cost import H200_PEER_COPY, H200_SYMMETRIC_MEMORY, SmallAllReduceCosts
from spmd.passes.assign_streams import AssignStreams
from spmd.passes.select_all_reduce import SelectAllReduce, algorithm_of, eligible_group_size
from tests.passes.pass_checks import run_pass_checked

HEAD = """HloModule ar, num_partitions=4, mesh={x=4}, is_partitioned=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%max (c: f32[], d: f32[]) -> f32[] {
  %c = f32[] parameter(0)
  %d = f32[] parameter(1)
  ROOT %m = f32[] maximum(%c, %d)
}

"""
# all-reduces of 1 KiB (small), 1 KiB maximum (small), 64 KiB (large), 1 KiB over groups of one
# device, 1 KiB over pairs.
BODY = """ENTRY %main (x: f32[16,16], y: f32[128,128]) -> (f32[16,16], f32[16,16], f32[128,128], f32[16,16], f32[16,16]) {
  %x = f32[16,16] parameter(0)
  %small = f32[16,16] all-reduce(%x), to_apply=%add, replica_groups={{0,1,2,3}}
  %smax = f32[16,16] all-reduce(%x), to_apply=%max, replica_groups={{0,1,2,3}}
  %y = f32[128,128] parameter(1)
  %large = f32[128,128] all-reduce(%y), to_apply=%add, replica_groups={{0,1,2,3}}
  %single = f32[16,16] all-reduce(%x), to_apply=%add, replica_groups={{0},{1},{2},{3}}
  %pairs = f32[16,16] all-reduce(%x), to_apply=%add, replica_groups={{0,2},{1,3}}
  ROOT %out = (f32[16,16], f32[16,16], f32[128,128], f32[16,16], f32[16,16]) tuple(%small, %smax, %large, %single, %pairs)
}
"""
TEXT = HEAD + BODY
CHEAP = SmallAllReduceCosts(ring_latency_us=10.0, ring_gbps=100.0, one_shot_latency_us=2.0, join_us=0.0,
                            p2p_gbps=200.0, hbm_gbps=1000.0, whole_graph_penalty_us=0.0)


def _entry(text: str) -> str:
    return text[text.index("ENTRY"):]


def _marked(mod) -> list[str]:
    return [i.name for i in mod.entry.instructions if i.opcode == "all-reduce" and algorithm_of(i) == "one-shot"]


def _run(p: SelectAllReduce) -> tuple[str, object]:
    text, mod = run_pass_checked(p, TEXT, exact=True)  # the choice never changes what is computed
    return _entry(text), mod


def test_on_marks_small_eligible_all_reduces_golden():
    text, mod = _run(SelectAllReduce(mode="on", max_bytes=4096))
    assert text == """ENTRY %main (x: f32[16,16], y: f32[128,128]) -> (f32[16,16], f32[16,16], f32[128,128], f32[16,16], f32[16,16]) {
  %x = f32[16,16] parameter(0)
  %small = f32[16,16] all-reduce(%x), to_apply=%add, backend_config={"algorithm":"one-shot"}, replica_groups={{0,1,2,3}}
  %smax = f32[16,16] all-reduce(%x), to_apply=%max, backend_config={"algorithm":"one-shot"}, replica_groups={{0,1,2,3}}
  %y = f32[128,128] parameter(1)
  %large = f32[128,128] all-reduce(%y), to_apply=%add, replica_groups={{0,1,2,3}}
  %single = f32[16,16] all-reduce(%x), to_apply=%add, replica_groups={{0},{1},{2},{3}}
  %pairs = f32[16,16] all-reduce(%x), to_apply=%add, backend_config={"algorithm":"one-shot"}, replica_groups={{0,2},{1,3}}
  ROOT %out = (f32[16,16], f32[16,16], f32[128,128], f32[16,16], f32[16,16]) tuple(%small, %smax, %large, %single, %pairs)
}
"""
    assert _marked(mod) == ["small", "smax", "pairs"]


@pytest.mark.parametrize(("max_bytes", "marked"), [
    (0, []), (1023, []), (1024, ["small", "smax", "pairs"]), (65535, ["small", "smax", "pairs"]),
    (65536, ["small", "smax", "large", "pairs"]),
])
def test_size_threshold_is_inclusive(max_bytes, marked):
    assert _marked(_run(SelectAllReduce(mode="on", max_bytes=max_bytes))[1]) == marked


def test_off_leaves_the_module_unchanged():
    text, mod = _run(SelectAllReduce(mode="off", max_bytes=1 << 30))
    assert text == BODY and _marked(mod) == []


def test_auto_follows_the_cost_model():
    # cheap one-shot: the small ones (and the 64 KiB one, below the crossover) are marked
    assert _marked(_run(SelectAllReduce(mode="auto", max_bytes=1 << 20, costs=CHEAP))[1]) == [
        "small", "smax", "large", "pairs"]
    # the 64 KiB one is above the crossover of these costs: 4-device one-shot pulls 3 copies
    slow_link = dataclasses.replace(CHEAP, p2p_gbps=20.0)
    assert _marked(_run(SelectAllReduce(mode="auto", max_bytes=1 << 20, costs=slow_link))[1]) == [
        "small", "smax", "pairs"]
    # peer copies on 2xH200: the joins cost more than NCCL's start-up, nothing is marked
    assert _marked(_run(SelectAllReduce(mode="auto", costs=H200_PEER_COPY))[1]) == []
    # symmetric memory: 64 KiB over 4 devices is below its ~1.3 MB crossover, 1 MiB above the threshold
    assert _marked(_run(SelectAllReduce(mode="auto", costs=H200_SYMMETRIC_MEMORY))[1]) == [
        "small", "smax", "large", "pairs"]
    assert _marked(_run(SelectAllReduce(mode="auto", max_bytes=4096, costs=H200_SYMMETRIC_MEMORY))[1]) == [
        "small", "smax", "pairs"]


@pytest.mark.parametrize(("process_ids", "marked"), [
    ((), []), ((0, 0, 0, 0), []),  # one process: peer copies, which the 2xH200 constants never pick
    ((0, 0, 1, 1), ["small", "smax", "large", "pairs"]),  # every group spans processes: symmetric memory
    ((0, 1, 0, 1), ["small", "smax", "large"]),  # pairs {0,2} and {1,3} stay inside one process each
])
def test_auto_prices_cross_process_groups_with_symmetric_memory(process_ids, marked):
    p = SelectAllReduce(mode="auto", costs=H200_PEER_COPY, cross_process_costs=H200_SYMMETRIC_MEMORY,
                        process_ids=process_ids)
    assert _marked(_run(p)[1]) == marked


def test_auto_counts_the_whole_graph_penalty():
    penalty = dataclasses.replace(CHEAP, whole_graph_penalty_us=1000.0)
    assert _marked(_run(SelectAllReduce(mode="auto", costs=penalty))[1]) == []
    assert _marked(_run(SelectAllReduce(mode="auto", costs=penalty, cuda_graphs=False))[1]) == [
        "small", "smax", "large", "pairs"]


def test_mark_survives_assign_streams_and_keeps_other_config():
    text = TEXT.replace('to_apply=%add, replica_groups={{0,2},{1,3}}',
                        'to_apply=%add, backend_config={"split_batch":1}, replica_groups={{0,2},{1,3}}')
    mod = parse_module(text)
    SelectAllReduce(mode="on").run(mod)
    AssignStreams().run(mod)
    starts = [i for i in mod.entry.instructions if i.opcode == "all-reduce-start"]
    assert [i.attrs["backend_config"] for i in starts] == [{"split_batch": 1, "algorithm": "one-shot"}]
    assert algorithm_of(starts[0]) == "one-shot"


def test_counts_marked_all_reduces():
    counter = spmd.metrics.counter("select-all-reduce.one_shot")
    before = counter.value
    SelectAllReduce(mode="on").run(parse_module(TEXT))
    assert counter.value - before == 4  # the 64 KiB one is below the default 512 KiB threshold


def test_unknown_reduction_and_uneven_groups_are_not_eligible():
    mod = parse_module(TEXT.replace("ROOT %m = f32[] maximum(%c, %d)", "ROOT %m = f32[] subtract(%c, %d)"))
    smax = next(i for i in mod.entry.instructions if i.name == "smax")
    assert eligible_group_size(smax, 4, 1 << 20) == 0
    uneven = parse_module(TEXT.replace("replica_groups={{0,2},{1,3}}", "replica_groups={{0,1,2},{3}}"))
    pairs = next(i for i in uneven.entry.instructions if i.name == "pairs")
    assert eligible_group_size(pairs, 4, 1 << 20) == 0
    small = next(i for i in uneven.entry.instructions if i.name == "small")
    assert eligible_group_size(small, 4, 1 << 20) == 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="small_all_reduce: expected one of"):
        SelectAllReduce(mode="always")
    with pytest.raises(ValueError, match="small_all_reduce_max_bytes: expected >= 0"):
        SelectAllReduce(max_bytes=-1)
    with pytest.raises(TypeError, match="small_all_reduce_max_bytes: expected an int"):
        SelectAllReduce(max_bytes=1.5)
    with pytest.raises(ValueError, match="before spmd-partition"):
        SelectAllReduce().run(parse_module(TEXT.replace(", is_partitioned=true", "")))
    with pytest.raises(ValueError, match="small_all_reduce must be"):
        spmd.CompileOptions(small_all_reduce="yes")
    with pytest.raises(ValueError, match="small_all_reduce_max_bytes must be >= 0"):
        spmd.CompileOptions(small_all_reduce_max_bytes=-5)
    with pytest.raises(TypeError, match="small_all_reduce_max_bytes must be an int"):
        spmd.CompileOptions(small_all_reduce_max_bytes=True)
