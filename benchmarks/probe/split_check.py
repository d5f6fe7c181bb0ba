"""What split-batch overlap is worth: a tensor-parallel BERT (MiniLM shapes) with it on, off and auto.

``spmd.parallelize`` with ``bert_plan()`` over ``--tp`` devices, random weights, compiled with
``split_batch_overlap`` "off", "on" and "auto" (CUDA graphs on where the mesh is on GPUs). For
each batch x sequence shape it prints the cost model's prediction (``split_batch_us``: serial and
split µs), whether "auto" split, each variant's error against single-device PyTorch, and the
median ms per call of the variants (interleaved rounds, ``benchmarks.common.interleaved``).

Usage: ``python3 -m benchmarks.probe.split_check [--tp 2] [--shapes 8x128,128x128] [--dtype bf16]``;
``--device cpu --small`` is a dry run on virtual CPU devices with a tiny BERT.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks import common

MODES = ("off", "on", "auto")


def _prediction(pm, ids, mask) -> str:
    from spmd.ir.text import parse_module
    from spmd.passes.cost_model import H200_NVLINK, split_batch_us
    from spmd.passes.split_batch import SplitBatch

    off = pm.lower(ids, mask)
    module = parse_module(off.as_text("hoist-weights"))
    hoisted = {p.attrs["parameter_number"] for p in module.entry.parameters if p.name.endswith(".hoisted")}
    plan = SplitBatch(mode="on", weights=frozenset(range(len(pm.params))) | hoisted).plan(module)
    if plan is None:
        return "not row-separable"
    serial, split = split_batch_us(module.entry, plan, H200_NVLINK)
    return f"predicted serial {serial:.0f} us, split {split:.0f} us"


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    common.apply_required_env()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shapes", default="8x128,128x128", help="comma-separated batch x sequence")
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    ap.add_argument("--small", action="store_true", help="a tiny BERT (hidden 32, 2 layers) for a dry run")
    args = ap.parse_args(argv)

    import torch

    import spmd
    from spmd.models.bert import BertConfig, BertSentenceEncoder
    from spmd.models.common import init_random_
    from spmd.models.plans import bert_plan
    from spmd.parallelize import parallelize

    cfg = (BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=128) if args.small
           else BertConfig(num_hidden_layers=6))
    dtype = torch.bfloat16 if args.dtype == "bf16" and args.device != "cpu" else torch.float32
    model = init_random_(BertSentenceEncoder(cfg), seed=0).eval()
    reference = copy.deepcopy(model).double()
    model = model.to(dtype)
    cpu = args.device == "cpu"
    mesh = spmd.Mesh.create({"tp": args.tp}, f"cpu:{args.tp}" if cpu else "cuda")
    devices = ["cpu"] if cpu else [f"cuda:{k}" for k in range(args.tp)]
    failures = []
    for shape in args.shapes.split(","):
        b, s = (int(v) for v in shape.split("x"))
        gen = torch.Generator().manual_seed(b * 1000 + s)
        ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
        mask = torch.ones(b, s, dtype=torch.long)
        mask[0, s // 2:] = 0
        with torch.no_grad():
            want = reference(ids, mask)
        pms = {m: parallelize(model, mesh, bert_plan(), options=spmd.CompileOptions(split_batch_overlap=m))
               for m in MODES}
        print(f"{shape}: {_prediction(pms['off'], ids, mask)}")
        placed = pms["off"].place_inputs(ids, mask)
        for mode, pm in pms.items():
            got = pm(*placed).to_torch().double()
            err = ((got - want).abs().max() / want.abs().max()).item()
            split = ".h1" in pm.lowered.as_text("split-batch")
            print(f"{shape} {mode}: split={split}, rel err {err:.2e}")
            if err > (2e-2 if dtype == torch.bfloat16 else 1e-4):
                failures.append(f"{shape} {mode}: rel err {err}")
        fns = {mode: (lambda pm=pm, placed=placed: pm(*placed)) for mode, pm in pms.items()}
        res = common.interleaved(fns, devices, rounds=args.rounds, reps=20, warmup=3)
        base = res["off"].median_ms
        for mode, m in res.items():
            print(f"{shape} {mode}: {m.median_ms:.4f} ms per call ({m.median_ms / base:.2f}x off)" if m.median_ms
                  else f"{shape} {mode}: failed {m.error}")
    print("FAILURES:", failures if failures else "none")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
