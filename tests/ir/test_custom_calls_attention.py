"""attention-forward / attention-backward kernels against PyTorch eager autograd (float64 reference).

Also the kernel choice: CPU takes ATen's flash kernel for CPU where it applies; the math kernel
gives the same numbers. The GPU test checks that CUDA picks a fused kernel and matches.
"""

import pytest
import torch
import torch.nn.functional as F

from spmd.ir import custom_calls_attention as cca
from spmd.ir.custom_calls import get_custom_call
from spmd.ir.custom_calls_attention import _as4d, _bias, _choose, backward_dims, forward_dims


def _reference(q, k, v, mask, causal, scale, do):
    """(out, dq, dk, dv) by eager SDPA in float64."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=m, is_causal=causal, scale=scale)
    return (out, *torch.autograd.grad(out, (qd, kd, vd), do.double()))


def _run(q, k, v, mask, causal, scale, do, backend="auto"):
    """(out, dq, dk, dv) through the two custom-call kernels."""
    config = {"is_causal": causal, "has_mask": mask is not None, "backend": backend}
    if scale is not None:
        config["scale"] = scale
    masks = [] if mask is None else [mask.expand(*q.shape[:-1], k.shape[-2])]
    packed = get_custom_call("attention-forward").fn([q, k, v, *masks], config)
    assert packed.shape == forward_dims(q.shape, k.shape, v.shape, q.dtype) and packed.dtype == q.dtype
    grads = get_custom_call("attention-backward").fn([q, k, v, packed, do, *masks], config)
    assert grads.shape == backward_dims(q.shape, k.shape, v.shape)
    return (_part(packed, 0, *v.shape[:-2], q.shape[-2], v.shape[-1]), *(
        _part(grads, i, *t.shape) for i, t in enumerate((q, k, v))))


def _part(packed, i, *dims):
    """Slab ``i`` of a packed result (``[n, *lead[:-1], S, lead[-1], E]``) cut to ``dims`` = (*lead, s, e)."""
    s, e, rank = dims[-2], dims[-1], len(dims)
    slab = packed[i]
    if rank == 2:
        return slab[:s, :e]
    return slab[..., :s, :, :e].movedim(-3, -2)


CASES = [  # (q shape, Sk, Dv, causal, mask kind, scale)
    ((2, 3, 5, 4), 7, 4, False, None, None),
    ((2, 3, 6, 4), 6, 4, True, None, None),
    ((2, 3, 5, 4), 7, 4, False, "bool", None),
    ((2, 3, 5, 4), 7, 4, False, "float", 0.3),
    ((3, 5, 8), 4, 6, False, None, None),  # Dv != D: math kernel
    ((2, 2, 3, 5, 4), 5, 4, False, "bool", None),  # rank 5
    ((2, 2, 3, 5, 4), 5, 4, True, None, 0.7),
    ((5, 4), 7, 4, False, "bool", None),  # rank 2: slabs [S, E]
    ((3, 5, 4), 7, 4, True, None, None),  # rank 3: slabs [S, N, E]
]


def _inputs(shape, sk, dv, mask_kind, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape, generator=g).to(dtype)
    k = torch.randn(*shape[:-2], sk, shape[-1], generator=g).to(dtype)
    v = torch.randn(*shape[:-2], sk, dv, generator=g).to(dtype)
    do = torch.randn(*shape[:-1], dv, generator=g).to(dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(shape[-2], sk, generator=g) > 0.3
        mask[:, 0] = True  # every row attends somewhere
    elif mask_kind == "float":
        mask = torch.randn(shape[-2], sk, generator=g).to(dtype)
    return q, k, v, mask, do


@pytest.mark.parametrize("backend", ["auto", "math"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_eager_autograd(case, dtype, tol, backend):
    shape, sk, dv, causal, mask_kind, scale = CASES[case]
    q, k, v, mask, do = _inputs(shape, sk, dv, mask_kind, dtype)
    want = _reference(q, k, v, mask, causal, scale, do)
    got = _run(q, k, v, mask, causal, scale, do, backend)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol, msg=name)


def test_bfloat16_within_rounding():
    q, k, v, mask, do = _inputs((2, 4, 16, 16), 16, 16, None, torch.bfloat16)
    want = _reference(q, k, v, None, True, None, do)
    for backend in ("auto", "math"):
        got = _run(q, k, v, None, True, None, do, backend)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            torch.testing.assert_close(a.double(), b, rtol=3e-2, atol=3e-2, msg=f"{backend} {name}")


def test_value_head_dim_narrower_than_the_statistics():
    """bfloat16 with Dv = 1: the slabs are 2 columns wide (one float32 log-sum-exp), the output
    slab's second column zero; forward and gradients match the float64 reference."""
    q, k, v, _, do = _inputs((2, 3, 5, 4), 6, 1, None, torch.bfloat16)
    want = _reference(q, k, v, None, False, None, do)
    got = _run(q, k, v, None, False, None, do)
    packed = get_custom_call("attention-forward").fn([q, k, v], {})
    assert packed.shape == (2, 2, 5, 3, 2) and torch.equal(packed[0, ..., 1:], torch.zeros_like(packed[0, ..., 1:]))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=3e-2, atol=3e-2, msg=name)


