"""Shared test set-up: GPU tests skip cleanly where CUDA is absent."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = marker.kwargs.get("count", 1)
        if n < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {n}"))
