"""JAX/XLA anchor, one process over the local GPUs: collective matmul (``--bench cm``) and dispatch.

Collective matmul, mesh axis ``"x"`` over tp devices, bf16 (as in shared/ANCHORS.md):

* ``ag``: x ``P("x", None)``, w ``P(None, "x")``, ``jit(x @ w)`` with out ``P(None, "x")``;
* ``rs``: x ``P(None, "x")``, w ``P("x", None)``, out ``P("x", None)``;
* limit parts in the same process: ``compute`` = the local GEMM alone (``shard_map``, no
  communication), ``comm`` = ``all_gather`` resp. ``psum_scatter`` alone (``shard_map``).

Windowed einsum is XLA's, switched on by the parent through ``XLA_FLAGS`` (a separate process):
the records carry the number of collective-permutes in the compiled HLO so the report can
show whether the flags took effect. ``--label`` names the source in the records.

JAX has no device events here: a variant's time is the host time of ``reps`` back-to-back calls
ended by one ``block_until_ready``, divided by ``reps`` (per round; median over interleaved
rounds). Dispatch (``--bench dispatch``): enqueue-only and synced host time per call of the
``benchmarks.workloads`` programs written in ``jax.numpy`` with the same shardings, float32
GEMMs at ``--matmul-precision`` (default full float32, as PyTorch's default; JAX's own default
on these GPUs is TF32); each record carries its relative distance to the full-float32 result.
MiniLM (``benchmarks.anchors.jax_minilm``) runs on the torch workload's weights and tokens,
placed by ``bert_plan``, and its record also carries ``rel_err_vs_torch``, the relative
distance to the PyTorch model's float32 output on CPU.

Devices: ``--device cuda`` takes JAX's GPUs, ``--device cpu`` its host devices (the parent sets
``XLA_FLAGS=--xla_force_host_platform_device_count=<tp>`` so there are ``tp`` of them; see
``benchmarks.harness.jax_child_env``); without ``--device``, the GPUs if JAX has any, else the
host devices.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import common, harness

DISPATCH_WORKLOADS = ("add", "mlp", "block", "minilm")
SPECS = {"ag": (("x", None), (None, "x"), (None, "x")), "rs": ((None, "x"), ("x", None), ("x", None))}


def _shard_map(f: Callable, mesh: Any, in_specs: Any, out_specs: Any) -> Callable:
    """``shard_map`` without replication checks, across JAX versions (jax.shard_map or experimental)."""
    import jax

    sm = getattr(jax, "shard_map", None)
    if sm is None:
        from jax.experimental.shard_map import shard_map as sm
    for kw in ({"check_vma": False}, {"check_rep": False}, {}):
        try:
            return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)
        except TypeError:
            continue
    raise RuntimeError("shard_map: no known signature accepted")


def _batched(fn: Callable[[], Any], k: int) -> Callable[[], None]:
    def run() -> None:
        out = None
        for _ in range(k):
            out = fn()
        out.block_until_ready()

    return run


def cm_side(side: str, shape: tuple[int, int, int], mesh: Any, seed: int, args: argparse.Namespace,
            label: str) -> None:
    """Time xla / compute / comm for one side of one shape and emit the records."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    m, k, n = shape
    tp = mesh.devices.size
    sh = lambda spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    xs, ws, outs = SPECS[side]

    def rand(key, dims, spec, scale):
        gen = jax.jit(lambda kk: (jax.random.normal(kk, dims, jnp.float32) * scale).astype(jnp.bfloat16),
                      out_shardings=sh(spec))
        return gen(key)

    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x, w = rand(kx, (m, k), xs, 1.0), rand(kw, (k, n), ws, 1.0 / math.sqrt(k))
    f = jax.jit(lambda a, b: a @ b, out_shardings=sh(outs))
    counts = common.hlo_op_counts(f.lower(x, w).compile().as_text())
    ref = jax.jit(lambda a, b: jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32),
                                          precision=jax.lax.Precision.HIGHEST), out_shardings=sh(outs))(x, w)
    got = f(x, w).astype(jnp.float32)
    rel_err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    del ref, got
    matmul = lambda a, b: a @ b  # noqa: E731
    if side == "ag":
        x_rep = jax.device_put(x, sh((None, None)))
        compute = jax.jit(_shard_map(matmul, mesh, (P(), P(None, "x")), P(None, "x")))
        comm = jax.jit(_shard_map(lambda a: jax.lax.all_gather(a, "x", axis=0, tiled=True), mesh, P("x", None), P()))
        calls = {"compute": lambda: compute(x_rep, w), "comm": lambda: comm(x)}
    else:
        compute = jax.jit(_shard_map(matmul, mesh, (P(None, "x"), P("x", None)), P("x", None)))
        partial = compute(x, w)  # per device [M, N]
        comm = jax.jit(_shard_map(lambda a: jax.lax.psum_scatter(a, "x", scatter_dimension=0, tiled=True),
                                  mesh, P("x", None), P("x", None)))
        calls = {"compute": lambda: compute(x, w), "comm": lambda: comm(partial)}
    calls["xla"] = lambda: f(x, w)
    reps = args.reps if 2.0 * m * k * n / tp / 700e12 >= 1e-3 else max(args.reps, 30)
    variants = {name: _batched(fn, reps) for name, fn in calls.items()}
    results = common.interleaved(variants, [], rounds=args.rounds, warmup=1, reps=1,
                                 log=lambda s: print(s, flush=True))
    for name, r in results.items():
        rec = {"kind": "cm", "source": label, "side": side, "shape": list(shape), "tp": tp, "variant": name,
               "ms": None if r.median_ms is None else r.median_ms / reps,
               "round_ms": [t / reps for t in r.round_ms], "error": r.error}
        if name == "xla":
            rec.update({"rel_err": rel_err, "hlo": counts})
        common.emit(rec)
    common.emit({"kind": "cm-done", "source": label, "side": side, "shape": list(shape)})


