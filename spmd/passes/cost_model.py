"""Cost model for windowed einsum: serial collective + GEMM vs. a ring of partial GEMMs.

A ``MachineProfile`` holds a few measured rates of one machine (GEMM throughput,
peer-copy and collective bandwidth, host launch and event costs). ``decide``
predicts, for one all-gather→dot or dot→reduce-scatter site, the time of

- serial: the collective, then the whole GEMM (``comm + compute``);
- uni: the unidirectional ring of the windowed einsum: P steps, each
  ``max(step GEMMs, step transfer) + per-step overhead``, bounded below by the
  host's launch cost for the step;
- bi: the bidirectional ring (half-chunks in both ring directions, two
  half-size GEMMs per step).

GEMMs smaller than the machine's sweet spot run below peak: efficiency is the
curve ``e / (e + e_half)`` over output elements ``e`` (``e_half`` = output size at
which a GEMM reaches half of peak), under a memory roofline. On the reduce-scatter
side the partial dots are independent; two compute streams let two of them run at
once (pooling their output elements for efficiency) at the price of one step of
latency before the first accumulator travels. On the all-gather side the partial
dots update one accumulator in turn, so one compute stream is all they use.

The decomposition follows Wang et al., "Overlap Communication with Dependent
Computation via Decomposition in Large Deep Learning Models" (ASPLOS 2023), the
collective matmul of XLA. ``decide`` never picks decomposition unless it predicts
it faster than serial by ``margin`` (default 3%).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8}


@dataclass(frozen=True)
class MachineProfile:
    """Measured rates of one machine (units in the field names).

    gemm_tflops: dtype name (``"bf16"``, ``"f32"``) -> large-GEMM throughput, TFLOP/s.
    link_gbps_unidirectional: peer copy GB/s when only one direction of a link copies.
    link_gbps_bidirectional: total GB/s of a link when both directions copy at once.
    collective_gbps: NCCL all-gather / reduce-scatter GB/s received per device.
    per_step_overhead_us: device-side gap per ring step (event waits, kernel tails).
    launch_us / event_us: host cost of one kernel launch / one event record + wait.
    gemm_half_efficiency_elems: output elements at which a GEMM runs at half of peak.
    hbm_gbps: device memory bandwidth (GEMM roofline, elementwise adds).
    switched: True where every device reaches all peers through a switch (NVSwitch):
      a ring step in which all devices send is then bound by each device's
      send+receive bandwidth whichever direction the chunks travel.
    """

    device_name: str
    gemm_tflops: Mapping[str, float]
    link_gbps_unidirectional: float
    link_gbps_bidirectional: float
    collective_gbps: float
    per_step_overhead_us: float
    launch_us: float = 20.0
    event_us: float = 9.0
    gemm_half_efficiency_elems: float = 0.5e6
    hbm_gbps: float = 4800.0
    switched: bool = True

    def to_json(self) -> str:
        """JSON text of the profile (``from_json`` reads it back)."""
        return json.dumps(asdict(self), sort_keys=True, indent=1)

    @staticmethod
    def from_json(text: str) -> MachineProfile:
        """Parse ``to_json`` output. Raises ValueError on missing/unknown fields."""
        data = json.loads(text)
        try:
            return MachineProfile(**data)
        except TypeError as e:
            raise ValueError(f"profile JSON does not match MachineProfile: {e}") from None


# 2×H200 over NVLink (NV18), see docs/benchmarks.md: bf16 GEMM ~790 TFLOP/s
# (the half-size partial GEMMs of 8192x8192x28672 ran at ~800), copy-engine peer copy
# 378 GB/s one way and 738 GB/s in total both ways at once (256 MiB, two streams; measured
# with benchmarks/probe/cm_probe.py), NCCL all-gather / reduce-scatter ~230 GB/s each way,
# ~20 µs per launch, ~9 µs per event record + wait.
H200_NVLINK = MachineProfile(
    device_name="NVIDIA H200 (NVLink)",
    gemm_tflops={"bf16": 790.0, "f16": 790.0, "f32": 400.0},
    link_gbps_unidirectional=378.0,
    link_gbps_bidirectional=738.0,
    collective_gbps=230.0,
    per_step_overhead_us=10.0,
)


@dataclass(frozen=True)
class GemmShape:
    """One per-device GEMM of a site, as ``[m, k] @ [k, n]``.

    ``m`` is the size of the dim that is split into P chunks (the gathered or
    scattered dim, full size on one device), ``k`` the contracted size, ``n`` all
    other output elements per row (``m * n`` = output elements).
    """

    m: int
    k: int
    n: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


@dataclass(frozen=True)
class Decision:
    """What ``decide`` chose and why: predicted times in µs keyed ``serial``/``uni``/``bi``."""

    decompose: bool
    bidirectional: bool
    num_compute_streams: int
    predicted_us: Mapping[str, float] = field(default_factory=dict)


def gemm_us(elems: float, flops: float, bytes_moved: float, dtype: str, profile: MachineProfile) -> float:
    """Device time of GEMM work: ``flops`` at peak × efficiency(``elems`` output elements), roofline on HBM.

    Work with no output elements or no flops (an empty M, N or K) costs only its memory traffic.
    """
    peak = _peak_tflops(dtype, profile) * 1e6  # flop / µs
    memory = bytes_moved / (profile.hbm_gbps * 1e3)
    if elems <= 0 or flops <= 0:
        return memory
    eff = elems / (elems + profile.gemm_half_efficiency_elems)
    return max(flops / (peak * eff), memory)


def _peak_tflops(dtype: str, profile: MachineProfile) -> float:
    if dtype not in profile.gemm_tflops:
        raise ValueError(f"dtype {dtype!r} has no GEMM rate in profile {profile.device_name!r}; "
                         f"expected one of {sorted(profile.gemm_tflops)}")
    return profile.gemm_tflops[dtype]


def _gemms_us(gemms: Sequence[GemmShape], frac: float, concurrent: int, dtype: str, prof: MachineProfile) -> float:
    """Time of the GEMMs of all ``gemms`` restricted to a fraction ``frac`` of their rows.

    ``concurrent`` GEMMs of the same kind run at once (separate streams) and pool efficiency.
    """
    it = ITEMSIZE.get(dtype, 2)
    total = 0.0
    for g in gemms:
        m = max(g.m * frac, 1.0)
        elems = m * g.n * concurrent
        total += gemm_us(elems, 2 * m * g.k * g.n * concurrent, it * (m * g.k + g.k * g.n + m * g.n) * concurrent,
                         dtype, prof) / concurrent
    return total


def _ring_rate_gbps(p: int, bidirectional: bool, prof: MachineProfile) -> float:
    """Effective GB/s of one device's chunk per ring step when every device sends at once."""
    if p == 2 or prof.switched:
        return prof.link_gbps_bidirectional / 2  # each device sends and receives on the same links
    return prof.link_gbps_bidirectional if bidirectional else prof.link_gbps_unidirectional


