"""Collective-matmul measurements in one process over all local devices (a worker of collective_matmul.py).

For each shape (M tokens, K, N) and side, times in one interleaved run:

* ``compute``  the per-device GEMM alone, all devices at once;
* ``comm``     the NCCL collective of the same bytes (all-gather of x, resp. reduce-scatter of the
  partial product);
* ``serial``   NCCL baseline: all-gather then matmul, resp. matmul then reduce-scatter;
* ``spmd:*``   ``spmd.jit(x @ w)`` under several ``CompileOptions`` (a variant that fails to
  build or run is reported as n/a with its error; the others go on).

Sides (bf16, tp = number of devices):

* ``ag`` (all-gather→matmul): x [M, K] sharded on M, w [K, N] sharded on N; out [M, N/tp] per device.
* ``rs`` (matmul→reduce-scatter): x sharded on K, w sharded on K; out [M/tp, N] per device.

Collectives go through ``torch.cuda.nccl`` (single process, one communicator over the devices,
each device's current stream); on CPU devices (tests) they are plain tensor copies.
Every result is printed as a JSON line (``common.emit``) as soon as it is known.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common

DEFAULT_SHAPES: tuple[tuple[int, int, int], ...] = (
    (8192, 12288, 49152), (8192, 8192, 28672), (16384, 8192, 4096),
    (2048, 24576, 24576), (4096, 4096, 4096), (1024, 24576, 24576),
)
SIDES = ("ag", "rs")
#: Per side: PartitionSpec entries of x, w and the output over the mesh axis "tp".
SPECS: dict[str, tuple[tuple[str | None, ...], ...]] = {
    "ag": (("tp", None), (None, "tp"), (None, "tp")),
    "rs": ((None, "tp"), ("tp", None), ("tp", None)),
}
#: spmd variants: name -> CompileOptions keyword arguments.
SPMD_VARIANTS: dict[str, dict[str, Any]] = {
    "spmd:off": {"windowed_einsum": "off"},
    "spmd:on-1s": {"windowed_einsum": "on", "num_compute_streams": 1},
    "spmd:on-2s": {"windowed_einsum": "on", "num_compute_streams": 2},
    "spmd:auto": {"windowed_einsum": "auto"},
    "spmd:auto+graphs": {"windowed_einsum": "auto", "cuda_graphs": True},
    "spmd:on-2s+graphs": {"windowed_einsum": "on", "num_compute_streams": 2, "cuda_graphs": True},
}
BF16_TOLERANCE = 1e-2


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """Parse ``"M,K,N;M,K,N"`` (also ``x`` as separator inside a shape) into shape triples."""
    shapes = []
    for part in text.replace(" ", "").split(";"):
        if not part:
            continue
        dims = part.replace("x", ",").split(",")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ValueError(f"--shapes: expected 'M,K,N' triples of positive ints, got {part!r}")
        shapes.append((int(dims[0]), int(dims[1]), int(dims[2])))
    if not shapes:
        raise ValueError(f"--shapes: expected at least one shape, got {text!r}")
    return shapes


def check_divisible(shape: Sequence[int], tp: int) -> None:
    """ValueError unless M, K and N all divide by ``tp`` (both sides shard all three)."""
    if any(d % tp for d in shape):
        raise ValueError(f"shape {tuple(shape)}: M, K and N must divide by tp={tp}")


class LocalComm:
    """All-gather / reduce-scatter over a list of local devices, one tensor per device.

    CUDA: ``torch.cuda.nccl`` on each device's current stream. CPU: plain copies (for tests).
    Layout: all-gather concatenates along dim 0; reduce-scatter sums and splits along dim 0.
    """

    def __init__(self, devices: Sequence[Any]):
        import torch

        self.devices = [torch.device(d) for d in devices]
        self.cuda = all(d.type == "cuda" for d in self.devices)

    def all_gather(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
        """outputs[i] = concat(inputs, dim 0) on device i."""
        if self.cuda:
            import torch.cuda.nccl as nccl

            nccl.all_gather(list(inputs), list(outputs))
            return
        import torch

        full = torch.cat([t.to(outputs[0].device) for t in inputs], 0)
        for out in outputs:
            out.copy_(full)

    def reduce_scatter(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
        """outputs[i] = chunk i (dim 0) of sum(inputs)."""
        if self.cuda:
            import torch.cuda.nccl as nccl

            nccl.reduce_scatter(list(inputs), list(outputs))
            return
        total = inputs[0].clone()
        for t in inputs[1:]:
            total += t.to(total.device)
        for out, chunk in zip(outputs, total.chunk(len(outputs), 0), strict=True):
            out.copy_(chunk)


@dataclass
class Problem:
    """One side of one shape on ``tp`` devices: global inputs, per-device shards and buffers.

    ``x`` [M, K] and ``w`` [K, N] live on devices[0]. ``ag``: ``x_shards[i]`` [M/tp, K],
    ``w_shards[i]`` [K, N/tp], ``mid[i]`` [M, K] (gathered x), ``out[i]`` [M, N/tp].
    ``rs``: ``x_shards[i]`` [M, K/tp], ``w_shards[i]`` [K/tp, N], ``mid[i]`` [M, N] (partial
    product), ``out[i]`` [M/tp, N].
    """

    side: str
    shape: tuple[int, int, int]
    devices: list[Any]
    x: Any
    w: Any
    x_shards: list[Any]
    w_shards: list[Any]
    mid: list[Any]
    out: list[Any]


def make_problem(side: str, x: Any, w: Any, devices: Sequence[Any]) -> Problem:
    """Shard global ``x`` [M, K], ``w`` [K, N] over ``devices`` for ``side``; allocate buffers."""
    import torch

    if side not in SIDES:
        raise ValueError(f"side: expected one of {SIDES}, got {side!r}")
    tp = len(devices)
    (m, k), n = x.shape, w.shape[1]
    check_divisible((m, k, n), tp)
    devs = [torch.device(d) for d in devices]
    xd, wd = (0, 1) if side == "ag" else (1, 0)
    x_shards = [c.to(d).contiguous() for c, d in zip(x.chunk(tp, xd), devs, strict=True)]
    w_shards = [c.to(d).contiguous() for c, d in zip(w.chunk(tp, wd), devs, strict=True)]
    mid_shape, out_shape = ((m, k), (m, n // tp)) if side == "ag" else ((m, n), (m // tp, n))
    mid = [torch.empty(mid_shape, dtype=x.dtype, device=d) for d in devs]
    out = [torch.empty(out_shape, dtype=x.dtype, device=d) for d in devs]
    return Problem(side, (m, k, n), list(devs), x, w, x_shards, w_shards, mid, out)


def baseline_variants(p: Problem, comm: LocalComm) -> dict[str, Callable[[], None]]:
    """compute-only, comm-only and serial NCCL baseline callables for ``p`` (all devices at once).

    Fills ``p.mid`` once with real data first, so compute-only (ag) and comm-only (rs) never
    read uninitialised memory.
    """
    import torch

    if p.side == "ag":
        def compute():
            for a, b, o in zip(p.mid, p.w_shards, p.out, strict=True):
                torch.matmul(a, b, out=o)

        def comm_only():
            comm.all_gather(p.x_shards, p.mid)

        comm_only()
        return {"compute": compute, "comm": comm_only, "serial": lambda: (comm_only(), compute())}

    def compute_rs():
        for a, b, o in zip(p.x_shards, p.w_shards, p.mid, strict=True):
            torch.matmul(a, b, out=o)

    def comm_rs():
        comm.reduce_scatter(p.mid, p.out)

    compute_rs()
    return {"compute": compute_rs, "comm": comm_rs, "serial": lambda: (compute_rs(), comm_rs())}


def assemble_output(p: Problem, outs: Sequence[Any]) -> Any:
    """Global [M, N] result from per-device outputs (ag: concat dim 1; rs: concat dim 0)."""
    import torch

    dim = 1 if p.side == "ag" else 0
    return torch.cat([o.to(p.devices[0]) for o in outs], dim)


def make_mesh(spmd: Any, devices: Sequence[Any]) -> Any:
    """A one-axis ("tp",) spmd mesh over ``devices``; tries the spellings the Mesh API may take."""
    import torch

    devs = [torch.device(d) for d in devices]
    tp = len(devs)
    if devs[0].type == "cpu":
        attempts: list[Any] = [f"cpu:{tp}"]
    else:
        attempts = ["cuda"] if tp == torch.cuda.device_count() else []
        attempts += [devs, f"cuda:{tp}"]
    last: Exception | None = None
    for spec in attempts:
        try:
            return spmd.Mesh.create(("tp",), devices=spec)
        except Exception as exc:  # try the next spelling
            last = exc
    assert last is not None
    raise last


def matmul(x: Any, w: Any) -> Any:
    """The benchmarked program: ``x @ w``."""
    import torch

    return torch.matmul(x, w)


@dataclass(frozen=True)
class SpmdInputs:
    """spmd handles shared by all spmd variants of one side: the module, mesh and sharded args."""

    spmd: Any
    mesh: Any
    args: tuple[Any, Any]


def spmd_inputs(p: Problem, devices: Sequence[Any]) -> SpmdInputs:
    """Import spmd, build the mesh and place ``p.x``, ``p.w`` with the side's shardings."""
    import spmd

    mesh = make_mesh(spmd, devices)
    xs, ws, _ = SPECS[p.side]
    args = tuple(spmd.device_put(t, spmd.NamedSharding(mesh, spmd.PartitionSpec(*s)))
                 for t, s in ((p.x, xs), (p.w, ws)))
    return SpmdInputs(spmd, mesh, args)  # type: ignore[arg-type]


