"""Checkpoints of a train step: a flat ``{name: tensor}`` dict in one safetensors file.

Tensors are written and read exactly (no dtype conversion), so a run resumed from a checkpoint
computes the same numbers as the uninterrupted run.
"""

from __future__ import annotations

import os

import torch

__all__ = ["save_state", "load_state", "check_path"]


def check_path(path) -> str | os.PathLike:
    """``path`` itself; TypeError naming it unless it is a str or os.PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike checkpoint file, got {type(path).__name__} {path!r}")
    return path


def save_state(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write ``tensors`` (CPU tensors of any shape / dtype) to ``path`` (safetensors format).

    Raises TypeError for a non-tensor value or ``path`` not a str / PathLike, ValueError for an
    unwritable path.
    """
    check_path(path)
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"tensors[{bad[0]!r}]: expected a torch.Tensor, got {type(tensors[bad[0]]).__name__}")
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, os.fspath(path))
    except (OSError, SafetensorError) as e:  # safetensors reports I/O errors (a directory, no parent) as its own
        raise ValueError(f"path: cannot write checkpoint {os.fspath(path)!r}: {e}") from None


def load_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a file written by ``save_state``; returns ``{name: CPU tensor}``.

    Raises TypeError for ``path`` not a str / PathLike, ValueError for a missing or unreadable file.
    """
    check_path(path)
    from safetensors.torch import load_file

    try:
        return load_file(os.fspath(path))
    except (OSError, Exception) as e:  # safetensors raises its own SafetensorError for a corrupt file
        raise ValueError(f"path: cannot read checkpoint {os.fspath(path)!r}: {e}") from None
