"""Decode benchmark: Llama-2-7B generation on one GPU, spmd against gpt-fast-style PyTorch and plain eager.

Usage (repository root)::

    python3 -m benchmarks.decode                          # H200: 32 layers, bf16, batch 1 and 8
    python3 -m benchmarks.decode --device cpu --small     # dry run on CPU in seconds (no docs row set)

Per batch size, in the same process and interleaved (round r runs every variant once, A B C,
A B C, ...; ``--warmup-rounds`` untimed rounds first), each variant generates ``--new-tokens``
greedy tokens after a ``--prompt-len`` prompt, with a static KV cache of ``prompt + new - 1``
slots; the medians over rounds are reported:

* ``spmd``: ``spmd.Generator`` on a one-device mesh (prefill and decode programs, the decode
  step captured as a CUDA graph; KV cache donated);
* ``spmd-no-pdl`` and ``spmd-pdl`` (not run unless named in ``--variants``): a second
  ``spmd.Generator`` of the same model (sharing its weights) whose calls run with ``SPMD_PDL=0``
  or ``SPMD_PDL=1`` (``spmd.runtime.triton_pdl``): no programmatic dependent launch, or PDL for
  every Triton launch, against ``spmd`` with the process's setting (by default ``auto``: PDL for
  launches over one row): a same-run, interleaved A/B;
* ``torch.compile``: the gpt-fast recipe (PyTorch-Labs gpt-fast, 2023): the cache as module
  buffers written in place with ``index_copy_`` at the position, SDPA with a position mask,
  the decode step under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` and the
  prefill under ``torch.compile(fullgraph=True)``;
* ``eager``: the same module and step without compilation.

Every variant runs the same ``spmd.models.llama_lm.LlamaForCausalLM`` code with the same seeded
weights. Columns: decode tokens/s (batch x (new - 1) / decode time), ms per step, time to first
token (prefill + first token), the effective bandwidth (weights + whole KV cache read per step /
step time) and its fraction of ``--hbm-tbps`` (H200: 4.8 TB/s), peak memory, and the share of
tokens equal to the torch.compile baseline's (bf16 numerics may part ways on random weights).
Output: a printed table and, with ``--doc`` (default on GPU), a row set in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import threading
import time
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import reporting

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
VARIANTS = ("spmd", "spmd-no-pdl", "spmd-pdl", "torch.compile", "eager")
DEFAULT_VARIANTS = ("spmd", "torch.compile", "eager")
PDL_VARIANTS = {"spmd-no-pdl": "0", "spmd-pdl": "1"}  # variant -> SPMD_PDL around its calls


class GptFastDecoder(torch.nn.Module):
    """gpt-fast-style step functions over a model whose attention writes the cache in place.

    ``model`` must be built with ``cache_update="inplace"``; the caches are buffers
    [B, kv heads, max_seq, head_dim]. ``prefill(tokens [B, P], start [B]) -> int64 [B]`` and
    ``decode(token [B], slot int64 [], start [B]) -> int64 [B]`` pick the argmax token.
    """

    def __init__(self, model, batch: int, max_seq: int) -> None:
        super().__init__()
        self.model = model
        for i, (k, v) in enumerate(model.empty_kv(batch, max_seq)):
            self.register_buffer(f"k{i}", k)
            self.register_buffer(f"v{i}", v)
        self.num_layers = len(model.layers)

    def _kv(self):
        return tuple((getattr(self, f"k{i}"), getattr(self, f"v{i}")) for i in range(self.num_layers))

    def prefill(self, tokens, start):
        logits, _ = self.model(tokens, 0, start, self._kv())
        return torch.argmax(logits, dim=-1)

    def decode(self, token, slot, start):
        logits, _ = self.model(token[:, None], slot, start, self._kv())
        return torch.argmax(logits, dim=-1)


def torch_runner(dec: GptFastDecoder, prefill, decode, tokens, start, new_tokens: int, sync):
    """One generation with ``prefill``/``decode`` callables. Returns (ttft_s, decode_s, tokens [B, T])."""
    sync()
    t0 = time.perf_counter()
    tok = prefill(tokens, start).clone()
    sync()
    ttft = time.perf_counter() - t0
    out = [tok]
    slot = torch.tensor(tokens.shape[1], dtype=torch.int64, device=tokens.device)
    t1 = time.perf_counter()
    for _ in range(1, new_tokens):
        tok = decode(tok, slot, start).clone()  # cudagraph outputs are overwritten by the next replay
        out.append(tok)
        slot += 1
    sync()
    return ttft, time.perf_counter() - t1, torch.stack(out, 1).cpu()


def step_bytes(model, batch: int, max_seq: int) -> int:
    """Bytes one decode step reads: every weight but the embedding table, plus the whole KV cache."""
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("embed"))
    cfg, item = model.config, model.lm_head.weight.element_size()
    return weights + 2 * cfg.num_layers * batch * cfg.num_kv_heads * max_seq * cfg.head_dim * item


def _with_env(name: str, value: str, fn):
    """``fn()`` with environment variable ``name`` set to ``value``, restored after."""
    import os

    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def _generate(gen, prompts, args):
    res = gen.generate(prompts.tolist(), args.new_tokens)
    return res.ttft_s, res.decode_s, res.tokens


def build_variants(args, batch: int, device: str):
    """{name: () -> (ttft_s, decode_s, tokens)} for one batch size, plus the spmd model (for bytes)."""
    import spmd
    from spmd.generation import Generator
    from spmd.models.llama_lm import llama_lm

    dtype = torch.float32 if args.small else torch.bfloat16
    kw = dict(small=args.small, dtype=dtype, seed=0)
    layers = args.layers if not args.small else min(args.layers, 2)
    model = llama_lm("llama2-7b", layers, device=device, **kw)
    max_seq = args.prompt_len + args.new_tokens - 1
    mesh = spmd.Mesh.create(("tp",), devices=f"{device.split(':')[0]}:1")
    gen = Generator(model, mesh, max_batch=batch, max_seq=max_seq, prefill_len=args.prompt_len)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    tokens, start = prompts.to(device), torch.zeros(batch, dtype=torch.int64, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    staged = spmd.metrics.counter("cuda_graphs.staged.bytes")

    def run_spmd():
        before = staged.value
        res = _generate(gen, prompts, args)
        # argument bytes copied into CUDA-graph inputs: the donated KV cache once per program, not per step
        print(f"spmd batch {batch}: {(staged.value - before) / 2**20:.2f} MiB staged into graph inputs "
              f"in {args.new_tokens} tokens", flush=True)
        return res

    variants = {"spmd": run_spmd}
    for name, setting in PDL_VARIANTS.items():
        if name in args.variants:
            other = Generator(model, mesh, max_batch=batch, max_seq=max_seq, prefill_len=args.prompt_len)
            variants[name] = partial(_with_env, "SPMD_PDL", setting, partial(_generate, other, prompts, args))
    base = GptFastDecoder(llama_lm("llama2-7b", layers, device=device, cache_update="inplace", **kw), batch, max_seq)
    if "torch.compile" in args.variants:
        pre = torch.compile(base.prefill, fullgraph=True)
        dec = torch.compile(base.decode, mode="reduce-overhead", fullgraph=True)
        variants["torch.compile"] = lambda: torch_runner(base, pre, dec, tokens, start, args.new_tokens, sync)
    if "eager" in args.variants:
        variants["eager"] = lambda: torch_runner(base, base.prefill, base.decode, tokens, start, args.new_tokens, sync)
    return {k: v for k, v in variants.items() if k in args.variants}, model, max_seq


@torch.no_grad()
def bench_batch(args, batch: int, device: str, log) -> list[dict]:
    """Interleaved rounds for one batch size; one record per variant."""
    variants, model, max_seq = build_variants(args, batch, device)
    nbytes = step_bytes(model, batch, max_seq)
    runs: dict[str, list] = {k: [] for k in variants}
    errors: dict[str, str] = {}
    peak: dict[str, float] = {}
    warm = args.warmup_rounds  # untimed: compilation, then CUDA-graph capture (the second call of a program)
    for r in range(warm + args.rounds):
        for name, fn in variants.items():
            if name in errors:
                continue
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            try:
                res = fn()
            except Exception as exc:  # one variant's failure must not stop the others
                errors[name] = f"{type(exc).__name__}: {exc}"[:300]
                log(f"batch {batch}: {name} failed: {errors[name]}")
                continue
            if device.startswith("cuda"):
                peak[name] = torch.cuda.max_memory_allocated() / 2**30
            if r >= warm:
                runs[name].append(res)
            log(f"batch {batch} round {r}: {name} ttft {res[0] * 1e3:.1f} ms, decode {res[1]:.3f} s")
            if _STOP.is_set():
                raise TimeBoxEnded
    if args.profile and device.startswith("cuda"):
        from benchmarks.gpu_kernels import print_kernels

        for name, fn in variants.items():
            if name not in errors:
                print_kernels(f"decode b{batch} {name} (one generation)", fn, calls=1, top=args.profile)
    ref = runs.get("torch.compile", [None])[-1] if runs.get("torch.compile") else None
    out = []
    for name in variants:
        if not runs[name]:
            out.append({"variant": name, "batch": batch, "error": errors.get(name, "no rounds")})
            continue
        ttft = statistics.median(x[0] for x in runs[name])
        decode_s = statistics.median(x[1] for x in runs[name])
        step_s = decode_s / max(args.new_tokens - 1, 1)
        toks = runs[name][-1][2]
        same = None if ref is None else float((toks == ref[2]).double().mean())
        out.append({"variant": name, "batch": batch, "ttft_ms": ttft * 1e3, "step_ms": step_s * 1e3,
                    "tokens_per_s": batch / step_s, "gbps": nbytes / step_s / 1e9,
                    "hbm_frac": nbytes / step_s / (args.hbm_tbps * 1e12), "peak_gib": peak.get(name),
                    "same_tokens": same, "error": None})
    return out


def table_rows(records: list[dict]) -> list[list[str]]:
    """Printable cells; ratios are against torch.compile of the same batch."""
    base = {r["batch"]: r for r in records if r["variant"] == "torch.compile" and not r.get("error")}
    rows = []
    for r in records:
        if r.get("error"):
            rows.append([str(r["batch"]), r["variant"]] + ["n/a"] * 8)
            continue
        b = base.get(r["batch"])
        rows.append([str(r["batch"]), r["variant"], f"{r['tokens_per_s']:,.1f}",
                     reporting.fmt_ratio(r["tokens_per_s"] / b["tokens_per_s"] if b else None),
                     reporting.fmt_ms(r["step_ms"]), reporting.fmt_ms(r["ttft_ms"]),
                     reporting.fmt_ratio(r["ttft_ms"] / b["ttft_ms"] if b else None),
                     f"{r['gbps']:,.0f} ({r['hbm_frac']:.0%})",
                     "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}",
                     "n/a" if r["same_tokens"] is None else f"{r['same_tokens']:.0%}"])
    return rows


HEADERS = ["batch", "variant", "tokens/s", "× compile", "ms/step", "TTFT ms", "TTFT × compile",
           "GB/s (HBM)", "peak GiB", "same tokens"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.decode", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes (hidden 64, 2 layers), float32: a dry run")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="timed interleaved rounds")
    p.add_argument("--warmup-rounds", type=int, default=3,
                   help="untimed rounds first (default 3: the first prefills of a process compile and capture "
                        "CUDA graphs; a run with 2 still captured during its third prefill)")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="peak HBM bandwidth, TB/s (H200: 4.8)")
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="after timing, print each variant's TOP longest kernels of one generation (CUDA only)")
    p.add_argument("--doc", dest="doc", action="store_true", default=None, help="append a row set to the docs")
    p.add_argument("--no-doc", dest="doc", action="store_false")
    args = p.parse_args(argv)
    if args.small:
        args.prompt_len, args.new_tokens = min(args.prompt_len, 16), min(args.new_tokens, 24)
    if args.warmup_rounds < 0:
        p.error(f"--warmup-rounds: expected >= 0, got {args.warmup_rounds}")
    for name in ("layers", "prompt_len", "new_tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.doc is None:
        args.doc = args.device == "cuda" and not args.small
    return args


class TimeBoxEnded(BaseException):  # not caught by the per-variant error handling
    """SIGTERM arrived (the stage's time box ended): write the finished batches and stop."""


_STOP = threading.Event()  # set with the SIGTERM, in case a library swallowed the exception


def _time_box_ended(signum, frame):
    _STOP.set()
    raise TimeBoxEnded


def _print_decisions(log, seen: list[int]) -> None:
    """The timed kernel choices (skinny products, attention) made since the last call."""
    from spmd.runtime.kernels_attention import DECISIONS as ATTENTION_DECISIONS
    from spmd.runtime.kernels_gemv import DECISIONS

    for k, ds in enumerate((DECISIONS, ATTENTION_DECISIONS)):
        for d in ds[seen[k]:]:
            log(d.summary() if k == 0 else d.line())
        seen[k] = len(ds)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    log = lambda msg: print(f"[decode] {msg}", flush=True)  # noqa: E731
    records, cut = [], None
    previous = signal.signal(signal.SIGTERM, _time_box_ended)  # run_gpu.sh's `timeout` sends SIGTERM
    seen = [0, 0]
    try:
        for batch in args.batch:
            records += bench_batch(args, batch, device, log)
            for row in table_rows([r for r in records if r["batch"] == batch]):
                log(" | ".join(row))
            _print_decisions(log, seen)
    except TimeBoxEnded:
        cut = f"The time box ended during batch {batch}: the rows are the batches finished before it."
        log(cut)
    finally:
        signal.signal(signal.SIGTERM, previous)
    shape = "small (hidden 64, 2 layers, float32)" if args.small else f"Llama-2-7B, {args.layers} layers, bf16"
    title = (f"decode: {shape}, prompt {args.prompt_len}, {args.new_tokens} new tokens, one "
             f"{'GPU' if args.device == 'cuda' else 'CPU'}, greedy, medians of {args.rounds} interleaved rounds "
             f"after {args.warmup_rounds} untimed")
    rows = table_rows(records)
    reporting.print_table(title, HEADERS, rows)
    _print_decisions(log, seen)
    for r in records:
        if r.get("error"):
            print(f"  batch {r['batch']} {r['variant']}: {r['error']}")
    if args.doc and records:
        notes = "\n".join([*(f"- batch {r['batch']} {r['variant']}: {r['error']}" for r in records if r.get("error")),
                           *([f"- {cut}"] if cut else [])])
        body = f"{title}.\n\n{reporting.markdown_table(HEADERS, rows)}\n\n{notes}"
        reporting.append_row_set(DOC, "decode (Llama generation, one GPU)", reporting.hardware_info(), body)
    return 0 if any(not r.get("error") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