def _kind(q, k, v, mask=None, causal=False, backend="auto"):
    q4, k4, v4 = (_as4d(t).contiguous() for t in (q, k, v))
    return _choose(q4, k4, v4, _bias(mask, q4, k4, q.shape[:-2]), causal, 0.5, {"backend": backend})


def test_cpu_picks_the_flash_kernel_for_cpu():
    q, k, v, mask, _ = _inputs((2, 3, 5, 4), 7, 4, "bool", torch.float32)
    assert _kind(q, k, v) == "flash-cpu"
    assert _kind(q, k, v, mask) == "flash-cpu"
    assert _kind(q, k, v, causal=True) == "flash-cpu"
    assert _kind(q.double(), k.double(), v.double()) == "flash-cpu"
    assert _kind(q, k, v, backend="math") == "math"
    q, k, v, _, _ = _inputs((3, 5, 8), 4, 6, None, torch.float32)
    assert _kind(q, k, v) == "math"  # head dims differ: the flash kernel needs D == Dv


def test_unknown_backend_is_a_value_error():
    q, k, v, _, _ = _inputs((1, 1, 2, 4), 2, 4, None, torch.float32)
    with pytest.raises(ValueError, match="backend"):
        get_custom_call("attention-forward").fn([q, k, v], {"backend": "triton"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", [None, "float"])
def test_cuda_picks_a_fused_kernel_and_matches(dtype, mask_kind):
    """Llama-like head shapes: a fused CUDA kernel (flash / efficient / cuDNN) is chosen and its
    output and gradients match the float64 reference as closely as the math kernel's do."""
    q, k, v, mask, do = (None if t is None else t.cuda() for t in _inputs((2, 8, 256, 64), 256, 64, mask_kind, dtype))
    causal = mask is None
    kind = _kind(q, k, v, mask, causal)
    assert kind in ("flash", "efficient", "cudnn"), kind
    want = _reference(q, k, v, mask, causal, None, do)
    got = _run(q, k, v, mask, causal, None, do)
    ref = _run(q, k, v, mask, causal, None, do, backend="math")
    for name, a, b, m in zip(("out", "dq", "dk", "dv"), got, want, ref, strict=True):
        err, err_math = (a.double() - b).abs().max().item(), (m.double() - b).abs().max().item()
        assert err <= 4 * err_math + 1e-2, (name, kind, err, err_math)


def test_results_written_into_the_given_buffer():
    """The runtime passes the result's buffer: contiguous ones are written in place, others copied into."""
    q, k, v, _, do = _inputs((2, 3, 5, 4), 5, 4, None, torch.float32)
    fwd, bwd = get_custom_call("attention-forward"), get_custom_call("attention-backward")
    assert fwd.writes_out and bwd.writes_out
    packed = fwd.fn([q, k, v], {})
    width = packed.shape[-1]
    strided = torch.full((*packed.shape[:-1], width + 4), float("nan"))[..., :width]
    w = cca.stat_width(q.dtype)
    for buf in (torch.full_like(packed, float("nan")), strided):
        assert fwd.fn([q, k, v], {}, buf) is buf
        # slab 0 whole, slab 1's statistics columns (the rest of slab 1 is unspecified: never read)
        assert torch.equal(buf[0], packed[0]) and torch.equal(buf[1, ..., :w], packed[1, ..., :w])
    grads = bwd.fn([q, k, v, packed, do], {})
    assert torch.equal(bwd.fn([q, k, v, strided.copy_(packed), do], {}), grads)  # a strided packed operand
    buf = torch.full_like(grads, float("nan"))
    assert bwd.fn([q, k, v, packed, do], {}, buf) is buf and torch.equal(buf, grads)


def test_verify_checks_the_result_shapes():
    from spmd.ir.text import parse_module
    from spmd.ir.verify import VerifyError, verify_module

    text = """HloModule m

ENTRY %main (q: bf16[2,5,4], k: bf16[2,7,4], v: bf16[2,7,6], dout: bf16[2,5,6]) -> bf16[3,7,2,{w}] {{
  %q = bf16[2,5,4] parameter(0)
  %k = bf16[2,7,4] parameter(1)
  %v = bf16[2,7,6] parameter(2)
  %dout = bf16[2,5,6] parameter(3)
  %fwd = bf16[2,{s},2,6] custom-call(%q, %k, %v), custom_call_target="attention-forward"
  ROOT %bwd = bf16[3,7,2,{w}] custom-call(%q, %k, %v, %fwd, %dout), custom_call_target="attention-backward"
}}
"""
    # slabs [S, H, E]: forward 2 of [Sq, H, Dv]; backward 3 of [max(Sq, Sk), H, max(D, Dv)]
    verify_module(parse_module(text.format(s=5, w=6)))
    with pytest.raises(VerifyError, match="attention-forward: result must be bf16"):
        verify_module(parse_module(text.format(s=7, w=6)))
    with pytest.raises(VerifyError, match="attention-backward: result must be bf16"):
        verify_module(parse_module(text.format(s=5, w=4)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transposed_operands_and_the_saved_output_are_read_in_place(dtype):
    """q, k, v and dout as transposes of [B, S, H, D] projections and the output slab of the packed
    forward result reach the kernels without a copy; the kernels copy nothing of [B, H, S, D] size
    besides packing their results, and the backward's three copies keep the memory order (the
    kernel's [B, S, H, D] gradients into [B, S, H, D] slabs: plain memory copies). Before, the
    packed results were head-major: the gradients' copies transposed, and so did a copy of dv
    and of the output for the projections."""
    from torch.utils._python_dispatch import TorchDispatchMode

    g = torch.Generator().manual_seed(0)
    b, s, h, d = 2, 8, 2, 64
    q, k, v, do = (torch.randn(b, s, h, d, generator=g).to(dtype).transpose(1, 2) for _ in range(4))
    copies = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("clone", "copy_", "contiguous") and args[0].numel() >= b * h * s * d:
                same = func.__name__ == "copy_.default" and args[0].stride() == args[1].stride()
                copies.append((func.__name__, same))
            return func(*args, **(kwargs or {}))

    config = {"is_causal": True, "has_mask": False}
    with Copies():
        packed = get_custom_call("attention-forward").fn([q, k, v], config)
    assert [c for c, _ in copies] == ["copy_.default"]  # the output into slab 0
    copies.clear()
    with Copies():
        grads = get_custom_call("attention-backward").fn([q, k, v, packed, do], config)
    assert copies == [("copy_.default", True)] * 3  # dq, dk, dv into their slabs, in memory order
    assert packed.shape == (2, b, s, h, d) and grads.shape == (3, b, s, h, d)
    out, dq, dk, dv = _reference(q, k, v, None, True, None, do)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(packed[0].transpose(1, 2).double(), out, rtol=tol, atol=tol)
    for want, part in zip((dq, dk, dv), grads, strict=True):
        torch.testing.assert_close(part.transpose(1, 2).double(), want, rtol=tol, atol=tol)
