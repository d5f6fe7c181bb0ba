"""One GPU: spmd against the compilers a PyTorch user picks (eager, torch.compile, reduce-overhead).

Usage (repository root)::

    python3 -m benchmarks.one_gpu --out $OUT --doc docs/benchmarks.md
    python3 -m benchmarks.one_gpu --device cpu --small           # a dry run on any machine

Workloads (the rows of the one-GPU comparison): all-MiniLM-L6-v2 (real weights when the package
is installed) at batch 8 × 128 in float32 and bf16 and at 128 × 128 in bf16, and a stack of two
Llama-2-7B-shaped layers in bf16 at batch × sequence 1 × 1, 1 × 128 and 4 × 2048. Variants, all
built in one process from the same module and timed in interleaved rounds (A B C …, A B C …;
median of round medians, CUDA events): PyTorch ``eager``, ``torch.compile`` (default mode),
``torch.compile(mode="reduce-overhead")`` (CUDA graphs), ``spmd`` (``spmd.parallelize`` with
default options on a one-device mesh) and spmd with single options turned off, to show what
each is worth. Each row logs the timed attention-backend choices of
``spmd.runtime.kernels_attention`` for its shapes, and the timed choices of
``spmd.runtime.kernels_epilogue`` (cuBLAS plus the activation, or one Triton GEMM with the
activation in its epilogue: each candidate's µs; kept in the JSON record as ``epilogue``).
(Variants with the same compile options share one compiled program through the process-wide
compile cache, and with it one CUDA graph: calls alternating between two variants' weights would
stage every weight into the graph's inputs on each call, so every spmd variant here differs in
its options.)

Anchors in the same run: the **HBM floor** (bytes of the weights read once per call / the HBM
bandwidth measured here by a device-to-device copy) and the **compute floor** (the model's
matmul FLOPs / the dense GEMM rate measured here at the workload's dtype); the floor of a row is
the larger of the two. Both are burst rates; the **matmul-only** column
(``benchmarks.matmul_anchor``) is the sustained one: the row's GEMMs and attention calls alone,
in a CUDA graph, timed in the same interleaved rounds, so on a power-capped card it is the time
no program with these products can beat in this run. Numerics: every variant's output against
the same module run in float64 on the same device; the table shows its relative error next to eager's own.

Output: a printed table (ms per call and ratios to reduce-overhead and to the floor),
``one_gpu_results.json`` in ``--out``, and with ``--doc`` a dated row set in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, harness, matmul_anchor, reporting


@dataclass(frozen=True)
class Row:
    """One workload: a model family, dtype, batch and sequence (tokens per call = batch × seq)."""

    name: str
    family: str  # "minilm" or "llama2-2l"
    dtype: str  # "f32" or "bf16"
    batch: int
    seq: int


ROWS = (
    Row("minilm-f32-8x128", "minilm", "f32", 8, 128),
    Row("minilm-bf16-8x128", "minilm", "bf16", 8, 128),
    Row("minilm-bf16-128x128", "minilm", "bf16", 128, 128),
    Row("llama2-2l-bf16-1x1", "llama2-2l", "bf16", 1, 1),
    Row("llama2-2l-bf16-1x128", "llama2-2l", "bf16", 1, 128),
    Row("llama2-2l-bf16-4x2048", "llama2-2l", "bf16", 4, 2048),
)
ROW_NAMES = tuple(r.name for r in ROWS)
#: spmd variants: column name -> CompileOptions fields changed from the defaults.
SPMD_VARIANTS: dict[str, dict[str, Any]] = {
    "spmd": {},
    "spmd-no-merge": {"merge_dots": False},
    "spmd-no-hoist": {"hoist_weights": False},
}
TORCH_VARIANTS = ("eager", "compile", "compile-ro")
#: Anchors timed in the same rounds (not checked for numerics: their operands are random).
ANCHOR_VARIANTS = ("matmul-only",)


def _dtype(name: str):
    import torch

    return {"f32": torch.float32, "bf16": torch.bfloat16, "f64": torch.float64}[name]


def build_module(row: Row, small: bool, seed: int):
    """(module in eval mode without grads, forward inputs as a tuple) for ``row``, on the CPU, float32."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if row.family == "minilm":
        from spmd.models import minilm
        from spmd.models.bert import BertConfig, BertSentenceEncoder
        from spmd.models.common import init_random_

        if small:
            cfg = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=128)
            model = init_random_(BertSentenceEncoder(cfg), seed)
        else:
            try:
                model = minilm.load_model()
            except (ValueError, ImportError, OSError):
                model = init_random_(BertSentenceEncoder(BertConfig()), seed)
        batch, seq = (2, 16) if small else (row.batch, row.seq)
        low, high = (1, 128) if small else (1000, 30000)
        ids = torch.randint(low, high, (batch, seq), generator=gen)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[batch // 2:, seq * 3 // 4:] = 0
        return model.eval().requires_grad_(False), (ids, mask)
    from spmd.models.llama import llama_layers

    model = llama_layers("llama2-7b", 2, small=small, seed=seed)
    batch, seq = (1, min(row.seq, 8)) if small else (row.batch, row.seq)
    hidden = model.config.hidden_size
    x = torch.randn(batch, seq, hidden, generator=gen)
    return model, (x,)


def plan_for(row: Row):
    """The sharding plan of ``row``'s model family (a one-device mesh: nothing is split)."""
    from spmd.models.plans import bert_plan, llama_plan

    return bert_plan("tp") if row.family == "minilm" else llama_plan("tp")


def _cast_inputs(inputs: tuple, dtype, device) -> tuple:
    import torch

    return tuple(x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device)
                 for x in inputs if isinstance(x, torch.Tensor))