def jnp_workloads() -> dict[str, Callable]:
    """The ``benchmarks.workloads`` programs in ``jax.numpy`` (same math, same argument order)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.workloads import BLOCK_HEADS

    def ln(x):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)

    def block(x, wq, wk, wv, wo, w1, w2):
        s, d = x.shape
        dh = d // BLOCK_HEADS
        h = ln(x)
        q, k, v = ((h @ wt).reshape(s, BLOCK_HEADS, dh).transpose(1, 0, 2) for wt in (wq, wk, wv))
        p = jax.nn.softmax(q @ k.transpose(0, 2, 1) / math.sqrt(dh), axis=-1)
        x = x + (p @ v).transpose(1, 0, 2).reshape(s, d) @ wo
        return x + jax.nn.gelu(ln(x) @ w1, approximate=False) @ w2

    return {"add": lambda x, y: x + y, "mlp": lambda x, w1, w2: jax.nn.relu(x @ w1) @ w2, "block": block}


def _timed_jit(fn: Callable, xs: Sequence[Any], shardings: dict[str, Any], precision: str,
               args: argparse.Namespace, name: str) -> tuple[dict[str, Any], Any]:
    """``jax.jit(fn, **shardings)`` at ``precision``, timed with ``common.host_call_times``.

    Returns (record fields: enqueue/throughput/synced µs, ``rel_err_vs_f32`` of the timed
    program's output against the same program at full float32, ``matmul_precision``, ``hlo``
    collective counts of the compiled program; the timed program's last output). On GPU it also
    emits the ``kernels`` record of workload ``name`` (``benchmarks.dispatch.emit_kernels``).

    Every call, timed or profiled, runs inside ``jax.default_matmul_precision(precision)``: JAX
    keys its jit cache on that setting, so a call outside the context would trace and run a
    second program at JAX's default precision (TF32 on these GPUs). Exceptions propagate.
    """
    import jax
    import jax.numpy as jnp

    with jax.default_matmul_precision(precision):
        f = jax.jit(fn, **shardings)
        last: list[Any] = [f(*xs)]
        counts = common.hlo_op_counts(f.lower(*xs).compile().as_text())

        def call() -> None:
            last[0] = f(*xs)

        enq, thru, syn = common.host_call_times(call, lambda: last[0].block_until_ready(),
                                                calls=args.calls, rounds=args.rounds)
        if jax.devices()[0].platform == "gpu":
            from benchmarks.dispatch import emit_kernels

            emit_kernels(args.label, name, lambda: (call(), last[0].block_until_ready()))
        timed = last[0]
    with jax.default_matmul_precision("float32"):
        ref = jax.jit(fn, **shardings)(*xs)
    rel_err = float(jnp.linalg.norm(timed - ref) / jnp.linalg.norm(ref))
    return ({"enqueue_us": enq, "throughput_us": thru, "synced_us": syn, "error": None,
             "rel_err_vs_f32": rel_err, "matmul_precision": precision, "hlo": counts}, timed)


def _failed(exc: BaseException) -> dict[str, Any]:
    return {"enqueue_us": None, "throughput_us": None, "synced_us": None,
            "error": f"{type(exc).__name__}: {exc}"[:400]}


def minilm_fields(mesh: Any, seed: int, args: argparse.Namespace, precision: str) -> dict[str, Any]:
    """MiniLM under ``jax.jit``: timing fields of :func:`_timed_jit` plus ``rel_err_vs_torch``.

    The model, weights and token batch are ``benchmarks.workloads.minilm_case`` on CPU; the
    parameters are placed by ``spmd.models.plans.bert_plan`` over mesh axis ``"x"``, ids and
    mask replicated, output [B, 384] replicated. ``rel_err_vs_torch`` compares the first JAX
    output with the PyTorch model's float32 output on CPU. Exceptions propagate (ValueError
    when the head count does not divide by the mesh size).
    """
    import jax
    import numpy as np
    import torch
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.anchors import jax_minilm as jm
    from benchmarks.workloads import minilm_case
    from spmd.ir.sharding import MeshShape

    case = minilm_case("cpu", seed, mesh=MeshShape(("tp",), (mesh.devices.size,)))
    with torch.no_grad():
        ref = case.fn(case.params, case.input_ids, case.attention_mask).float()
    dims, ops = jm.case_dims(case.real_weights), jm.jax_ops()
    params, ids, mask = jm.case_arrays(case)
    rep = NamedSharding(mesh, P())
    p_sh = {k: NamedSharding(mesh, P(*e)) for k, e in jm.jax_param_specs(case.param_specs, "tp", "x").items()}
    xs = [{k: jax.device_put(v, p_sh[k]) for k, v in params.items()}, jax.device_put(ids, rep),
          jax.device_put(mask, rep)]
    fn = lambda p, i, m: jm.sentence_embeddings(ops, p, i, m, dims)  # noqa: E731
    rec, out = _timed_jit(fn, xs, {"in_shardings": (p_sh, rep, rep), "out_shardings": rep}, precision, args,
                          "minilm")
    rec["rel_err_vs_torch"] = common.rel_error(torch.from_numpy(np.array(out, dtype=np.float32)), ref)
    rec["real_weights"] = case.real_weights
    return rec


def dispatch(mesh: Any, seed: int, args: argparse.Namespace, label: str) -> None:
    """Host time per call of each workload under ``jax.jit`` with the workloads' shardings.

    One record per workload of ``args.workloads`` (default all); a failure is an n/a record.
    """
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.dispatch import PRECISIONS
    from benchmarks.workloads import WORKLOADS

    precision = PRECISIONS[getattr(args, "matmul_precision", "highest")][1]
    wanted = getattr(args, "workloads", None) or DISPATCH_WORKLOADS

    spec = lambda entries: NamedSharding(mesh, P(*[None if e is None else "x" for e in entries]))  # noqa: E731
    rng = np.random.default_rng(seed)
    for name, fn in jnp_workloads().items():
        if name not in wanted:
            continue
        wl = WORKLOADS[name]
        try:
            xs = [jax.device_put((rng.standard_normal(s) / math.sqrt(s[-1])).astype(np.float32), spec(sp))
                  for s, sp in zip(wl.shapes, wl.specs, strict=True)]
            shardings = {"in_shardings": tuple(spec(sp) for sp in wl.specs), "out_shardings": spec(wl.out_spec)}
            rec, _ = _timed_jit(fn, xs, shardings, precision, args, name)
        except Exception as exc:
            rec = _failed(exc)
        common.emit({"kind": "dispatch", "source": label, "workload": name, **rec})
    if "minilm" in wanted:
        try:
            rec = minilm_fields(mesh, seed, args, precision)
        except Exception as exc:
            rec = _failed(exc)
        common.emit({"kind": "dispatch", "source": label, "workload": "minilm", **rec})


def local_devices(device: str | None, tp: int | None) -> list[Any]:
    """The first ``tp`` (default: all) JAX devices of ``device``: ``cuda`` -> GPUs, ``cpu`` -> host
    devices, None -> GPUs if JAX has any, else its default devices.

    ValueError when JAX has no device of that kind or fewer than ``tp`` of them (on CPU the
    message names the ``XLA_FLAGS`` setting that provides more).
    """
    import jax

    if device is None:
        devs = [d for d in jax.devices() if d.platform == "gpu"] or jax.devices()
    else:
        platform = "gpu" if device == "cuda" else "cpu"
        try:
            devs = jax.devices(platform)
        except RuntimeError as exc:
            raise ValueError(f"--device {device}: JAX has no {platform} devices "
                             f"(it sees {[str(d) for d in jax.devices()]}): {exc}") from exc
    tp = tp or len(devs)
    if tp > len(devs):
        hint = (f" (XLA_FLAGS=--xla_force_host_platform_device_count={tp} gives {tp})"
                if devs[0].platform == "cpu" else "")
        raise ValueError(f"--tp: asked for {tp} devices, JAX sees {len(devs)}{hint}")
    return list(devs[:tp])


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    common.apply_required_env()
    from benchmarks.cm_local import build_parser

    ap = build_parser()
    ap.set_defaults(device=None)
    ap.add_argument("--bench", choices=("cm", "dispatch"), default="cm")
    ap.add_argument("--label", default="xla")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--matmul-precision", choices=("highest", "high"), default="highest",
                    help="dispatch: float32 GEMM math, as benchmarks/dispatch.py --matmul-precision")
    ap.add_argument("--workloads", type=harness.name_list(DISPATCH_WORKLOADS, allow_empty=False),
                    default=list(DISPATCH_WORKLOADS),
                    help=f"dispatch: comma-separated subset of {', '.join(DISPATCH_WORKLOADS)}")
    args = ap.parse_args(argv)
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = local_devices(args.device, args.tp)
    mesh = Mesh(np.array(devices), ("x",))
    seed = args.seed if args.seed is not None else common.fresh_seed()
    common.emit({"kind": "meta", "source": args.label, "jax": jax.__version__, "devices": [str(d) for d in devices]})
    if args.bench == "dispatch":
        dispatch(mesh, seed, args, args.label)
        return 0
    deadline = common.Deadline(args.budget_s)
    for i, shape in enumerate(args.shapes):
        if i > 0 and deadline.expired(args.margin_s):  # the first shape always runs (see --margin-s)
            common.emit({"kind": "cm-skipped", "source": args.label, "shape": list(shape), "reason": "budget"})
            continue
        for side in args.sides:
            try:
                cm_side(side, tuple(shape), mesh, seed + 10 * i, args, args.label)
            except Exception as exc:
                common.emit({"kind": "cm", "source": args.label, "side": side, "shape": list(shape), "variant": "xla",
                             "ms": None, "error": f"{type(exc).__name__}: {exc}"[:400]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
