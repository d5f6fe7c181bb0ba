"""Whether torch.compile (Inductor, Triton) works here, and what a fused LayerNorm+GELU costs.

Usage: ``python3 -m benchmarks.probe.inductor_check``
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    """Compile a LayerNorm + bias + GELU chain; print compile seconds and eager vs compiled µs."""
    import torch
    import torch.nn.functional as F

    try:
        import triton
        print("triton", triton.__version__)
    except Exception as exc:  # noqa: BLE001
        print("no triton:", exc)
    dev = torch.device("cuda", 0)
    x = torch.randn(1024, 384, device=dev)
    b = torch.randn(384, device=dev)

    def chain(x, b):
        h = F.layer_norm(x + b, (384,))
        return F.gelu(h) * 2.0 + x

    t0 = time.perf_counter()
    comp = torch.compile(chain, fullgraph=True, dynamic=False)
    out = comp(x, b)
    torch.cuda.synchronize()
    print(f"compile {time.perf_counter() - t0:.2f} s, max err {(out - chain(x, b)).abs().max().item():.2e}")
    for name, f in (("eager", chain), ("inductor", comp)):
        for _ in range(20):
            f(x, b)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            f(x, b)
            with torch.cuda.graph(g, stream=s):
                for _ in range(100):
                    f(x, b)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        print(f"{name}: {e0.elapsed_time(e1) * 1e3 / 1000:.2f} µs per chain in a graph")
    return 0


if __name__ == "__main__":
    sys.exit(main())
