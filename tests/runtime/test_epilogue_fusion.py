"""A matrix product and its elementwise reader as one op (``spmd.runtime.epilogue_fusion``): the lowered
program on CPU meshes, and its results against float64 eager on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import Mesh
from spmd import PartitionSpec as P
from spmd.passes.assign_buffers import assign_buffers
from spmd.runtime.hazards import find_hazards
from spmd.runtime.lower import lower
from spmd.runtime.thunks import KernelThunk

ACTS = {
    "gelu": F.gelu,
    "gelu-tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
    "relu": torch.relu,
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6}


def _jit(f, n: int, in_specs, out_specs):
    mesh = Mesh.create(("tp",), devices=f"cpu:{n}")
    return spmd.jit(f, mesh=mesh, in_shardings=in_specs, out_shardings=out_specs,
                    options=spmd.CompileOptions(cuda_graphs=False)), n


def _opcodes(f_jit, n: int, *args) -> list[str]:
    """Opcodes of the instructions the kernel thunks of device 0 run (views left out)."""
    module = f_jit.lower(*args).result.module
    program = lower(module, [torch.device("cpu")] * n, list(range(n)), assign_buffers(module), gpu=True)
    assert find_hazards(program) == []
    by_name = {i.name: i.opcode for i in module.entry.instructions}
    return [by_name[t.name] for t in program.thunks
            if isinstance(t, KernelThunk) and t.out not in program.view_slots and t.name in by_name]


def _inputs(dtype, seed: int, m=(3, 8), k=24, n=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g)
    return tuple(t.to(dtype) for t in (x, w, b))


def _close(got, want, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(got.to_torch().double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_activation_of_a_linear_layer_is_one_op(dtype, act, n):
    """``act(x @ w.T + b)`` with ``w`` split over its rows on ``n`` devices: no dot, bias add or
    activation kernel of its own (float32 fuses the bias and the activation into one elementwise
    fusion first, bfloat16 runs the bias in an addmm); results equal float64 eager."""
    fn = ACTS[act]

    def f(x, w, b):
        return fn(F.linear(x, w, b))

    f_jit, n = _jit(f, n, (P(), P("tp", None), P("tp")), P(None, None, "tp"))
    xs = _inputs(dtype, seed=n * 7 + len(act))
    kinds = _opcodes(f_jit, n, *xs)
    assert len([k for k in kinds if k != "broadcast"]) == 1, kinds  # the fused op (and relu's zeros)
    assert "dot" not in kinds and "add" not in kinds, kinds
    for seed in (1, 2):  # fresh inputs on the compiled program
        xs = _inputs(dtype, seed=seed)
        _close(f_jit(*xs), f(*(t.double() for t in xs)), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_product_read_twice_is_not_fused(dtype):
    """The linear layer's result is also an output: it stays materialised, computed once."""
    def f(x, w, b):
        y = F.linear(x, w, b)
        return F.gelu(y), y

    f_jit, n = _jit(f, 1, (P(), P(), P()), (P(), P()))
    xs = _inputs(dtype, seed=3)
    kinds = _opcodes(f_jit, n, *xs)
    assert "dot" in kinds or "add" in kinds, kinds
    for got, want in zip(f_jit(*xs), f(*(t.double() for t in xs)), strict=True):
        _close(got, want, dtype)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_full_addend_goes_into_the_fused_op(dtype, n):
    """``gelu(x @ w.T + r)`` with ``r`` of the result's shape (no row broadcast): one op, exact."""
    def f(x, w, r):
        return F.gelu(x @ w.t() + r)

    f_jit, n = _jit(f, n, (P(), P("tp", None), P(None, None, "tp")), P(None, None, "tp"))
    g = torch.Generator().manual_seed(5)
    x, w = (t.to(dtype) for t in _inputs(torch.float32, 4)[:2])
    r = torch.randn(3, 8, 40, generator=g).to(dtype)
    kinds = _opcodes(f_jit, n, x, w, r)
    assert "dot" not in kinds and "add" not in kinds, kinds
    _close(f_jit(x, w, r), f(x.double(), w.double(), r.double()), dtype)


