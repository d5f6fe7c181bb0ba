"""The kernels of one spmd call of a one-GPU row, in issue order: name and µs.

The one-GPU benchmark aggregates its profile by kernel name; this lists one call's kernels one by
one (``benchmarks.gpu_kernels.kernel_events`` of the CUDA-graph replay of ``spmd.parallelize`` on
a one-device mesh), so that the kernels of one layer and the head and tail of the model can be
told apart.

Usage: ``python3 -m benchmarks.probe.kernel_sequence [--row minilm-bf16-128x128] [--first 24] [--last 12] [--text]``
(``--text``: also the scheduled program's instructions, to match kernels with the ops they run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    """Entry point; see the module docstring."""
    import torch

    import spmd
    from benchmarks import one_gpu
    from benchmarks.gpu_kernels import kernel_events

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--row", default="minilm-bf16-128x128", choices=[r.name for r in one_gpu.ROWS])
    ap.add_argument("--first", type=int, default=24)
    ap.add_argument("--last", type=int, default=12)
    ap.add_argument("--text", action="store_true", help="also print the scheduled program's entry instructions")
    args = ap.parse_args(argv)
    row = next(r for r in one_gpu.ROWS if r.name == args.row)
    device = torch.device("cuda", 0)
    module32, inputs32 = one_gpu.build_module(row, False, 0)
    dtype = torch.bfloat16 if row.dtype == "bf16" else torch.float32
    module = module32.to(device=device, dtype=dtype)
    inputs = one_gpu._cast_inputs(inputs32, dtype, device)
    mesh = spmd.Mesh.create({"tp": 1}, devices="cuda:1")
    pm = spmd.parallelize(module, mesh, one_gpu.plan_for(row))
    placed = pm.place_inputs(*inputs)
    for _ in range(5):
        pm(*placed)
    kernels = kernel_events(lambda: pm(*placed), name_chars=110)
    if args.text:
        _print_entry(pm.lowered.as_text(pm.lowered.stages[-1]))
    print(f"{args.row}: {len(kernels)} kernels in one call", flush=True)
    shown = list(enumerate(kernels))
    if len(shown) > args.first + args.last:
        shown = shown[:args.first] + [(-1, None)] + shown[-args.last:]
    for i, k in shown:
        if k is None:
            print("  ...")
            continue
        start, end, name = k
        print(f"  {i:3d} {end - start:8.2f} µs  {name}")
    return 0


def _print_entry(text: str) -> None:
    """The entry computation's instructions, without parameters and metadata."""
    import re

    entry = text[text.index("\nENTRY") + 1:]
    for line in entry.splitlines()[1:]:
        if " parameter(" not in line and line.strip() != "}":
            print("  | " + re.sub(r", (metadata|sharding)=\{[^}]*\}", "", line.strip())[:200])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
