"""A generated test case as a plain value: program source, inputs, mesh, shardings, options.

``Case`` holds everything needed to run one differential check and to print it as a standalone
script (``reproducer``). Inputs are made by ``make_input`` from a per-input seed, so the script
rebuilds exactly the tensors the tester used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: Source shared by the tester and the printed reproducers (exec'd in both).
PRELUDE = '''
import torch
import torch.nn.functional as F
import spmd
from spmd import PartitionSpec as P

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


def make_input(shape, dtype, seed, high=0):
    """Fresh random input of ``shape``: floats ~ N(0, 1) drawn in float64, then cast to ``dtype``;
    index tensors (``high`` > 0) uniform in [0, high)."""
    g = torch.Generator().manual_seed(seed)
    if high:
        return torch.randint(0, high, shape, generator=g)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
'''

DTYPE_NAMES = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
               torch.int64: "torch.int64", torch.bool: "torch.bool"}


@dataclass(frozen=True)
class InputSpec:
    """One argument: ``make_input(shape, dtype, seed + 1000 * call, high)``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    seed: int
    high: int = 0

    def make(self, call: int = 0) -> torch.Tensor:
        return prelude()["make_input"](self.shape, self.dtype, self.seed + 1000 * call, self.high)


@dataclass(frozen=True)
class Case:
    """One random program with its compilation and call set-up.

    Fields:
      inputs: the positional arguments.
      body: source lines of the function body (each ``name = expr`` or a statement).
      outputs: returned value names (one: returned bare; several: a tuple).
      ops: the op kinds used, in order (statistics, signatures).
      mesh_axes: ((axis name, size), ...); device: "cpu" or "cuda".
      in_specs / out_specs: per argument / output a PartitionSpec entry tuple or None;
        out_specs None = let propagation choose.
      options: CompileOptions keyword arguments.
      donate: donate_argnums.
      arg_modes: per argument "tensor" | "put" | "reshard" | "auto" (placed with ``pre_specs``
        and resharded by the call, ``reshard_inputs=True``).
      pre_specs: per argument the sharding an array is first placed with ("reshard"/"auto").
      calls: how many calls (each with fresh inputs) through the same ``Jitted``.
      packed: inputs passed together in one dict argument ``p`` (a params pytree).
      threads: the first call is made from this many threads at once (concurrent tracing).
    """

    inputs: tuple[InputSpec, ...]
    body: tuple[str, ...]
    outputs: tuple[str, ...]
    ops: tuple[str, ...]
    mesh_axes: tuple[tuple[str, int], ...]
    device: str = "cpu"
    in_specs: tuple = ()
    out_specs: tuple | None = None
    options: tuple[tuple[str, Any], ...] = ()
    donate: tuple[int, ...] = ()
    arg_modes: tuple[str, ...] = ()
    pre_specs: tuple = ()
    calls: int = 2
    features: frozenset = field(default_factory=frozenset)
    packed: tuple[str, ...] = ()
    threads: int = 1

    def structure(self, per_input: list) -> list:
        """Per-input values (tensors, arrays, specs) as the positional arguments of ``f``: the
        unpacked inputs in order, then (if any are ``packed``) one dict {name: value} named ``p``."""
        flat = [v for i, v in zip(self.inputs, per_input) if i.name not in self.packed]
        if self.packed:
            flat.append({i.name: v for i, v in zip(self.inputs, per_input) if i.name in self.packed})
        return flat

    def position(self, k: int) -> int:
        """The positional argument holding input ``k`` (donate_argnums indices)."""
        name = self.inputs[k].name
        if name in self.packed:
            return len(self.inputs) - len(self.packed)
        return sum(1 for i in self.inputs[:k] if i.name not in self.packed)

    @property
    def num_devices(self) -> int:
        n = 1
        for _, s in self.mesh_axes:
            n *= s
        return n

    def source(self) -> str:
        """The program as Python source (a function ``f``)."""
        args = ", ".join([i.name for i in self.inputs if i.name not in self.packed] + ["p"] * bool(self.packed))
        ret = self.outputs[0] if len(self.outputs) == 1 else "(" + ", ".join(self.outputs) + ",)"
        unpack = [f"{n} = p[{n!r}]" for n in self.packed]
        return "\n".join([f"def f({args}):", *(f"    {line}" for line in unpack + list(self.body)),
                          f"    return {ret}", ""])

    def function(self, dtype_map: dict[str, torch.dtype] | None = None):
        """``f`` compiled from ``source()``; ``dtype_map`` rebinds F32/F64/BF16/F16 (reference runs)."""
        ns = prelude()
        ns.update(dtype_map or {})
        exec(compile(self.source(), "<fuzz program>", "exec"), ns)
        return ns["f"]

    def mesh_text(self) -> str:
        axes = "{" + ", ".join(f"{n!r}: {s}" for n, s in self.mesh_axes) + "}"
        return f"spmd.Mesh.create({axes}, devices={self.device + ':' + str(self.num_devices)!r})"

    def options_text(self) -> str:
        return "spmd.CompileOptions(" + ", ".join(f"{k}={v!r}" for k, v in self.options) + ")"


