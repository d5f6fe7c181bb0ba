"""Training-step benchmark: GPT / Llama layer stacks on one device, spmd vs PyTorch eager and torch.compile.

    python3 -m benchmarks.train --model llama2-7b --layers 2 --batch 2 --seq 2048 --doc docs/benchmarks.md
    python3 -m benchmarks.train --device cpu --small            # dry run (tiny shapes, no report)

One step = forward, MSE loss against a fixed target, backward, AdamW update (weight decay 0.1),
all three in the same dtype (bfloat16 on CUDA by default, float32 on CPU): PyTorch eager with
``torch.optim.AdamW(foreach=True)``, the same under ``torch.compile`` (model and loss compiled,
optimizer step compiled with ``torch.compile`` too), and ``spmd.train.make_train_step`` on a
one-device mesh (params and optimizer state donated; attention forward and backward as fused
kernels, or as dots and a softmax in the ``spmd-math`` variant). Variants are timed in interleaved rounds
(round r runs every variant once, ``--steps`` timed steps each, after warm-up), so drift of the
machine hits all of them alike; the median step time over rounds is reported, with peak device
memory (CUDA ``max_memory_allocated`` over the timed steps, reset per variant) and, for the spmd
variants, the peak the compiler plans for the step (``TrainStep.memory_analysis()``: arguments,
arena, heap temporaries and outputs live at once; ``spmd.runtime.memory``). ``spmd-remat`` is the
spmd step with activation recomputation (``CompileOptions(remat=--remat)``, default "full");
``spmd-nomof`` the spmd step without multi-output fusion (``CompileOptions(multi_output_fusion=False)``:
three optimizer-update kernels per parameter instead of one). The result is printed as a markdown
table and, with ``--doc``, appended to that file as a dated row set.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

VARIANTS = ("eager", "compile", "spmd", "spmd-math", "spmd-remat", "spmd-nomof")
DEFAULT_VARIANTS = ("eager", "compile", "spmd")  # spmd-math, spmd-remat, spmd-nomof: on request


def build_model(args):
    """The layer stack (trainable) and an input / target pair of shape [batch, seq, hidden]."""
    from spmd.models.gpt import gpt3_layers
    from spmd.models.llama import llama_layers

    dev = args.device
    if args.model == "gpt3":
        model = gpt3_layers(args.layers, small=args.small, dtype=args.dtype, device=dev)
    else:
        model = llama_layers(args.model, args.layers, small=args.small, dtype=args.dtype, device=dev)
    model.train().requires_grad_(True)
    mlp = model.layers[0].mlp
    hidden = mlp.fc_in.in_features if args.model == "gpt3" else mlp.gate_proj.in_features
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.batch, args.seq, hidden, generator=g).to(dev, args.dtype)
    y = torch.randn(args.batch, args.seq, hidden, generator=g).to(dev, args.dtype)
    return model, x, y


def _torch_step(model, x, y, compiled: bool) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    fwd = torch.compile(lambda: F.mse_loss(model(x), y)) if compiled else (lambda: F.mse_loss(model(x), y))
    opt_step = torch.compile(opt.step) if compiled else opt.step

    def step():
        loss = fwd()
        loss.backward()
        opt_step()
        opt.zero_grad(set_to_none=True)
    return step


def _spmd_step(model, x, y, device: str, fused_attention: bool = True,
               remat: str = "none", multi_output_fusion: bool = True) -> Callable[[], None]:
    """The spmd step as a closure; its ``planned_peak_gib()`` is the compiled step's planned peak (GiB)."""
    from spmd import CompileOptions, Mesh
    from spmd.train import AdamW, make_train_step

    mesh = Mesh.create(("dp",), devices=f"{device}:1")
    ts = make_train_step(model, mesh, None, lambda apply, b: F.mse_loss(apply(b["x"]), b["y"]),
                         optimizer=AdamW(lr=1e-4, weight_decay=0.1),
                         options=CompileOptions(fused_attention_grad=fused_attention, remat=remat,
                                                multi_output_fusion=multi_output_fusion))
    batch = {"x": ts.place_batch({"x": x})["x"], "y": ts.place_batch({"y": y})["y"]}

    def step():
        ts.step(batch, fetch=False)  # like the torch loops: no host read of the loss per step
    step.planned_peak_gib = lambda: ts.memory_analysis().peak_size_bytes / 2**30
    return step


def _graph_counters() -> dict[str, int]:
    """The ``cuda_graphs.*`` counters of ``spmd.metrics`` now (replays, captures, recaptures, staged copies, ...)."""
    from spmd import metrics

    return {k: v for k, v in metrics.snapshot()["counters"].items() if k.startswith("cuda_graphs.")}