def test_a_product_without_bias_and_a_transposed_weight():
    """``gelu(x @ w)`` (``w`` as ``[K, N]``, no bias) on a 2-d ``x``: one op."""
    def f(x, w):
        return F.gelu(x @ w)

    f_jit, n = _jit(f, 2, (P("tp", None), P()), P("tp", None))
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(40, 24, generator=g), torch.randn(24, 33, generator=g)
    assert _opcodes(f_jit, n, x, w) == ["custom-call"]
    _close(f_jit(x, w), f(x.double(), w.double()), torch.float32)


def test_bfloat16_rounds_where_the_unfused_ops_round():
    """Op by op the fused op is the addmm rounded to bfloat16, then the GELU: equal to eager bfloat16."""
    def f(x, w, b):
        return F.gelu(F.linear(x, w, b))

    f_jit, _ = _jit(f, 1, (P(), P(), P()), P())
    xs = _inputs(torch.bfloat16, seed=8)
    want = F.gelu(F.linear(*xs))
    got = f_jit(*xs).to_torch()
    assert (got.float() - want.float()).abs().max().item() <= want.float().abs().max().item() * 2 ** -8


class _MLP(torch.nn.Module):
    """A feed-forward block: ``fc2(gelu(fc1(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(24, 64), torch.nn.Linear(64, 24)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_parallelized_feed_forward_runs_fc1_and_gelu_as_one_op(dtype, n):
    """Megatron split (fc1 colwise, fc2 rowwise) on ``n`` devices: fc1's product and the GELU are one
    op on each device, fc2's product (read by the all-reduce) stays; results equal float64 eager."""
    from spmd.models.plans import ColwiseParallel, Plan, RowwiseParallel

    torch.manual_seed(n)
    model = _MLP().to(dtype)
    plan = Plan((("fc1", ColwiseParallel()), ("fc2", RowwiseParallel())))
    pm = spmd.parallelize(model, Mesh.create(("tp",), devices=f"cpu:{n}"), plan,
                          options=spmd.CompileOptions(cuda_graphs=False))
    g = torch.Generator().manual_seed(10 + n)
    x = torch.randn(3, 8, 24, generator=g).to(dtype)
    module = pm.lower(x).result.module
    program = lower(module, [torch.device("cpu")] * n, list(range(n)), assign_buffers(module), gpu=True)
    by_name = {i.name: i for i in module.entry.instructions}
    kinds = [by_name[t.name].opcode for t in program.thunks
             if isinstance(t, KernelThunk) and t.out not in program.view_slots and t.name in by_name]
    fused = [t.name for t in program.thunks if isinstance(t, KernelThunk)
             and t.fn.__qualname__.startswith("make_kernel.")]  # kernels_epilogue's op
    assert len(fused) == 1 and kinds.count("dot") <= 1, kinds  # fc2 (a dot, or an addmm with its bias)
    assert find_hazards(program) == []
    want = _MLP().double()
    want.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    for seed in (1, 2):
        x = torch.randn(3, 8, 24, generator=torch.Generator().manual_seed(seed)).to(dtype)
        with torch.no_grad():
            _close(pm(x), want(x.double()), dtype)


