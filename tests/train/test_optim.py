"""spmd.train optimizers against torch.optim (single-tensor paths), eagerly and inside spmd.jit."""

import pytest
import torch

import spmd
from spmd import Mesh, NamedSharding
from spmd import PartitionSpec as P
from spmd.train import SGD, Adam, AdamW, clip_grad_norm

CASES = [
    (AdamW(lr=1e-2, weight_decay=0.1), lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)),
    (Adam(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
     lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, foreach=False)),
    (SGD(lr=1e-2), lambda ps: torch.optim.SGD(ps, lr=1e-2)),
    (SGD(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.1),
     lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.1)),
    (SGD(lr=1e-2, momentum=0.9, nesterov=True), lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True)),
]


@pytest.mark.parametrize("opt,factory", CASES, ids=lambda c: repr(c)[:40] if not callable(c) else "")
def test_matches_torch_optim_eager_and_jitted(opt, factory):
    torch.manual_seed(0)
    init = {"w": torch.randn(6, 5), "b": torch.randn(5)}
    ref = {k: v.clone().requires_grad_() for k, v in init.items()}
    topt = factory(list(ref.values()))
    mesh = Mesh.create(("dp",), devices="cpu:2")
    specs = {"w": P("dp"), "b": P()}
    state_specs = {"step": P(), **{slot: specs for slot in opt.slots()}}
    update = spmd.jit(lambda p, g, s: opt.update(p, g, s), mesh=mesh,
                      in_shardings=(specs, None, state_specs), donate_argnums=(0, 2))
    eager, state = {k: v.clone() for k, v in init.items()}, opt.init(init)
    jitted = {k: spmd.device_put(v, NamedSharding(mesh, P("dp") if k == "w" else P())) for k, v in init.items()}
    jstate = opt.init(init)
    for _ in range(6):
        grads = {k: torch.randn_like(v) for k, v in init.items()}
        for k, p in ref.items():
            p.grad = grads[k].clone()
        topt.step()
        eager, state = opt.update(eager, grads, state)
        jitted, jstate = update(jitted, grads, jstate)
    for k, p in ref.items():
        torch.testing.assert_close(eager[k], p.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(jitted[k].to_torch(), p.detach(), rtol=0, atol=1e-6)
    assert float(jstate["step"].to_torch()) == 6.0


@pytest.mark.parametrize("opt,factory", CASES[:2], ids=["AdamW", "Adam"])
def test_float64_matches_torch_optim_to_float64_precision(opt, factory):
    """float64 parameters keep float64 step sizes (torch.optim's Python floats), eagerly and jitted."""
    torch.manual_seed(2)
    init = {"w": torch.randn(6, 5, dtype=torch.float64)}
    ref = {k: v.clone().requires_grad_() for k, v in init.items()}
    topt = factory(list(ref.values()))
    mesh = Mesh.create(("dp",), devices="cpu:2")
    update = spmd.jit(lambda p, g, s: opt.update(p, g, s), mesh=mesh, in_shardings=({"w": P("dp")}, None, None))
    eager, state, jitted, jstate = dict(init), opt.init(init), dict(init), opt.init(init)
    for _ in range(4):
        grads = {"w": torch.randn(6, 5, dtype=torch.float64)}
        ref["w"].grad = grads["w"].clone()
        topt.step()
        eager, state = opt.update(eager, grads, state)
        jitted, jstate = update(jitted, grads, jstate)
    torch.testing.assert_close(eager["w"], ref["w"].detach(), rtol=0, atol=1e-14)
    torch.testing.assert_close(jitted["w"].to_torch(), ref["w"].detach(), rtol=0, atol=1e-14)


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(1)
    grads = {"a": torch.randn(4, 3) * 5, "b": torch.randn(7)}
    ref = [torch.zeros_like(g, requires_grad=True) for g in grads.values()]
    for r, g in zip(ref, grads.values()):
        r.grad = g.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    clipped, norm = clip_grad_norm(grads, 0.5)
    torch.testing.assert_close(norm, want_norm)
    for r, g in zip(ref, clipped.values()):
        torch.testing.assert_close(g, r.grad)
    unclipped, _ = clip_grad_norm(grads, 1e6)  # below the limit: unchanged
    for k in grads:
        torch.testing.assert_close(unclipped[k], grads[k])


@pytest.mark.parametrize("bad,exc,match", [
    (lambda: AdamW(lr="0.1"), TypeError, "lr must be a number"),
    (lambda: AdamW(lr=True), TypeError, "lr must be a number"),
    (lambda: SGD(lr=-1.0), ValueError, "lr must be in"),
    (lambda: Adam(betas=(0.9, 1.0)), ValueError, r"betas\[1\]"),
    (lambda: SGD(lr=0.1, nesterov=True), ValueError, "nesterov"),
    (lambda: clip_grad_norm({"a": torch.ones(2)}, None), TypeError, "max_norm"),
])
def test_bad_hyper_parameters(bad, exc, match):
    with pytest.raises(exc, match=match):
        bad()


def test_update_checks_state_against_params():
    opt = AdamW()
    params = {"w": torch.ones(3, 2)}
    state = opt.init({"w": torch.ones(2, 3)})
    with pytest.raises(ValueError, match=r"state\['exp_avg'\]\['w'\]: expected shape \(3, 2\)"):
        opt.update(params, {"w": torch.ones(3, 2)}, state)
    with pytest.raises(ValueError, match="grads: expected the keys"):
        opt.update(params, {"v": torch.ones(3, 2)}, opt.init(params))


@pytest.mark.parametrize("opt", [AdamW(), SGD(lr=1e-2, momentum=0.9)], ids=["AdamW", "SGD"])
def test_update_checks_grads_and_state_shape_dtype_and_type(opt):
    """Grads and state buffers must match their parameter's shape and dtype (torch.optim's invariant):
    a mismatch is a ValueError naming the entry, never a broadcast error or a silently promoted parameter."""
    params = {"w": torch.ones(3, 2)}
    slot = opt.slots()[0]
    with pytest.raises(ValueError, match=r"grads\['w'\]: expected shape \(3, 2\) torch.float32 .*got shape \(2, 2\)"):
        opt.update(params, {"w": torch.ones(2, 2)}, opt.init(params))
    with pytest.raises(ValueError, match=r"grads\['w'\]: .* got shape \(3, 2\) torch.float64"):
        opt.update(params, {"w": torch.ones(3, 2, dtype=torch.float64)}, opt.init(params))
    state64 = opt.init({"w": torch.ones(3, 2, dtype=torch.float64)})
    with pytest.raises(ValueError, match=rf"state\['{slot}'\]\['w'\]: .* got shape \(3, 2\) torch.float64"):
        opt.update(params, {"w": torch.ones(3, 2)}, state64)
    with pytest.raises(TypeError, match=rf"state\['{slot}'\]: expected a dict of tensors"):
        opt.update(params, {"w": torch.ones(3, 2)}, {**opt.init(params), slot: torch.zeros(3, 2)})
    with pytest.raises(TypeError, match=r"state\['step'\]: expected a 0-d tensor"):
        opt.update(params, {"w": torch.ones(3, 2)}, {**opt.init(params), "step": 0})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kwargs", [dict(momentum=0.9, nesterov=True, weight_decay=0.01),
                                    dict(momentum=0.9, dampening=0.3, weight_decay=0.01), {}],
                         ids=["nesterov", "dampening", "plain"])
