"""Focused collective-matmul probe on local GPUs: correctness, races, overlap and × limit per variant.

For each shape and side (``ag``, ``rs`` as in ``benchmarks/cm_local.py``) it times the GEMM alone,
the NCCL collective alone, the NCCL serial baseline and several spmd variants in interleaved
rounds, checks every spmd result against a float32 reference (fresh random inputs), runs the
static race checker (``spmd.runtime.hazards``) on every lowered program, and prints one traced
call per windowed variant (per-thunk start/end on device 0). It also measures the peer-copy
bandwidth one way and both ways at once. Prints a table of time / limit last, where
limit = max(compute-only, comm-only).

Usage: ``python3 -m benchmarks.probe.cm_probe --shapes "8192,8192,28672;16384,8192,4096"``
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks import cm_local, common

VARIANTS = {
    "off": {"windowed_einsum": "off"},
    "uni-1s": {"windowed_einsum": "on", "num_compute_streams": 1, "bidirectional": False},
    "bi-1s": {"windowed_einsum": "on", "num_compute_streams": 1, "bidirectional": True},
    "uni-2s": {"windowed_einsum": "on", "num_compute_streams": 2, "bidirectional": False},
    "auto": {"windowed_einsum": "auto"},
}


def _executable(compiled):
    ex = compiled.executable
    return getattr(ex, "executable", ex)


def _copy_bandwidth(log) -> dict:
    """GB/s of a 256 MiB peer copy 0→1 alone and of two at once (0→1 and 1→0 on separate streams)."""
    import torch

    n = 128 << 20
    a0, a1 = torch.randn(n, device="cuda:0").bfloat16(), torch.randn(n, device="cuda:1").bfloat16()
    b0, b1 = torch.empty_like(a0), torch.empty_like(a1)
    s0, s1 = torch.cuda.Stream("cuda:0"), torch.cuda.Stream("cuda:1")

    def one():
        with torch.cuda.stream(s0):
            b1.copy_(a0, non_blocking=True)

    def both():
        with torch.cuda.stream(s0):
            b1.copy_(a0, non_blocking=True)
        with torch.cuda.stream(s1):
            b0.copy_(a1, non_blocking=True)

    out = {}
    for name, fn, nbytes in (("one_way", one, 2 * n), ("both_ways_total", both, 4 * n)):
        fn()
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        out[name] = nbytes * 10 / (time.perf_counter() - t0) / 1e9
    log(f"peer copy GB/s: {json.dumps({k: round(v, 1) for k, v in out.items()})}")
    return out


def _trace(compiled, si, log, label: str) -> None:
    from spmd.runtime.trace_events import TraceRecorder

    ex = _executable(compiled)
    args = [[sh.data for sh in a.shards] for a in si.args]
    ex.run(args)
    rec = TraceRecorder()
    ex.run(args, trace=rec)
    evs = [e for e in rec.events() if e.device == 0]
    log(f"trace {label} (device 0, us): " + "; ".join(
        f"{e.name}@s{e.stream_id} {e.start_us:.0f}-{e.end_us:.0f}" for e in evs))


def run_side(side, shape, x, w, ref, devices, args, log) -> list[dict]:
    """Check, trace and time every variant of one side; returns table rows."""
    from spmd.runtime.hazards import find_hazards

    p = cm_local.make_problem(side, x, w, devices)
    comm = cm_local.LocalComm(devices)
    variants = cm_local.baseline_variants(p, comm)
    si = cm_local.spmd_inputs(p, devices)
    info = {}
    for name in args.variants:
        opts = dict(VARIANTS[name], cuda_graphs=False)
        try:
            fn, inf = cm_local.spmd_variant(p, si, opts, ref)
            variants[name] = fn
            f = si.spmd.jit(cm_local.matmul, mesh=si.mesh, in_shardings=tuple(
                si.spmd.PartitionSpec(*s) for s in cm_local.SPECS[side][:2]),
                out_shardings=si.spmd.PartitionSpec(*cm_local.SPECS[side][2]),
                options=si.spmd.CompileOptions(**opts))
            compiled = f.lower(*si.args).compile()
            haz = find_hazards(_executable(compiled).program)
            inf["hazards"] = [str(h) for h in haz[:3]]
            inf["hlo"] = inf.get("hlo")
            info[name] = inf
            log(f"{side} {shape} {name}: rel_err={inf.get('rel_err'):.2e} hazards={len(haz)} hlo={inf.get('hlo')}")
            if name in ("uni-1s", "bi-1s", "auto") and shape == args.shapes[0] or args.trace_all:
                _trace(compiled, si, log, f"{side} {shape} {name}")
        except Exception as exc:  # report and go on
            log(f"{side} {shape} {name}: FAILED {type(exc).__name__}: {exc}"[:400])
    common.synchronize(p.devices)
    res = common.interleaved(variants, p.devices, rounds=args.rounds, warmup=2, reps=args.reps, log=log)
    cm_local.drop_spmd_executables()
    limit = max(res["compute"].median_ms, res["comm"].median_ms)
    rows = []
    for name, m in res.items():
        rows.append({"side": side, "shape": shape, "variant": name, "ms": m.median_ms,
                     "x_limit": m.median_ms / limit if m.median_ms else None,
                     "rel_err": info.get(name, {}).get("rel_err"), "hazards": info.get(name, {}).get("hazards")})
    return rows


def main(argv=None) -> int:
    import torch

    common.apply_required_env()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=cm_local.parse_shapes, default=[(8192, 8192, 28672), (16384, 8192, 4096)])
    ap.add_argument("--sides", default="ag,rs")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--trace-all", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    torch.backends.cuda.matmul.allow_tf32 = False
    log = lambda s: print(s, flush=True)  # noqa: E731
    devices = [torch.device("cuda", i) for i in range(2)]
    bw = _copy_bandwidth(log)
    rows = []
    for i, shape in enumerate(args.shapes):
        m, k, n = shape
        x = common.fresh_randn((m, k), torch.bfloat16, devices[0], 1000 + i, scale=1.0)
        w = common.fresh_randn((k, n), torch.bfloat16, devices[0], 2000 + i, scale=1.0 / math.sqrt(k))
        ref = torch.matmul(x.float(), w.float())
        for side in args.sides.split(","):
            rows += run_side(side, shape, x, w, ref, devices, args, log)
        del x, w, ref
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_gbps": bw, "rows": rows}, indent=1))
    log(f"{'side':<4}{'M,K,N':>18} {'variant':<10}{'ms':>8}{'x limit':>9}{'rel_err':>10}")
    for r in rows:
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        xl = "n/a" if r["x_limit"] is None else f"{r['x_limit']:.3f}"
        ms = "n/a" if r["ms"] is None else f"{r['ms']:.3f}"
        log(f"{r['side']:<4}{','.join(map(str, r['shape'])):>18} {r['variant']:<10}{ms:>8}{xl:>9}{err:>10}"
            + ("" if not r["hazards"] else " HAZARDS"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