def spmd_variant(p: Problem, si: SpmdInputs, options: dict[str, Any], ref: Any | None
                 ) -> tuple[Callable[[], Any], dict[str, Any]]:
    """Compile ``x @ w`` with ``options``, run it once, check it; returns (callable, info).

    ``info`` holds ``compile_s``, ``hlo`` (collective counts of the last compiler stage's text)
    and, when ``ref`` is given, ``rel_err`` against it.
    Raises whatever spmd raises; the caller marks the variant n/a.
    """
    spmd, P = si.spmd, si.spmd.PartitionSpec
    xs, ws, outs = SPECS[p.side]
    # 16-bit partial sums, as the peers (PyTorch async TP, XLA) reduce-scatter them: same bytes on the wire
    f = spmd.jit(matmul, mesh=si.mesh, in_shardings=(P(*xs), P(*ws)), out_shardings=P(*outs),
                 options=spmd.CompileOptions(**{"float32_partial_sums": False, **options}))
    t0 = time.perf_counter()
    lowered = f.lower(*si.args)
    compiled = lowered.compile()
    info: dict[str, Any] = {"compile_s": round(time.perf_counter() - t0, 3)}
    try:
        info["hlo"] = common.hlo_op_counts(lowered.as_text(lowered.stages[-1]))
    except Exception as exc:  # the text is a diagnostic only
        info["hlo_error"] = f"{type(exc).__name__}: {exc}"[:200]
    result = compiled(*si.args)
    common.synchronize(p.devices)
    if ref is not None:
        info["rel_err"] = result_rel_error(result, ref)
    return (lambda: join_ready(compiled(*si.args))), info


