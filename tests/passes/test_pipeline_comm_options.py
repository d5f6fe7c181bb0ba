"""CompileOptions of the training-communication passes: validation and where they run."""

from __future__ import annotations

import pytest

from spmd.passes.pipeline import STAGES, CompileOptions, build_passes


@pytest.mark.parametrize("value, error", [(-1, ValueError), (2.5, TypeError), (True, TypeError), ("25MB", TypeError)])
def test_bad_bucket_size_bytes(value, error):
    with pytest.raises(error, match="bucket_size_bytes"):
        CompileOptions(bucket_size_bytes=value)


def test_bad_async_collectives():
    with pytest.raises(TypeError, match="async_collectives"):
        CompileOptions(async_collectives=1)


def test_passes_follow_the_options():
    names = [p.name for p in build_passes(CompileOptions())]
    assert names == [s for s in STAGES if s != "import"]
    assert names.index("cse") < names.index("reduce-scatter-creator") < names.index("all-reduce-reuse")
    assert names.index("all-reduce-reuse") < names.index("sink-scale") < names.index("windowed-einsum")
    assert names.index("split-batch") < names.index("combine-collectives") < names.index("fuse-elementwise")
    assert names.index("assign-streams") < names.index("async-collectives") < names.index("schedule")
    by_name = {p.name: p for p in build_passes(CompileOptions(bucket_size_bytes=0, async_collectives=False,
                                                              windowed_einsum="off"))}
    assert by_name["combine-collectives"].bucket_size_bytes == 0
    assert not by_name["async-collectives"].enabled
    assert not by_name["sink-scale"].enabled
