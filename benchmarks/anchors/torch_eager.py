"""PyTorch eager anchor for the dispatch benchmark: each workload unsharded on one device.

``python3 -m benchmarks.anchors.torch_eager [--device cuda|cpu]``: for every workload of
``benchmarks.workloads`` (and MiniLM from ``spmd.models`` when it loads), the host time per
call, enqueue-only and synced (µs), printed as JSON records with source ``torch-eager``, and on
a GPU the kernels of one call (``kind: kernels``).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import common
from benchmarks.dispatch import emit_kernels, fail, measure, parse_args, set_torch_precision

SOURCE = "torch-eager"


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    common.apply_required_env()
    import torch

    from benchmarks.workloads import WORKLOADS, make_inputs, minilm_case

    args = parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    seed = args.seed if args.seed is not None else common.fresh_seed()
    sync = lambda: common.synchronize([device])  # noqa: E731
    torch.set_grad_enabled(False)
    set_torch_precision(args.matmul_precision)
    for name in args.workloads:
        try:
            if name == "minilm":
                case = minilm_case(device, seed)
                fn = lambda c=case: c.fn(c.params, c.input_ids, c.attention_mask)  # noqa: E731
            else:
                wl = WORKLOADS[name]
                xs = make_inputs(wl, device, seed)
                fn = lambda wl=wl, xs=xs: wl.fn(*xs)  # noqa: E731
        except Exception as exc:
            fail(SOURCE, name, exc)
            continue
        rec = measure(SOURCE, name, fn, sync, args)
        if args.device == "cuda" and rec.get("error") is None:
            emit_kernels(SOURCE, name, fn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