@pytest.mark.parametrize("act", ["gelu", "relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_op_by_op_the_fused_op_is_bit_equal_to_the_unfused_pair(monkeypatch, dtype, act):
    """The same program lowered with and without this fusion gives the same bits (the product rounds
    to its dtype, then the activation, in both)."""
    from spmd.runtime import epilogue_fusion

    fn = ACTS[act]
    xs = _inputs(dtype, seed=11)

    def run(fuse: bool):
        if not fuse:
            monkeypatch.setattr(epilogue_fusion, "fuse_epilogues", lambda ops, blocked: None)
        f_jit, n = _jit(lambda x, w, b: fn(F.linear(x, w, b)), 2, (P(), P("tp", None), P("tp")), P(None, None, "tp"))
        kinds = _opcodes(f_jit, n, *xs)
        return f_jit(*xs).to_torch(), kinds

    fused, fused_kinds = run(True)
    unfused, unfused_kinds = run(False)
    assert len(fused_kinds) < len(unfused_kinds), (fused_kinds, unfused_kinds)
    assert torch.equal(fused, unfused)


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_traced_pair_is_what_a_generated_candidate_compiles(monkeypatch, dtype, act):
    """With the choice forced on (CPU stand-in for the CUDA warm-up), the ATen graph the generated
    candidate would compile holds the product and the activation, computes the pair's bits, and
    the choice is made once for the operands' layout and reused."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from spmd.runtime import kernels_epilogue as ke

    monkeypatch.setattr(ke, "_choices", {})
    monkeypatch.setattr(ke, "_eligible", lambda ops: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    graphs = []

    def choose(ops, pair, traceable, name):
        gm = make_fx(lambda *args: traceable(list(args), None))(*ops)
        targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        assert targets & {"aten.mm.default", "aten.addmm.default"}, targets
        assert torch.equal(gm(*ops), pair(ops, None))
        graphs.append(name)
        return lambda ops: gm(*ops)

    monkeypatch.setattr(ke, "_choose", choose)
    fn = ACTS[act]
    f_jit, _ = _jit(lambda x, w, b: fn(F.linear(x, w, b)), 1, (P(), P(), P()), P())
    for seed in (1, 2):
        xs = _inputs(dtype, seed=seed, m=(64, 8), k=32, n=1024)  # 2·512·32·1024 flops: past MIN_FLOPS
        _close(f_jit(*xs), fn(F.linear(*(t.double() for t in xs))), dtype)
    assert len(graphs) == 1, graphs


def test_a_skinny_product_keeps_its_own_kernel_choice():
    """Up to ``kernels_gemv.MAX_ROWS`` rows (a decode step) the product and its activation stay two ops."""
    mesh = spmd.Mesh.create(("tp",), devices="cpu:1")
    f_jit = spmd.jit(lambda x, w: torch.relu(x @ w), mesh=mesh, options=spmd.CompileOptions(cuda_graphs=False))
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(16, 24, generator=g), torch.randn(24, 33, generator=g)
    assert "dot" in _opcodes(f_jit, 1, x, w)


def _product_then_another_chain(p, q, r, s, w):
    a = p @ q
    t = a @ w
    u = (r @ s) @ s  # between the product and its gelu; r @ s takes a's arena bytes (dead there)
    return torch.cat([F.gelu(t), u])


@pytest.mark.parametrize("n", [1, 2])
def test_a_product_is_not_moved_into_its_reader_past_a_product_that_reuses_its_inputs_bytes(n):
    g = torch.Generator().manual_seed(12)
    p, r = torch.randn(40, 32, generator=g), torch.randn(40, 32, generator=g)
    q, s, w = (torch.randn(32, 32, generator=g) / 5 for _ in range(3))
    f, n = _jit(_product_then_another_chain, n, (P(), P(), P(), P(), P(None, "tp")), P())
    assert "dot" in _opcodes(f, n, p, q, r, s, w)  # t stays its own product
    _close(f(p, q, r, s, w), _product_then_another_chain(*(t.double() for t in (p, q, r, s, w))), torch.float32)


def test_differential_sweep_case_8181_an_elementwise_reader_after_a_resharded_product():
    """Seed 0, program 8181 of the slow sweep (shrunk, as its reproducer runs it): the product's
    operand bytes were reused by the ops between the product and its ``maximum`` reader (the
    stack, the attention); the fused op then read them (relative error 1.3 in float64, 2 x 2 mesh)."""
    def f(x0, x1, x2, x3, x4, x5, x6):
        v0 = x0 @ x3
        torch.stack([v0, x4, v0], dim=1)
        v2 = F.scaled_dot_product_attention(x4, x5, x6, is_causal=True)
        v4 = torch.maximum(spmd.with_sharding_constraint(v0, P("tp", "dp", None, None)), x5)
        return v4[:, :, :, 1:2:2], v2

    mesh = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")
    specs = [P(None, "dp", "tp"), None, None, P(None, "dp"), P("dp", "tp", None, None), P("dp", "tp", None, None),
             P("dp", "tp", None, None)]
    g = spmd.jit(f, mesh=mesh, in_shardings=specs)
    shapes = ((3, 8, 7, 4), (), (), (4, 2), (3, 8, 7, 2), (3, 8, 7, 2), (3, 8, 7, 4))
    for call in range(2):
        xs = [torch.randn(s, generator=torch.Generator().manual_seed(818100 + k + 1000 * call), dtype=torch.float64)
              for k, s in enumerate(shapes)]
        for got, want in zip(g(*xs), f(*xs), strict=True):
            torch.testing.assert_close(got.to_torch(), want)
