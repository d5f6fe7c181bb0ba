"""Import PyTorch programs, run the HLO-lite through the runtime kernels, compare with PyTorch."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

from spmd.frontend.torch_export import UnsupportedOpError, import_program
from spmd.ir.text import parse_module, print_module
from spmd.ir.verify import verify_module

from .helpers import assert_close_tree, run_imported
from .models import MLP, Block, LlamaBlock, TinyLM


def opcodes(prog) -> collections.Counter:
    return collections.Counter(i.opcode for i in prog.module.entry.instructions)


def check(fn, args, kwargs=None, rtol=1e-5, atol=1e-5):
    prog, got = run_imported(fn, args, kwargs)
    verify_module(prog.module)
    assert print_module(parse_module(print_module(prog.module))) == print_module(prog.module)
    with torch.no_grad():
        want = fn(*args, **(kwargs or {}))
    assert_close_tree(got, want, rtol=rtol, atol=atol)
    return prog


def test_mlp_gelu_and_compact_linear():
    for approximate in ("none", "tanh"):
        model = MLP(approximate=approximate).eval()
        prog = check(model, (torch.randn(3, 5, 16),))
        ops = opcodes(prog)
        # two linears: one dot + one broadcast bias + one add each; gelu is one custom call
        assert ops["dot"] == 2 and ops["add"] == 2 and ops["broadcast"] == 2
        assert ops["custom-call"] == 1 and ops["reshape"] == 0 and ops["transpose"] == 0
    assert prog.param_names == ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    assert prog.input_names == ("x",) + prog.param_names


def test_program_metadata_and_locations():
    prog = import_program(MLP().eval(), (torch.randn(2, 16),))
    entry = prog.module.entry
    params = entry.parameters
    assert [p.attrs["parameter_number"] for p in params] == list(range(5))
    assert [p.shape.dims for p in params] == [(2, 16), (64, 16), (64,), (16, 64), (16,)]
    dot = next(i for i in entry.instructions if i.opcode == "dot")
    assert dot.location.op_name == "aten.linear.default"
    assert dot.location.source_file.endswith("models.py") and dot.location.source_line > 0
    assert prog.module.mesh.axis_names == ()


@pytest.mark.parametrize("use_sdpa", [False, True])
def test_transformer_block_with_mask(use_sdpa):
    model = Block(use_sdpa=use_sdpa).eval()
    x = torch.randn(2, 6, 32)
    mask = torch.rand(6, 6) > 0.3
    mask |= torch.eye(6, dtype=torch.bool)
    prog = check(model, (x, mask))
    targets = {i.attrs["custom_call_target"] for i in prog.module.entry.instructions if i.opcode == "custom-call"}
    assert targets == {"layer-norm", "gelu", "attention" if use_sdpa else "softmax"}


def test_llama_block_and_embedding_model():
    check(LlamaBlock().eval(), (torch.randn(2, 7, 32),))
    prog = check(TinyLM().eval(), (torch.randint(0, 50, (2, 9)),))
    assert opcodes(prog)["gather"] == 1


def test_function_with_kwargs_scalars_and_promotion():
    def f(x, y, *, scale):
        i = torch.arange(x.shape[-1])                       # s64 iota
        z = x * scale + i                                   # float * python float + int tensor
        w = (y > 0).float() * 2 - y.to(torch.bfloat16).float()
        m = torch.where(x > 0.5, x, -1.0).amax(dim=0)
        return {"z": z / 3, "w": w.sum(), "m": m, "r": torch.relu(y).clamp(max=0.7)}

    args = (torch.randn(4, 6), torch.randn(4, 6))
    check(f, args, {"scale": 1.5})


def test_int_and_bool_ops():
    def f(a, b):
        q = torch.div(a, b, rounding_mode="trunc")
        s = (a > b).sum(dim=1)                 # bool sum -> s64
        return q, s, a % b + torch.fmod(a, b) * 10, (a.float() % -2.5), ~(a > 0) | (b == 3)

    a = torch.randint(-20, 20, (3, 5))
    b = torch.randint(1, 6, (3, 5))
    check(f, (a, b))


def test_shape_ops():
    def f(x, y):
        a = x.permute(2, 0, 1).reshape(6, -1).t().contiguous()
        b = torch.cat([x[:, 1:], x[:, :1]], dim=1).unsqueeze(0).squeeze(0)
        c = torch.stack([y, y * 2], dim=1)
        d = x.select(1, 2) + y[None, :3].expand(2, 3)
        e = list(torch.split(x, [1, 2], dim=2))
        return a, b, c, d, e[0] * e[1][..., :1], x.flatten(1), x.mean(), y.var(), torch.var_mean(x, dim=1)

    check(f, (torch.randn(2, 4, 3), torch.randn(5)))


def test_matmul_forms():
    def f(a, b, c, v, m):
        return (a @ b, v @ b, a[0] @ v[:4].view(4, 1).expand(4, 3), m @ c, torch.addmm(v[:3], m, c),
                torch.baddbmm(a[..., :3], a, b, alpha=0.5, beta=2.0), m @ b)

    a = torch.randn(2, 3, 4)
    b = torch.randn(2, 4, 3)
    check(f, (a, b, torch.randn(4, 3), torch.randn(4), torch.randn(3, 4)), rtol=1e-5, atol=1e-5)


def test_creation_and_masked_fill():
    def f(x):
        causal = torch.ones(4, 4, dtype=torch.bool).tril()
        s = x.masked_fill(~causal, float("-inf"))
        return (torch.softmax(s, -1) + torch.zeros_like(x) + torch.full((4, 4), 0.25), F.normalize(x, dim=-1),
                torch.linalg.vector_norm(x, ord=1, dim=0), x.norm(dim=1, keepdim=True),
                torch.arange(1, 9, 2, dtype=torch.float32), F.log_softmax(x, dim=0))

    check(f, (torch.randn(4, 4),))


def test_bf16_program():
    model = MLP().eval().to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    check(model, (x,), rtol=1e-2, atol=1e-2)


def test_unsupported_op_names_op_and_user_line():
    def f(x):
        y = x + 1
        return torch.logcumsumexp(y, dim=-1)  # the unsupported line

    with pytest.raises(UnsupportedOpError, match=r"aten\.logcumsumexp.*test_torch_export\.py:\d+") as info:
        import_program(f, (torch.randn(3, 4),))
    assert isinstance(info.value, TypeError)
    line = int(str(info.value).split("test_torch_export.py:")[1].split(":")[0].split()[0])
    with open(__file__) as f:
        src = f.read().splitlines()[line - 1]
    assert "torch.logcumsumexp" in src


def test_an_op_with_side_effects_is_named():
    # used to be "unsupported program input TokenArgument(name='token') of kind TOKEN"
    def f(x):
        return torch.linalg.inv(x) + 1  # the effectful line

    with pytest.raises(UnsupportedOpError, match=r"unsupported operation aten._linalg_check_errors.default \(of "
                                                 r"linalg.inv\) at .*test_torch_export.py:\d+: an operation with "
                                                 r"side effects \(torch.export threads an effect token"):
        import_program(f, (torch.eye(4),))


def test_unsupported_fft():
    with pytest.raises(UnsupportedOpError, match="fft"):
        import_program(lambda x: torch.fft.fft(x).real, (torch.randn(8),))


def test_layer_norm_statistics_are_computed():
    # native_layer_norm's mean and rstd (what its backward reads) equal ATen's
    fn = lambda x: tuple(torch.ops.aten.native_layer_norm(x, [8], None, None, 1e-5))  # noqa: E731
    x = torch.randn(3, 8, dtype=torch.float64)
    _, got = run_imported(fn, (x,))
    assert_close_tree(tuple(got), fn(x), rtol=1e-12, atol=1e-12)
    # 16-bit input: the statistics are computed in float32 and rounded once, to ATen's stat dtype
    xb = torch.randn(3, 8, dtype=torch.bfloat16)
    _, got = run_imported(fn, (xb,))
    assert_close_tree(tuple(got), fn(xb), rtol=1e-2, atol=1e-2)


def test_dropout_in_training_mode_takes_a_random_key_last():
    prog = import_program(Block().train(), (torch.randn(2, 4, 32),))
    params = prog.module.entry.parameters
    assert prog.rng_key_parameter == len(params) - 1 == len(prog.input_names)
    assert params[-1].name == "rng_key" and str(params[-1].shape) == "s64[2]"
    assert import_program(Block().eval(), (torch.randn(2, 4, 32),)).rng_key_parameter is None


def test_hf_bert_model_with_attention_mask():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=100, max_position_embeddings=32)
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    prog, got = run_imported(model, (ids,), {"attention_mask": mask})
    verify_module(prog.module)
    with torch.no_grad():
        want = model(ids, attention_mask=mask)
    assert_close_tree(tuple(got.values()), tuple(want.values()))
    assert opcodes(prog)["dot"] == 13  # 2 layers x 6 linears + pooler


def test_advanced_index_and_torch_gather():
    def f(x, i, j, table):
        return x[i, j], x[:, i], x[i[:, None], j[None, :]], torch.gather(table.expand(1, -1), 1, i[None])

    x = torch.randn(5, 7, 3)
    i, j = torch.tensor([4, 0, 2]), torch.tensor([6, 1, 1])
    check(f, (x, i, j, torch.randn(1, 9)))


# --------------------------------------------------------------------------- user-facing semantics
def _jit2(fn, **kw):
    import spmd

    return spmd.jit(fn, mesh=spmd.Mesh.create({"tp": 2}, "cpu:2"), **kw)


@pytest.mark.parametrize("index", [[-1, 0], [-2, 4, -5]])
def test_negative_indices_count_from_the_end(index):
    """x[idx] with negative entries (a list or an index tensor, rows or columns) as in PyTorch."""
    from spmd import PartitionSpec as P

    y = torch.randn(5, 5)
    i = torch.tensor(index)
    torch.testing.assert_close(_jit2(lambda a: a[index])(y).to_torch(), y[index])
    torch.testing.assert_close(_jit2(lambda a, i: a[i])(y, i).to_torch(), y[i])
    torch.testing.assert_close(_jit2(lambda a, i: a[:, i])(y, i).to_torch(), y[:, i])
    torch.testing.assert_close(_jit2(lambda a, i: a[i, i])(y, i).to_torch(), y[i, i])
    sharded = _jit2(lambda a, i: a[i], in_shardings=(P("tp", None), P()))
    torch.testing.assert_close(sharded(y, i).to_torch(), y[i])


def test_matrix_product_of_mixed_dtypes_is_refused():
    """PyTorch eager refuses int @ float and f32 @ f64; a silent convert would change the numbers."""
    from spmd.frontend.torch_export import UnsupportedOpError

    for x, w in ((torch.tensor([[1, 2]]), torch.tensor([[0.7], [0.7]])),
                 (torch.randn(2, 3), torch.randn(3, 2, dtype=torch.float64))):
        with pytest.raises(UnsupportedOpError, match="one dtype"):
            _jit2(lambda x, w: x @ w)(x, w)


@pytest.mark.parametrize("name", ["dim", "transpose", "index", "select"])
def test_index_errors_of_the_traced_program_are_value_errors(name):
    """PyTorch's own IndexError for a bad dim or index in the user's program (eager raises it too)
    reached ``spmd.jit`` callers as an IndexError; it is now the ValueError "tracing failed"."""
    import spmd
    from spmd import Mesh
    from spmd import PartitionSpec as P

    fn = {"dim": lambda t: t.sum(5), "transpose": lambda t: t.transpose(0, 3), "index": lambda t: t[5],
          "select": lambda t: t.select(0, 7)}[name]
    mesh = Mesh.create(("x",), devices="cpu:2")
    with pytest.raises(ValueError, match=r"<lambda>: tracing failed: .*(out of range|out of bounds).*"
                                         r"\(argument shapes args\[0\]: \(4, 3\)\)"):
        spmd.jit(fn, mesh=mesh, in_shardings=(P("x"),), out_shardings=P())(torch.randn(4, 3))
