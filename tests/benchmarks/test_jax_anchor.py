"""The JAX anchor's timed calls run at the matmul precision they are reported at."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

jax = pytest.importorskip("jax")

from benchmarks.anchors import jax_xla  # noqa: E402


def test_timed_jit_traces_only_at_the_requested_precision():
    """JAX keys its jit cache on ``default_matmul_precision``: a timed call made outside the
    precision context traces a second program at JAX's default (TF32 on recent GPUs). Every trace
    of the timed program must see the requested precision; the reference sees float32."""
    seen: list[str | None] = []

    def fn(x, w):
        seen.append(jax.config.jax_default_matmul_precision)
        return x @ w

    rng = np.random.default_rng(0)
    xs = [jax.numpy.asarray(rng.standard_normal((8, 16), dtype=np.float32)),
          jax.numpy.asarray(rng.standard_normal((16, 4), dtype=np.float32))]
    args = argparse.Namespace(calls=3, rounds=2, label="jax")
    rec, out = jax_xla._timed_jit(fn, xs, {}, "tensorfloat32", args, "mm")
    assert set(seen) == {"tensorfloat32", "float32"}, seen
    assert rec["matmul_precision"] == "tensorfloat32"
    assert rec["enqueue_us"] > 0 and rec["synced_us"] > 0
    np.testing.assert_allclose(np.asarray(out), np.asarray(xs[0]) @ np.asarray(xs[1]), rtol=1e-5, atol=1e-5)
