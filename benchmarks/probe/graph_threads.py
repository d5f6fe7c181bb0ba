"""Probe: first calls of one jitted program from several threads at once on one GPU, with CUDA graphs.

Runs the program of ``tests/runtime/test_graphs_threads_gpu.py`` in ``--trials`` fresh compilations,
``--threads`` threads of ``--calls`` calls each, and prints every result that differs from the
float64 reference by more than 2e-2, with its thread, call number and what the runner did on that
call (eager warm-up, capture, replay, clone), plus the ``cuda_graphs.*`` counters.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

import torch
import torch.nn.functional as F

import spmd

P = spmd.PartitionSpec


def _program(x, k, v):
    q = torch.log(x.abs() + 1).view(2, 12, 1, 2).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v)
    return F.layer_norm(o.transpose(1, 2).reshape(2, 12, 4), (12, 4)), o


_PATH = threading.local()


def _instrument() -> None:
    """Record in a thread-local what the runner did on this thread's last call."""
    from spmd.runtime import graphs

    r = graphs.GraphRunner
    run_checked, select, capture = r.run_checked, r._select, r._capture

    def run_checked_(self, *a, **k):
        _PATH.steps = [f"call#{self._calls + 1}", f"bound={[b.adopted for b in self._bound]}"]
        out = run_checked(self, *a, **k)
        _PATH.steps.append(f"bound-after={[b.adopted for b in self._bound]}")
        return out

    def select_(self, *a, **k):
        out_set, clone = select(self, *a, **k)
        idx = self._sets.index(out_set) if out_set in self._sets else "private"
        _PATH.steps.append(f"set={idx} clone={clone}")
        return out_set, clone

    def capture_(self, *a, **k):
        _PATH.steps.append("capture")
        return capture(self, *a, **k)

    r.run_checked, r._select, r._capture = run_checked_, select_, capture_


def _program_ln(x, k, v):
    o = (torch.log(x.abs() + 1).view(2, 12, 1, 2).transpose(1, 2) * k.sum()).transpose(1, 2)
    return F.layer_norm(o.reshape(2, 12, 2), (12, 2)), o


def _read(o, how: str) -> torch.Tensor:
    if how == "to_torch":
        return o.to_torch().float()
    o.block_until_ready()
    t = o.addressable_shards[0].data.clone()
    torch.cuda.synchronize()
    return t.cpu().float()


def trial(seed: int, threads: int, calls: int, sync: bool, read: str) -> list[str]:
    mesh = spmd.Mesh.create(("tp",), devices="cuda:1")
    opts = spmd.CompileOptions(fuse_attention=False, cuda_graphs=True)
    prog = _program_ln if os.environ.get("PROBE_PROGRAM") == "ln" else _program
    sys.modules["spmd.jit"]._GLOBAL_CACHE.clear()  # a new compilation and graph runner per trial
    g = spmd.jit(prog, mesh=mesh, in_shardings=(P(), P(), P()), out_shardings=(P(), P()), options=opts)
    gen = torch.Generator().manual_seed(seed)
    x, k, v = (torch.randn(*s, generator=gen).half() for s in ((2, 12, 2), (2, 1, 4, 2), (2, 1, 4, 4)))
    want = [t.float() for t in prog(x.double(), k.double(), v.double())]
    lock, order, bad = threading.Lock(), [0], []

    def one(t):
        for c in range(calls):
            _PATH.steps = []
            outs = g(x, k, v)
            path = list(_PATH.steps)
            if sync:
                torch.cuda.synchronize()
            got = [_read(o, read) for o in outs]
            with lock:
                n = order[0]
                order[0] += 1
            errs = [float((a - b).abs().max()) for a, b in zip(got, want, strict=True)]
            if max(errs) > 2e-2:
                bad.append(f"seed {seed} thread {t} call {c} (#{n} overall): max abs error per output {errs}; "
                           f"path {path}")

    ts = [threading.Thread(target=one, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    from spmd.runtime import graphs

    plain = graphs.maybe_graph
    _instrument()

    configs = [("rotate", {}, "to_torch"), ("clone", {"outputs": "clone"}, "to_torch")]

    for name, kw, read in configs:
        graphs.maybe_graph = lambda ex, opts, kw=kw: plain(ex, opts, graphs.GraphOptions(**kw))
        for sync in (False, True):
            bad = []
            for s in range(args.trials):
                bad += trial(s, args.threads, args.calls, sync, read)
            print(f"== {name} sync={sync}: {len(bad)} wrong of {args.trials * args.threads * args.calls}", flush=True)
            for line in bad[:4]:
                print("  ", line, flush=True)
    graphs.maybe_graph = plain


if __name__ == "__main__":
    main()