def _windowed_us(gemms, p, dtype, prof, chunk_bytes, add_bytes, bidirectional, streams) -> float:
    halves = 2 if bidirectional else 1
    concurrent = min(streams, halves * p)
    step_compute = _gemms_us(gemms, 1.0 / (p * halves), concurrent, dtype, prof) * halves
    step_compute += add_bytes / (prof.hbm_gbps * 1e3)
    transfer = chunk_bytes / (_ring_rate_gbps(p, bidirectional, prof) * 1e3)
    launches = halves * (len(gemms) + 1)
    host = launches * prof.launch_us + (halves * 2 + (streams > 1)) * prof.event_us
    # with concurrent dots the first accumulator is ready one step later (two dots share the GPU)
    total = step_compute if streams > 1 else 0.0
    for s in range(p):
        gpu = max(step_compute, transfer if s < p - 1 else 0.0) + prof.per_step_overhead_us
        total += max(gpu, host)
    return total


def _serial_us(gemms, p, dtype, prof, chunk_bytes) -> float:
    comm = (p - 1) * chunk_bytes / (prof.collective_gbps * 1e3)
    compute = _gemms_us(gemms, 1.0, 1, dtype, prof)
    host = (1 + len(gemms)) * prof.launch_us
    return max(comm + compute, host)


