"""``reads_can_move``: a lowering fusion moves an op's reads later only past ops that cannot write
its operands' memory (arena results, in-place updates, readers of the operands)."""

from __future__ import annotations

import pytest

from spmd.runtime.fusion_moves import reads_can_move
from spmd.runtime.lower import Op


def _op(ins, out, buffer_name=None, alias_of=-1) -> Op:
    return Op(inst=None, stream=0, ins=list(ins), out=out, buffer_name=buffer_name, alias_of=alias_of)


def test_adjacent_ops_and_fresh_unrelated_results_in_between_allow_the_move():
    ops = [_op([0, 1], 2), _op([3], 4), _op([2, 5], 6)]
    assert reads_can_move(ops, 0, 1, [0, 1])
    assert reads_can_move(ops, 0, 2, [0, 1])


@pytest.mark.parametrize("between", [
    _op([3], 4, buffer_name="matmul_1"),  # an arena result: may take the bytes of a dead operand
    _op([3], 4, alias_of=3),              # an in-place update
    _op([1], 4),                          # reads an operand (an in-place writer or collective would)
])
def test_an_op_in_between_that_may_write_an_operand_blocks_the_move(between):
    ops = [_op([0, 1], 2), between, _op([2, 5], 6)]
    assert not reads_can_move(ops, 0, 2, [0, 1])


def test_views_in_between_are_passed_and_their_readers_watched():
    view = _op([2], 4, buffer_name="bcast")
    view.extra["view"] = True
    assert reads_can_move([_op([0], 1), view, _op([1, 4], 5)], 0, 2, [0])
    view_of_operand = _op([0], 4, buffer_name="r")
    view_of_operand.extra["view"] = True
    writer = _op([4], 6, alias_of=4)
    assert not reads_can_move([_op([0], 1), view_of_operand, writer, _op([1], 7)], 0, 3, [0])
    assert not reads_can_move([_op([0], 1), view_of_operand, _op([4], 6), _op([1], 7)], 0, 3, [0])
