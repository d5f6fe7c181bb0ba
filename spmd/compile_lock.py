"""The process-wide compilation lock: tracing, lowering and compiling run one at a time.

``torch.export`` traces with process-global state (the proxy and fake-tensor dispatch mode
stacks, the tracing context), so two traces at once in one process fail inside PyTorch
("ProxyTorchDispatchMode slot already occupied"). Every path that traces or compiles
(``Jitted`` calls, ``Jitted.lower``, ``Lowered.compile``, the first ``reshard`` of a layout
pair) holds ``COMPILE_LOCK``; a cache lookup made before taking it is repeated under it, so
a program that several threads need at once is traced and compiled once while the others
wait for it (single flight, as JAX's compilation cache does). Running compiled programs
never takes the lock.

The lock is re-entrant: a compilation that compiles another program (a reshard inside a
call) on the same thread does not deadlock.
"""

from __future__ import annotations

import threading

COMPILE_LOCK = threading.RLock()
