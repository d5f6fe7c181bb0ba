"""Copies in the lowered one-device Llama train step (the ``benchmarks/train.py`` program, small).

The step is built as the benchmark builds it on one GPU: two Llama-2-shaped layers (as many KV
heads as query heads), MSE loss, AdamW, fused attention forward / backward, one device, params
and optimizer state donated; ``merge_dots=False`` because at the benchmark's sizes no group of
dots is under merge-dots' size limit. Each test counts the kernel thunks of the lowered program
(the donated variant the step runs) that only move bytes: a layout op (transpose, reshape,
broadcast, slice) that is not a view, a ``copy``, a ``concatenate`` or a ``dynamic-update-slice``.
The numerics test runs the same step against PyTorch eager + ``torch.optim.AdamW`` step by step.
"""

import pytest
import torch
import torch.nn.functional as F

from spmd import CompileOptions, Mesh
from spmd.models.llama import llama_layers
from spmd.runtime.thunks import KernelThunk
from spmd.train import AdamW, make_train_step

LAYERS, BATCH, SEQ, HIDDEN = 2, 2, 16, 64
COPY_OPCODES = frozenset({"transpose", "reshape", "broadcast", "slice", "copy", "concatenate",
                          "dynamic-update-slice"})


def _model(dtype=torch.float32):
    return llama_layers("llama2-7b", LAYERS, small=True, num_kv_heads=4, dtype=dtype, seed=0).train().requires_grad_()


def _loss_fn(apply, batch):
    return F.mse_loss(apply(batch["x"]), batch["y"])


def _batches(n, dtype=torch.float32, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(dtype),
             "y": torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(dtype)} for _ in range(n)]


def _step(dtype=torch.float32, lr=1e-4):
    mesh = Mesh.create(("dp",), devices="cpu:1")
    return make_train_step(_model(dtype), mesh, None, _loss_fn, optimizer=AdamW(lr=lr, weight_decay=0.1),
                           options=CompileOptions(merge_dots=False))


@pytest.fixture(scope="module")
def stepped():
    """The bfloat16 step after one call (compiled, donated state)."""
    ts = _step(torch.bfloat16)
    ts.step(_batches(1, torch.bfloat16)[0])
    return ts


@pytest.fixture(scope="module")
def lowered(stepped):
    """(entry instructions by name, the donated program's kernel thunks that are not views)."""
    ex = stepped.compiled.executable
    program = max(ex._variants.items(), key=lambda kv: len(kv[0]))[1][0]  # the variant a donating step runs
    assert program.donated_params
    insts = {i.name: i for i in ex.module.entry.instructions}
    kernels = [t for t in program.thunks if isinstance(t, KernelThunk) and t.out not in program.view_slots]
    return insts, kernels


def _copies(insts, kernels, opcodes=COPY_OPCODES):
    return [insts[t.name] for t in kernels if t.name in insts and insts[t.name].opcode in opcodes]


def test_attention_operands_are_not_copied(lowered):
    """q, k, v and dout reach the fused attention kernels as views (transposes of the projections'
    outputs); before, each transposed operand was copied to a contiguous buffer first."""
    insts, kernels = lowered
    copied = {i.name for i in _copies(insts, kernels)}
    calls = [i for i in insts.values() if i.opcode == "custom-call"
             and i.attrs.get("custom_call_target") in ("attention-forward", "attention-backward")]
    assert len(calls) == 2 * LAYERS
    fed = [(c.name, o.name) for c in calls for o in c.operands if o.name in copied]
    assert fed == []


def test_rotary_backward_updates_are_fused_pads(lowered):
    """rotate_half's backward (``slice_scatter`` into zeros, for q and k) runs inside the rotary
    backward fusions as pads; before, each of the 4 updates per layer copied a zero buffer and
    wrote half of it in place (two copy kernels each)."""
    insts, kernels = lowered
    assert [i.name for i in _copies(insts, kernels, {"dynamic-update-slice", "pad"})] == []
    fused_pads = [j for i in insts.values() if i.opcode == "fusion" for j in i.attrs["calls"].instructions
                  if j.opcode == "pad"]
    assert len(fused_pads) == 4 * LAYERS