def test_sgd_eager_equals_torch_optim_bit_for_bit(dtype, kwargs):
    """x + c·y as torch.add(x, y, alpha=c), as torch.optim.SGD computes it (two roundings were 1 ulp off)."""
    torch.manual_seed(3)
    w = torch.randn(64, dtype=dtype)
    ref = w.clone().requires_grad_()
    topt = torch.optim.SGD([ref], lr=0.1, **kwargs)
    opt = SGD(lr=0.1, **kwargs)
    params, state = {"w": w}, opt.init({"w": w})
    for _ in range(5):
        g = torch.randn(64, dtype=dtype)
        ref.grad = g.clone()
        topt.step()
        params, state = opt.update(params, {"w": g}, state)
    assert torch.equal(params["w"], ref.detach())


@pytest.mark.parametrize("opt", [AdamW(), SGD(lr=1e-2, momentum=0.9)], ids=["AdamW", "SGD"])
def test_integer_parameters_are_a_type_error(opt):
    """An int64 parameter used to come back from update() as float32."""
    params = {"w": torch.ones(3, 2), "n": torch.ones(2, dtype=torch.int64)}
    with pytest.raises(TypeError, match=r"params\['n'\]: expected a floating-point parameter .* got torch.int64"):
        opt.init(params)
    state = opt.init({"w": params["w"]})
    with pytest.raises(TypeError, match=r"params\['n'\]: expected a floating-point parameter"):
        opt.update(params, {k: torch.ones_like(v) for k, v in params.items()}, {**state})
