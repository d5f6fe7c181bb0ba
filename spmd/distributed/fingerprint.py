"""One program everywhere: the compiled program's fingerprint is compared across ranks at its first execution.

Every process of a multi-controller run must execute the same sequence of programs (as in JAX's
multi-controller model); a rank that compiled another program (other shapes, dtypes, shardings,
options or code) would otherwise deadlock or compute garbage in the first mismatched collective.
At its first execution each program publishes a SHA-256 of its final HLO text, mesh, shardings,
donation, options and cross-process reduction mode through the store (a bounded exchange) and
compares it with every rank's.
"""

from __future__ import annotations

import hashlib
from typing import Any

from spmd.distributed.errors import ProgramMismatchError, fmt_ranks, ranks_by_value
from spmd.distributed.store import all_gather_str


def fingerprint(compiled: Any) -> tuple[str, str]:
    """(SHA-256 hex digest of the program, a short description ``name(f32[8,16], ...)``)."""
    from spmd.runtime.comm.multiprocess import reduce_mode

    h = hashlib.sha256()
    # the cross-process reduction ($SPMD_DISTRIBUTED_REDUCE) decides which collectives run: ranks
    # that differ in it would wait in different collectives
    for part in (str(compiled.module), repr(compiled.mesh), str(compiled.mesh.process_ids),
                 reduce_mode(compiled.mesh.platform == "cuda"),
                 repr(compiled.lowered.jitted.options), repr(sorted(compiled._donated)),
                 repr(compiled.input_shardings), repr(compiled.output_shardings)):
        h.update(part.encode())
        h.update(b"\0")
    args = ", ".join(f"{str(s.dtype).removeprefix('torch.')}{list(s.shape)}" for s in compiled.input_specs)
    return h.hexdigest(), f"{compiled.name}({args})"


def check_same_program(state: Any, compiled: Any) -> int:
    """Compare ``compiled``'s fingerprint with every rank's (call at its first execution, on every rank).

    Returns the execution's sequence number (equal on every rank; it names the program's keys).

    Raises:
      ProgramMismatchError: ranks compiled different programs (names the ranks and what each runs).
      DistributedTimeoutError: some ranks did not reach this first execution within the timeout.
    """
    digest, about = fingerprint(compiled)
    seq = state.next_id("program")
    got = all_gather_str(state, f"program/{seq}", f"{digest}|{about}",
                         f"first execution #{seq} (program fingerprint check)", program=compiled.name)
    if len(set(got)) == 1:
        return seq
    said = "; ".join(f"{fmt_ranks(rs)} run {v.split('|', 1)[1]} [{v[:12]}]" for v, rs in ranks_by_value(got).items())
    raise ProgramMismatchError(
        f"program {compiled.name!r}: processes compiled different programs for execution #{seq}: {said}; every "
        "process must call the same spmd.jit functions with the same shapes, dtypes, shardings and options, "
        "in the same order")
