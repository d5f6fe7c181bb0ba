"""``python -m spmd train``: train a small GPT on Python standard-library text on a mesh (or, with
``--task minilm``, fine-tune all-MiniLM-L6-v2 contrastively, ``spmd.train.contrastive``).

    python -m spmd train                              # all GPUs, else 4 virtual CPU devices (dp=2, tp=2)
    python -m spmd train --steps 300 --ckpt-dir ck --save-every 100 --plot loss.png
    python -m spmd train --resume ck/step-100.safetensors --steps 300 --ckpt-dir ck

Data parallel over ``dp`` (FSDP with ``--fsdp``) and Megatron tensor parallel over ``tp``
(``gpt_plan``), AdamW, gradient clipping; rich progress (loss, tokens/s, step time); checkpoints
in safetensors from which a resumed run reproduces the uninterrupted run's losses bit for bit
(the batch of step k is a function of ``--seed`` and k).
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import time

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["add_train_parser", "cmd_train"]


def add_train_parser(sub) -> None:
    """Register the ``train`` sub-command on an argparse sub-parsers object."""
    p = sub.add_parser("train", help="train a small GPT on Python stdlib text (DP/FSDP x TP), with checkpoints")
    p.add_argument("--task", choices=("gpt", "minilm"), default="gpt",
                   help="gpt: a small GPT from scratch (default); minilm: fine-tune all-MiniLM-L6-v2 (real "
                   "weights) with in-batch negatives on stdlib (signature, docstring) pairs (slow on CPUs)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if GPUs are present, else 4 cpu devices")
    p.add_argument("--mesh", help="mesh axes dp=..,tp=.. (default: tp=2 when the device count is even, dp the rest)")
    p.add_argument("--steps", type=int, default=200, help="train until this step (default 200)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--vocab", type=int, default=1024, help="compact vocabulary size (default 1024)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 3e-3 gpt, 2e-5 minilm)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batches")
    p.add_argument("--fsdp", action="store_true", help="shard parameters and optimizer state over dp (ZeRO-3)")
    p.add_argument("--remat", choices=("none", "selective", "full"), default="none",
                   help="activation recomputation (spmd.passes.rematerialize): selective recomputes all but "
                   "matmuls, full recomputes matmuls too (default none)")
    p.add_argument("--ckpt-dir", metavar="DIR", help="write step-N.safetensors checkpoints here")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", metavar="FILE", help="continue from a checkpoint")
    p.add_argument("--plot", metavar="PNG", help="write the loss curve (needs matplotlib)")
    p.add_argument("--model-dir", metavar="DIR", help="all-MiniLM-L6-v2 files (for its tokenizer)")


def _mesh(args):
    from spmd.cli import CliError, make_mesh, parse_mesh

    if args.device == "cuda" and not torch.cuda.device_count():
        raise CliError("--device cuda: no CUDA GPU is present (torch.cuda.device_count() is 0); "
                       "run spmd train --device cpu (virtual CPU devices), or leave --device out")
    if args.mesh:
        axes = parse_mesh(args.mesh)
    else:
        n = torch.cuda.device_count() if args.device == "cuda" else 4
        tp = 2 if n % 2 == 0 and n > 1 else 1
        axes = {"dp": n // tp, "tp": tp}
    if set(axes) - {"dp", "tp"}:
        raise CliError(f"--mesh: expected axes dp and/or tp, got {args.mesh!r}")
    axes.setdefault("tp", 1)
    if args.fsdp and axes.get("dp", 1) < 2:
        raise CliError(f"--fsdp: shards parameters over the dp axis, which needs 2 or more devices; got mesh {axes}")
    return make_mesh(axes, args.device), axes


def _check(args) -> None:
    from spmd.cli import CliError

    for name in ("steps", "batch", "seq", "hidden", "heads", "layers"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name}: expected >= 1, got {getattr(args, name)}")
    if args.vocab < 2:
        raise CliError(f"--vocab: expected >= 2, got {args.vocab}")
    if args.save_every < 0:
        raise CliError(f"--save-every: expected >= 0 (0: only at the end), got {args.save_every}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise CliError(f"--lr: expected a finite number > 0, got {args.lr}")
    if args.hidden % args.heads:
        raise CliError(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads})")
    if args.task == "minilm" and args.seq > 512:
        raise CliError(f"--seq: minilm has 512 positions, got {args.seq}")
    _check_paths(args)


def _matplotlib_installed() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _check_paths(args) -> None:
    """Create the --ckpt-dir and the --plot file's directory before training; CliError when either cannot be
    or when --plot is given without matplotlib (checked first: no directory is made for a plot never written)."""
    from spmd.cli import CliError

    dirs = [("--ckpt-dir", args.ckpt_dir)] if args.ckpt_dir else []
    if args.plot:
        if not _matplotlib_installed():
            raise CliError("--plot: matplotlib is not installed, so no loss curve can be written; "
                           "pip install matplotlib, or leave --plot out")
        dirs.append(("--plot", os.path.dirname(os.path.abspath(args.plot))))
    for flag, path in dirs:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise CliError(f"{flag}: cannot create directory {path!r}: {e.strerror}") from None
        if not os.access(path, os.W_OK):
            raise CliError(f"{flag}: directory {path!r} is not writable")


def _gpt_job(args, mesh, axes):
    """(model, plan, loss_fn, batch_of(step), description) of the small-GPT task."""
    from spmd.models.plans import gpt_plan
    from spmd.train.tiny_gpt import TinyGPT, batch_at, lm_loss, load_corpus

    tokens, _ = load_corpus(args.vocab, args.model_dir)
    if args.seq + 1 >= tokens.numel():
        from spmd.cli import CliError

        raise CliError(f"--seq: each sequence is a window of seq + 1 of the corpus's {tokens.numel():,} tokens; "
                       f"expected --seq < {tokens.numel() - 1}, got {args.seq}")
    torch.manual_seed(args.seed)
    model = TinyGPT(args.vocab, args.seq, args.hidden, args.heads, args.layers)
    n_params = sum(p.numel() for p in model.parameters())
    what = (f"TinyGPT ({args.layers} layers, hidden {args.hidden}, {n_params:,} parameters) on {mesh!r}; "
            f"{tokens.numel():,} stdlib tokens")
    plan = gpt_plan() if axes["tp"] > 1 else None
    return model, plan, lm_loss, lambda step: batch_at(tokens, step, args.batch, args.seq, args.seed), what


def _minilm_job(args, mesh, axes):
    """(model, plan, loss_fn, batch_of(step), description) of the MiniLM contrastive fine-tune."""
    from spmd.models.minilm import load_model, load_tokenizer
    from spmd.models.plans import bert_plan
    from spmd.train.contrastive import contrastive_loss, load_pairs, pair_batch_at

    pairs, tok = load_pairs(), load_tokenizer(args.model_dir)
    model = load_model(args.model_dir).train().requires_grad_(True)
    what = (f"all-MiniLM-L6-v2 (real weights, {sum(p.numel() for p in model.parameters()):,} parameters) on "
            f"{mesh!r}; {len(pairs)} stdlib (signature, docstring) pairs")
    plan = bert_plan() if axes["tp"] > 1 else None
    return model, plan, contrastive_loss, lambda step: pair_batch_at(pairs, tok, step, args.batch, args.seq,
                                                                     args.seed), what


def cmd_train(args, console: Console) -> int:
    """Run the training job described by ``args``; returns the exit status (0)."""
    from spmd.passes.pipeline import CompileOptions
    from spmd.train import AdamW, make_train_step

    _check(args)
    mesh, axes = _mesh(args)
    model, plan, loss_fn, batch_of, what = (_gpt_job if args.task == "gpt" else _minilm_job)(args, mesh, axes)
    lr = args.lr if args.lr is not None else (3e-3 if args.task == "gpt" else 2e-5)
    ts = make_train_step(model, mesh, plan, loss_fn, optimizer=AdamW(lr=lr, weight_decay=0.1 if args.task == "gpt"
                                                                      else 0.01),
                         fsdp=args.fsdp, clip_grad_norm=1.0,
                         options=CompileOptions(remat=args.remat))
    start = 0
    if args.resume:
        ts.load(args.resume)
        start = int(ts.opt_state["step"].to_torch())
        if start >= args.steps:
            from spmd.cli import CliError

            raise CliError(f"--steps: the checkpoint {args.resume!r} is at step {start}; expected --steps > {start} "
                           f"(the step to train until), got {args.steps}")
    console.print(f"{what}, batch {args.batch} x {args.seq}, steps {start}..{args.steps}")
    losses, times = _loop(ts, args, batch_of, start, console)
    _report(console, losses, times, args)
    console.print(f"memory (remat={args.remat}): {ts.memory_analysis().summary()}")
    return 0


def _loop(ts, args, batch_of, start, console):
    losses: list[tuple[int, float]] = []
    times: list[float] = []
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("compiling", total=args.steps, completed=start)
        for step in range(start, args.steps):
            t0 = time.perf_counter()
            loss = float(ts.step(batch_of(step))["loss"])
            dt = time.perf_counter() - t0
            if step > start:  # the first step compiles
                times.append(dt)
            losses.append((step + 1, loss))
            tok_s = args.batch * args.seq / dt
            progress.update(task, advance=1, description=f"step {step + 1} loss {loss:.4f}  {tok_s:,.0f} tok/s  "
                            f"{dt * 1e3:.0f} ms")
            if args.ckpt_dir and (step + 1 == args.steps or (args.save_every and (step + 1) % args.save_every == 0)):
                os.makedirs(args.ckpt_dir, exist_ok=True)
                ts.save(os.path.join(args.ckpt_dir, f"step-{step + 1}.safetensors"))
            if step + 1 in (start + 1, args.steps) or (step + 1) % 10 == 0:
                console.print(f"step {step + 1:5d}  loss {loss:.6f}")
    return losses, times


def _report(console, losses, times, args) -> None:
    table = Table(title="training summary")
    for col in ("steps", "first loss", "last loss", "median step ms", "tokens/s"):
        table.add_column(col, justify="right")
    med = statistics.median(times) if times else float("nan")
    table.add_row(f"{losses[0][0]}..{losses[-1][0]}", f"{losses[0][1]:.4f}", f"{losses[-1][1]:.4f}",
                  f"{med * 1e3:.1f}" if times else "-", f"{args.batch * args.seq / med:,.0f}" if times else "-")
    console.print(table)
    if args.ckpt_dir:
        console.print(f"checkpoint: {os.path.join(args.ckpt_dir, f'step-{args.steps}.safetensors')}")
    if args.plot:
        import matplotlib  # installed: checked by _check_paths

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([s for s, _ in losses], [v for _, v in losses])
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title("TinyGPT on Python stdlib text" if args.task == "gpt" else "MiniLM contrastive fine-tune")
        fig.tight_layout()
        fig.savefig(args.plot)
        console.print(f"loss curve: {args.plot}")