def result_rel_error(result: Any, ref: Any) -> float:
    """Relative error of a ShardedArray against the global ``ref``, shard by shard on ``ref``'s device.

    sqrt(sum ||shard - ref[index]||^2 / sum ||ref[index]||^2) over the shards (replicas count
    in both sums alike), without assembling the global array on the host; falls back to
    ``to_torch()`` when the array has no ``shards``. NaN/inf gives ``inf``.
    """
    import torch

    shards = getattr(result, "shards", None)
    if shards is None:
        return common.rel_error(result.to_torch(), ref)
    result.block_until_ready()
    num = den = 0.0
    for shard in shards:
        r = ref[shard.index].float()
        num += float((shard.data.to(ref.device, torch.float32) - r).norm()) ** 2
        den += float(r.norm()) ** 2
    if not math.isfinite(num) or den == 0.0:
        return math.inf
    return math.sqrt(num / den)


def join_ready(result: Any) -> Any:
    """Make each device's current stream wait for ``result``'s per-device ready events.

    spmd runs an executable on its own streams and marks its outputs with ready events instead
    of joining back into the caller's stream (like PjRt). The timing events are recorded on
    the current streams, so they must wait for those ready events to see the work. Reads the
    runtime's ``ShardedArray._ready_events``; without them nothing is joined (the record's
    ``wall_ms`` then shows whether the events missed the work).
    """
    import torch

    events = getattr(result, "_ready_events", None)
    if not events:
        return result
    for dev, ev in zip(result.sharding.mesh.devices, events, strict=False):
        if ev is not None and torch.device(dev).type == "cuda":
            torch.cuda.current_stream(dev).wait_event(ev)
    return result


