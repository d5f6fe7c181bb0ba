"""One-shot peer-copy all-reduce (``CudaCommunicator._p2p_all_reduce``) against NCCL on all local GPUs,
directly and inside ``spmd.jit`` with CUDA graphs on and off; ``SPMD_P2P_ALL_REDUCE_MAX_BYTES`` parsing
(CPU). The GPU tests skip without 2 GPUs."""

from __future__ import annotations

import sys

import pytest
import torch
from hlo_helpers import FakeMesh

import spmd
from spmd.ir.text import parse_module
from spmd.runtime.comm import cuda as comm_cuda
from spmd.runtime.comm.cuda import P2P_ALL_REDUCE_ENV, CudaCommunicator, p2p_all_reduce_max_bytes
from spmd.runtime.executor import Executable

P = spmd.PartitionSpec
BIG = str(1 << 30)  # every all-reduce of these tests is below it: the peer-copy path
SIZES = [(1,), (7, 3), (256, 1024), (3, 1000, 129)]


# --------------------------------------------------------------------------- the variable (CPU)
@pytest.mark.parametrize("raw", ["abc", "-1", "1.5", "4k", " "])
def test_bad_max_bytes_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(P2P_ALL_REDUCE_ENV, raw)
    with pytest.raises(ValueError, match=P2P_ALL_REDUCE_ENV) as err:
        p2p_all_reduce_max_bytes()
    assert repr(raw) in str(err.value)
    with pytest.raises(ValueError, match=P2P_ALL_REDUCE_ENV):
        CudaCommunicator([])  # read when a communicator is made


DEFAULT = comm_cuda.P2P_ALL_REDUCE_MAX_BYTES


@pytest.mark.parametrize("raw,value", [(None, DEFAULT), ("", DEFAULT), ("0", 0), ("4096", 4096), (" 65536 ", 65536)])
def test_max_bytes_values(monkeypatch, raw, value):
    if raw is None:
        monkeypatch.delenv(P2P_ALL_REDUCE_ENV, raising=False)
    else:
        monkeypatch.setenv(P2P_ALL_REDUCE_ENV, raw)
    assert p2p_all_reduce_max_bytes() == value
    assert CudaCommunicator([]).p2p_max_bytes == value
    assert CudaCommunicator([], p2p_all_reduce_max_bytes=123).p2p_max_bytes == 123


# --------------------------------------------------------------------------- on GPUs
@pytest.fixture
def p2p_calls(monkeypatch):
    """Counts calls of the peer-copy all-reduce."""
    calls: list[int] = []
    original = CudaCommunicator._p2p_all_reduce

    def spy(self, spec, x, streams, stream_id):
        calls.append(len(x))
        return original(self, spec, x, streams, stream_id)

    monkeypatch.setattr(CudaCommunicator, "_p2p_all_reduce", spy)
    monkeypatch.setattr(sys.modules["spmd.jit"], "_GLOBAL_CACHE", {})
    return calls


def _groups_text(groups) -> str:
    return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"


def _module(n: int, dims, dtype: str, groups, stream_id):
    d = ",".join(map(str, dims))
    stream = f", stream_id={stream_id}" if stream_id is not None else ""
    return parse_module(f"""HloModule ar, num_partitions={n}, mesh={{x={n}}}, is_partitioned=true

%sum (a: {dtype}[], b: {dtype}[]) -> {dtype}[] {{
  %a = {dtype}[] parameter(0)
  %b = {dtype}[] parameter(1)
  ROOT %s = {dtype}[] add(%a, %b)
}}

ENTRY %main (x: {dtype}[{d}]) -> {dtype}[{d}] {{
  %x = {dtype}[{d}] parameter(0)
  %c = {dtype}[{d}] all-reduce(%x), to_apply=%sum, replica_groups={_groups_text(groups)}{stream}
  ROOT %r = {dtype}[{d}] copy(%c)
}}
""")


def _run(module, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    ex = Executable(module, FakeMesh(module.mesh, platform="cuda"))
    outs, ready = ex.run([[x.to(f"cuda:{d}") for d, x in enumerate(xs)]])
    for ev in ready:
        ev.synchronize()
    return [t.cpu() for t in outs[0]]


def _group_layouts(n: int) -> list[list[list[int]]]:
    layouts = [[list(range(n))]]
    if n >= 4 and n % 2 == 0:
        layouts.append([[p, p + n // 2] for p in range(n // 2)])  # pairs: several groups at once
    return layouts


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("stream_id", [None, 2])
@pytest.mark.parametrize("dtype,tol", [("f32", 1e-5), ("bf16", 3e-2)])
@pytest.mark.parametrize("dims", SIZES, ids=str)
def test_p2p_all_reduce_matches_nccl_on_all_local_gpus(monkeypatch, p2p_calls, dims, dtype, tol, stream_id):
    n = torch.cuda.device_count()
    tdtype = torch.float32 if dtype == "f32" else torch.bfloat16
    for groups in _group_layouts(n):
        xs = [(torch.randn(dims, dtype=torch.float64) + 0.1).to(tdtype) for _ in range(n)]
        module = _module(n, dims, dtype, groups, stream_id)
        monkeypatch.setenv(P2P_ALL_REDUCE_ENV, BIG)
        calls = len(p2p_calls)
        p2p = _run(module, xs)
        assert len(p2p_calls) == calls + 1
        monkeypatch.setenv(P2P_ALL_REDUCE_ENV, "0")
        nccl = _run(module, xs)
        assert len(p2p_calls) == calls + 1
        for g in groups:
            want = sum(xs[p].double() for p in g)
            scale = want.abs().max().item()
            for p in g:
                assert torch.equal(p2p[p], p2p[g[0]]), f"device {p} differs from device {g[0]} in group {g}"
                assert (p2p[p].double() - want).abs().max().item() <= tol * scale
                assert (nccl[p].double() - want).abs().max().item() <= tol * scale


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_p2p_all_reduce_inside_jit(monkeypatch, p2p_calls, cuda_graphs):
    """A row-parallel matmul on every local GPU: its partial sums all-reduced by peer copies (also
    inside a CUDA graph); every device holds the same bits, close to float64 and to NCCL's result."""
    n = torch.cuda.device_count()
    mesh = spmd.Mesh.create({"tp": n}, "cuda")
    results = {}
    for mode in ("p2p", "nccl"):
        monkeypatch.setenv(P2P_ALL_REDUCE_ENV, BIG if mode == "p2p" else "0")
        monkeypatch.setattr(sys.modules["spmd.jit"], "_GLOBAL_CACHE", {})

        def matmul(x, w):
            return x @ w

        f = spmd.jit(matmul, mesh=mesh, in_shardings=(P(None, "tp"), P("tp", None)), out_shardings=P(),
                     options=spmd.CompileOptions(cuda_graphs=cuda_graphs))
        calls = len(p2p_calls)
        gen = torch.Generator().manual_seed(3)
        for _ in range(5):  # fresh inputs every call: warm-up, capture and replays under graphs
            x, w = torch.randn(16, 64 * n, generator=gen), torch.randn(64 * n, 48, generator=gen)
            out = f(x, w)
            shards = [s.data.cpu() for s in out.shards]
            assert all(torch.equal(s, shards[0]) for s in shards[1:])
            want = x.double() @ w.double()
            assert ((shards[0].double() - want).abs().max() / want.abs().max()).item() < 1e-5
        results[mode] = shards[0]
        assert (len(p2p_calls) > calls) is (mode == "p2p")
    torch.testing.assert_close(results["p2p"], results["nccl"], rtol=1e-5, atol=1e-5)
