"""Checkpoint files of a train step: exact round trips and user errors for bad paths."""

import pytest
import torch

from spmd.train.state import load_state, save_state


def test_round_trip_is_exact(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(4, dtype=torch.float64).to(torch.bfloat16),
               "step": torch.tensor(7.0)}
    save_state(tensors, tmp_path / "ck.safetensors")
    back = load_state(tmp_path / "ck.safetensors")
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)


@pytest.mark.parametrize("where", ["dir", "missing_parent"])
def test_unwritable_path_is_value_error(tmp_path, where):
    path = tmp_path if where == "dir" else tmp_path / "no" / "such" / "ck.safetensors"
    with pytest.raises(ValueError, match="path: cannot write checkpoint"):
        save_state({"a": torch.randn(2)}, path)


def test_non_tensor_value_is_type_error(tmp_path):
    with pytest.raises(TypeError, match=r"tensors\['a'\]"):
        save_state({"a": [1.0, 2.0]}, tmp_path / "ck.safetensors")


def test_missing_file_is_value_error(tmp_path):
    with pytest.raises(ValueError, match="path: cannot read checkpoint"):
        load_state(tmp_path / "absent.safetensors")
