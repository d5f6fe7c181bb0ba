"""The functional step API: step(params, opt_state, batch) jitted with donated params and state,
gradients by torch.func.grad_and_value or torch.autograd.grad; and bad input to make_train_step."""

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import Mesh, NamedSharding
from spmd import PartitionSpec as P
from spmd.array import DeletedArrayError
from spmd.train import SGD, AdamW, make_train_step


def _loss(params, batch):
    h = torch.tanh(batch["x"] @ params["w1"].T + params["b1"])
    return F.mse_loss(h @ params["w2"].T, batch["y"])


def _step_func(opt):
    def step(params, state, batch):
        grads, loss = torch.func.grad_and_value(_loss)(params, batch)
        params, state = opt.update(params, grads, state)
        return params, state, {"loss": loss}
    return step


def _step_autograd(opt):
    def step(params, state, batch):
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
            loss = _loss(leaves, batch)
            grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        params, state = opt.update(params, grads, state)
        return params, state, {"loss": loss.detach()}
    return step


def _init():
    torch.manual_seed(0)
    return {"w1": torch.randn(12, 6) * 0.3, "b1": torch.randn(12) * 0.1, "w2": torch.randn(3, 12) * 0.3}


@pytest.mark.parametrize("make", [_step_func, _step_autograd])
def test_functional_step_matches_torch_optim(make):
    mesh = Mesh.create(("dp",), devices="cpu:2")
    opt = AdamW(lr=1e-2)
    init = _init()
    specs = {"w1": P("dp"), "b1": P("dp"), "w2": P(None, "dp")}
    state_specs = {"step": P(), "exp_avg": specs, "exp_avg_sq": specs}
    step = spmd.jit(make(opt), mesh=mesh, in_shardings=(specs, state_specs, P("dp")),
                    out_shardings=(specs, state_specs, None), donate_argnums=(0, 1))
    params = {k: spmd.device_put(v, NamedSharding(mesh, specs[k])) for k, v in init.items()}
    state = opt.init(init)
    ref = {k: v.clone().requires_grad_() for k, v in init.items()}
    topt = torch.optim.AdamW(list(ref.values()), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        batch = {"x": torch.randn(8, 6, generator=g), "y": torch.randn(8, 3, generator=g)}
        old = params
        params, state, metrics = step(params, state, batch)
        topt.zero_grad()
        want = _loss(ref, batch)
        want.backward()
        topt.step()
        assert abs(float(metrics["loss"].to_torch()) - float(want.detach())) <= 1e-5 * float(want.detach())
    for k, p in ref.items():
        torch.testing.assert_close(params[k].to_torch(), p.detach(), rtol=0, atol=1e-5)
    with pytest.raises(DeletedArrayError, match="donated"):  # donated inputs are dead after the step
        step(old, state, batch)


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _mse(apply, batch):
    return F.mse_loss(apply(batch["x"]), batch["y"])


def _batch(n=4):
    return {"x": torch.randn(n, 4), "y": torch.randn(n, 2)}


def test_non_scalar_loss_is_a_value_error_and_nothing_is_mutated():
    mesh = Mesh.create(("dp",), devices="cpu:2")
    ts = make_train_step(_tiny(), mesh, None, lambda apply, b: (apply(b["x"]) - b["y"]) ** 2, optimizer=SGD(lr=0.1))
    before = ts.state_dict()
    with pytest.raises(ValueError, match=r"loss_fn: expected a 0-d floating-point loss, got a tensor of shape \(4,"):
        ts.step(_batch())
    after = ts.state_dict()  # params and state alive and unchanged
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_donated_state_reused_after_step_is_a_clear_error():
    mesh = Mesh.create(("dp",), devices="cpu:2")
    ts = make_train_step(_tiny(), mesh, None, _mse, optimizer=AdamW(lr=0.1))
    old = ts.params
    ts.step(_batch())
    ts.params = old
    with pytest.raises(DeletedArrayError, match=r"params\['0.weight'\].*donated"):
        ts.step(_batch())


def test_a_deleted_array_of_the_last_steps_state_is_a_clear_error():
    """The state the last step returned, one array of it deleted since: the check's fast path (the
    same arrays as returned) still finds it."""
    mesh = Mesh.create(("dp",), devices="cpu:2")
    ts = make_train_step(_tiny(), mesh, None, _mse, optimizer=AdamW(lr=0.1))
    ts.step(_batch())
    ts.opt_state["exp_avg_sq"]["0.bias"].delete()
    with pytest.raises(DeletedArrayError, match=r"opt_state\['exp_avg_sq'\]\['0.bias'\]"):
        ts.step(_batch())


@pytest.mark.parametrize("steps_before", [0, 1])  # 1: replaced after a step (its fast path of the state check)
def test_state_sharding_mismatching_its_parameter(steps_before):
    mesh = Mesh.create(("dp",), devices="cpu:2")
    ts = make_train_step(_tiny(), mesh, None, _mse, optimizer=AdamW(lr=0.1), fsdp=True)
    for _ in range(steps_before):
        ts.step(_batch())
    buf = ts.opt_state["exp_avg"]["0.weight"]
    ts.opt_state["exp_avg"]["0.weight"] = spmd.device_put(buf.to_torch(), NamedSharding(mesh, P()))
    with pytest.raises(ValueError, match=r"opt_state\['exp_avg'\]\['0.weight'\]: expected sharding"):
        ts.step(_batch())


@pytest.mark.parametrize(("replace", "match"), [
    (lambda ts, m: ts.opt_state["exp_avg"].__setitem__(
        "0.weight", spmd.device_put(torch.zeros(4, 2), NamedSharding(m, P("dp")))),
     r"opt_state\['exp_avg'\]\['0.weight'\]: expected shape \(8, 4\) and dtype torch.float32"),
    (lambda ts, m: ts.opt_state["exp_avg"].__setitem__(
        "0.weight", spmd.device_put(torch.zeros(8, 4, dtype=torch.float64), NamedSharding(m, P("dp")))),
     r"opt_state\['exp_avg'\]\['0.weight'\]: .* got \(8, 4\) torch.float64"),
    (lambda ts, m: ts.params.__setitem__("0.weight", spmd.device_put(torch.zeros(4, 8), NamedSharding(m, P("dp")))),
     r"params\['0.weight'\]: expected shape \(8, 4\)"),
    (lambda ts, m: ts.params.pop("0.bias"), r"params: expected the keys .*missing \['0.bias'\]"),
])
@pytest.mark.parametrize("steps_before", [0, 1])  # 1: replaced after a step (its fast path of the state check)
def test_state_of_another_shape_or_dtype_is_a_value_error_and_nothing_runs(replace, match, steps_before):
    mesh = Mesh.create(("dp",), devices="cpu:2")
    ts = make_train_step(_tiny(), mesh, None, _mse, optimizer=AdamW(lr=0.1), fsdp=True)
    for _ in range(steps_before):
        ts.step(_batch())
    replace(ts, mesh)
    before = {k: v.to_torch() for k, v in ts.params.items()}
    with pytest.raises(ValueError, match=match):
        ts.step(_batch())
    assert all(torch.equal(v.to_torch(), before[k]) for k, v in ts.params.items())


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(optimizer=SGD(), dp_axis=0), TypeError, "dp_axis: expected a mesh axis name"),
    (dict(optimizer=AdamW), TypeError, "optimizer: expected an spmd.train optimizer"),
    (dict(optimizer=SGD(), clip_grad_norm="1"), TypeError, "clip_grad_norm must be a number"),
    (dict(optimizer=SGD(), plan={"0.weight": P()}), ValueError, r"unmatched parameter\(s\) \['0.bias'"),
    (dict(optimizer=SGD(), fsdp=True, dp_axis="data"), ValueError, "fsdp: needs dp_axis"),
    (dict(optimizer=SGD(), plan={"0.weight": P(None, "tp"), "0.bias": P(), "2.weight": P(), "2.bias": P()}), ValueError,
     r"plan\['0.weight'\]: unknown mesh axis 'tp'"),
    (dict(optimizer=SGD(), plan={"0.weight": P(), "0.bias": P(None, "dp"), "2.weight": P(), "2.bias": P()}), ValueError,
     r"plan\['0.bias'\]: P\(None, 'dp'\) has 2 entries but the array has 1 dims"),
])
def test_bad_arguments(kwargs, exc, match):
    kwargs = {"plan": None, **kwargs}
    with pytest.raises(exc, match=match):
        make_train_step(_tiny(), Mesh.create(("dp",), devices="cpu:2"), loss_fn=_mse, **kwargs)


