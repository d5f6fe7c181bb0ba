"""The ``fusion`` kernel: a fused computation (``spmd.passes.fuse_elementwise``) as one kernel.

The called computation is traced once per device and operand layout into an ATen FX graph
(``torch.fx.experimental.proxy_tensor.make_fx``) and compiled by PyTorch Inductor
(``torch._inductor.compile``), which generates one Triton kernel for a chain of elementwise ops
and reductions on CUDA. This is the code generation step of XLA's loop fusion (XLA emits LLVM
IR / Triton for each ``kLoop`` fusion); here PyTorch's own compiler does it, so no kernel code
lives in this project.

By default the generated kernels serve the calls that are captured into CUDA graphs: the
eager call a ``GraphRunner`` makes before its capture (``graph_warmup``) compiles them, and the
capture records them. A call that runs eagerly (``cuda_graphs=False``, or after a capture
failed) keeps the unfused PyTorch kernels: its cost is host time per launch, and the dispatch
benchmark's eager column measured slower with the generated kernels (the transformer block
over 2xH200: 919 µs per call unfused, 1170-2275 µs with them, on a noisy host).

Compilation is lazy and shared between fusions of the same structure (the layers of a
transformer give the same fused computations): the cache key is the computation's structure,
the device and the operands' dims, strides and dtypes. Where Inductor is not used or fails (the
reason is counted in ``spmd.metrics`` as ``fusion.fallback.<exception type>`` and logged once),
the called computation runs op by op with the same kernels as unfused instructions, so results
match the unfused program.

``SPMD_FUSION_COMPILER``: ``auto`` (default: Inductor for graph-captured calls on CUDA, op by op
otherwise), ``inductor`` (every call, also on CPU, which needs a C++ compiler) or ``eager``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from spmd import metrics
from spmd.compile_lock import COMPILE_LOCK
from spmd.ir.hlo import ELEMENTWISE_OPCODES, Computation, Instruction

Tensor = torch.Tensor
COMPILER_ENV = "SPMD_FUSION_COMPILER"
COMPILERS = ("auto", "inductor", "eager")

logger = logging.getLogger("spmd")
_cache: dict[tuple, Callable[..., Tensor]] = {}
_compile_lock = COMPILE_LOCK  # Inductor compiles one graph at a time, never beside a torch.export trace
_logged: set[str] = set()
_warmup = threading.local()


def fusion_compiler(device: torch.device) -> str:
    """How fusions on ``device`` run under ``SPMD_FUSION_COMPILER``.

    "inductor" (generated kernels for every call), "graphs" (generated kernels for calls
    captured into CUDA graphs and their warm-up, op by op otherwise: ``auto`` on CUDA) or
    "eager" (op by op: ``auto`` elsewhere). Raises ValueError naming the variable for a value
    outside ``COMPILERS``.
    """
    mode = os.environ.get(COMPILER_ENV, "auto") or "auto"
    if mode not in COMPILERS:
        raise ValueError(f"{COMPILER_ENV}: expected one of {COMPILERS}, got {mode!r}")
    if mode == "auto":
        return "graphs" if device.type == "cuda" else "eager"
    return mode


@contextlib.contextmanager
def graph_warmup() -> Iterator[None]:
    """Within (this thread): fusions run, and first compile, their generated kernels.

    ``GraphRunner`` wraps the eager call it makes before capturing a CUDA graph in it, so that
    nothing compiles during the capture.
    """
    previous = getattr(_warmup, "on", False)
    _warmup.on = True
    try:
        yield
    finally:
        _warmup.on = previous


def _graph_call() -> bool:
    """Inside ``graph_warmup`` or a CUDA graph capture (of the current stream)."""
    if getattr(_warmup, "on", False):
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def build_fusion(inst: Instruction, dev: torch.device | None = None) -> Callable:
    """Kernel ``(operands, out) -> Tensor`` for a ``fusion`` instruction.

    Operands are the fusion's operand tensors (any strides), all on one device; the result is
    a fresh contiguous tensor of ``inst.shape`` (copied into ``out`` when given). A tuple-shaped
    fusion (several outputs) gets ``spmd.runtime.kernels_fusion_multi``'s kernel instead, and one
    whose outputs are in-place dynamic-update-slices ``spmd.runtime.kernels_fusion_update``'s.
    """
    body: Computation = inst.attrs["calls"]
    from spmd.runtime.kernels_fusion_update import build_update_fusion, is_update_fusion

    if is_update_fusion(body):
        return build_update_fusion(inst, dev)
    if inst.shape.is_tuple:
        from spmd.runtime.kernels_fusion_multi import build_multi_output_fusion

        return build_multi_output_fusion(inst, dev)
    structure = structure_key(body)
    in_place_ok = pointwise_parameters(body)
    prepared: dict[tuple, list] = {}  # (device, strides) -> [mode, op-by-op fn, compiled fn or None]

    def kernel(ops: list[Tensor], out: Tensor | None) -> Tensor:
        key = (ops[0].device, *(t.stride() for t in ops))
        entry = prepared.get(key)
        if entry is None:
            device = ops[0].device
            entry = prepared[key] = [fusion_compiler(device), interpreter(body, device), None]
        mode, eager, compiled = entry
        if mode == "eager" or (mode == "graphs" and not _graph_call()):
            r = eager(*ops)
        elif out is not None and not _overlaps(out, [t for k, t in enumerate(ops)
                                                     if not (k in in_place_ok and _same_view(t, out))]):
            # the generated kernel stores straight into the arena buffer: no copy after it
            writer = _compile_into(structure, eager, ops, out)
            if writer is not None:
                writer(*ops, out)
                return out
            r = eager(*ops)
        else:
            if compiled is None:
                compiled = entry[2] = _compile(structure, eager, ops)
            r = compiled(*ops)
        if out is None:
            return r if r.is_contiguous() else r.contiguous()
        out.copy_(r)
        return out
    return kernel


def pointwise_parameters(body: Computation) -> frozenset[int]:
    """Parameter numbers of ``body`` read only element for element at the root's index: every
    instruction reached from the parameter is elementwise and has the root's dims. The fused
    kernel may then store its result over such an operand (each element is read before the
    thread that writes it stores), as an optimizer writes a parameter's update over it.
    With a ``tuple`` root (a multi-output fusion) every element must have the same dims, and
    the parameter may reach the tuple only through elementwise instructions."""
    root = body.root
    if root.shape.is_tuple:
        dims = {o.shape.dims for o in root.operands}
        if root.opcode != "tuple" or len(dims) != 1:
            return frozenset()
        (root_dims,) = dims
    else:
        root_dims = root.shape.dims
    users = body.users()
    ok = set()
    for p in body.parameters:
        stack, seen, good = [p], set(), p.shape.dims == root_dims
        while stack and good:
            inst = stack.pop()
            for u in users.get(inst, ()):
                if id(u) in seen:
                    continue
                seen.add(id(u))
                if u is root and u.opcode == "tuple":
                    continue
                good = u.opcode in ELEMENTWISE_OPCODES and u.shape.dims == root_dims
                stack.append(u)
        if good:
            ok.add(p.attrs["parameter_number"])
    return frozenset(ok)


def _same_view(t: Tensor, out: Tensor) -> bool:
    return (t.device == out.device and t.data_ptr() == out.data_ptr() and t.shape == out.shape
            and t.stride() == out.stride() and t.dtype == out.dtype)


def _overlaps(out: Tensor, ops: list[Tensor]) -> bool:
    """Whether ``out``'s bytes may overlap an operand's (then the result goes through a fresh buffer).

    Arena buffers are views of one storage, so this compares the byte ranges the views span.
    """
    lo, hi = _span(out)
    return any(t.device == out.device and a < hi and lo < b for t in ops for a, b in [_span(t)])


def _span(t: Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return 0, 0
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr() + t.element_size() * sum(min(0, (n - 1) * st) for n, st in zip(t.shape, t.stride(),
                                                                                          strict=True))
    return start, start + extent * t.element_size()


def op_steps(body: Computation, skip: frozenset[int] = frozenset()) -> tuple[list, Callable]:
    """``(steps, source)`` of an op-by-op run of ``body``: ``steps`` lists its instructions in order
    (parameters and those whose ``id`` is in ``skip`` left out) as ``(instruction, sources)``, and
    ``source(inst)`` is ``(is_parameter, k)``: operand ``k`` of the fusion, or the value of step ``k``."""
    index = {id(p): p.attrs["parameter_number"] for p in body.parameters}
    slot: dict[int, int] = {}

    def source(o: Instruction) -> tuple[bool, int]:
        return id(o) in index, index.get(id(o), slot.get(id(o)))

    steps = []
    for inst in body.instructions:
        if inst.opcode == "parameter" or id(inst) in skip:
            continue
        slot[id(inst)] = len(steps)
        steps.append((inst, [source(o) for o in inst.operands]))
    return steps, source


def run_steps(kernels: list[Callable], steps: list, args: Sequence[Tensor]) -> list[Tensor]:
    """The value of every step of ``op_steps`` (``kernels[i]`` runs step ``i``) on the operands ``args``."""
    vals: list[Tensor] = []
    for fn, (_, srcs) in zip(kernels, steps, strict=True):
        vals.append(fn([args[k] if is_param else vals[k] for is_param, k in srcs], None))
    return vals


def interpreter(body: Computation, device: torch.device) -> Callable[..., Tensor]:
    """``fn(*operands) -> Tensor`` running ``body`` op by op with the unfused kernels."""
    from spmd.runtime.kernels import VIEW_KERNEL_OPCODES, compile_kernel, compile_view_kernel

    steps, source = op_steps(body)
    # layout ops are views here (the fused kernel never stores them; the caller copies a
    # non-contiguous result once): a rotary embedding's transposed q is not copied first
    kernels = [compile_view_kernel(inst) if inst.opcode in VIEW_KERNEL_OPCODES else compile_kernel(inst, device)
               for inst, _ in steps]
    _, root = source(body.root)

    def run(*args: Tensor) -> Tensor:
        return run_steps(kernels, steps, args)[root]
    return run


def structure_key(body: Computation) -> tuple:
    """A hashable description of ``body`` that ignores instruction names (equal for equal math)."""
    pos = {id(inst): k for k, inst in enumerate(body.instructions)}
    rows = []
    for inst in body.instructions:
        attrs = tuple(sorted((k, _attr_key(v)) for k, v in inst.attrs.items()))
        rows.append((inst.opcode, str(inst.shape), tuple(pos[id(o)] for o in inst.operands), attrs))
    return tuple(rows), pos[id(body.root)]


def _attr_key(v: Any) -> Any:
    if isinstance(v, Computation):
        return ("computation", structure_key(v))
    if isinstance(v, Tensor):
        return ("tensor", str(v.dtype), tuple(v.shape), tuple(v.flatten().tolist()))
    if isinstance(v, dict):
        return ("dict", json.dumps(v, sort_keys=True, default=str))
    return repr(v)


def _compile(structure: tuple, eager: Callable[..., Tensor], ops: list[Tensor]) -> Callable[..., Tensor]:
    """The generated kernel of a fusion for ``ops``' device and layout (cached), else ``eager``."""
    key = (structure, str(ops[0].device), *((tuple(t.shape), t.stride(), t.dtype) for t in ops))
    return _cached_compile(key, lambda: _inductor(eager, ops), eager)


