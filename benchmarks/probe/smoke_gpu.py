"""GPU smoke check of the jit path: MLP and a collective matmul on all local GPUs (prints tracebacks)."""

import traceback

import torch

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P

mesh = Mesh.create(("tp",), devices="cuda")
n = mesh.num_devices if hasattr(mesh, "num_devices") else len(mesh.devices)
for name, fn, shapes, ins, out, opts in [
    ("mlp", lambda x, w1, w2: torch.nn.functional.gelu(x @ w1) @ w2, [(64, 128), (128, 256), (256, 128)],
     (P(), P(None, "tp"), P("tp", None)), P(), spmd.CompileOptions(cuda_graphs=False)),
    ("ag-on", lambda x, w: x @ w, [(1024, 512), (512, 256)], (P("tp", None), P(None, "tp")), P(None, "tp"),
     spmd.CompileOptions(windowed_einsum="on", num_compute_streams=2, cuda_graphs=False)),
    ("rs-on", lambda x, w: x @ w, [(1024, 512), (512, 256)], (P(None, "tp"), P("tp", None)), P("tp", None),
     spmd.CompileOptions(windowed_einsum="on", cuda_graphs=False)),
]:
    try:
        args = [torch.randn(s, dtype=torch.float32) for s in shapes]
        f = spmd.jit(fn, mesh=mesh, in_shardings=ins, out_shardings=out, options=opts)
        y = f(*args)
        ref = fn(*[a.double() for a in args])
        err = ((y.to_torch().double() - ref).norm() / ref.norm()).item()
        print(name, "OK rel err", err, y)
    except Exception:
        print(name, "FAILED")
        traceback.print_exc()
