"""make_train_step against the same model trained by PyTorch eager + torch.optim on one device.

Tiny GPT layer (hidden 16, 4 heads, FFN 32), float32, 20 steps, same init and batches: per-step
loss within 1e-5 relative, final parameters within 1e-4, on cpu:1/2/4/8 meshes for data
parallel, FSDP, tensor parallel, tensor + sequence parallel and dp x tp.

AdamW uses eps=1e-4 here: the key projection's bias has a gradient that is exactly zero in
exact arithmetic (softmax is shift-invariant), so both runs see rounding noise there and
Adam's m / sqrt(v) turns any noise into steps of size lr; a larger eps keeps that parameter
comparable without changing the others' updates materially.
"""

import pytest
import torch
import torch.nn.functional as F

from spmd import Mesh
from spmd.models.gpt import gpt3_layers
from spmd.models.plans import gpt_plan
from spmd.train import SGD, AdamW, make_train_step

STEPS = 20


def _model(seed=0):
    torch.manual_seed(seed)
    return gpt3_layers(1, small=True, hidden_size=16, num_heads=4, ffn_size=32, seed=seed).train().requires_grad_()


def _loss_fn(apply, batch):
    return F.mse_loss(apply(batch["x"]), batch["y"])


def _batches(n, batch, seq, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(batch, seq, 16, generator=g), "y": torch.randn(batch, seq, 16, generator=g)}
            for _ in range(n)]


def _reference(batches, opt_factory, clip):
    ref = _model()
    opt = opt_factory(ref.parameters())
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = _loss_fn(ref, b)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: p.detach() for k, p in ref.named_parameters()}


def _check(mesh, optimizer, opt_factory, *, plan=None, fsdp=False, clip=1.0, batch=4, seq=8):
    batches = _batches(STEPS, batch, seq)
    want_losses, want_params = _reference(batches, opt_factory, clip)
    ts = make_train_step(_model(), mesh, plan, _loss_fn, optimizer=optimizer, fsdp=fsdp, clip_grad_norm=clip)
    for k, (b, want) in enumerate(zip(batches, want_losses)):
        got = float(ts.step(b)["loss"])
        assert abs(got - want) <= 1e-5 * abs(want), (k, got, want)
    sd = ts.state_dict()
    for name, want in want_params.items():
        torch.testing.assert_close(sd[f"param.{name}"], want, rtol=0, atol=1e-4, msg=name)
    return ts


def _adamw():
    return AdamW(lr=1e-2, weight_decay=0.1, eps=1e-4), \
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-4, foreach=False)


@pytest.mark.parametrize("n", [1, 8])
def test_data_parallel(n):
    ts = _check(Mesh.create(("dp",), devices=f"cpu:{n}"), *_adamw(), batch=8)
    text = ts.lowered.as_text("spmd-partition")
    assert ("all-reduce" in text) == (n > 1)


def test_data_parallel_uneven_batch_sgd_nesterov():
    opt = SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    factory = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    _check(Mesh.create(("dp",), devices="cpu:4"), opt, factory, batch=6, clip=None)


@pytest.mark.parametrize("n", [2, 4])
def test_fsdp(n):
    ts = _check(Mesh.create(("dp",), devices=f"cpu:{n}"), *_adamw(), fsdp=True)
    assert any("dp" in str(s) for s in ts.param_specs.values())
    assert tuple(ts.params["layers.0.mlp.fc_in.weight"].sharding.spec)[0] == "dp"
    text = ts.lowered.as_text("spmd-partition")
    assert "all-gather" in text


def test_tensor_parallel():
    _check(Mesh.create(("tp",), devices="cpu:2"), *_adamw(), plan=gpt_plan())


def test_tensor_and_sequence_parallel():
    _check(Mesh.create(("tp",), devices="cpu:4"), *_adamw(), plan=gpt_plan(sequence_parallel=True))


def test_dp_times_tp():
    _check(Mesh.create({"dp": 2, "tp": 4}, devices="cpu:8"), *_adamw(), plan=gpt_plan(), batch=4)


