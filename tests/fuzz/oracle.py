"""Run one ``Case`` through ``spmd.jit`` and judge it against PyTorch eager.

Outcome classes:
  match        every output equals the eager program (shape, dtype, sharding, values within tolerance),
               inputs are untouched and donated arrays are dead.
  unsupported  ``spmd.UnsupportedOpError``, or a ValueError/TypeError listed in USER_ERRORS.
  crash        any other exception from spmd (an internal error reaching the user).
  wrong        a wrong shape, dtype, output sharding or value, a modified input, a live donated array.
  invalid      the program fails in eager PyTorch itself (a generator defect; not counted against spmd).

Tolerance (values). Per float output, errors are measured against the program run in float64 (the
inputs as drawn, upcast exactly; every cast in the program to F32/F64/BF16/F16 becomes float64), as
``err(y) = max|y - ref| / max|ref|`` over the elements where ``ref`` and eager are finite. The error
PyTorch eager itself makes in the program's own dtypes sets the bar:

    est = max(err(eager), err(eager_f32) * eps(out dtype) / eps(float32),
              noise / max|ref| * (eps(float32) / (NOISE_ULPS * eps(float64)) for float32 outputs, else 1))
    pass  iff  err(spmd) <= K * est + ATOL[out dtype]

``eager_f32`` (every float dtype mapped to float32) measures the program's conditioning, which the
second term carries over to float64 outputs, where eager and the reference coincide. ``noise`` is
the spread of float64 runs on inputs perturbed by a few ulps (Monte Carlo arithmetic): the float64
rounding error relative to the magnitude of the terms, which matters where an output cancels (a
sum of size-1 terms that is ~1e-15) and the float32 run says nothing (it cancels to 0 too); scaled
to float32's precision, it bounds the rounding of a float32 output that cancels (a sum of
layer-norm outputs that is ~1e-8 in float32, where eager's happens to be exact). "out dtype"
is the least precise float dtype the output passed through (its inputs and casts, ``lowest_dtype``):
a bf16 mean cast to float32 keeps bf16's rounding, and a mean reduced across devices may round
its bf16 partial sums where eager accumulates in float32 (one ulp of bf16, legitimately). K = 8 allows
the legitimate differences of a partitioned program (partial sums reduced in another order, a
reduction split over devices, fused kernels accumulating differently) and still fails the 27x
eager error of the bf16 partial-sum defect of issue 20; ATOL (about two ulps of the output
type at the output's scale) covers outputs eager happens to get exactly right. Non-finite
elements must match the reference where eager matches it; where eager overflows and the
reference does not, the element is not compared. Integer and bool outputs must equal eager exactly.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import spmd
from spmd.frontend.aten_common import UnsupportedOpError
from tests.fuzz.case import Case, reproducer

K = 8.0
#: Float64 runs on perturbed inputs (and the perturbation, in ulps of float64) that measure the
#: float64 program's own rounding noise (Monte Carlo arithmetic; see ``compare_float``).
NOISE_RUNS, NOISE_ULPS = 2, 4.0
ATOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
EPS = {dt: torch.finfo(dt).eps for dt in ATOL}

#: ValueError/TypeError messages that are legitimate user errors for generated programs (regexes).
USER_ERRORS: tuple[str, ...] = ()


@dataclass
class Outcome:
    """The verdict on one case: ``cls`` (see the module docstring), a short ``signature`` grouping
    equal failures, ``detail`` (message / traceback tail), and per float output (spmd error / est)."""

    cls: str
    signature: str = ""
    detail: str = ""
    ratios: list[float] = field(default_factory=list)


class Wrong(Exception):
    """A wrong result found while checking outputs; ``kind`` names what was wrong."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def _tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


