"""``SPMD_PDL``: whether spmd's Triton kernels use programmatic dependent launch (``triton_pdl``).

Parsed here, without Triton, so that a bad value fails when a program is compiled on any mesh
(``spmd.compiled.compile_module``), not mid-program at a kernel launch on a GPU; on CPU meshes
and GPUs without PDL the flag has no effect but is still checked.
"""

from __future__ import annotations

import os

ENV = "SPMD_PDL"


def pdl_flag() -> bool:
    """``SPMD_PDL`` as a bool: ``"1"`` on, ``"0"``, empty or unset off (as the other ``SPMD_*`` choices).

    Raises:
      ValueError: naming ``SPMD_PDL``, for any other value (expected 0 or 1, got the value).
    """
    flag = os.environ.get(ENV, "0") or "0"
    if flag not in ("0", "1"):
        raise ValueError(f"{ENV}: expected one of ('0', '1'), got {flag!r}")
    return flag == "1"