def test_llama_tensor_and_sequence_parallel_sgd():
    """Llama layer (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) under llama_plan with SP."""
    from spmd.models.llama import llama_layers
    from spmd.models.plans import llama_plan

    def model():
        return llama_layers("llama2-7b", 1, small=True, seed=0).train().requires_grad_()

    g = torch.Generator().manual_seed(2)
    batches = [{"x": torch.randn(2, 8, 64, generator=g), "y": torch.randn(2, 8, 64, generator=g)} for _ in range(STEPS)]
    ref = model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ts = make_train_step(model(), Mesh.create(("tp",), devices="cpu:2"), llama_plan(sequence_parallel=True), _loss_fn,
                         optimizer=SGD(lr=0.05, momentum=0.9))
    for k, b in enumerate(batches):
        opt.zero_grad()
        want = _loss_fn(ref, b)
        want.backward()
        opt.step()
        got = float(ts.step(b)["loss"])
        assert abs(got - float(want.detach())) <= 1e-5 * float(want.detach()), k
    sd = ts.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd[f"param.{name}"], p.detach(), rtol=0, atol=1e-4, msg=name)


def test_collectives_of_data_parallel_and_fsdp():
    """DP all-reduces the gradients; FSDP all-gathers weights and reduce-scatters gradients (shardings alone)."""
    from spmd.parallelize import summarize_collectives

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    loss = lambda apply, b: F.mse_loss(apply(b["x"]), b["y"])
    batch = {"x": torch.randn(8, 16), "y": torch.randn(8, 16)}
    kinds = {}
    for fsdp in (False, True):
        ts = make_train_step(model, Mesh.create(("dp",), devices="cpu:4"), None, loss, optimizer=SGD(lr=0.1), fsdp=fsdp)
        ts.step(batch)
        kinds[fsdp] = {s.opcode: s for s in summarize_collectives(ts.lowered.as_text("spmd-partition"))}
    assert set(kinds[False]) == {"all-reduce"} and kinds[False]["all-reduce"].count == 5  # 4 gradients + loss
    assert {"all-gather", "reduce-scatter"} <= set(kinds[True])
    assert kinds[True]["all-reduce"].bytes_per_device < 64  # only the scalar loss is all-reduced


def test_uneven_batch_and_sequence_with_fsdp_tp_and_sp():
    """Batch 3 over dp=2 and sequence 6 over tp=2 (with SP), parameters also FSDP-sharded over dp."""
    _check(Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4"), *_adamw(), plan=gpt_plan(sequence_parallel=True),
           fsdp=True, batch=3, seq=6)


def test_bf16_mixed_precision_tracks_the_float32_run():
    """bf16 forward/backward with float32 master weights and AdamW state: losses within 2% of float32."""
    batches = _batches(10, 4, 8)
    mesh = Mesh.create(("dp",), devices="cpu:2")
    runs = {}
    for dtype in (None, torch.bfloat16):
        ts = make_train_step(_model(), mesh, None, _loss_fn, optimizer=AdamW(lr=1e-2, eps=1e-4), compute_dtype=dtype)
        runs[dtype] = [float(ts.step(b)["loss"]) for b in batches]
        assert all(v.dtype == torch.float32 for v in ts.state_dict().values())
    for got, want in zip(runs[torch.bfloat16], runs[None]):
        assert abs(got - want) <= 0.02 * want, (got, want)
    assert runs[torch.bfloat16] != runs[None]  # it really computed in bf16


def test_unfetched_metrics_stay_on_the_mesh_and_equal_the_fetched_ones():
    """``fetch=False`` returns the metrics as ShardedArrays (no host wait); the run is unchanged."""
    from spmd import ShardedArray

    batches = _batches(3, 4, 8)
    opt, _ = _adamw()
    mesh = Mesh.create(("dp",), devices="cpu:2")
    a = make_train_step(_model(), mesh, None, _loss_fn, optimizer=opt)
    b = make_train_step(_model(), mesh, None, _loss_fn, optimizer=opt)
    for batch in batches:
        fetched = a.step(batch)
        lazy = b.step(batch, fetch=False)
        assert isinstance(lazy["loss"], ShardedArray) and not isinstance(fetched["loss"], ShardedArray)
        assert torch.equal(lazy["loss"].to_torch(), fetched["loss"])
    with pytest.raises(TypeError, match="fetch: expected a bool"):
        a.step(batches[0], fetch="no")