class EagerWorkarounds(TorchDispatchMode):
    """Eager PyTorch with its known CPU kernel defects avoided, so the reference is the right answer.

    ``median(dim)`` / ``nanmedian(dim)`` (torch 2.13 CPU) answer values of other rows when the
    reduced dim has stride 0 (an ``expand``ed dim); their operand is made contiguous first.
    """

    CONTIGUOUS_OPERAND = (torch.ops.aten.median.dim, torch.ops.aten.nanmedian.dim,
                          torch.ops.aten.median.default, torch.ops.aten.nanmedian.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.CONTIGUOUS_OPERAND:
            args = (args[0].contiguous(), *args[1:])
        return func(*args, **(kwargs or {}))


def references(case: Case, inputs: list[torch.Tensor]) -> tuple[tuple, tuple, tuple, tuple]:
    """(eager in the program's dtypes, eager with every float dtype float32, float64 reference, float64
    noise): the noise of float output k is the elementwise max |y - ref| over NOISE_RUNS float64 runs on
    inputs perturbed by a few ulps (None for other outputs); see ``compare_float``."""
    f64 = {k: torch.float64 for k in ("F32", "F64", "BF16", "F16")}
    f32 = {k: torch.float32 for k in f64}
    as64 = [t.double() if t.is_floating_point() else t for t in inputs]
    with EagerWorkarounds():
        eager = _tuple(case.function()(*case.structure([t.clone() for t in inputs])))
        e32 = _tuple(case.function(f32)(*case.structure([t.float() if t.is_floating_point() else t
                                                           for t in inputs])))
        ref = _tuple(case.function(f64)(*case.structure([t.clone() for t in as64])))
        noise: list = [torch.zeros_like(r) if r.is_floating_point() else None for r in ref]
        g = torch.Generator().manual_seed(len(case.body))
        for _ in range(NOISE_RUNS):
            pert = [t * (1 + NOISE_ULPS * torch.finfo(torch.float64).eps
                         * (2 * torch.rand(t.shape, generator=g, dtype=torch.float64) - 1))
                    if t.is_floating_point() else t for t in as64]
            for k, y in enumerate(_tuple(case.function(f64)(*case.structure(pert)))):
                if noise[k] is not None and y.shape == ref[k].shape:
                    noise[k] = torch.maximum(noise[k], (y - ref[k]).abs().nan_to_num(0.0, 0.0, 0.0))
    return eager, e32, ref, tuple(noise)


def _mesh(case: Case) -> spmd.Mesh:
    return spmd.Mesh.create(dict(case.mesh_axes), devices=f"{case.device}:{case.num_devices}")


def _place(case: Case, mesh, t: torch.Tensor, i: int):
    mode, spec, pre = case.arg_modes[i], case.in_specs[i], case.pre_specs[i]
    ns = lambda s: spmd.NamedSharding(mesh, spmd.PartitionSpec(*(s or ())))  # noqa: E731
    if mode == "tensor":
        return t
    if mode == "put":
        return spmd.device_put(t, ns(spec))
    a = spmd.device_put(t, ns(pre))
    return a.reshard(ns(spec)) if mode == "reshard" else a


def jitted(case: Case, mesh):
    """``spmd.jit`` of the case's program with its shardings, donation and options."""
    P = spmd.PartitionSpec
    in_specs = tuple(case.structure([None if s is None else P(*s) for s in case.in_specs]))
    out = None
    if case.out_specs is not None:
        outs = tuple(P(*s) for s in case.out_specs)
        out = outs[0] if len(case.outputs) == 1 else outs
    return spmd.jit(case.function(), mesh=mesh, in_shardings=in_specs, out_shardings=out,
                    donate_argnums=case.donate, options=spmd.CompileOptions(**dict(case.options)),
                    reshard_inputs="auto" in case.arg_modes)


def run_case(case: Case) -> Outcome:
    """Compile and call ``case`` (``case.calls`` times, fresh inputs each time) and judge it."""
    ratios: list[float] = []
    try:
        mesh = _mesh(case)
        fn = jitted(case, mesh)
        for call in range(case.calls):
            inputs = [i.make(call) for i in case.inputs]
            try:
                eager, e32, ref, noise = references(case, inputs)
            except Exception as e:  # noqa: BLE001 - the generator made a program eager rejects
                return Outcome("invalid", f"generator: eager failed: {type(e).__name__}: {normalise(str(e))}",
                               traceback.format_exc()[-1500:])

            def one_call(inputs=inputs, eager=eager, e32=e32, ref=ref, noise=noise, call=call) -> list[float]:
                args = [_place(case, mesh, t, i) for i, t in enumerate(inputs)]
                out = _tuple(fn(*case.structure(args)))
                r = check_outputs(case, mesh, out, eager, e32, ref, noise)
                check_inputs(case, call, args)
                return r

            ratios += one_call() if call or case.threads <= 1 else _in_threads(one_call, case.threads)
    except Wrong as w:
        return Outcome("wrong", wrong_signature(case, w.kind), str(w), ratios)
    except Exception as e:  # noqa: BLE001 - every exception is classified
        return classify_exception(case, e)
    return Outcome("match", ratios=ratios)


def _in_threads(fn, n: int) -> list[float]:
    """Run ``fn`` in ``n`` threads at once (the first call traces and compiles concurrently); the
    first exception any thread raised is re-raised here."""
    import threading

    results: list = [None] * n
    barrier = threading.Barrier(n)

    def worker(k: int) -> None:
        try:
            barrier.wait()
            results[k] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            results[k] = e

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [x for r in results for x in r]


def check_outputs(case: Case, mesh, out: tuple, eager: tuple, e32: tuple, ref: tuple,
                  noise: tuple | None = None) -> list[float]:
    if len(out) != len(eager):
        raise Wrong("structure", f"{len(out)} outputs, eager has {len(eager)}")
    ratios = []
    noise = noise or (None,) * len(ref)
    storages: dict[int, int] = {}
    for i, (o, e, e2, r, nz) in enumerate(zip(out, eager, e32, ref, noise)):
        if not isinstance(o, spmd.ShardedArray):
            raise Wrong("type", f"output {i}: {type(o).__name__}, expected a ShardedArray")
        for sh in o.shards:  # outputs own their memory: donating one must not change another
            if sh.data.numel():
                j = storages.setdefault(sh.data.untyped_storage().data_ptr(), i)
                if j != i:
                    raise Wrong("aliasing", f"outputs {j} and {i} share a buffer on {sh.device}")
        if tuple(o.shape) != tuple(e.shape) or o.dtype != e.dtype:
            raise Wrong("shape/dtype", f"output {i}: {o.dtype}{list(o.shape)}, eager {e.dtype}{list(e.shape)}")
        if case.out_specs is not None:
            want = spmd.NamedSharding(mesh, spmd.PartitionSpec(*case.out_specs[i]))
            if o.sharding != want:
                raise Wrong("sharding", f"output {i}: sharding {o.sharding}, expected {want}")
        got = o.to_torch()
        if tuple(got.shape) != tuple(e.shape) or got.dtype != e.dtype:
            raise Wrong("to_torch", f"output {i}: to_torch gives {got.dtype}{list(got.shape)}, eager {e.dtype}")
        if not e.is_floating_point():
            if not torch.equal(got, e):
                raise Wrong("values-exact", f"output {i} ({e.dtype}): differs from eager in "
                            f"{int((got != e).sum())} of {e.numel()} elements")
            continue
        ratios.append(compare_float(i, got, e, e2, r, floor=lowest_dtype(case, case.outputs[i], e.dtype), noise=nz))
    return ratios


_CASTS = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16}