def _add_deltas(into: dict[str, int], before: dict[str, int], after: dict[str, int]) -> None:
    for k, v in after.items():
        if v != before.get(k, 0):
            into[k.removeprefix("cuda_graphs.")] = into.get(k.removeprefix("cuda_graphs."), 0) + v - before.get(k, 0)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(args, log: Callable[[str], None] = print) -> dict[str, dict[str, float]]:
    """Median ms per step and peak memory (GiB, CUDA only) per variant, interleaved rounds."""
    steps: dict[str, Callable[[], None]] = {}
    for v in args.variants:
        model, x, y = build_model(args)
        t0 = time.perf_counter()
        before = _graph_counters()
        if v.startswith("spmd"):
            steps[v] = _spmd_step(model, x, y, args.device, fused_attention=v != "spmd-math",
                                  remat=args.remat if v == "spmd-remat" else "none",
                                  multi_output_fusion=v != "spmd-nomof")
        else:
            steps[v] = _torch_step(model, x, y, v == "compile")
        for _ in range(args.warmup):
            steps[v]()
        _sync(args.device)
        warm: dict[str, int] = {}
        _add_deltas(warm, before, _graph_counters())  # captures, staged copies, donated outputs copied in the graph
        log(f"{v}: built and warmed up in {time.perf_counter() - t0:.1f} s"
            + (f"; cuda_graphs: {warm}" if v.startswith("spmd") else ""))
    times: dict[str, list[float]] = {v: [] for v in steps}
    host: dict[str, list[float]] = {v: [] for v in steps}
    graphs: dict[str, dict[str, int]] = {v: {} for v in steps}
    peak: dict[str, float] = {v: float("nan") for v in steps}
    for r in range(args.rounds):
        for v, step in steps.items():
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            before = _graph_counters()
            _sync(args.device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                t1 = time.perf_counter()
                step()
                host[v].append((time.perf_counter() - t1) * 1e3)
            _sync(args.device)
            times[v].append((time.perf_counter() - t0) * 1e3 / args.steps)
            _add_deltas(graphs[v], before, _graph_counters())
            if args.device == "cuda":
                peak[v] = max(0.0 if peak[v] != peak[v] else peak[v], torch.cuda.max_memory_allocated() / 2**30)
        log(f"round {r + 1}: " + ", ".join(f"{v} {times[v][-1]:.2f} ms" for v in steps))
    for v in steps:  # host time inside step() (no sync in it: small when the host runs ahead of the GPU)
        log(f"{v}: host {statistics.median(host[v]):.3f} ms/step median, {max(host[v]):.3f} max"
            + (f"; cuda_graphs over the timed steps: {graphs[v]}" if v.startswith("spmd") else ""))
    if args.profile and args.device == "cuda":
        from benchmarks.gpu_kernels import print_idle_gaps, print_kernels

        for v, step in steps.items():
            print_kernels(f"train {v}", step, calls=2, top=args.profile)
            print_idle_gaps(f"train {v}", step)
            # back to back, as timed: idle time between the steps (host-bound issue or a per-step sync)
            print_idle_gaps(f"train {v} x{args.steps}", lambda step=step: [step() for _ in range(args.steps)])
    planned = {v: getattr(step, "planned_peak_gib", lambda: float("nan"))() for v, step in steps.items()}
    return {v: {"ms": statistics.median(times[v]), "peak_gib": peak[v], "planned_gib": planned[v]} for v in steps}


def markdown(results: dict[str, dict[str, float]], args) -> str:
    """A dated row set: one row per variant with ms/step, × eager, × torch.compile and peak memory."""
    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu"
    dtype = str(args.dtype).removeprefix("torch.")
    head = (f"### Training step, {args.model} x{args.layers} layers, batch {args.batch} x {args.seq}, {dtype}, "
            f"AdamW ({datetime.date.today()}, {dev}, torch {torch.__version__})")
    rows = ["| variant | ms / step | × eager | × torch.compile | peak GiB | planned peak GiB |",
            "|---|---:|---:|---:|---:|---:|"]
    base = results.get("eager", {}).get("ms")
    comp = results.get("compile", {}).get("ms")
    for v, r in results.items():
        ratio = lambda ref, ms=r["ms"]: f"{ms / ref:.2f}" if ref else "n/a"
        gib = lambda x: "n/a" if x != x else f"{x:.2f}"
        planned = r.get("planned_gib", float("nan"))
        rows.append(f"| {v} | {r['ms']:.2f} | {ratio(base)} | {ratio(comp)} | {gib(r['peak_gib'])} | {gib(planned)} |")
    note = (f"Median of {args.rounds} interleaved rounds of {args.steps} steps after {args.warmup} warm-up steps; "
            "spmd: `make_train_step` on a one-device mesh (joint forward+backward import, donated state); "
            "peak GiB: `torch.cuda.max_memory_allocated`; planned peak: `TrainStep.memory_analysis()`"
            + (f"; spmd-remat: remat={args.remat!r}" if "spmd-remat" in results else "") + ".")
    return "\n".join([head, "", *rows, "", note, ""])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt3", "llama2-7b", "llama3-70b"), default="llama2-7b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=None, help="default 2 (1 with --small)")
    ap.add_argument("--seq", type=int, default=None, help="default 2048 (16 with --small)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a dry run)")
    ap.add_argument("--variants", default=None, help="comma-separated from eager,compile,spmd,spmd-math,"
                    "spmd-remat,spmd-nomof (spmd-math: attention's backward as dots and softmax; spmd-remat: "
                    "with --remat; spmd-nomof: without multi-output fusion; default: eager,compile,spmd on "
                    "cuda, eager,spmd on cpu)")
    ap.add_argument("--remat", choices=("selective", "full"), default="full",
                    help="activation recomputation of the spmd-remat variant (default full)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="after timing, print each variant's TOP longest kernels per step (CUDA only)")
    ap.add_argument("--doc", default=None, help="append the row set to this markdown file (docs/benchmarks.md)")
    args = ap.parse_args(argv)
    args.batch = args.batch or (1 if args.small else 2)
    args.seq = args.seq or (16 if args.small else 2048)
    args.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[
        args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    names = args.variants.split(",") if args.variants else (list(DEFAULT_VARIANTS) if args.device == "cuda"
                                                             else ["eager", "spmd"])
    bad = [n for n in names if n not in VARIANTS]
    if bad or min(args.layers, args.batch, args.seq, args.rounds, args.steps) < 1 or args.warmup < 0:
        ap.error(f"--variants from {VARIANTS} (got {bad}); sizes, --rounds and --steps >= 1; --warmup >= 0")
    args.variants = names
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results = measure(args, log=lambda s: print(s, file=sys.stderr, flush=True))
    text = markdown(results, args)
    print(text)
    if args.doc:
        with open(args.doc, "a", encoding="utf-8") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
