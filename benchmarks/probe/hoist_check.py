"""What hoisting weight-only work is worth on one GPU, and that weight updates stay correct.

Llama-2-7B-shaped decoder layers (``spmd.models.llama``, bf16) through ``spmd.parallelize`` on
``cuda:0`` (CUDA graphs on), compiled three ways: the default pipeline (merge-dots with the
merged weights hoisted into the prologue), ``hoist_weights=False`` (the Q/K/V and gate/up
weights concatenated on every call) and ``merge_dots=False``; plus PyTorch eager. Prints the
median ms per call of each (interleaved rounds, ``benchmarks.common.interleaved``), the
concatenate kernels left per call, and then replaces and updates parameters in place between
graph replays, checking every result against eager and that nothing was captured again.

Usage: ``python3 -m benchmarks.probe.hoist_check [--layers 2] [--shapes 1x1,1x128] [--rounds 5]``;
``--device cpu --small`` is a dry run on the CPU (tiny Llama shapes, float32).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks import common

VARIANTS = {"hoist": {}, "no-hoist": {"hoist_weights": False}, "no-merge-dots": {"merge_dots": False}}


def _concats(compiled) -> int:
    from spmd.runtime.thunks import KernelThunk

    ops = {i.name: i.opcode for i in compiled.module.entry.instructions}
    ex = getattr(compiled.executable, "executable", compiled.executable)
    return sum(isinstance(t, KernelThunk) and ops.get(t.name) == "concatenate" for t in ex.program.thunks)


def _updates(pm, model, x, xs) -> list[str]:
    """Replace / update parameters between replays; every result against eager. Returns failures."""
    import torch

    import spmd
    from spmd import metrics

    bad = []
    recaptures = metrics.counter("cuda_graphs.recapture").value
    names = ["layers.0.self_attn.k_proj.weight", "layers.0.mlp.up_proj.weight"]
    for step, name in enumerate(names * 2):
        p = model.get_parameter(name)
        with torch.no_grad():
            if step < 2:  # a new array
                p.copy_(torch.randn_like(p) * 0.02)
                pm.params[name] = spmd.device_put(p.detach(), pm.params[name].sharding)
            else:  # in place, through the shards
                p.mul_(-1.5)
                for shard in pm.params[name].shards:
                    shard.data.mul_(-1.5)
        got = pm(xs).to_torch().float()
        with torch.no_grad():
            want = model(x).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        print(f"  update {step} ({name}): rel err {err:.2e}, prologue runs {pm.compiled.weight_cache.runs}")
        if err > 2e-2:
            bad.append(f"update {step}: rel err {err}")
    if metrics.counter("cuda_graphs.recapture").value != recaptures:
        bad.append("graphs were captured again after a weight update")
    return bad


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    common.apply_required_env()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--shapes", default="1x1,1x128", help="comma-separated batch x sequence")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda:0", help="cuda:0, or cpu for a dry run")
    ap.add_argument("--small", action="store_true", help="tiny Llama shapes (hidden 64) for a dry run")
    args = ap.parse_args(argv)

    import torch

    import spmd
    from spmd.models.llama import llama_layers
    from spmd.models.plans import llama_plan
    from spmd.parallelize import parallelize

    torch.manual_seed(0)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = llama_layers("llama2-7b", layers=args.layers, dtype=dtype, device=args.device, small=args.small)
    hidden = model.config.hidden_size
    mesh = spmd.Mesh.create(("tp",), devices="cpu:1" if args.device == "cpu" else args.device)
    failures = []
    for shape in args.shapes.split(","):
        b, s = (int(v) for v in shape.split("x"))
        x = torch.randn(b, s, hidden, dtype=dtype, device=args.device)
        xs = spmd.device_put(x, spmd.NamedSharding(mesh, spmd.PartitionSpec()))
        pms = {name: parallelize(model, mesh, llama_plan(), options=spmd.CompileOptions(**opts))
               for name, opts in VARIANTS.items()}
        with torch.no_grad():
            want = model(x).float()
        for name, pm in pms.items():
            got = pm(xs).to_torch().float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            print(f"{shape} {name}: rel err {err:.2e}, concatenate kernels per call {_concats(pm.compiled)}")
            if err > 2e-2:
                failures.append(f"{shape} {name}: rel err {err}")

        def eager(x=x):
            with torch.no_grad():
                return model(x)

        fns = {name: (lambda pm=pm, xs=xs: pm(xs)) for name, pm in pms.items()}
        fns["eager"] = eager
        res = common.interleaved(fns, [args.device], rounds=args.rounds, reps=50, warmup=5)
        base = res["hoist"].median_ms
        for name, m in res.items():
            print(f"{shape} {name}: {m.median_ms:.4f} ms per call ({m.median_ms / base:.2f}x hoist)" if m.median_ms
                  else f"{shape} {name}: failed {m.error}")
        failures += _updates(pms["hoist"], model, x, xs)
    print("FAILURES:", failures if failures else "none")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