def _compile_into(structure: tuple, eager: Callable[..., Tensor], ops: list[Tensor],
                  out: Tensor) -> Callable[..., Tensor] | None:
    """A generated kernel ``fn(*ops, out)`` that writes the fusion's value into ``out`` (cached per
    structure, device and layouts of ``ops`` and ``out``), or None where Inductor is unavailable
    for it (the caller then runs op by op and copies, as ``_compile`` falls back)."""
    key = ("into", structure, str(out.device), tuple(out.shape), out.stride(), out.dtype,
           *((tuple(t.shape), t.stride(), t.dtype) for t in ops))
    return _cached_compile(key, lambda: _inductor_into(eager, ops, out), None)


def _cached_compile(key: tuple, build: Callable[[], Any], fallback: Any) -> Any:
    """``build()`` once per ``key`` under the compile lock; ``fallback`` (cached too) when it raises,
    counted as ``fusion.fallback.<exception type>`` and logged once per type."""
    with COMPILE_LOCK:  # one compile at a time (make_fx uses global modes, as torch.export does)
        if key in _cache:
            metrics.counter("fusion.compile_cache.hit").inc()
            return _cache[key]
        try:
            with metrics.timer("fusion.compile"):
                compiled = build()
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to op-by-op execution
            reason = type(exc).__name__
            metrics.counter(f"fusion.fallback.{reason}").inc()
            if reason not in _logged:
                _logged.add(reason)
                first = str(exc).splitlines()[0][:200] if str(exc) else ""
                logger.warning("fusion: running op by op (%s: %s)", reason, first)
            compiled = fallback
        _cache[key] = compiled
        return compiled