def lowest_dtype(case: Case, name: str, out_dtype: torch.dtype) -> torch.dtype:
    """The least precise float dtype among ``out_dtype``, the inputs ``name`` depends on and the casts
    on its way (its ATOL applies: a bf16 value cast to float32 keeps bf16's rounding)."""
    need, lowest = {name}, out_dtype
    inputs = {i.name: i.dtype for i in case.inputs}
    for line in reversed(case.body):
        target, _, expr = line.partition(" = ")
        target = re.match(r"\w+", target).group(0) if re.match(r"\w+", target) else target
        if target not in need:
            continue
        need |= set(re.findall(r"\b[vx]\d+\b", expr))
        for cast in re.findall(r"\.to\((F32|F64|BF16|F16)\)", expr):
            lowest = max(lowest, _CASTS[cast], key=lambda dt: EPS[dt])
    for n in need:
        if n in inputs and inputs[n] in EPS:
            lowest = max(lowest, inputs[n], key=lambda dt: EPS[dt])
    return lowest


def _noise_to(dt: torch.dtype) -> float:
    """The factor from the float64 noise (inputs perturbed by ``NOISE_ULPS`` float64 ulps) to the
    rounding noise of a float32 run: one float32 ulp per ``NOISE_ULPS`` float64 ulps. 1 for other
    dtypes: float64 outputs keep their measured noise, and for 16-bit outputs one ulp of their own
    would exceed eager's error (half an ulp) and hide defects such as issue 20's (27x eager's error);
    for float32 outputs it stays below ``ATOL`` wherever the output does not cancel."""
    return EPS[torch.float32] / (NOISE_ULPS * EPS[torch.float64]) if dt == torch.float32 else 1.0