def matmul_flops(module, inputs: tuple) -> float:
    """FLOPs of one forward's matrix products (2·M·N·K per GEMM, attention included), counted by
    ``torch.utils.flop_counter.FlopCounterMode`` on the float32 CPU module."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        module(*inputs)
    return float(counter.get_total_flops())


def measure_limits(device, dtype) -> dict[str, float]:
    """HBM bandwidth (GB/s, a 1 GiB device copy: read + write) and dense GEMM rate (TFLOP/s at
    ``dtype``, 8192³) measured now on ``device``; both medians of 10 reps."""
    import torch

    if device.type != "cuda":
        n, m = 1 << 24, 512
    else:
        n, m = 1 << 28, 8192
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_ms = common.interleaved({"copy": lambda: dst.copy_(src)}, [device], rounds=3, reps=10)["copy"].median_ms
    a = torch.randn(m, m, device=device, dtype=dtype)
    b = torch.randn(m, m, device=device, dtype=dtype)
    gemm_ms = common.interleaved({"gemm": lambda: a @ b}, [device], rounds=3, reps=10)["gemm"].median_ms
    return {"hbm_gbs": 2 * n * 4 / (copy_ms * 1e-3) / 1e9, "gemm_tflops": 2 * m**3 / (gemm_ms * 1e-3) / 1e12}


def build_variants(row: Row, module, inputs: tuple, device, args) -> tuple[dict[str, Callable], dict[str, str]]:
    """Per variant name, a zero-argument call (already warmed up once); errors of those that
    could not be built, by name."""
    import torch

    import spmd

    calls: dict[str, Callable] = {}
    errors: dict[str, str] = {}
    calls["eager"] = lambda: module(*inputs)
    if "compile" in args.variants:
        calls["compile"] = _try(errors, "compile", lambda: torch.compile(module, dynamic=False))
    if "compile-ro" in args.variants:
        calls["compile-ro"] = _try(errors, "compile-ro",
                                   lambda: torch.compile(module, mode="reduce-overhead", dynamic=False))
    for key in ("compile", "compile-ro"):
        if calls.get(key) is not None:
            fn = calls[key]
            calls[key] = lambda fn=fn: fn(*inputs)
    mesh = spmd.Mesh.create({"tp": 1}, devices="cuda:1" if device.type == "cuda" else "cpu:1")
    fields = set(spmd.CompileOptions.__dataclass_fields__)
    for name, changes in SPMD_VARIANTS.items():
        if name not in args.variants:
            continue
        if not set(changes) <= fields:
            errors[name] = f"CompileOptions has no {sorted(set(changes) - fields)} here"
            continue
        try:
            pm = spmd.parallelize(module, mesh, plan_for(row), options=spmd.CompileOptions(**changes))
            placed = pm.place_inputs(*inputs)
            calls[name] = lambda pm=pm, placed=placed: pm(*placed)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
    return {k: v for k, v in calls.items() if v is not None}, errors


def _try(errors: dict[str, str], name: str, make: Callable[[], Any]) -> Any:
    try:
        return make()
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"[:300]
        return None


def _as_tensor(out) -> Any:
    if hasattr(out, "to_torch"):
        return out.to_torch()
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def check_numerics(calls: dict[str, Callable], ref, errors: dict[str, str]) -> dict[str, float]:
    """Run each call once (compiling it), clone its output, and return its relative error to ``ref``
    (float64); a call that fails is moved to ``errors``."""
    out: dict[str, float] = {}
    for name in list(calls):
        try:
            for _ in range(3):  # reduce-overhead records its graph on the third call
                y = _as_tensor(calls[name]())
            out[name] = common.rel_error(y.detach().clone().double(), ref)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            del calls[name]
    return out


def run_row(row: Row, args, device, limits: dict[str, dict[str, float]], log: Callable[[str], None]) -> dict:
    """Build, check and time every variant of ``row``; one JSON-ready record."""
    import torch

    seed = args.seed
    torch._dynamo.reset()  # each row compiles afresh: no automatic-dynamic shapes from the previous row
    module32, inputs32 = build_module(row, args.small, seed)
    flops = matmul_flops(module32, inputs32)
    ref_module = module32.to(device=device, dtype=torch.float64)
    with torch.no_grad():
        ref = _as_tensor(ref_module(*_cast_inputs(inputs32, torch.float64, device))).double()
    dtype = _dtype(row.dtype)
    module = module32.to(device=device, dtype=dtype)
    del ref_module
    inputs = _cast_inputs(inputs32, dtype, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    from spmd.runtime.kernels_attention import DECISIONS
    from spmd.runtime.kernels_epilogue import DECISIONS as EPILOGUE_DECISIONS

    decided, epilogues = len(DECISIONS), len(EPILOGUE_DECISIONS)
    calls, errors = build_variants(row, module, inputs, device, args)
    rel = check_numerics(calls, ref, errors)
    if "matmul-only" in args.variants:  # the sustained compute floor (benchmarks.matmul_anchor)
        eager = calls["eager"]
        anchor = _try(errors, "matmul-only", lambda: matmul_anchor.matmul_only(eager, device))
        if anchor is not None:
            calls["matmul-only"] = anchor
    for d in DECISIONS[decided:]:  # the timed attention backend choice of this row's shapes
        log(f"{row.name}: {d.line()}")
    for d in EPILOGUE_DECISIONS[epilogues:]:  # cuBLAS + activation or one GEMM with it in the epilogue
        log(f"{row.name}: {d.summary()}")
    log(f"{row.name}: timing {', '.join(calls)}")
    times = common.interleaved(calls, [device], rounds=args.rounds, reps=args.reps, warmup=2, log=log)
    lim = limits[row.dtype]
    hbm_ms = weight_bytes / (lim["hbm_gbs"] * 1e9) * 1e3
    compute_ms = flops / (lim["gemm_tflops"] * 1e12) * 1e3
    rec = {"row": row.name, "flops": flops, "weight_bytes": weight_bytes, "hbm_floor_ms": hbm_ms,
           "compute_floor_ms": compute_ms, "floor_ms": max(hbm_ms, compute_ms), "rel_err": rel,
           "errors": errors, "ms": {k: m.median_ms for k, m in times.items()},
           "round_ms": {k: list(m.round_ms) for k, m in times.items()},
           "epilogue": [d.summary() for d in EPILOGUE_DECISIONS[epilogues:]]}
    for k, m in times.items():
        if m.error:
            errors[k] = m.error
    if device.type == "cuda" and args.profile:
        rec["kernels"] = profile_kernels({k: v for k, v in calls.items() if k in ("spmd", "compile-ro")})
    del calls, module
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def profile_kernels(calls: dict[str, Callable]) -> dict[str, Any]:
    """Per variant, the kernels of one call (``benchmarks.gpu_kernels``): count, busy µs split into
    GEMM/attention and other, and the 40 longest kernel names (the whole list of a one-GPU row: the
    printed lines show 4, ``one_gpu_results.json`` keeps all); a failed profile is its error text."""
    from dataclasses import asdict

    from benchmarks.gpu_kernels import kernel_summary

    out: dict[str, Any] = {}
    for name, call in calls.items():
        try:
            out[name] = [asdict(d) for d in kernel_summary(call, top=40)]
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def _kernel_lines(r: dict) -> list[str]:
    lines = []
    for name, devs in (r.get("kernels") or {}).items():
        if not isinstance(devs, list) or not devs:
            lines.append(f"{r['row']}/{name}: kernel profile n/a: {devs}")
            continue
        d = devs[0]
        top = "; ".join(f"{n[:48]} ×{c:.0f} {us:.1f} µs" for n, c, us in d["top"][:4])
        lines.append(f"{r['row']}/{name}: {d['kernels']} kernels, busy {d['busy_us']:.1f} µs = GEMM/attention "
                     f"{d['matmul_us']:.1f} + other {d['other_us']:.1f}; longest: {top}")
    return lines


def table(records: list[dict], variants: list[str]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: ms per call per variant, spmd ÷ reduce-overhead, spmd ÷ compile, spmd ÷ floor,
    and reduce-overhead ÷ the matmul-only anchor (below ×1.11 a ×0.9 target is under the sustained floor)."""
    headers = ["workload", *[f"{v} ms" for v in variants], "floor ms", "spmd ÷ compile-ro", "spmd ÷ compile",
               "spmd ÷ floor", "compile-ro ÷ matmul-only"]
    rows = []
    for r in records:
        ms = r["ms"]
        spmd_ms = ms.get("spmd")
        rows.append([r["row"], *[reporting.fmt_ms(ms.get(v)) for v in variants], reporting.fmt_ms(r["floor_ms"]),
                     reporting.fmt_ratio(common.ratio(spmd_ms, ms.get("compile-ro"))),
                     reporting.fmt_ratio(common.ratio(spmd_ms, ms.get("compile"))),
                     reporting.fmt_ratio(common.ratio(spmd_ms, r["floor_ms"])),
                     reporting.fmt_ratio(common.ratio(ms.get("compile-ro"), ms.get("matmul-only")))])
    return headers, rows


