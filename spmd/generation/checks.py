"""Argument checks shared by the generation entry points (``Generator``, ``generate``, ``reference_generate``)."""

from __future__ import annotations

import numbers


def positive_int(name: str, value) -> int:
    """``value`` as a Python int (numpy integers included).

    Raises:
      TypeError: naming ``name``, for a non-integer (bools included), expected vs got.
      ValueError: naming ``name``, for a value below 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)
