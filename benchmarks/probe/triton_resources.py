"""Registers and shared memory of spmd's Triton attention kernels, compiled ahead of time (no GPU).

Triton compiles a kernel for a named target without a device (``triton.compile`` of an
``ASTSource`` for ``GPUTarget("cuda", 90, 32)``); ``cuobjdump --dump-resource-usage`` (shipped
with Triton's NVIDIA backend) then reads the registers per thread from the cubin. With the
shared memory from the kernel's metadata this gives the programs an SM can hold at once, the
occupancy limit that decides how many bytes a latency-bound kernel keeps in flight. Runs on any
machine with the ``triton`` package, GPU or not.

Printed per configuration of ``spmd.runtime.triton_short_attention`` (for MiniLM's bf16 shape:
128 keys, head dim 32, a padding mask) and of ``spmd.runtime.triton_decode_attention``'s split-KV
kernels (Llama-2-7B's head dim 128): registers per thread, shared memory bytes, and programs per
SM (the smaller of 65,536 registers and 228 KiB of shared memory over one program's use, at most
32 programs).

Usage: ``python3 -m benchmarks.probe.triton_resources [--arch 90]``
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

REGISTERS_PER_SM = 65536
#: arguments left without the divisibility-by-16 hint (1 or not a multiple of 16 at run time: the
#: mask's key stride, the head group, sequence and head counts)
_UNALIGNED = ("sm_k", "GROUP", "SQ", "SK", "HQ")
SHARED_PER_SM_BYTES = 228 * 1024


def resources(fn, signature: dict[str, str], constexprs: dict, num_warps: int, arch: int) -> tuple[int, int]:
    """(registers per thread, shared memory bytes) of ``fn`` compiled for ``sm_<arch>``, with the
    pointers and integer arguments (except ``_UNALIGNED``) marked divisible by 16 as Triton's JIT
    marks them at run time for MiniLM's and Llama's shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    # what the JIT specialises at run time for 16-divisible pointers and strides (16-byte vector loads)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if signature[n] != "constexpr" and n not in _UNALIGNED and signature[n] != "fp32"}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    found = re.search(r"REG:(\d+)", out)
    if found is None:
        raise RuntimeError(f"cuobjdump gave no register count: {out[:200]!r}")
    return int(found.group(1)), int(kernel.metadata.shared)


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int) -> int:
    """Programs of one kernel an SM holds at once, by registers and shared memory (at most 32)."""
    by_registers = REGISTERS_PER_SM // max(1, registers * 32 * num_warps)
    by_shared = SHARED_PER_SM_BYTES // max(1, shared_bytes)
    return max(0, min(32, by_registers, by_shared))


def _signature(fn, pointer: str, constexprs: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name == "part_ptr" else pointer
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    return sig


def main(argv=None) -> int:
    """Entry point; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (H100 / H200: 90)")
    args = ap.parse_args(argv)
    try:
        from spmd.runtime import triton_decode_attention as tda
        from spmd.runtime import triton_short_attention as tsa
    except ImportError as exc:
        print(f"triton_resources: Triton is not installed ({exc})", flush=True)
        return 0
    for m, warps in tsa.CONFIGS:
        consts = dict(HAS_MASK=True, BOOL_MASK=False, MASK_ROW=True, CAUSAL=False, F32=False, EVEN_N=True,
                      BLOCK_M=m, BLOCK_N=128, BLOCK_D=32, BLOCK_DV=32)
        regs, smem = resources(tsa._attention, _signature(tsa._attention, "*bf16", consts), consts, warps, args.arch)
        print(f"short-seq:{m}x{warps} (bf16, 128 keys, D 32): {regs} registers, {smem} B shared, "
              f"{programs_per_sm(regs, smem, warps)} programs per SM", flush=True)
    consts = dict(HAS_MASK=True, BOOL_MASK=False, D=128, BLOCK_S=tda.BLOCK_S, PDL=False, KV_LINES=0)
    regs, smem = resources(tda._partial, _signature(tda._partial, "*bf16", consts), consts, 4, args.arch)
    print(f"split-kv partial (bf16, D 128): {regs} registers, {smem} B shared, "
          f"{programs_per_sm(regs, smem, 4)} programs per SM", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