def test_rotate_half_runs_inside_the_rotary_fusions(lowered):
    """The forward's rotate_half (``cat(-x2, x1)`` for q and k) is fused into the rotary embedding;
    before, each was a concatenate kernel after a negate kernel (2 of each per layer)."""
    insts, kernels = lowered
    alone = [insts[t.name].opcode for t in kernels if t.name in insts
             and insts[t.name].opcode in ("concatenate", "negate")]
    assert alone == []
    fused = [j for i in insts.values() if i.opcode == "fusion" for j in i.attrs["calls"].instructions
             if j.opcode == "concatenate"]
    assert len(fused) == 2 * LAYERS


def _source(inst):
    """The first instruction below ``inst`` that is not a layout op."""
    while inst.opcode in ("reshape", "transpose", "slice", "broadcast"):
        inst = inst.operands[0]
    return inst


def test_attention_results_reach_the_projections_as_views(lowered):
    """No layout op runs as a copy kernel: the attention output (slab 0 of ``attention-forward``'s
    sequence-major packed result) and dv (slab 2 of ``attention-backward``'s) are read by the o_proj
    and v_proj GEMMs (forward, weight and input gradients) as [B*S, H*D] views. Before, the packed
    results were head-major and both were copied to that layout (2 copy kernels per layer)."""
    insts, kernels = lowered
    assert _copies(insts, kernels) == []
    run = {t.name for t in kernels}
    fed = sorted((_source(o).attrs.get("custom_call_target"), o.name in run)  # (call, operand runs a kernel)
                 for d in insts.values() if d.opcode == "dot" for o in d.operands if _source(o).opcode == "custom-call")
    assert fed == [("attention-backward", False)] * 2 * LAYERS + [("attention-forward", False)] * 2 * LAYERS