def drop_spmd_executables() -> None:
    """Free spmd's compiled executables (and their device buffers) between sides and shapes.

    Calls ``spmd.jit.clear_cache()`` where it exists, else empties the process-wide cache
    ``spmd.jit._GLOBAL_CACHE``; silently does nothing if neither is there.
    """
    mod = sys.modules.get("spmd.jit")  # the submodule: ``spmd.jit`` the attribute is the function
    if mod is None:
        return
    clear = getattr(mod, "clear_cache", None)
    if callable(clear):
        clear()
        return
    cache = getattr(mod, "_GLOBAL_CACHE", None)
    if isinstance(cache, dict):
        cache.clear()


def reps_for(shape: Sequence[int], tp: int, reps: int) -> int:
    """More reps for small GEMMs (estimated < 1 ms at 700 TFLOP/s per device), so rounds last."""
    est_ms = 2.0 * shape[0] * shape[1] * shape[2] / tp / 700e12 * 1e3
    return reps if est_ms >= 1.0 else max(reps, 30)


def run_side(side: str, x: Any, w: Any, ref: Any | None, devices: Sequence[Any], args: argparse.Namespace,
             log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Build and time every variant of one side; returns the records (also emitted)."""
    p = make_problem(side, x, w, devices)
    comm = LocalComm(devices)
    variants = baseline_variants(p, comm)
    infos: dict[str, dict[str, Any]] = {name: {} for name in variants}
    if ref is not None:
        variants["serial"]()
        common.synchronize(p.devices)
        infos["serial"]["rel_err"] = common.rel_error(assemble_output(p, p.out), ref)
    failed: dict[str, str] = {}
    if not args.no_spmd:
        try:
            si = spmd_inputs(p, devices)
        except Exception as exc:
            si = None
            failed.update({n: f"setup: {type(exc).__name__}: {exc}"[:500] for n in args.spmd_variants})
        for name in args.spmd_variants if si is not None else ():
            try:
                variants[name], infos[name] = spmd_variant(p, si, SPMD_VARIANTS[name], ref)
            except Exception as exc:  # spmd under construction: log, mark n/a, go on
                failed[name] = f"{type(exc).__name__}: {exc}"[:500]
                log(f"{side} {p.shape} {name}: n/a ({failed[name]})")
                if len(failed) == 1:
                    log(traceback.format_exc())
    reps = reps_for(p.shape, len(devices), args.reps)
    results = common.interleaved(variants, p.devices, rounds=args.rounds, warmup=args.warmup, reps=reps, log=log)
    variants.clear()
    if not args.no_spmd:
        drop_spmd_executables()
    records = []
    for name in [*results, *failed]:
        m = results.get(name)
        rec = {"kind": "cm", "source": "local", "side": side, "shape": list(p.shape), "tp": len(devices),
               "variant": name, "ms": m.median_ms if m else None, "wall_ms": m.wall_ms if m else None,
               "round_ms": list(m.round_ms) if m else [], "error": failed.get(name) or (m.error if m else None),
               "events_suspect": comm.cuda and events_suspect(m), **infos.get(name, {})}
        records.append(rec)
        common.emit(rec)
    return records


def events_suspect(m: common.Measurement | None) -> bool:
    """True when host wall time per rep is far above the event time: the events likely missed work."""
    if m is None or not m.ok or m.wall_ms is None:
        return False
    return m.wall_ms > 1.5 * m.median_ms and m.wall_ms - m.median_ms > 0.05


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run every requested shape and side until done or the budget is spent; returns the records."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    devices = resolve_devices(args.device, args.tp)
    deadline = common.Deadline(args.budget_s)
    dtype = getattr(torch, args.dtype)
    records: list[dict[str, Any]] = []
    seed = args.seed if args.seed is not None else common.fresh_seed()
    common.emit({"kind": "cm-meta", "source": "local", "seed": seed, "tp": len(devices),
                 "devices": [str(d) for d in devices]})
    for i, shape in enumerate(args.shapes):
        if i > 0 and deadline.expired(args.margin_s):  # the first shape always runs (see --margin-s)
            common.emit({"kind": "cm-skipped", "source": "local", "shape": list(shape), "reason": "budget"})
            continue
        check_divisible(shape, len(devices))
        m, k, n = shape
        x = common.fresh_randn((m, k), dtype, devices[0], seed + 2 * i, scale=1.0)
        w = common.fresh_randn((k, n), dtype, devices[0], seed + 2 * i + 1, scale=1.0 / math.sqrt(k))
        ref = None if args.no_check else torch.matmul(x.float(), w.float())
        for side in args.sides:
            records += run_side(side, x, w, ref, devices, args, log)
            common.emit({"kind": "cm-done", "source": "local", "side": side, "shape": list(shape)})
        del x, w, ref
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return records


def resolve_devices(device: str, tp: int) -> list[Any]:
    """``tp`` devices: cuda:0..tp-1 (ValueError if fewer GPUs), or ``tp`` times cpu."""
    import torch

    if tp < 1:
        raise ValueError(f"--tp: expected >= 1, got {tp}")
    if device == "cpu":
        return [torch.device("cpu")] * tp
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < tp:
        raise ValueError(f"--tp: asked for {tp} GPUs, found {n}")
    return [torch.device("cuda", i) for i in range(tp)]


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of the worker (also reused by collective_matmul.py)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=None, help="devices (default: all GPUs, or 2 on CPU)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shapes", type=parse_shapes, default=list(DEFAULT_SHAPES), help="'M,K,N;M,K,N'")
    ap.add_argument("--sides", type=lambda s: [x for x in s.split(",") if x], default=list(SIDES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--margin-s", type=float, default=20.0,
                    help="do not start a shape after the first with less time left (the first always runs: "
                    "a run that measures nothing is no benchmark; the parent's time box still bounds it)")
    ap.add_argument("--no-spmd", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="skip the float32 reference checks")
    ap.add_argument("--spmd-variants", type=lambda s: [x for x in s.split(",") if x], default=list(SPMD_VARIANTS))
    return ap


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill defaults that depend on the machine; ValueError on unknown sides/variants."""

    if args.tp is None:
        args.tp = common.default_tp(args.device)
    bad = [s for s in args.sides if s not in SIDES]
    if bad:
        raise ValueError(f"--sides: expected a subset of {SIDES}, got {bad}")
    bad = [v for v in args.spmd_variants if v not in SPMD_VARIANTS]
    if bad:
        raise ValueError(f"--spmd-variants: expected a subset of {list(SPMD_VARIANTS)}, got {bad}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the worker process."""
    common.apply_required_env()
    args = finish_args(build_parser().parse_args(argv))
    run(args, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