def spec_text(spec) -> str:
    """``P(None, 'tp')`` for the entry tuple ``(None, 'tp')``; ``None`` for None."""
    if spec is None:
        return "None"
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


_PRELUDE_NS: dict | None = None


def prelude() -> dict:
    """A fresh namespace with ``PRELUDE`` executed in it."""
    global _PRELUDE_NS
    if _PRELUDE_NS is None:
        ns: dict = {}
        exec(PRELUDE, ns)
        _PRELUDE_NS = ns
    return dict(_PRELUDE_NS)


def reproducer(case: Case, note: str = "") -> str:
    """A self-contained Python script that rebuilds ``case``, runs it and compares with eager float64."""
    in_specs = "[" + ", ".join(spec_text(s) for s in case.in_specs) + "]"
    out_specs = "None" if case.out_specs is None else (
        spec_text(case.out_specs[0]) if len(case.outputs) == 1
        else "(" + "".join(spec_text(s) + ", " for s in case.out_specs) + ")")
    lines = [f"# spmd random-program reproducer{': ' + note if note else ''}", PRELUDE.strip(), "", "",
             case.source(), "",
             f"mesh = {case.mesh_text()}",
             f"CALLS = {case.calls}",
             "make_inputs = lambda call: [" + ", ".join(_make_text(i) for i in case.inputs) + "]  # noqa: E731",
             f"modes = {list(case.arg_modes)!r}",
             f"pre_specs = [{', '.join(spec_text(s) for s in case.pre_specs)}]",
             f"in_specs = {in_specs}",
             f"packed = {list(case.packed)!r}  # inputs passed in one dict argument p",
             f"g = spmd.jit(f, mesh=mesh, in_shardings=structure(in_specs), out_shardings={out_specs},",
             f"             donate_argnums={case.donate!r}, options={case.options_text()},",
             f"             reshard_inputs={'auto' in case.arg_modes!r})",
             REPRO_TAIL.strip(), ""]
    if case.threads > 1:
        at = lines.index(REPRO_TAIL.strip())
        lines[at:at] = [THREADS.strip().replace("N_THREADS", str(case.threads)), ""]
    lines.insert(lines.index(f"mesh = {case.mesh_text()}"), STRUCTURE.strip() + "\n\n")
    return "\n".join(lines)


def _make_text(i: InputSpec) -> str:
    high = f", high={i.high}" if i.high else ""
    return f"make_input({i.shape!r}, {DTYPE_NAMES[i.dtype]}, {i.seed} + 1000 * call{high})"


STRUCTURE = '''
def structure(per_input):
    """Per-input values as f's positional arguments: unpacked inputs, then the dict p of packed ones."""
    names = [f"x{k}" for k in range(len(per_input))]
    flat = [v for n, v in zip(names, per_input) if n not in packed]
    return flat + ([{n: v for n, v in zip(names, per_input) if n in packed}] if packed else [])
'''

THREADS = '''
def threaded_first_call():
    """The first call from N_THREADS threads at once (concurrent tracing); one thread's result."""
    import threading
    results = []
    def one():
        results.append(g(*structure([place(t, m, s, p) for t, m, s, p in zip(inputs, modes, in_specs, pre_specs)])))
    ts = [threading.Thread(target=one) for _ in range(N_THREADS)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return results[0]
'''

REPRO_TAIL = '''
def place(t, mode, spec, pre):
    ns = lambda s: spmd.NamedSharding(mesh, s if s is not None else P())
    if mode == "tensor":
        return t
    if mode == "put":
        return spmd.device_put(t, ns(spec))
    a = spmd.device_put(t, ns(pre))
    return a.reshard(ns(spec)) if mode == "reshard" else a


for call in range(CALLS):  # each call with fresh inputs, through the same jitted g
    inputs = make_inputs(call)
    print(f"call {call}:")
    args = structure([place(t, m, s, p) for t, m, s, p in zip(inputs, modes, in_specs, pre_specs)])
    out = threaded_first_call() if call == 0 and "threaded_first_call" in globals() else g(*args)
    outs = out if isinstance(out, tuple) else (out,)
    f64 = {"F32": F64, "F64": F64, "BF16": F64, "F16": F64}
    g64 = type(f)(f.__code__, {**f.__globals__, **f64})
    refs = g64(*structure([t.double() if t.is_floating_point() else t for t in inputs]))
    eager = f(*structure(inputs))
    refs = refs if isinstance(refs, tuple) else (refs,)
    eager = eager if isinstance(eager, tuple) else (eager,)
    for i, (o, r, e) in enumerate(zip(outs, refs, eager)):
        got = o.to_torch()
        print(f"output {i}: spmd {o.dtype}{list(o.shape)} eager {e.dtype}{list(e.shape)}")
        if got.shape == e.shape and got.is_floating_point():
            scale = r.abs().max().item() or 1.0
            print(f"  spmd error {(got.double() - r).abs().max().item() / scale:.3g}, "
                  f"eager error {(e.double() - r).abs().max().item() / scale:.3g} (relative to max |ref|)")
        elif got.shape == e.shape:
            print("  equal to eager:", torch.equal(got, e))
'''