def test_non_number_lr():
    with pytest.raises(TypeError, match="AdamW: lr must be a number, got str"):
        AdamW(lr="1e-3")


def test_integer_parameters_cannot_take_gradients():
    model = _tiny()
    model.register_parameter("count", torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))
    with pytest.raises(ValueError, match="parameter 'count' has dtype torch.int64"):
        make_train_step(model, Mesh.create(("dp",), devices="cpu:2"), None, _mse, optimizer=SGD())


def test_save_and_load_resume_bit_for_bit(tmp_path):
    mesh = Mesh.create(("dp",), devices="cpu:2")
    batches = [_batch() for _ in range(6)]
    straight = make_train_step(_tiny(), mesh, None, _mse, optimizer=AdamW(lr=0.05), fsdp=True)
    losses = [float(straight.step(b)["loss"]) for b in batches]
    first = make_train_step(_tiny(), mesh, None, _mse, optimizer=AdamW(lr=0.05), fsdp=True)
    for b in batches[:3]:
        first.step(b)
    first.save(tmp_path / "ckpt.safetensors")
    resumed = make_train_step(_tiny(), mesh, None, _mse, optimizer=AdamW(lr=0.05), fsdp=True)
    resumed.load(tmp_path / "ckpt.safetensors")
    assert [float(resumed.step(b)["loss"]) for b in batches[3:]] == losses[3:]
    end, want = resumed.state_dict(), straight.state_dict()
    assert all(torch.equal(end[k], want[k]) for k in want)



