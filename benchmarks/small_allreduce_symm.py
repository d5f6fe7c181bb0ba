"""One process per GPU: NCCL ``dist.all_reduce`` against the symmetric-memory one-shot all-reduce.

Part of ``benchmarks.small_allreduce`` (``--symm``); also runnable alone::

    python3 -m benchmarks.small_allreduce_symm --tp 2 --sizes 1024 4096 65536

``tp`` processes (``torch.multiprocessing.spawn``, NCCL, one GPU each) time, per message size, a
chain of ``--layers`` all-reduces of ``x`` -- ``dist.all_reduce`` on a copy (NCCL) against
``spmd.runtime.comm.symmetric.SymmetricOneShot.run`` (``torch.ops.symm_mem`` one-shot) -- eagerly
and replayed from a CUDA graph captured on every rank, in interleaved rounds; µs per all-reduce
(rank 0's events; the ranks meet in every all-reduce). Prints one ``BENCH_JSON`` record per size.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, harness


def _time_us(torch: Any, fn: Any, reps: int, per: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * per)


def _variants(torch: Any, dist: Any, x: Any, so: Any, spec: Any, layers: int) -> dict[str, Any]:
    def nccl():
        for _ in range(layers):
            y = x.clone()
            dist.all_reduce(y)

    def symm():
        for _ in range(layers):
            so.run(spec, x)

    out = {"nccl-eager": nccl, "symm-eager": symm}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture (NCCL communicators, allocator)
        nccl()
        symm()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for name, fn in (("nccl-graph", nccl), ("symm-graph", symm)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        out[name] = g.replay
    return out


def _worker(rank: int, world: int, init: str, opts: dict[str, Any], result_path: str) -> None:
    import torch
    import torch.distributed as dist

    from spmd.runtime.comm.symmetric import SymmetricOneShot
    from spmd.runtime.thunks import CollectiveSpec

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    dtype = getattr(torch, opts["dtype"])
    records = []
    try:
        for size in opts["sizes"]:
            rows = 1
            elems = max(size // torch.empty((), dtype=dtype).element_size(), 8)
            while rows < 16 and elems // (rows * 2) >= 256:
                rows *= 2
            spec = CollectiveSpec("all-reduce", groups=(tuple(range(world)),), out_dims=(rows, elems // rows),
                                  dtype=dtype, algorithm="one-shot")
            so = SymmetricOneShot(rank, [spec], {tuple(range(world)): dist.group.WORLD}, torch.device("cuda", rank))
            rec: dict[str, Any] = {"kind": "small_allreduce_symm", "size_bytes": size, "tp": world,
                                   "error": so.reason or None}
            if not so.reason:
                x = common.fresh_randn(spec.out_dims, dtype, f"cuda:{rank}", seed=rank + 1)
                variants = _variants(torch, dist, x, so, spec, opts["layers"])
                times: dict[str, list[float]] = {k: [] for k in variants}
                for _ in range(opts["rounds"]):
                    for name, fn in variants.items():
                        fn()
                        times[name].append(_time_us(torch, fn, opts["reps"], opts["layers"]))
                rec.update({f"{k.replace('-', '_')}_us": common.median(v) for k, v in times.items()})
            records.append(rec)
            if rank == 0:
                common.emit(rec)
        if rank == 0:
            Path(result_path).write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def run(tp: int, sizes: list[int], dtype: str, layers: int, rounds: int, reps: int) -> list[dict[str, Any]]:
    """Spawn ``tp`` NCCL processes and return rank 0's records (one per size)."""
    import torch.multiprocessing as mp

    common.apply_required_env()
    with tempfile.TemporaryDirectory() as tmp:
        opts = {"sizes": sizes, "dtype": dtype, "layers": layers, "rounds": rounds, "reps": reps}
        out = Path(tmp) / "records.json"
        mp.spawn(_worker, args=(tp, f"file://{tmp}/store", opts, str(out)), nprocs=tp, join=True)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    """Run alone (see the module docstring); exit status 0 when every size was measured."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=harness.positive_int, default=2)
    p.add_argument("--sizes", type=harness.positive_int, nargs="+", default=[1024, 4096, 16384, 65536, 262144])
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--layers", type=harness.positive_int, default=16)
    p.add_argument("--rounds", type=harness.positive_int, default=5)
    p.add_argument("--reps", type=harness.positive_int, default=20)
    a = p.parse_args(argv)
    records = run(a.tp, a.sizes, a.dtype, a.layers, a.rounds, a.reps)
    for r in records:
        print(r)
    return 0 if all(r.get("error") is None for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
