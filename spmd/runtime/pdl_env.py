"""``SPMD_PDL``: when spmd's Triton kernels use programmatic dependent launch (``triton_pdl``).

Parsed here, without Triton, so that a bad value fails when a program is compiled on any mesh
(``spmd.compiled.compile_module``), not mid-program at a kernel launch on a GPU; on CPU meshes
and GPUs without PDL the setting has no effect but is still checked.
"""

from __future__ import annotations

import os

ENV = "SPMD_PDL"
#: ``auto``: only launches over one row (a batch-1 decode step's products and attention), where PDL
#: was measured faster; ``1``: every launch; ``0``: none.
VALUES = ("auto", "0", "1")


def pdl_mode() -> str:
    """``SPMD_PDL`` as one of ``VALUES`` (unset or empty: ``auto``).

    Raises:
      ValueError: naming ``SPMD_PDL``, for any other value (expected one of ``VALUES``, got the value).
    """
    mode = os.environ.get(ENV, "auto") or "auto"
    if mode not in VALUES:
        raise ValueError(f"{ENV}: expected one of {VALUES}, got {mode!r}")
    return mode
