"""Machine probe: single-process NCCL, peer copies, symm_mem, JAX presence (prints facts)."""

import os
import subprocess
import time

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print("nccl", torch.cuda.nccl.version())
n = torch.cuda.device_count()
devs = [torch.device("cuda", i) for i in range(n)]
xs = [torch.randn(1 << 20, device=d) for d in devs]
outs = [torch.empty(n << 20, device=d) for d in devs]
t = time.perf_counter()
torch.cuda.nccl.all_gather(xs, outs)
torch.cuda.synchronize()
print("nccl.all_gather first call s", time.perf_counter() - t)
ok = all(torch.equal(outs[i][(j << 20):((j + 1) << 20)].cpu(), xs[j].cpu()) for i in range(n) for j in range(n))
print("all_gather correct", ok)
ys = [x.clone() for x in xs]
torch.cuda.nccl.all_reduce(ys)
torch.cuda.synchronize()
ref = sum(x.cpu() for x in xs)
print("all_reduce correct", all(torch.allclose(y.cpu(), ref) for y in ys))
for _round in range(3):
    t = time.perf_counter()
    for _ in range(100):
        torch.cuda.nccl.all_gather(xs, outs)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print("nccl.all_gather 1M f32 host us/call", (t1 - t) * 1e4, "synced us", (time.perf_counter() - t) * 1e4)
if n >= 2:
    a = torch.randn(64 << 20, device=devs[0], dtype=torch.bfloat16)
    b = torch.empty_like(a, device=devs[1])
    b.copy_(a)
    torch.cuda.synchronize()
    s = torch.cuda.Stream(devs[0])
    for _ in range(3):
        t = time.perf_counter()
        with torch.cuda.stream(s):
            for _ in range(10):
                b.copy_(a, non_blocking=True)
        s.synchronize()
        dt = time.perf_counter() - t
        print("peer copy GB/s", 10 * a.numel() * 2 / dt / 1e9)
    print("can_device_access_peer", torch.cuda.can_device_access_peer(0, 1))
print("symm_mem fused ops", hasattr(torch.ops.symm_mem, "fused_all_gather_matmul"))
k0 = time.perf_counter()
for _ in range(1000):
    e = torch.cuda.Event()
    e.record()
    torch.cuda.current_stream().wait_event(e)
print("event record+wait us", (time.perf_counter() - k0) * 1e3)
x = torch.randn(16, device=devs[0])
torch.cuda.synchronize()
k0 = time.perf_counter()
for _ in range(1000):
    x.add_(1)
print("tiny kernel launch us", (time.perf_counter() - k0) * 1e3)
r = subprocess.run(["python3", "-c", "import jax; print(jax.__version__, jax.devices())"],
                   capture_output=True, text=True, env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
print("jax:", r.stdout.strip(), r.stderr.strip()[-300:])
MODULES = ["sentence_transformers", "transformers", "tokenizers", "safetensors", "rich", "matplotlib",
           "hypothesis", "expecttest", "filecheck", "cupy"]
for m in MODULES:
    try:
        mod = __import__(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as ex:  # noqa: BLE001
        print(m, "MISSING", ex)