def test_one_transposing_copy_of_an_attention_sized_value_per_layer(stepped):
    """Copies (``copy_``: copy kernels and the attention kernels' packing) of [B, S, H*D]-sized
    values whose source and destination strides differ, i.e. that reorder memory, in one step:
    one per layer, the CPU flash kernel's [B, H, S, D] output into the sequence-major output slab
    (CUDA's kernels write [B, S, H, D]: a memory copy there). Before: six per layer (that one,
    dq, dk and dv into the head-major packed gradients, and the output and dv copied to
    [B*S, H*D] for the projections)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    found = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if (func is torch.ops.aten.copy_.default and args[0].numel() == BATCH * SEQ * HIDDEN
                    and args[0].stride() != args[1].stride()):
                found.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    with Copies():
        stepped.step(_batches(2, torch.bfloat16)[1])
    assert len(found) == LAYERS, found


def test_silu_is_recomputed_inside_the_gated_products(lowered):
    """SwiGLU's silu(gate) has no kernel of its own: the forward's silu(gate) * up and the backward's
    dout * silu(gate) fusions recompute it (before: one silu kernel and two lone multiplies per layer)."""
    insts, kernels = lowered
    alone = [insts[t.name] for t in kernels if t.name in insts]
    assert [i.name for i in alone if i.opcode == "custom-call" and i.attrs.get("custom_call_target") == "silu"] == []
    assert [i.name for i in alone if i.opcode == "multiply"] == []


def test_residual_adds_of_projections_run_as_addmm(lowered):
    """The residual adds after o_proj and down_proj and the sum of the k / v input gradients read
    their dot through a [B*S, D] -> [B, S, D] view and run inside it as addmm; the residual-gradient
    sum at a layer boundary is the root of the norm backward's fusion. No add runs alone (before:
    5 in this program)."""
    insts, kernels = lowered
    adds = [insts[t.name] for t in kernels if t.name in insts and insts[t.name].opcode == "add"
            and insts[t.name].shape.rank > 0 and not any(o.opcode == "reshape" for o in insts[t.name].operands)]
    fused = [insts[t.name] for t in kernels if t.name in insts and insts[t.name].opcode == "add"
             and any(o.opcode == "reshape" and o.operands[0].opcode == "dot" for o in insts[t.name].operands)]
    assert adds == []
    assert all(len(t.ins) == 3 for t in kernels if t.name in {a.name for a in fused})  # C, A, B
    # forward: after o_proj and down_proj of each layer (the last down_proj's too: the loss and its
    # gradient read its bfloat16 result and widen it themselves; before, that add joined the loss
    # fusion, which stored a float32 copy of it); backward: the k / v input-gradient sum of every
    # layer but the first (no dx there)
    assert len(fused) == 2 * LAYERS + (LAYERS - 1)


def test_loss_gradient_is_converted_inside_its_fusion(lowered):
    """The bfloat16 gradient of the loss (read by the last layer's dots and by the residual-gradient
    sum) is the result of the loss-gradient fusion; before, the residual sum's fusion recomputed
    it and a convert kernel of its own made it for the dots. No convert runs alone: the batch
    target's widening to float32 is recomputed in the loss and loss-gradient fusions (before: a
    convert kernel of its own, whose float32 result was stored and read by both)."""
    insts, kernels = lowered
    converts = [insts[t.name] for t in kernels if t.name in insts and insts[t.name].opcode == "convert"]
    assert converts == []


def _results(inst):
    """The arrays a kernel of ``inst`` writes (a multi-output fusion's tuple elements)."""
    if inst.opcode == "fusion":
        root = inst.attrs["calls"].root
        return list(root.operands) if root.opcode == "tuple" else [root]
    return [] if inst.shape.is_tuple else [inst]


def test_loss_reads_the_16_bit_prediction_and_target(lowered):
    """The loss and its gradient are the two fusions that read the batch target, in bfloat16, and
    they write only the scalar loss and the bfloat16 gradient (before: a convert kernel wrote the
    target in float32, and the gradient's fusion also wrote the prediction in float32, each read
    by both)."""
    insts, kernels = lowered
    readers = [i for i in insts.values() if any(o.name == "batch.y" for o in i.operands)]
    assert [i.opcode for i in readers] == ["fusion", "fusion"]
    written = sorted((r.shape.dtype, r.shape.dims) for i in readers for r in _results(i))
    assert written == [("bf16", (BATCH, SEQ, HIDDEN)), ("f32", ())]


def test_one_device_step_matches_torch_optim():
    """float32: per-step loss within 1e-5 relative and final parameters within 1e-4 of PyTorch
    eager with ``torch.optim.AdamW`` (same init, same batches)."""
    steps, lr = 6, 1e-2
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1, foreach=False)
    ts = _step(lr=lr)
    for k, b in enumerate(_batches(steps)):
        opt.zero_grad()
        want = _loss_fn(ref, b)
        want.backward()
        opt.step()
        got = float(ts.step(b)["loss"])
        want = float(want.detach())
        assert abs(got - want) <= 1e-5 * abs(want), (k, got, want)
    sd = ts.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd[f"param.{name}"], p.detach(), rtol=0, atol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_gpu_step_matches_torch_optim(dtype):
    """The same step on one GPU (the fused CUDA attention kernels reading transposed operands and
    the packed output in place, Inductor fusions with pads, concatenates and transposed results,
    addmm through views, CUDA graphs): per-step losses against eager float32 + torch.optim.AdamW
    (float32 within 1e-4 relative, bfloat16 compute within 5e-2)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    steps, lr = 4, 1e-2
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1, foreach=False)
    mesh = Mesh.create(("dp",), devices="cuda:1")
    ts = make_train_step(_model(dtype).cuda(), mesh, None, _loss_fn, optimizer=AdamW(lr=lr, weight_decay=0.1),
                         options=CompileOptions(merge_dots=False))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for k, b in enumerate(_batches(steps)):
        opt.zero_grad()
        want = _loss_fn(ref, b)
        want.backward()
        opt.step()
        got = float(ts.step({n: t.to("cuda", dtype) for n, t in b.items()})["loss"])
        want = float(want.detach())
        assert abs(got - want) <= tol * abs(want), (k, got, want)
