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

``CAPTURE_LOCK`` is held while a CUDA graph is captured and around every device-wide
synchronisation the runtime makes (``ShardedArray.block_until_ready`` of replayed outputs,
the graph backend's ``synchronize``): a ``cudaDeviceSynchronize`` from one thread while another
thread captures fails ("operation not permitted when stream is capturing") and invalidates the
capture, so the two never overlap (a first call from several threads at once: one captures
while another waits for its own results). Taken after ``COMPILE_LOCK`` where both are held.
"""

from __future__ import annotations

import threading

COMPILE_LOCK = threading.RLock()
CAPTURE_LOCK = threading.RLock()