def test_steps_from_several_threads_run_one_after_the_other():
    """Each step donates and replaces the shared params and state: concurrent steps from threads used to
    pass an array another thread had donated (DeletedArrayError) or mix two steps' states."""
    import threading

    batch = _batches(1, 4, 8)[0]  # the same batch every step: the order of the steps does not matter
    opt, _ = _adamw()
    mesh = Mesh.create(("dp",), devices="cpu:2")
    seq = make_train_step(_model(), mesh, None, _loss_fn, optimizer=opt)
    par = make_train_step(_model(), mesh, None, _loss_fn, optimizer=opt)
    par.step(batch)  # compile once
    seq.step(batch)
    errors: list = []

    def work():
        try:
            for _ in range(3):
                par.step(batch, fetch=False)
        except Exception as e:  # collected and reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(12):
        seq.step(batch)
    assert not errors, errors
    assert float(par.opt_state["step"].to_torch()) == 13.0
    for k, v in seq.params.items():
        assert torch.equal(par.params[k].to_torch(), v.to_torch()), k


def _tiny_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return make_train_step(model, Mesh.create(("dp",), devices="cpu:2"), None, _loss_fn,
                           optimizer=AdamW(lr=0.1))


def _tiny_batch():
    return {"x": torch.randn(4, 4), "y": torch.randn(4, 2)}


@pytest.mark.parametrize("replace, exc, match", [
    (lambda ts: ts.opt_state.__setitem__("exp_avg", None), TypeError,
     r"opt_state\['exp_avg'\]: expected a dict of ShardedArrays \(one per parameter\), got NoneType"),
    (lambda ts: setattr(ts, "opt_state", []), TypeError, r"opt_state: expected a dict with 'step' and the slots"),
    (lambda ts: setattr(ts, "params", None), TypeError, "params: expected a dict of ShardedArrays, got NoneType"),
    (lambda ts: ts.opt_state.pop("exp_avg_sq"), ValueError,
     r"opt_state: expected the keys \['step', 'exp_avg', 'exp_avg_sq'\], got \['step', 'exp_avg'\]"),
    (lambda ts: ts.opt_state["exp_avg"].pop("0.bias"), ValueError,
     r"opt_state\['exp_avg'\]: expected one entry per parameter; missing \['0.bias'\]"),
])
@pytest.mark.parametrize("steps_before", [0, 1])
def test_replaced_state_structure_is_named_before_anything_runs(replace, exc, match, steps_before):
    ts = _tiny_step()
    for _ in range(steps_before):
        ts.step(_tiny_batch())
    before = {k: v.to_torch() for k, v in ts.params.items()}
    replace(ts)
    with pytest.raises(exc, match=match):
        ts.step(_tiny_batch())
    with pytest.raises(exc, match=match):
        ts.state_dict()
    if isinstance(ts.params, dict):  # nothing was donated: the parameters are alive and unchanged
        assert all(torch.equal(v.to_torch(), before[k]) for k, v in ts.params.items())


def test_load_repairs_a_replaced_state(tmp_path):
    ts = _tiny_step()
    ts.step(_tiny_batch())
    ts.save(tmp_path / "c.safetensors")
    ts.opt_state["exp_avg"] = None
    ts.load(tmp_path / "c.safetensors")
    ts.step(_tiny_batch())


@pytest.mark.parametrize("method", ["save", "load"])
def test_save_and_load_name_a_bad_path(method):
    ts = _tiny_step()
    with pytest.raises(TypeError, match="path: expected a str or os.PathLike checkpoint file, got int 5"):
        getattr(ts, method)(5)