def decide(
    gemms: GemmShape | Sequence[GemmShape],
    p: int,
    dtype: str,
    profile: MachineProfile,
    *,
    collective: str = "all-gather",
    margin: float = 0.03,
    chunk_bytes: float | None = None,
) -> Decision:
    """Choose serial vs. uni/bidirectional windowed einsum for one site.

    gemms: the per-device GEMM(s) of the site (several for one all-gather feeding
      several dots; they share one ring).
    p: replica group size (ring length), >= 2.
    dtype: HLO element type of the dot (``"bf16"``, ``"f32"``, ...).
    collective: ``"all-gather"`` (chunks of the gathered ``[m/p, k]`` operand travel)
      or ``"reduce-scatter"`` (``[m/p, n]`` partial accumulators travel and are added).
    chunk_bytes: bytes one ring step moves per device, where they differ from the above.
    Returns a Decision whose ``predicted_us`` has ``serial``, ``uni`` and ``bi``;
    decompose is True only if the best windowed variant beats serial by ``margin`` and
    every GEMM has work (a GEMM with an empty m, k or n has nothing to overlap).
    Raises ValueError for p < 2, an unknown collective or a dtype the profile lacks.
    """
    gemms = [gemms] if isinstance(gemms, GemmShape) else list(gemms)
    if p < 2:
        raise ValueError(f"p must be >= 2, got {p}")
    if collective not in ("all-gather", "reduce-scatter"):
        raise ValueError(f"collective must be 'all-gather' or 'reduce-scatter', got {collective!r}")
    if not gemms:
        raise ValueError("gemms must not be empty")
    _peak_tflops(dtype, profile)
    it = ITEMSIZE.get(dtype, 2)
    g0 = gemms[0]
    if chunk_bytes is None:
        chunk_bytes = g0.m / p * (g0.k if collective == "all-gather" else g0.n) * it
    serial = _serial_us(gemms, p, dtype, profile, chunk_bytes)
    best: dict[str, tuple[float, int]] = {}
    # One compute stream: concurrent partial GEMMs compete for the same SMs and measured
    # slower on H200 (reduce-scatter 8192x8192x28672: 1.66x vs 1.16x of the limit).
    for name, bi in (("uni", False), ("bi", True)):
        # reduce-scatter: uni adds the received accumulator in a separate pass (read 2, write 1);
        # bi accumulates with addmm into the result rows, which first copies the received rows
        # (read 1, write 1) and measured as slow as the add (0.15 vs 0.16 ms of 2x235 MB, H200)
        add_bytes = 0.0 if collective == "all-gather" else 3.0 * chunk_bytes
        best[name] = (_windowed_us(gemms, p, dtype, profile, chunk_bytes, add_bytes, bi, 1), 1)
    pick = "uni" if best["uni"][0] <= best["bi"][0] else "bi"
    decompose = best[pick][0] < serial * (1.0 - margin) and all(g.flops > 0 for g in gemms)
    predicted = {"serial": serial, "uni": best["uni"][0], "bi": best["bi"][0]}
    return Decision(decompose, pick == "bi", best[pick][1] if decompose else 1, predicted)


# --------------------------------------------------------------------------- profiles on disk
def _cache_path(device_name: str, cache_dir: str | os.PathLike | None) -> Path:
    base = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "spmd"
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{device_name}-torch{torch.__version__}")
    return base / f"profile-{key}.json"


def _time_us(fn, sync, repeats: int = 5) -> float:
    fn()
    sync()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, (time.perf_counter() - t0) * 1e6)
    return best