def compare_float(i: int, got, eager, e32, ref, floor: torch.dtype | None = None, noise=None) -> float:
    """Raise Wrong unless ``got`` is within tolerance (module docstring); returns err(spmd) / tolerance.

    ``floor``: the least precise dtype the value passed through (ATOL and the conditioning term use it).
    ``noise``: elementwise |y - ref| of float64 runs on inputs perturbed by a few ulps (``references``),
    the float64 program's own rounding noise, which counts in ``est`` like eager's error, scaled to
    float32's precision for a float32 output (``_noise_to``): an output
    that cancels to ~1e-15 (a sum of terms of size 1) is noise, and is only held to noise's size.
    This is Monte Carlo arithmetic (Parker, Pierce, Eggert 2000; Vignes's CESTAC, 1993): the spread
    of randomly perturbed runs estimates the rounding error relative to the terms, not the result.
    """
    dt = eager.dtype if floor is None or EPS[floor] < EPS[eager.dtype] else floor
    got, eager, e32, ref = got.double(), eager.double(), e32.double(), ref.double()
    fin_ref, fin_eager, fin_got = torch.isfinite(ref), torch.isfinite(eager), torch.isfinite(got)
    agree = fin_ref == fin_eager
    bad_nonfinite = ~fin_ref & agree & ~((got == ref) | (got.isnan() & ref.isnan()))
    if bad_nonfinite.any() or (fin_ref & fin_eager & ~fin_got).any():
        raise Wrong("nonfinite", f"output {i}: non-finite values where the reference has "
                    f"{ref[bad_nonfinite | (fin_ref & ~fin_got)][:4].tolist()}")
    cmp = fin_ref & fin_eager
    if not cmp.any():
        return 0.0
    scale = ref[cmp].abs().max().item() or 1.0
    err = lambda y: ((y - ref)[cmp & torch.isfinite(y)].abs().max().item() if (cmp & torch.isfinite(y)).any()
                     else 0.0) / scale  # noqa: E731
    est = max(err(eager), err(e32) * EPS[dt] / EPS[torch.float32],
              noise.double()[cmp].max().item() / scale * _noise_to(dt) if noise is not None else 0.0)
    tol = K * est + ATOL[dt]
    e_got = err(got)
    if not e_got <= tol:
        raise Wrong("values", f"output {i}: error {e_got:.3g} (relative to max|ref| {scale:.3g}), "
                    f"eager error {err(eager):.3g}, float32-run error {err(e32):.3g}, tolerance {tol:.3g}")
    return e_got / tol


def check_inputs(case: Case, call: int, args: list) -> None:
    """Undonated arguments keep their values (tensors and arrays); donated arrays are dead."""
    for i, a in enumerate(args):
        fresh = case.inputs[i].make(call)
        if isinstance(a, torch.Tensor):
            if not torch.equal(a, fresh):
                raise Wrong("input-mutated", f"argument {i} (a torch.Tensor) was modified by the call")
        elif case.position(i) in case.donate:
            if not a.is_deleted:
                raise Wrong("donation-contract", f"argument {i} was donated but is still alive")
        elif a.is_deleted or not torch.equal(a.to_torch(), fresh):
            raise Wrong("input-mutated", f"argument {i} (a ShardedArray, not donated) was "
                        f"{'deleted' if a.is_deleted else 'modified'} by the call")


def classify_exception(case: Case, e: BaseException) -> Outcome:
    """unsupported for UnsupportedOpError and USER_ERRORS, else crash; with a normalised signature."""
    msg = str(e)
    tb = traceback.extract_tb(e.__traceback__)
    where = next((f"{_short(fr.filename)}:{fr.name}" for fr in reversed(tb) if "/spmd/" in fr.filename), "?")
    text = f"{type(e).__name__}: {normalise(msg)}"
    if isinstance(e, UnsupportedOpError):
        op = re.search(r"aten\.[\w.]+", msg)
        return Outcome("unsupported", f"UnsupportedOpError: {op.group(0) if op else normalise(msg)[:80]}", msg)
    if isinstance(e, (ValueError, TypeError)) and any(re.search(p, msg) for p in USER_ERRORS):
        return Outcome("unsupported", f"user error: {text[:100]}", msg)
    donation = "donation" if case.donate else "no donation"
    tail = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
    return Outcome("crash", f"[{donation}] {text[:140]} @ {where}", tail)


def wrong_signature(case: Case, kind: str) -> str:
    donation = "donation" if case.donate else "no donation"
    dtypes = sorted({str(i.dtype).removeprefix("torch.") for i in case.inputs if i.dtype.is_floating_point})
    return f"[{donation}] wrong {kind} ({'/'.join(dtypes)}, {case.num_devices} devices)"


def normalise(msg: str) -> str:
    """``msg`` with numbers, value names and quoted text generalised (equal bugs get one signature)."""
    msg = msg.splitlines()[0] if msg else ""
    msg = re.sub(r"%[\w.\-]+", "%X", msg)
    msg = re.sub(r"\b[vx]\d+\b", "vN", msg)
    msg = re.sub(r"\d+", "N", msg)
    return msg


def _short(path: str) -> str:
    return path[path.rindex("/spmd/") + 1:] if "/spmd/" in path else path


def describe(case: Case, outcome: Outcome) -> str:
    """A failure report: the outcome, then the standalone reproducer."""
    return f"{outcome.cls}: {outcome.signature}\n{outcome.detail}\n\n{reproducer(case, outcome.signature)}"