@pytest.mark.parametrize("bad, match", [
    ("numpy", r"state_dict\['param.0.weight'\]: expected a torch.Tensor, got ndarray"),
    ("list", r"state_dict\['opt.step'\]: expected a torch.Tensor, got list"),
    ("none", r"state_dict: expected a dict of tensors .* got NoneType")])
def test_load_state_dict_of_non_tensors_is_a_type_error_and_nothing_is_replaced(bad, match):
    # a list value used to fail with AttributeError ('list' object has no attribute 'shape')
    mesh = Mesh.create(("dp",), devices="cpu:2")
    step = make_train_step(_tiny(), mesh, None, _mse, optimizer=AdamW(lr=0.05))
    sd = step.state_dict()
    given = {"numpy": {**sd, "param.0.weight": sd["param.0.weight"].numpy()}, "list": {**sd, "opt.step": [0.0]},
             "none": None}[bad]
    params = step.params
    with pytest.raises(TypeError, match=match):
        step.load_state_dict(given)
    assert step.params is params
    step.load_state_dict(sd)


@pytest.mark.parametrize("how", ["func", "autograd"])
def test_gradient_of_integer_input_is_a_type_error(how):
    def by_func(w, ids):
        return torch.func.grad(lambda i: (w[0] * i).sum())(ids)

    def by_autograd(w, ids):
        with torch.enable_grad():
            ids = ids.requires_grad_()
            return torch.autograd.grad((w[0] * ids).sum(), ids)[0]

    fn = by_func if how == "func" else by_autograd
    with pytest.raises(TypeError, match=r"gradients requested for a tensor of dtype torch.int64 and shape \(2,\) "
                                        r"at .*test_functional_step.py:\d+"):
        spmd.jit(fn, mesh=Mesh.create(("dp",), devices="cpu:1"))(torch.randn(4), torch.tensor([1, 2]))


def test_compiled_gradients_do_not_depend_on_the_callers_grad_mode():
    """Traced under torch.no_grad() (the compile cache key has no grad mode), autograd.grad still differentiates."""
    def grads(w, x):
        w = w.detach().requires_grad_()
        return torch.autograd.grad(torch.tanh(x @ w).sum(), w)[0]

    w, x = torch.randn(5, 7), torch.randn(3, 5)
    with torch.no_grad():
        got = spmd.jit(grads, mesh=Mesh.create(("dp",), devices="cpu:2"))(w, x)
    with torch.enable_grad():
        want = grads(w, x)
    torch.testing.assert_close(got.to_torch(), want)
