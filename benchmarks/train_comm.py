"""Communication hidden in a training step: step time and collective counts per CompileOptions variant.

    python3 -m benchmarks.train_comm --devices cuda:2 --strategy dp fsdp tp-sp --model llama2-7b --layers 2 \\
        --batch 4 --seq 1024
    python3 -m benchmarks.train_comm --devices cpu:2 --small --steps 2 --rounds 1    # dry run

For each parallel strategy (``dp``: batch on ``dp``; ``fsdp``: + parameters and AdamW state
sharded on ``dp``; ``tp-sp``: the model's Megatron plan with sequence parallelism on ``tp``)
and each variant of the communication passes:

- ``sync``: no bucketing, no async collectives, no windowed einsum (every collective blocks);
- ``bucketed``: gradient all-reduces / reduce-scatters combined into 25 MiB buckets;
- ``async``: bucketed, and independent collectives on the communication stream (the default);
- ``async+we``: the default with ``windowed_einsum="on"``,

it prints the median ms per step over interleaved rounds (every variant once per round), peak
device memory and the number of collectives of the compiled step (``summarize_collectives`` of
the scheduled program). float32 on CPU, bfloat16 compute with float32 master weights on CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

VARIANTS = {
    "sync": {"bucket_size_bytes": 0, "async_collectives": False, "windowed_einsum": "off"},
    "bucketed": {"async_collectives": False, "windowed_einsum": "off"},
    "async": {"windowed_einsum": "off"},
    "async+we": {"windowed_einsum": "on"},
}


def _model(args):
    from spmd.models.gpt import gpt3_layers
    from spmd.models.llama import llama_layers

    if args.model == "gpt3":
        return gpt3_layers(args.layers, small=args.small, seed=0).train().requires_grad_()
    return llama_layers(args.model, args.layers, small=args.small, seed=0).train().requires_grad_()


def _train_step(args, strategy: str, variant: str):
    from spmd import CompileOptions, Mesh
    from spmd.models.plans import gpt_plan, llama_plan
    from spmd.train import AdamW, make_train_step

    kind, n = args.devices.split(":")
    axis = "tp" if strategy == "tp-sp" else "dp"
    mesh = Mesh.create((axis,), devices=args.devices)
    plan = None
    if strategy == "tp-sp":
        plan = gpt_plan(sequence_parallel=True) if args.model == "gpt3" else llama_plan(sequence_parallel=True)
    compute = torch.bfloat16 if kind == "cuda" else None
    return make_train_step(_model(args), mesh, plan, lambda apply, b: F.mse_loss(apply(b["x"]), b["y"]),
                           optimizer=AdamW(lr=1e-4, weight_decay=0.1), fsdp=strategy == "fsdp",
                           compute_dtype=compute, options=CompileOptions(**VARIANTS[variant]))


def _sync(devices: str) -> None:
    if devices.startswith("cuda"):
        torch.cuda.synchronize()


def measure(args, strategy: str) -> dict[str, dict]:
    """{variant: {"ms", "peak_gib", "collectives"}} for one strategy."""
    from spmd.parallelize import summarize_collectives

    model = _model(args)
    hidden = next(p for p in model.parameters() if p.dim() == 2).shape[1]
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(args.batch, args.seq, hidden, generator=g),
             "y": torch.randn(args.batch, args.seq, hidden, generator=g)}
    steps, out = {}, {}
    for v in args.variants:
        ts = _train_step(args, strategy, v)
        placed = ts.place_batch(batch)
        for _ in range(args.warmup):
            ts.step(placed)
        counts = {s.opcode: s.count for s in summarize_collectives(ts.lowered.as_text("schedule"))}
        steps[v], out[v] = ts, {"collectives": counts, "ms": [], "peak_gib": float("nan")}
    for r in range(args.rounds):
        for v, ts in steps.items():
            placed = ts.place_batch(batch)
            if args.devices.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            _sync(args.devices)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                ts.step(placed)
            _sync(args.devices)
            out[v]["ms"].append((time.perf_counter() - t0) * 1e3 / args.steps)
            if args.devices.startswith("cuda"):
                out[v]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        print(f"{strategy} round {r + 1}: " + ", ".join(f"{v} {out[v]['ms'][-1]:.2f} ms" for v in steps), flush=True)
    for v in out:
        out[v]["ms"] = statistics.median(out[v]["ms"])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="cuda:2" if torch.cuda.device_count() >= 2 else "cpu:2")
    ap.add_argument("--strategy", nargs="+", default=["dp", "fsdp", "tp-sp"], choices=["dp", "fsdp", "tp-sp"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--model", default="llama2-7b", help="gpt3 or a Llama preset (spmd.models.llama)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--small", action="store_true", help="the models' small test shapes")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    rows = ["| strategy | variant | ms / step | peak GiB | collectives |", "|---|---|---:|---:|---|"]
    for strategy in args.strategy:
        for v, r in measure(args, strategy).items():
            counts = ", ".join(f"{k} {c}" for k, c in r["collectives"].items())
            rows.append(f"| {strategy} | {v} | {r['ms']:.2f} | {r['peak_gib']:.2f} | {counts} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
