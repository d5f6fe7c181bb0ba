import sys, torch, cProfile, pstats, time
sys.path.insert(0, "tests/runtime")
from hlo_helpers import FakeMesh
from programs import windowed_all_gather_dot
from spmd.runtime.executor import Executable, RuntimeOptions
from spmd.ir.text import parse_module
g = 2
for async_dot in (False, True):
    wag = windowed_all_gather_dot(g, m=8, k=16, f=8, async_dot=async_dot)
    ex = Executable(wag, FakeMesh(wag.mesh, "cuda"))
    args = [[torch.randn(8, 16, device=f"cuda:{d}") for d in range(g)], [torch.randn(16, 8, device=f"cuda:{d}") for d in range(g)]]
    for _ in range(20): ex.run(args)
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    for t in ex.program.thunks: print(type(t).__name__, t.name, t.stream_id)
    cProfile.run("for _ in range(200): ex.run(args)", "/tmp/p.out")
    pstats.Stats("/tmp/p.out").sort_stats("tottime").print_stats(25)
