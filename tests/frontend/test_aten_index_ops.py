"""gather / index_select / scatter / scatter_add / scatter_reduce / index_add / index_put (accumulate)
/ one_hot / cross_entropy / embedding backward, imported and run through the kernels on one device,
against PyTorch eager in float64."""

import pytest
import torch
import torch.nn.functional as F

from tests.frontend.helpers import assert_close_tree, run_imported

F64 = torch.float64


def _r(*shape):
    return torch.randn(*shape, dtype=F64)


def _i(n, *shape):
    return torch.randint(0, n, shape)


CASES = {
    "gather_dim1": (lambda x, i: torch.gather(x, 1, i), lambda: (_r(4, 8), _i(8, 4, 3))),
    "gather_dim0_small_index": (lambda x, i: torch.gather(x, 0, i), lambda: (_r(5, 6), _i(5, 3, 2))),
    "gather_3d_neg_dim": (lambda x, i: x.gather(-1, i), lambda: (_r(2, 3, 7), _i(7, 2, 3, 4))),
    "index_select_dim1": (lambda x, i: torch.index_select(x, 1, i), lambda: (_r(4, 8, 3), _i(8, 5))),
    "index_select_repeated": (lambda x, i: x.index_select(0, i), lambda: (_r(4, 3), torch.tensor([3, 3, 0, 3]))),
    "take_rows": (lambda x, i: x[i], lambda: (_r(6, 3), _i(6, 2, 5))),
    "scatter_src": (lambda x, i, y: x.scatter(1, i, y),
                    lambda: (_r(4, 8), torch.stack([torch.randperm(8)[:3] for _ in range(4)]), _r(4, 5))),
    "scatter_value": (lambda x, i: x.scatter(0, i, 2.5),
                      lambda: (_r(5, 3), torch.stack([torch.randperm(5)[:2] for _ in range(3)], 1))),
    "scatter_add_repeated": (lambda x, i, y: x.scatter_add(1, i, y), lambda: (_r(4, 5), _i(3, 4, 7), _r(4, 7))),
    "scatter_add_small_index": (lambda x, i, y: torch.scatter_add(x, 0, i, y),
                                lambda: (_r(6, 5), _i(6, 4, 3), _r(5, 5))),
    "scatter_reduce_sum": (lambda x, i, y: x.scatter_reduce(1, i, y, "sum"), lambda: (_r(3, 4), _i(4, 3, 6), _r(3, 6))),
    "scatter_reduce_amax": (lambda x, i, y: x.scatter_reduce(1, i, y, "amax"),
                            lambda: (_r(3, 4), _i(4, 3, 6), _r(3, 6))),
    "scatter_reduce_amin": (lambda x, i, y: x.scatter_reduce(0, i, y, "amin"),
                            lambda: (_r(4, 3), _i(4, 6, 3), _r(6, 3))),
    "scatter_reduce_prod": (lambda x, i, y: x.scatter_reduce(0, i, y, "prod"),
                            lambda: (_r(4, 3), _i(4, 6, 3), _r(6, 3))),
    "index_add": (lambda x, i, y: x.index_add(1, i, y), lambda: (_r(3, 5, 2), _i(5, 7), _r(3, 7, 2))),
    "index_add_alpha": (lambda x, i, y: torch.index_add(x, 0, i, y, alpha=-0.5),
                        lambda: (_r(4, 3), _i(4, 6), _r(6, 3))),
    "index_put_acc": (lambda x, i, y: x.index_put((i,), y, accumulate=True), lambda: (_r(5, 3), _i(5, 8), _r(8, 3))),
    "index_put_acc_neg": (lambda x, i, y: x.index_put((i,), y, accumulate=True),
                          lambda: (_r(5, 3), torch.tensor([-1, 0, -5, 4, -1]), _r(5, 3))),
    "index_put_two_dims": (lambda x, i, j, y: x.index_put((i, j), y),
                           lambda: (_r(4, 5, 2), torch.tensor([0, 3, 1]), torch.tensor([4, 0, -2]), _r(3, 2))),
    "index_put_middle": (lambda x, i, y: torch.ops.aten.index_put(x, [None, i], y, True),
                         lambda: (_r(3, 5, 2), _i(5, 4), _r(3, 4, 2))),
    "index_put_split_dims": (lambda x, i, j, y: torch.ops.aten.index_put(x, [i, None, j], y, True),
                             lambda: (_r(4, 3, 5), _i(4, 6), _i(5, 6), _r(6, 3))),
    "index_copy": (lambda x, i, y: x.index_copy(1, i, y), lambda: (_r(3, 6), torch.randperm(6)[:4], _r(3, 4))),
    "setitem_rows": (lambda x, i, y: (lambda z: (z.__setitem__(i, y), z)[1])(x.clone()),
                     lambda: (_r(6, 3), torch.randperm(6)[:4], _r(4, 3))),
    "iadd_rows": (lambda x, i, y: (lambda z: (z.index_put_((i,), y, accumulate=True), z)[1])(x.clone()),
                  lambda: (_r(6, 3), _i(6, 9), _r(9, 3))),
    "one_hot": (lambda i: F.one_hot(i, 7), lambda: (_i(7, 3, 4),)),
    "embedding_backward": (lambda g, t: torch.ops.aten.embedding_dense_backward(g, t, 6, -1, False),
                           lambda: (_r(4, 5, 3), _i(6, 4, 5))),
    "embedding_backward_padding_idx": (lambda g, t: torch.ops.aten.embedding_dense_backward(g, t, 6, 2, False),
                                       lambda: (_r(4, 5, 3), _i(6, 4, 5))),
    "strided_slice_assign": (lambda x, y: (lambda z: (z.__setitem__((slice(None), slice(1, 7, 2)), y), z)[1])(
        x.clone()),
                             lambda: (_r(4, 8), _r(4, 3))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_index_op_matches_eager(name):
    torch.manual_seed(hash(name) % 1000)
    fn, make = CASES[name]
    args = make()
    want = fn(*[a.clone() for a in args])
    prog, got = run_imported(fn, [a.clone() for a in args])
    assert_close_tree(got, want, rtol=1e-12, atol=1e-12)


CE = [dict(), dict(reduction="sum"), dict(reduction="none"), dict(ignore_index=2),
      dict(label_smoothing=0.1), dict(label_smoothing=0.2, ignore_index=1, reduction="sum"),
      dict(label_smoothing=0.3, reduction="none", ignore_index=0)]


@pytest.mark.parametrize("kw", CE, ids=[str(k) for k in CE])
def test_cross_entropy_matches_eager(kw):
    logits, target = _r(6, 5), _i(5, 6)
    target[0] = kw.get("ignore_index", 0)
    fn = lambda x, t: F.cross_entropy(x, t, **kw)  # noqa: E731
    _, got = run_imported(fn, (logits, target))
    assert_close_tree(got, fn(logits, target), rtol=1e-12, atol=1e-12)


def test_cross_entropy_over_sequence_and_nll_loss():
    logits, target = _r(2, 5, 4), _i(5, 2, 4)
    fn = lambda x, t: (F.cross_entropy(x, t), F.nll_loss(F.log_softmax(x, 1), t, reduction="sum"))  # noqa: E731
    _, got = run_imported(fn, (logits, target))
    assert_close_tree(got, fn(logits, target), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- through spmd.jit on CPU meshes
def _mesh(axes):
    import spmd

    n = 1
    for v in axes.values():
        n *= v
    return spmd.Mesh.create(axes, devices=f"cpu:{n}")


def _emb(w, t):
    return F.embedding(t, w)


def _ce(x, t):
    return F.cross_entropy(x, t, label_smoothing=0.1, ignore_index=3)


def _ce_none(x, t):
    return F.cross_entropy(x, t, reduction="none")


def _emb_bwd(g, t):
    return torch.ops.aten.embedding_dense_backward(g, t, 11, -1, False)


def _scatter_add(x, i, y):
    return x.scatter_add(1, i, y)


def _index_add(x, i, y):
    return x.index_add(0, i, y)


def _lm_head_loss(h, w, t):
    """Tied-embedding logits and the loss: the vocabulary-parallel cross-entropy pattern."""
    return F.cross_entropy(h @ w.t(), t)


V = 11  # uneven over 2 and 4 devices

JIT_CASES = [  # (fn, args maker, in specs, out spec, mesh axes)
    (_emb, lambda: (_r(V, 6), _i(V, 4, 5)), ("tp", None), None, {"tp": 2}),
    (_emb, lambda: (_r(V, 6), _i(V, 4, 5)), ("tp", None), None, {"tp": 4}),
    (_emb, lambda: (_r(V, 6), _i(V, 3, 5)), ("tp", "dp"), "dp", {"dp": 2, "tp": 2}),
    (_ce, lambda: (_r(6, V), _i(V, 6)), ((None, "tp"), None), (), {"tp": 4}),
    (_ce, lambda: (_r(5, V), _i(V, 5)), (("dp", "tp"), "dp"), (), {"dp": 2, "tp": 2}),
    (_ce_none, lambda: (_r(5, V), _i(V, 5)), (("dp", "tp"), "dp"), "dp", {"dp": 2, "tp": 2}),
    (_emb_bwd, lambda: (_r(4, 5, 6), _i(4, 4, 5)), ("dp", "dp"), (), {"dp": 2}),
    (_emb_bwd, lambda: (_r(3, 5, 6), _i(V, 3, 5)), ("dp", "dp"), "tp", {"dp": 2, "tp": 2}),
    (_scatter_add, lambda: (_r(5, 8), _i(8, 5, 7), _r(5, 7)), ((None, "tp"), None, None), (None, "tp"), {"tp": 4}),
    (_scatter_add, lambda: (_r(5, 8), _i(8, 5, 7), _r(5, 7)), (None, (None, "tp"), (None, "tp")), (), {"tp": 2}),
    (_index_add, lambda: (_r(V, 3), _i(V, 9), _r(9, 3)), ("tp", "dp", "dp"), "tp", {"dp": 2, "tp": 2}),
    (_lm_head_loss, lambda: (_r(6, 4), _r(V, 4), _i(V, 6)), (None, "tp", None), (), {"tp": 2}),
]


def _spec(s):
    from spmd import PartitionSpec as P

    if s is None or s == ():
        return P()
    return P(*s) if isinstance(s, tuple) else P(s)


@pytest.mark.parametrize("case", range(len(JIT_CASES)))
def test_index_ops_on_meshes_match_eager(case):
    import spmd

    torch.manual_seed(case)
    fn, make, in_specs, out_spec, axes = JIT_CASES[case]
    args = make()
    specs = tuple(_spec(s) for s in in_specs)
    f = spmd.jit(fn, mesh=_mesh(axes), in_shardings=specs, out_shardings=_spec(out_spec))
    got = f(*args).to_torch()
    torch.testing.assert_close(got, fn(*args), rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_vocab_parallel_loss_and_embedding_backward_on_gpus():
    """Under CUDA graphs on every local GPU: the tied-embedding loss with a vocabulary-sharded table,
    and the embedding gradient with sharded tokens."""
    import spmd

    mesh = spmd.Mesh.create(("tp",), devices="cuda")
    h, w, t = _r(16, 32), _r(1003, 32), _i(1003, 16)
    f = spmd.jit(_lm_head_loss, mesh=mesh, in_shardings=(_spec(None), _spec("tp"), _spec(None)),
                 out_shardings=_spec(None))
    for _ in range(2):  # the second call replays the captured graph
        got = f(h.cuda(), w.cuda(), t.cuda()).to_torch().cpu()
    torch.testing.assert_close(got, _lm_head_loss(h, w, t), rtol=1e-12, atol=1e-12)
    g, ids = _r(8, 16, 32), _i(1003, 8, 16)
    bwd = lambda g, t: torch.ops.aten.embedding_dense_backward(g, t, 1003, -1, False)  # noqa: E731
    f = spmd.jit(bwd, mesh=mesh, in_shardings=(_spec("tp"), _spec("tp")), out_shardings=_spec("tp"))
    for _ in range(2):
        got = f(g.cuda(), ids.cuda()).to_torch().cpu()
    torch.testing.assert_close(got, bwd(g, ids), rtol=1e-12, atol=1e-12)


def test_out_of_range_indices_follow_xla_rules_where_eager_raises():
    """Not checked on the device: a lookup clamps the index, a scatter drops the update."""
    w, ids = _r(5, 3), torch.tensor([0, 7, -9, 4])
    with pytest.raises(IndexError):
        F.embedding(ids, w)
    _, got = run_imported(_emb, (w, ids))
    torch.testing.assert_close(got, w[ids.clamp(0, 4)])
    x, y = _r(5, 3), _r(4, 3)
    _, got = run_imported(_index_add, (x, ids, y))
    keep = (ids >= 0) & (ids < 5)
    torch.testing.assert_close(got, x.index_add(0, ids[keep], y[keep]))


def test_index_select_of_a_0d_tensor():
    """One index into a 0-d tensor selects it (as eager); more is eager's RuntimeError, a ValueError
    here (was an AssertionError inside the emitter)."""
    import spmd
    from spmd import Mesh
    from spmd import PartitionSpec as P

    mesh = Mesh.create(("x",), devices="cpu:2")
    x = torch.randn(())
    for index in (torch.tensor([0]), torch.tensor(0)):
        fn = lambda t, i=index: t.index_select(0, i) * 2  # noqa: E731
        got = spmd.jit(fn, mesh=mesh, in_shardings=(P(),), out_shardings=P())(x).to_torch()
        assert got.shape == () and torch.equal(got, fn(x))
    with pytest.raises(ValueError, match="index_select: an index into a 0-d tensor can have only 1 value, got 2"):
        spmd.jit(lambda t: t.index_select(0, torch.tensor([0, 0])), mesh=mesh, in_shardings=(P(),),
                 out_shardings=P())(x)


@pytest.mark.parametrize("fn", [
    lambda x, i: x.index_select(1, i),
    lambda x, i: x.index_add(1, i, torch.ones(4, 2, dtype=F64)),
    lambda x, i: F.one_hot(i, 8).to(F64),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.int32])
def test_index_dtypes_match_eager(fn, dtype):
    # a float index used to be truncated (index 2.7 read row 2) where PyTorch raises; int32 stays
    # accepted where eager accepts it (not by one_hot, which takes int64 only)
    from spmd.frontend.aten_common import InvalidArgumentError

    x, i = _r(4, 8), torch.tensor([2.7, 5.0]).to(dtype)
    try:
        want = fn(x, i)
    except RuntimeError:
        with pytest.raises(InvalidArgumentError, match=r"test_aten_index_ops.py:\d+: expected an integer "
                                                       rf"\(int64(/int32)?\) .*tensor, got {str(dtype)[6:]}"):
            run_imported(fn, (x, i))
        return
    assert_close_tree(run_imported(fn, (x, i))[1], want)
