"""``spmd generate``: decode with a random-weight Llama on a mesh and report TTFT, tokens/s, latency percentiles.

    python -m spmd generate --model llama2-7b --layers 4 --mesh tp=2 --max-new-tokens 128
    python -m spmd generate --model llama2-7b --small --mesh tp=4 --device cpu --max-new-tokens 32

A warm-up generation (3 tokens) compiles the prefill and decode programs (and captures their
CUDA graphs on GPUs); the timed generation then waits for every token to record its latency
(``spmd.metrics`` timer ``generate.decode_step``).
"""

from __future__ import annotations

import re

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

GEN_MODELS = ("llama2-7b", "llama3-8b")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_generate_parser(sub) -> None:
    """The ``generate`` subcommand's arguments."""
    g = sub.add_parser("generate", help="autoregressive decoding of a random-weight Llama with a sharded KV cache")
    g.add_argument("--model", default="llama2-7b", choices=GEN_MODELS)
    g.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's 32; small: 2)")
    g.add_argument("--mesh", default="tp=1", help="mesh axes, e.g. tp=2 or dp=2,tp=2 (default tp=1)")
    g.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    g.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; small: 16)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per sequence (default 64)")
    g.add_argument("--dtype", choices=tuple(_DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    g.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if GPUs are present, else cpu")
    g.add_argument("--small", action="store_true", help="tiny shapes (hidden 64, vocab 256) that run on CPU in seconds")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: greedy)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and sampler")
    g.add_argument("--small-all-reduce", choices=("auto", "on", "off"), default="auto",
                   help="run small all-reduces one-shot (CompileOptions.small_all_reduce; default auto)")
    g.add_argument("--dump", metavar="DIR", help="write the HLO text after each compiler stage to DIR")


def _error(msg: str) -> None:
    raise ValueError(msg)


_SAMPLING_FLAGS = {"temperature=None": "no --temperature", "temperature": "--temperature", "top_k": "--top-k",
                   "top_p": "--top-p", "seed": "--seed"}


def _sampling(args):
    """The ``Sampling`` of the flags; its ValueError / TypeError reworded with the flags' names."""
    from spmd.generation import Sampling

    try:
        return Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except (ValueError, TypeError) as e:
        msg = re.sub(r"\btemperature=None|\b(?:temperature|top_k|top_p|seed)\b",
                     lambda m: _SAMPLING_FLAGS[m.group(0)], str(e))
        raise ValueError(msg) from None


def _check(args) -> None:
    for name in ("batch", "max_new_tokens"):
        if getattr(args, name) < 1:
            _error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.layers is not None and args.layers < 1:
        _error(f"--layers: expected >= 1, got {args.layers}")
    if args.prompt_len is not None and args.prompt_len < 1:
        _error(f"--prompt-len: expected >= 1, got {args.prompt_len}")


def _prefill_error(message: str) -> str:
    """The Generator's prefill-memory error (``checks.check_memory``) in the command's flags."""
    for arg, flag in (("a shorter prefill_len", "a shorter --prompt-len"),
                      ("max_batch / max_seq", "--batch / --max-new-tokens"),
                      ("fewer mesh devices", "fewer --mesh devices")):
        message = message.replace(arg, flag)
    return "--prompt-len" + message[len("prefill_len"):]


def cmd_generate(args, console: Console, make_mesh, parse_mesh) -> int:
    """Run ``spmd generate``; ``make_mesh`` / ``parse_mesh`` come from ``spmd.cli``. Bad flags: ValueError."""
    from spmd import metrics
    from spmd.generation import Generator
    from spmd.models.llama_lm import llama_lm
    from spmd.passes.pipeline import CompileOptions

    _check(args)
    axes = parse_mesh(args.mesh)
    unused = [a for a in axes if a not in ("dp", "tp")]
    if unused:
        _error(f"--mesh: axis {unused[0]!r} is not used by spmd generate; expected axes dp and/or tp, "
               f"got {args.mesh!r}")
    mesh = make_mesh(axes, args.device)
    dtype = _DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    sampling = _sampling(args)
    build_device = "cuda:0" if args.device == "cuda" else "cpu"
    layers = args.layers if args.layers is not None else (2 if args.small else None)
    model = llama_lm(args.model, layers, small=args.small, dtype=dtype, device=build_device, seed=args.seed)
    cfg = model.config
    prompt_len = args.prompt_len or (16 if args.small else 128)
    max_seq = prompt_len + args.max_new_tokens - 1
    try:
        gen = Generator(model, mesh, max_batch=args.batch, max_seq=max_seq, prefill_len=prompt_len,
                        options=CompileOptions(dump_dir=args.dump, small_all_reduce=args.small_all_reduce))
    except ValueError as e:
        if str(e).startswith("prefill_len: a prefill"):
            _error(_prefill_error(str(e)))
        if "KV cache" not in str(e):
            raise
        _error(f"--batch {args.batch}, --prompt-len {prompt_len}, --max-new-tokens {args.max_new_tokens}: {e}")
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, prompt_len),
                            generator=torch.Generator().manual_seed(args.seed)).tolist()
    console.print(f"[bold]{args.model}[/]{' (small)' if args.small else ''}: {cfg.num_layers} layers, hidden "
                  f"{cfg.hidden_size}, {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}, "
                  f"{str(dtype).removeprefix('torch.')}, random weights on {mesh!r}; batch {args.batch}, prompt "
                  f"{prompt_len}, {args.max_new_tokens} new tokens, {'greedy' if sampling.greedy else sampling}")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("compile + warm-up", total=1)
        warm = gen.generate(prompts, min(3, args.max_new_tokens), sampling)
        progress.update(task, completed=1, description=f"compiled + warm-up in {warm.ttft_s + warm.decode_s:.2f} s")
        metrics.timer("generate.decode_step")._reset()
        task = progress.add_task("decode", total=args.max_new_tokens)
        res = gen.generate(prompts, args.max_new_tokens, sampling, timing=True,
                           progress=lambda n: progress.update(task, completed=n))
    pct = metrics.timer("generate.decode_step").percentiles()
    table = Table(title=f"spmd generate --model {args.model} --mesh {args.mesh}",
                  caption="decode tokens/s = batch x (new tokens - 1) / decode time; latencies of one decode step")
    for col in ("TTFT ms", "tokens/s", "p50 ms", "p90 ms", "p99 ms"):
        table.add_column(col, justify="right")
    ms = [f"{pct[p] * 1e3:.3f}" if pct else "-" for p in (50, 90, 99)]
    table.add_row(f"{res.ttft_s * 1e3:.2f}", f"{res.tokens_per_s:,.1f}", *ms)
    console.print(table)
    console.print(f"first sequence's tokens: {res.tokens[0, :16].tolist()}{' ...' if res.tokens.shape[1] > 16 else ''}")
    return 0

