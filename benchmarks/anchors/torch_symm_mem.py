"""PyTorch anchor for collective matmul: symmetric-memory fused ops vs NCCL, one process per GPU.

Run with ``python3 -m torch.distributed.run --nproc-per-node N -m benchmarks.anchors.torch_symm_mem``.
Per shape (M, K, N) and side, interleaved over 5 rounds (median of round medians; per rep the
maximum over ranks):

* ``compute``  the local GEMM alone;  ``comm``  ``all_gather_into_tensor`` resp.
  ``reduce_scatter_tensor`` of the same bytes (this process's own limit = max of the two);
* ``serial``   all-gather then ``torch.matmul`` (resp. matmul then reduce-scatter);
* ``fused``    ``torch.ops.symm_mem.fused_all_gather_matmul(A_shard, [B], gather_dim=0, group_name)``
  resp. ``torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, "sum", scatter_dim=0, group_name)``.

Rank 0 prints the records as JSON lines (``benchmarks.common.emit``); ``rel_err`` of ``fused``
is its distance to ``serial`` on the same fresh random inputs (both bf16).
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import common
from benchmarks.cm_local import build_parser, check_divisible, reps_for


def _setup() -> tuple[Any, int, int, str]:
    """Init NCCL on this rank's GPU; returns (device, rank, world size, group name)."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group_name = dist.group.WORLD.group_name
    import torch.distributed._symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(group_name)
    return device, dist.get_rank(), dist.get_world_size(), group_name


def _max_over_ranks(device: Any):
    import torch
    import torch.distributed as dist

    def combine(times: list[float]) -> list[float]:
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    return combine


def _variants(side: str, shape: tuple[int, int, int], tp: int, device: Any, seed: int, group_name: str):
    """(variants dict, check callable) for one side; inputs are fresh random shards on ``device``."""
    import torch
    import torch.distributed as dist

    m, k, n = shape
    if side == "ag":
        a = common.fresh_randn((m // tp, k), torch.bfloat16, device, seed, scale=1.0)
        b = common.fresh_randn((k, n // tp), torch.bfloat16, device, seed + 1, scale=1.0 / math.sqrt(k))
        gathered = torch.empty((m, k), dtype=a.dtype, device=device)
        out = torch.empty((m, n // tp), dtype=a.dtype, device=device)
        dist.all_gather_into_tensor(gathered, a)

        def fused():
            return torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group_name)[1][0]

        variants = {
            "compute": lambda: torch.matmul(gathered, b, out=out),
            "comm": lambda: dist.all_gather_into_tensor(gathered, a),
            "serial": lambda: (dist.all_gather_into_tensor(gathered, a), torch.matmul(gathered, b, out=out)),
            "fused": fused,
        }
    else:
        a = common.fresh_randn((m, k // tp), torch.bfloat16, device, seed, scale=1.0)
        b = common.fresh_randn((k // tp, n), torch.bfloat16, device, seed + 1, scale=1.0 / math.sqrt(k))
        partial = torch.matmul(a, b)
        out = torch.empty((m // tp, n), dtype=a.dtype, device=device)

        def fused():
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)

        variants = {
            "compute": lambda: torch.matmul(a, b, out=partial),
            "comm": lambda: dist.reduce_scatter_tensor(out, partial),
            "serial": lambda: (torch.matmul(a, b, out=partial), dist.reduce_scatter_tensor(out, partial)),
            "fused": fused,
        }

    def check() -> float:
        variants["serial"]()
        ref = out.clone()
        got = fused()
        err = torch.tensor(common.rel_error(got, ref), device=device)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        return float(err)

    return variants, check


def main(argv: list[str] | None = None) -> int:
    """Entry point (every rank); see the module docstring."""
    common.apply_required_env()
    import torch
    import torch.distributed as dist

    args = build_parser().parse_args(argv)
    device, rank, tp, group_name = _setup()
    deadline = common.Deadline(args.budget_s)
    seed = (args.seed if args.seed is not None else common.fresh_seed()) + 7919 * rank
    combine = _max_over_ranks(device)
    _reserve_workspace(group_name, args.shapes, tp)
    for i, shape in enumerate(args.shapes):
        go = torch.tensor([0 if deadline.expired(args.margin_s) else 1], device=device)
        dist.broadcast(go, 0)  # every rank takes the same decision
        if not go.item():
            if rank == 0:
                common.emit({"kind": "cm-skipped", "source": "torch", "shape": list(shape), "reason": "budget"})
            continue
        check_divisible(shape, tp)
        for side in args.sides:
            _run_side(side, tuple(shape), tp, device, seed + 10 * i, group_name, args, rank, combine)
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _reserve_workspace(group_name: str, shapes, tp: int) -> None:
    """Allocate the group's symmetric-memory workspace once, for the largest shape.

    The fused ops grow the workspace on demand (a new allocation and rendezvous on every rank);
    doing it once up front keeps that out of the timed calls. Bytes: the largest gathered
    operand or full-size float32 partial product over all shapes.
    """
    import torch.distributed._symmetric_memory as symm_mem

    get = getattr(symm_mem, "get_symm_mem_workspace", None)
    if get is None:
        return
    size = max(m * max(k, n) * 4 for m, k, n in shapes)
    t0 = time.perf_counter()
    get(group_name, size)
    if os.environ.get("RANK", "0") == "0":
        print(f"[torch] symmetric-memory workspace of {size / 2**20:.0f} MiB in {time.perf_counter() - t0:.1f} s",
              flush=True)


def _run_side(side, shape, tp, device, seed, group_name, args, rank, combine) -> None:
    log = (lambda s: print(f"[torch {side} {shape}] {s}", flush=True)) if rank == 0 else (lambda s: None)
    t0 = time.perf_counter()
    variants, check = _variants(side, shape, tp, device, seed, group_name)
    info: dict[str, Any] = {}
    try:
        info["rel_err"] = check()
    except Exception as exc:  # the fused op may be missing in this torch build: time the rest
        info["check_error"] = f"{type(exc).__name__}: {exc}"[:300]
    log(f"inputs and check done in {time.perf_counter() - t0:.1f} s")
    results = common.interleaved(variants, [device], rounds=args.rounds, warmup=args.warmup,
                                 reps=reps_for(shape, tp, args.reps), log=log, combine=combine)
    if rank != 0:
        return
    for name, m in results.items():
        rec = {"kind": "cm", "source": "torch", "side": side, "shape": list(shape), "tp": tp, "variant": name,
               "ms": m.median_ms, "wall_ms": m.wall_ms, "round_ms": list(m.round_ms), "error": m.error}
        if name == "fused":
            rec.update(info)
        common.emit(rec)
    common.emit({"kind": "cm-done", "source": "torch", "side": side, "shape": list(shape)})


if __name__ == "__main__":
    sys.exit(main())
