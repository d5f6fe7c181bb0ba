"""What each optimization pass is worth on GPU: one program compiled with passes switched off.

For each workload of ``benchmarks.workloads`` (default minilm,block) on the local GPUs (all by
default), it compiles spmd with CUDA graphs once per variant of :data:`VARIANTS` (the full
pipeline, then one ``CompileOptions`` switch off at a time), checks each output against the
PyTorch reference, then times the variants interleaved (A B C, A B C, ... over ``--rounds``
rounds; GPU µs per call from CUDA events around ``--calls`` back-to-back calls, and the host's
enqueue µs) and prints medians with the ratio to the full pipeline, plus each variant's kernels
per call by class (``benchmarks.gpu_kernels``).

Usage: ``python3 -m benchmarks.probe.ablate [--workloads minilm] [--tp 1] [--rounds 7]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks import common, harness
from benchmarks.dispatch import WORKLOAD_NAMES

#: variant name -> CompileOptions fields changed from the defaults (CUDA graphs on in all).
VARIANTS: dict[str, dict[str, object]] = {
    "full": {},
    "no-merge-dots": {"merge_dots": False},
    "no-fuse-attention": {"fuse_attention": False},
    "no-fuse-elementwise": {"fuse_elementwise": False},
}


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    common.apply_required_env()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", type=harness.name_list(WORKLOAD_NAMES, allow_empty=False),
                    default=["minilm", "block"], help=f"comma-separated subset of {', '.join(WORKLOAD_NAMES)}")
    ap.add_argument("--variants", type=harness.name_list(tuple(VARIANTS), allow_empty=False), default=list(VARIANTS),
                    help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tp", type=int, default=0, help="GPUs to use (default: all)")
    ap.add_argument("--matmul-precision", choices=("highest", "high"), default="highest",
                    help="torch.set_float32_matmul_precision for every variant (high = TF32)")
    args = ap.parse_args(argv)
    names = args.variants
    common.require_cuda("benchmarks.probe.ablate")
    import torch

    import spmd
    from benchmarks.gpu_kernels import kernel_summary
    from benchmarks.probe.block_profile import gpu_us_per_call, placed_cases

    torch.set_float32_matmul_precision(args.matmul_precision)
    for wl, (fn, in_sh, out_sh, ref, placed), mesh, devices in placed_cases(args.tp, args.workloads):
        calls = {}
        for name in names:
            f = spmd.jit(fn, mesh=mesh, in_shardings=in_sh, out_shardings=out_sh,
                         options=spmd.CompileOptions(cuda_graphs=True, **VARIANTS[name]))
            calls[name] = lambda f=f, a=placed: f(*a)
            err = common.rel_error(calls[name]().to_torch().float(), ref.float())
            print(f"{wl} {name}: rel err {err:.1e}", flush=True)
        times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for _ in range(args.rounds):
            for name in names:
                times[name].append(gpu_us_per_call(calls[name], devices, args.calls, rounds=1))
        base = common.median([g for g, _ in times["full"]]) if "full" in times else None
        print(f"== {wl} on {len(devices)} GPU(s), precision {args.matmul_precision}: GPU µs/call "
              f"(median of {args.rounds} interleaved rounds)")
        for name in names:
            gpu = common.median([g for g, _ in times[name]])
            host = common.median([h for _, h in times[name]])
            ratio = f"{gpu / base:5.2f}x" if base else "  n/a"
            k = max(kernel_summary(calls[name]), key=lambda d: d.busy_us)
            print(f"   {name:22s} GPU {gpu:8.1f} µs ({ratio} full)  host {host:7.1f} µs  | cuda:{k.device} "
                  f"{k.kernels} kernels, busy {k.busy_us:.1f} = matmul {k.matmul_us:.1f} + coll "
                  f"{k.collective_us:.1f} + other {k.other_us:.1f}", flush=True)
        del placed, calls
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