def measure_profile(device: str = "cpu") -> MachineProfile:
    """Measure a profile with a small GEMM and copy micro-benchmark on ``device``.

    ``device``: ``"cpu"`` or ``"cuda"`` (GPU 0; peer copies to GPU 1 where present).
    Takes well under a second on CPU. Raises ValueError for other devices.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    cuda = device == "cuda"
    dev0 = torch.device("cuda:0" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = 4096 if cuda else 256
    tflops = {}
    for dt in ("f32", "bf16"):
        a = torch.randn(n, n, device=dev0, dtype=torch.float32 if dt == "f32" else torch.bfloat16)
        tflops[dt] = 2 * n**3 / _time_us(lambda a=a: a @ a, sync) / 1e6
    tflops["f16"] = tflops["bf16"]
    numel = (64 << 20) // 4 if cuda else (8 << 20) // 4
    src = torch.randn(numel, device=dev0)
    dev1 = torch.device("cuda:1") if cuda and torch.cuda.device_count() > 1 else dev0
    dst = torch.empty(numel, device=dev1)
    one_way = src.numel() * 4 / _time_us(lambda: dst.copy_(src, non_blocking=True), sync) / 1e3
    back_src, back_dst = torch.randn(numel, device=dev1), torch.empty(numel, device=dev0)

    def both_ways():
        dst.copy_(src, non_blocking=True)
        back_dst.copy_(back_src, non_blocking=True)

    both = 2 * src.numel() * 4 / _time_us(both_ways, sync) / 1e3
    tiny = torch.zeros(1, device=dev0)
    launch = _time_us(lambda: tiny.add_(1), sync)
    name = torch.cuda.get_device_name(0) if cuda else f"cpu-{os.cpu_count()}"
    return MachineProfile(
        device_name=name, gemm_tflops=tflops, link_gbps_unidirectional=one_way,
        link_gbps_bidirectional=both, collective_gbps=min(one_way, both / 2),
        per_step_overhead_us=launch, launch_us=launch, event_us=launch / 2,
        gemm_half_efficiency_elems=0.5e6 if cuda else 1.6e4, hbm_gbps=both, switched=True,
    )


def load_profile(device: str = "cpu", cache_dir: str | os.PathLike | None = None) -> MachineProfile:
    """The cached profile of ``device``, measured once and stored as JSON.

    Cache file: ``<cache_dir or ~/.cache/spmd>/profile-<device name>-torch<version>.json``.
    A corrupt cache file is measured again and overwritten.
    """
    name = torch.cuda.get_device_name(0) if device == "cuda" else f"cpu-{os.cpu_count()}"
    path = _cache_path(name, cache_dir)
    if path.exists():
        try:
            return MachineProfile.from_json(path.read_text())
        except (ValueError, json.JSONDecodeError):
            pass
    prof = measure_profile(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.to_json())
    return prof


# --------------------------------------------------------------------------- benchmark table
BENCHMARK_SHAPES: tuple[tuple[int, int, int], ...] = (
    (8192, 12288, 49152), (8192, 8192, 28672), (16384, 8192, 4096),
    (2048, 24576, 24576), (4096, 4096, 4096), (1024, 24576, 24576),
)


@dataclass(frozen=True)
class PredictionRow:
    """One line of ``predict_table``: global GEMM (m, k, n) tensor-parallel over ``tp`` devices."""

    collective: str
    m: int
    k: int
    n: int
    tp: int
    decision: Decision


def site_gemm(m: int, k: int, n: int, tp: int, collective: str) -> GemmShape:
    """Per-device GEMM of a global ``[m,k] @ [k,n]`` split ``tp`` ways.

    all-gather: x rows sharded, w columns sharded → per device ``[m,k] @ [k,n/tp]``.
    reduce-scatter: x columns and w rows sharded → per device ``[m,k/tp] @ [k/tp,n]``.
    """
    if collective == "all-gather":
        return GemmShape(m, k, n // tp)
    return GemmShape(m, k // tp, n)


def predict_table(
    profile: MachineProfile = H200_NVLINK,
    tps: Sequence[int] = (2, 4, 8),
    shapes: Sequence[tuple[int, int, int]] = BENCHMARK_SHAPES,
    dtype: str = "bf16",
) -> list[PredictionRow]:
    """Predictions for every (collective, shape, tp): the rows the benchmark prints."""
    rows = []
    for coll in ("all-gather", "reduce-scatter"):
        for m, k, n in shapes:
            for tp in tps:
                d = decide(site_gemm(m, k, n, tp, coll), tp, dtype, profile, collective=coll)
                rows.append(PredictionRow(coll, m, k, n, tp, d))
    return rows


def format_table(rows: Sequence[PredictionRow]) -> str:
    """Plain-text table of ``predict_table`` rows (times in ms)."""
    head = f"{'collective':<15}{'M,K,N':>20}{'tp':>4}{'serial':>9}{'uni':>9}{'bi':>9}  pick"
    lines = [head]
    for r in rows:
        d = r.decision
        pick = ("bi" if d.bidirectional else "uni") + f"/{d.num_compute_streams}s" if d.decompose else "serial"
        p = d.predicted_us
        lines.append(f"{r.collective:<15}{f'{r.m},{r.k},{r.n}':>20}{r.tp:>4}"
                     f"{p['serial'] / 1e3:>9.3f}{p['uni'] / 1e3:>9.3f}{p['bi'] / 1e3:>9.3f}  {pick}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- split batch
SPLIT_KERNEL_US = 2.0  # device-side gap of one more kernel in a replayed CUDA graph
ALL_REDUCE_LATENCY_US = 8.0  # NCCL all-reduce start-up on NVLink, independent of size


def split_batch_pays(comp: Any, plan: Any, profile: MachineProfile, margin: float = 0.03) -> bool:
    """Whether running ``comp`` as two interleaved batch halves is predicted faster (by ``margin``).

    ``plan`` is the ``spmd.passes.batch_dims.BatchDims`` of ``comp``. See ``split_batch_us``.
    """
    serial, split = split_batch_us(comp, plan, profile)
    return split < serial * (1.0 - margin)


def split_batch_us(comp: Any, plan: Any, profile: MachineProfile) -> tuple[float, float]:
    """Predicted device µs of ``comp`` as is and split into two batch halves (Domino's schedule).

    The per-row work is cut into segments at the all-reduces. Serial: every segment's compute,
    then its all-reduce. Split: a two-stream timeline -- the compute stream runs A0 B0 A1 B1 ...
    (a half's segment k+1 waits for its all-reduce k), the communication stream each half's
    all-reduce after its segment. Each half's GEMM reads the whole shared operand (weights are
    read twice), runs on half the rows (lower efficiency, ``gemm_us``), and every kernel of a
    half costs ``SPLIT_KERNEL_US`` more (kernels counted as after elementwise fusion). Other ops
    are memory-bound on ``profile.hbm_gbps``.
    An all-reduce costs ``ALL_REDUCE_LATENCY_US`` plus ``2 (p-1)/p`` of its bytes at
    ``profile.collective_gbps``. Returns (serial, split) in µs.
    """
    dims = plan.dims
    users = comp.users()
    segs: dict[int, list[float]] = {}  # level -> [full compute, half compute, full ar, half ar, kernels]
    level: dict[int, int] = {}
    for inst in comp.instructions:
        if dims.get(inst) is None or inst.opcode in ("parameter", "tuple"):
            continue
        lvl = max((level.get(id(o), 0) + (o.opcode == "all-reduce") for o in inst.operands
                   if dims.get(o) is not None), default=0)
        level[id(inst)] = lvl
        seg = segs.setdefault(lvl, [0.0, 0.0, 0.0, 0.0, 0])
        if inst.opcode == "all-reduce":
            seg[2] += _all_reduce_us(inst, 1.0, profile)
            seg[3] += _all_reduce_us(inst, 0.5, profile)
            continue
        seg[0] += _op_us(inst, dims, 1.0, profile)
        seg[1] += _op_us(inst, dims, 0.5, profile)
        seg[4] += _is_kernel(inst, users[inst])
    serial = sum(s[0] + s[2] for s in segs.values())
    compute = comm = 0.0
    ready = [0.0, 0.0]
    for lvl in sorted(segs):
        full, half, _, ar_half, kernels = segs[lvl]
        for h in (0, 1):
            compute = max(compute, ready[h]) + half + kernels * SPLIT_KERNEL_US
            if ar_half:
                comm = max(compute, comm) + ar_half
                ready[h] = comm
    return serial, max(compute, comm)


_VIEWS = frozenset({"reshape", "transpose", "broadcast", "slice", "get-tuple-element", "tuple"})


def _is_kernel(inst: Any, users: list) -> bool:
    """Whether ``inst`` ends a kernel after elementwise fusion: not a view, and not an elementwise
    op whose users are all elementwise too (fuse-elementwise joins those into one kernel)."""
    from spmd.ir.hlo import ELEMENTWISE_OPCODES

    if inst.opcode in _VIEWS:
        return False
    if inst.opcode in ELEMENTWISE_OPCODES:
        return not users or any(u.opcode not in ELEMENTWISE_OPCODES and u.opcode not in _VIEWS for u in users)
    return True


def _all_reduce_us(inst: Any, frac: float, profile: MachineProfile) -> float:
    groups = inst.attrs.get("replica_groups") or ()
    p = len(groups[0]) if groups and groups[0] else 2
    nbytes = inst.shape.size_bytes * frac
    return ALL_REDUCE_LATENCY_US + 2.0 * (p - 1) / p * nbytes / (profile.collective_gbps * 1e3)


def _op_us(inst: Any, dims: Mapping, frac: float, profile: MachineProfile) -> float:
    """Device µs of one per-row op on ``frac`` of the rows (shared operands read whole)."""
    def part(value: Any) -> float:
        return value.shape.size_bytes * (frac if dims.get(value) is not None else 1.0)

    nbytes = part(inst) + sum(part(o) for o in inst.operands)
    if inst.opcode != "dot":
        return nbytes / (profile.hbm_gbps * 1e3)
    lhs = inst.operands[0]
    k = math.prod(lhs.shape.dims[d] for d in inst.attrs.get("lhs_contracting_dims", ()))
    elems = inst.shape.numel * frac
    dtype = inst.shape.dtype if inst.shape.dtype in profile.gemm_tflops else "f32"
    return gemm_us(elems, 2.0 * elems * k, nbytes, dtype, profile)
