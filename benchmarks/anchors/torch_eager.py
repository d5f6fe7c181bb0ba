"""PyTorch anchors for the dispatch benchmark: each workload unsharded on one device, run by
eager PyTorch, ``torch.compile`` (default mode) and ``torch.compile(mode="reduce-overhead")``.

``python3 -m benchmarks.anchors.torch_eager [--device cuda|cpu]``: for every workload of
``benchmarks.workloads`` (and MiniLM from ``spmd.models`` when it loads), the host time per
call, enqueue-only and synced (µs), printed as JSON records with sources ``torch-eager``,
``torch-compile`` and ``torch-compile-ro``, each with its relative error against eager's
result, and on a GPU the kernels of one call (``kind: kernels``). The three variants of a
workload are measured one after another in the same process, in rounds (eager, compile,
reduce-overhead, eager, ...: :func:`benchmarks.common.host_call_times` per round).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import common
from benchmarks.dispatch import emit_kernels, fail, measure, parse_args, set_torch_precision

SOURCE = "torch-eager"
#: source -> torch.compile keyword arguments (None: plain eager).
VARIANTS = {"torch-eager": None, "torch-compile": {}, "torch-compile-ro": {"mode": "reduce-overhead"}}


def _calls(name: str, device, seed: int) -> dict:
    """Per source, a zero-argument call of the workload (compiled variants are compiled here)."""
    import torch

    from benchmarks.workloads import WORKLOADS, make_inputs, minilm_case

    if name == "minilm":
        case = minilm_case(device, seed)
        module, args = case.module, (case.input_ids, case.attention_mask)
        base = lambda *a: module(*a)  # noqa: E731
    else:
        wl = WORKLOADS[name]
        args = tuple(make_inputs(wl, device, seed))
        base = wl.fn
    out = {}
    for source, kwargs in VARIANTS.items():
        fn = base if kwargs is None else torch.compile(base, dynamic=False, **kwargs)
        out[source] = lambda fn=fn, args=args: fn(*args)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    common.apply_required_env()
    import torch

    args = parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    seed = args.seed if args.seed is not None else common.fresh_seed()
    sync = lambda: common.synchronize([device])  # noqa: E731
    torch.set_grad_enabled(False)
    set_torch_precision(args.matmul_precision)
    for name in args.workloads:
        torch._dynamo.reset()
        try:
            calls = _calls(name, device, seed)
            ref = calls["torch-eager"]().float().clone()
        except Exception as exc:
            for source in VARIANTS:
                fail(source, name, exc)
            continue
        for source, fn in calls.items():
            try:
                for _ in range(3):  # compile; reduce-overhead records its CUDA graph on the third call
                    out = fn()
                extra = {"rel_err_vs_eager": common.rel_error(out.float(), ref)}
            except Exception as exc:
                fail(source, name, exc)
                continue
            rec = measure(source, name, fn, sync, args, extra)
            if args.device == "cuda" and rec.get("error") is None:
                emit_kernels(source, name, fn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
