"""benchmarks/matmul_anchor.py: what it records, that the replay runs those products, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks import matmul_anchor


def _block(x, w1, b1, w2):
    h = F.linear(x, w1, b1)  # addmm
    q = h.view(2, 4, 3, 8).transpose(1, 2)
    a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    return F.linear(F.gelu(a.transpose(1, 2).reshape(8, 24)), w2)  # mm


def test_records_each_gemm_and_attention_call_with_its_layout():
    x, w1, b1, w2 = torch.randn(8, 16), torch.randn(24, 16), torch.randn(24), torch.randn(5, 24)
    calls = matmul_anchor.record_matmuls(lambda: _block(x, w1, b1, w2))
    names = [c.op._schema.name for c in calls]
    assert names[0] == "aten::addmm" and names[-1] == "aten::mm"
    assert any("scaled_dot_product" in n for n in names[1:-1])
    bias, mat1, mat2 = calls[0].args[:3]
    assert (bias.shape, mat1.shape, mat2.shape) == ((24,), (8, 16), (16, 24))
    assert mat2.stride == (1, 16)  # the transposed weight stays a transposed view


def test_replay_runs_the_recorded_products_on_fresh_operands():
    x, w1, b1, w2 = torch.randn(8, 16), torch.randn(24, 16), torch.randn(24), torch.randn(5, 24)
    replay = matmul_anchor.matmul_only(lambda: _block(x, w1, b1, w2), torch.device("cpu"))
    out = replay()
    assert out.shape == (8, 5) and torch.isfinite(out).all() and out.abs().sum() > 0


def test_flops_of_the_record_match_the_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    x, w1, w2 = torch.randn(4, 7, 32), torch.randn(64, 32), torch.randn(32, 64)
    fn = lambda: F.linear(F.relu(F.linear(x, w1)), w2)  # noqa: E731
    calls = matmul_anchor.record_matmuls(fn)
    flops = sum(2 * c.args[0].shape[0] * c.args[0].shape[1] * c.args[1].shape[1] for c in calls)
    with FlopCounterMode(display=False) as counter:
        fn()
    assert flops == counter.get_total_flops()


def test_a_call_without_matrix_products_is_a_value_error():
    with pytest.raises(ValueError, match="fn: expected a call that runs at least one matrix product"):
        matmul_anchor.record_matmuls(lambda: torch.randn(3).relu())


def test_an_expanded_operand_keeps_its_layout_in_the_replay():
    x, w = torch.randn(6, 4), torch.randn(4, 3)
    bias = torch.randn(3).expand(6, 3)  # stride (0, 1): one row read six times
    calls = matmul_anchor.record_matmuls(lambda: torch.addmm(bias, x, w))
    assert calls[0].args[0].stride == (0, 1)
    out = matmul_anchor.build_replay(calls, torch.device("cpu"))()
    assert out.shape == (6, 3) and torch.isfinite(out).all()