def _inductor_into(fn: Callable[..., Tensor], ops: list[Tensor], out: Tensor) -> Callable[..., Tensor]:
    """``out.copy_(fn(*ops))`` traced and compiled by Inductor, which stores the fused value into
    ``out`` itself (a mutated graph input) instead of a fresh buffer plus a copy."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def write(*args: Tensor) -> Tensor:
        return args[-1].copy_(fn(*args[:-1]))

    with torch.no_grad():
        want = fn(*ops)
        scratch = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device)
        gm = make_fx(write)(*ops, scratch)
        compiled = torch._inductor.compile(gm, [*ops, scratch], options=_INDUCTOR_OPTIONS)
        compiled(*ops, scratch)
    if want.shape != out.shape or want.dtype != out.dtype:
        raise RuntimeError(f"fusion value {want.dtype}{list(want.shape)} does not fit its buffer "
                           f"{out.dtype}{list(out.shape)}")
    if not torch.allclose(scratch.double(), want.double(), rtol=1e-2, atol=1e-2, equal_nan=True):
        raise RuntimeError("compiled fusion wrote a different value into its buffer")

    def run(*args: Tensor) -> None:
        compiled(*args)
    return run


#: Inductor config for fusions: keep every cast the program makes (a float32 -> float16 -> float32
#: round trip must round as the unfused kernels do; by default Inductor elides such casts).
_INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


def _inductor(fn: Callable[..., Tensor], ops: list[Tensor]) -> Callable[..., Tensor]:
    """``fn`` traced to ATen on ``ops`` and compiled by Inductor; checked against ``fn`` once."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def contiguous(*args: Tensor) -> Tensor:  # the kernel stores row-major: no copy after it
        return fn(*args).contiguous()

    with torch.no_grad():
        gm = make_fx(contiguous)(*ops)
        compiled = torch._inductor.compile(gm, list(ops), options=_INDUCTOR_OPTIONS)
        got, want = compiled(*ops), fn(*ops)
    if isinstance(got, (tuple, list)):
        (got,) = got
    if got.shape != want.shape or got.dtype != want.dtype:
        raise RuntimeError(f"compiled fusion returned {got.dtype}{list(got.shape)}, "
                           f"expected {want.dtype}{list(want.shape)}")

    def run(*args: Tensor) -> Tensor:
        r = compiled(*args)
        return r[0] if isinstance(r, (tuple, list)) else r
    return run