def notes(records: list[dict], limits: dict[str, dict[str, float]]) -> list[str]:
    """Report lines: the measured limits, each row's errors vs float64, and failures."""
    lines = [f"measured limits ({dt}): HBM copy {v['hbm_gbs']:.0f} GB/s, dense GEMM {v['gemm_tflops']:.1f} TFLOP/s"
             for dt, v in limits.items()]
    for r in records:
        errs = ", ".join(f"{k} {v:.1e}" for k, v in r["rel_err"].items())
        lines.append(f"{r['row']}: rel. error vs float64: {errs}; floor = max(HBM {r['hbm_floor_ms']:.3f}, "
                     f"compute {r['compute_floor_ms']:.3f}) ms")
        lines += [f"{r['row']}/{k}: n/a: {e}" for k, e in r["errors"].items()]
        lines += _kernel_lines(r)
    return lines


def parse_args(argv) -> argparse.Namespace:
    """Options; unknown rows or variants are usage errors (exit 2)."""
    all_variants = (*TORCH_VARIANTS, *SPMD_VARIANTS, *ANCHOR_VARIANTS)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU dry run)")
    ap.add_argument("--rows", type=harness.name_list(ROW_NAMES, allow_empty=False), default=list(ROW_NAMES))
    ap.add_argument("--variants", type=harness.name_list(all_variants, allow_empty=False),
                    default=list(all_variants))
    ap.add_argument("--rounds", type=harness.positive_int, default=7)
    ap.add_argument("--reps", type=harness.positive_int, default=20)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="kernel profile of spmd and reduce-overhead per row (GPU only)")
    ap.add_argument("--out", default="/tmp/spmd_bench_out")
    ap.add_argument("--doc", default=None)
    args = ap.parse_args(argv)
    if "eager" not in args.variants:
        args.variants.insert(0, "eager")
    if args.seed is None:
        args.seed = common.fresh_seed()
    return args


def main(argv=None) -> int:
    """Entry point; exits 1 when no row was measured."""
    common.apply_required_env()
    args = parse_args(argv)
    if args.device == "cuda":
        common.require_cuda("benchmarks.one_gpu")
    import torch

    torch.set_float32_matmul_precision("highest")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    log = lambda s: print(f"  {s}", flush=True)  # noqa: E731
    info = reporting.hardware_info()
    rows = [r for r in ROWS if r.name in args.rows]
    limits = {dt: measure_limits(device, _dtype(dt)) for dt in sorted({r.dtype for r in rows})}
    records = []
    for row in rows:
        try:
            with torch.no_grad():
                records.append(run_row(row, args, device, limits, log))
        except Exception as exc:
            log(f"{row.name}: failed: {type(exc).__name__}: {exc}")
            continue
        r = records[-1]  # one line and the JSON per row, so that a run cut short keeps what it measured
        log(f"{row.name}: " + ", ".join(f"{k} {reporting.fmt_ms(v)} ms" for k, v in r["ms"].items()))
        reporting.write_json(Path(args.out) / "one_gpu_results.json",
                             {"info": info, "args": vars(args), "limits": limits, "records": records, "partial": True})
    variants = [v for v in args.variants if any(r["ms"].get(v) is not None for r in records)]
    headers, body = table(records, variants)
    title = "one GPU: ms per call (interleaved rounds, median)" + (" — small dry run" if args.small else "")
    reporting.print_table(title, headers, body)
    lines = notes(records, limits)
    for line in lines:
        print("  " + line)
    reporting.write_json(Path(args.out) / "one_gpu_results.json",
                         {"info": info, "args": vars(args), "limits": limits, "records": records})
    if args.doc:
        text = f"### {title}\n\n{reporting.markdown_table(headers, body)}\n\n" + "\n".join(f"- {x}" for x in lines)
        reporting.append_row_set(Path(args.doc), "one GPU vs torch.compile", info, text)
    return 0 if any(r["ms"].get("spmd") is not None for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
