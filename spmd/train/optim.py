"""Optimizers as pure functions on tensors, with ``torch.optim``'s update formulas.

Each optimizer is a frozen dataclass of hyper-parameters with two methods:

    state = opt.init(params)                             # {"step": 0-d f32, per-param buffers}
    params, state = opt.update(params, grads, state)     # new dicts; nothing is mutated

``params`` and ``grads`` are dicts ``{name: tensor}`` with the same keys. The functions use only
traceable tensor ops, so they run inside a function given to ``spmd.jit`` (the optimizer state
then lives on the mesh as ``ShardedArray``s, sharded like its parameter) and eagerly on tensors
alike. The formulas are those of the single-tensor (``foreach=False``) paths of
``torch.optim.SGD``, ``torch.optim.Adam`` and ``torch.optim.AdamW`` (PyTorch documentation,
https://pytorch.org/docs/stable/optim.html), including their first-step behaviour; the bias
corrections of Adam are computed in float64, as torch.optim computes them in Python floats.

``clip_grad_norm`` follows ``torch.nn.utils.clip_grad_norm_`` (norm of the per-tensor norms,
clip coefficient ``max_norm / (total_norm + 1e-6)`` clamped to at most 1).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "clip_grad_norm", "check_hyper"]


def check_hyper(owner: str, name: str, value, *, low: float = 0.0, high: float = math.inf,
                open_high: bool = False) -> None:
    """TypeError unless ``value`` is a real number (not a bool); ValueError unless in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a number, got {type(value).__name__} {value!r}")
    bad_high = value >= high if open_high else value > high
    if not math.isfinite(value) and high != math.inf or value < low or bad_high or math.isnan(value):
        bracket = ")" if open_high else "]"
        raise ValueError(f"{owner}: {name} must be in [{low}, {high}{bracket}, got {value!r}")


class Optimizer:
    """Base of the pure optimizers: ``init(params)`` and ``update(params, grads, state)``."""

    def init(self, params: dict[str, torch.Tensor]) -> dict:
        """The initial state: ``{"step": tensor(0.0)}`` plus one zero buffer per parameter and slot.

        Returns a dict ``{"step": 0-d float32, slot: {name: zeros like the parameter}}``.
        """
        _check_params(params, "params")
        state: dict = {"step": torch.zeros((), dtype=torch.float32)}
        for slot in self.slots():
            state[slot] = {k: torch.zeros_like(v) for k, v in params.items()}
        return state

    def slots(self) -> tuple[str, ...]:
        """Names of the per-parameter state buffers."""
        return ()

    def update(self, params: dict, grads: dict, state: dict) -> tuple[dict, dict]:
        raise NotImplementedError


def _check_params(params, what: str) -> None:
    if not isinstance(params, dict) or not all(isinstance(v, torch.Tensor) for v in params.values()):
        raise TypeError(f"{what}: expected a dict of tensors, got {type(params).__name__}")
    if what == "params":
        for k, p in params.items():
            if not p.dtype.is_floating_point:
                raise TypeError(f"params[{k!r}]: expected a floating-point parameter (as torch.optim), got {p.dtype}")


def _check_update(opt: Optimizer, params: dict, grads: dict, state: dict) -> None:
    _check_params(params, "params")
    _check_params(grads, "grads")
    if set(grads) != set(params):
        raise ValueError(f"grads: expected the keys of params {sorted(params)}, got {sorted(grads)}")
    expected = {"step", *opt.slots()}
    if not isinstance(state, dict) or set(state) != expected:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state: expected keys {sorted(expected)} (from {type(opt).__name__}.init), got {got}")
    for k, p in params.items():
        _check_like(f"grads[{k!r}]", grads[k], p)
    if not isinstance(state["step"], torch.Tensor) or state["step"].dim() != 0:
        raise TypeError(f"state['step']: expected a 0-d tensor (from {type(opt).__name__}.init), got "
                        f"{_describe(state['step'])}")
    for slot in opt.slots():
        if not isinstance(state[slot], dict):
            raise TypeError(f"state[{slot!r}]: expected a dict of tensors keyed like params (from "
                            f"{type(opt).__name__}.init), got {type(state[slot]).__name__}")
        for k, p in params.items():
            _check_like(f"state[{slot!r}][{k!r}]", state[slot].get(k), p)


def _describe(t) -> str:
    return f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_like(what: str, t, p: torch.Tensor) -> None:
    """ValueError unless ``t`` is a tensor with ``p``'s shape and dtype (as torch.optim's grads and state)."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
        raise ValueError(f"{what}: expected shape {tuple(p.shape)} {p.dtype} like its parameter, got {_describe(t)}")


def _bias_correction(beta: float, step: torch.Tensor) -> torch.Tensor:
    """``1 - beta ** step`` in float64 (torch.optim computes it in Python floats)."""
    return 1.0 - torch.pow(torch.tensor(beta, dtype=torch.float64), step.to(torch.float64))


@dataclass(frozen=True)
class SGD(Optimizer):
    """``torch.optim.SGD``: momentum, dampening, Nesterov momentum, L2 weight decay.

    Per parameter p with gradient g (PyTorch docs, torch.optim.SGD):
      g ← g + weight_decay·p;  b ← g at the first step, else momentum·b + (1 − dampening)·g;
      g ← g + momentum·b (nesterov) or b;  p ← p − lr·g.
    Each ``x + c·y`` is ``torch.add(x, y, alpha=c)`` as in torch.optim (one rounding: eagerly the
    result equals torch.optim.SGD bit for bit in every floating dtype).
    Raises TypeError for a non-number hyper-parameter, ValueError for one out of range or
    ``nesterov`` with zero momentum or non-zero dampening (as torch.optim.SGD).
    """

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            check_hyper("SGD", name, getattr(self, name))
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"SGD: nesterov must be True or False, got {self.nesterov!r}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("SGD: nesterov momentum requires a momentum and zero dampening")

    def slots(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum != 0 else ()

    def update(self, params: dict, grads: dict, state: dict) -> tuple[dict, dict]:
        """One SGD step; returns ``(new_params, new_state)``. Shapes and dtypes are kept."""
        _check_update(self, params, grads, state)
        first = state["step"] == 0
        new_params, bufs = {}, {}
        for k, p in params.items():
            d_p = grads[k]
            if self.weight_decay != 0:
                d_p = torch.add(d_p, p, alpha=self.weight_decay)
            if self.momentum != 0:
                later = torch.add(state["momentum_buffer"][k] * self.momentum, d_p, alpha=1 - self.dampening)
                buf = torch.where(first, d_p, later)
                bufs[k] = buf
                d_p = torch.add(d_p, buf, alpha=self.momentum) if self.nesterov else buf
            new_params[k] = torch.add(p, d_p, alpha=-self.lr)
        new_state: dict = {"step": state["step"] + 1}
        if self.momentum != 0:
            new_state["momentum_buffer"] = bufs
        return new_params, new_state


@dataclass(frozen=True)
class Adam(Optimizer):
    """``torch.optim.Adam`` (Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2014).

    Per parameter (PyTorch docs, torch.optim.Adam, amsgrad=False): g ← g + weight_decay·p (L2);
    m ← lerp(m, g, 1 − β1); v ← β2·v + (1 − β2)·g²; p ← p − lr/(1 − β1ᵗ) · m / (√v/√(1 − β2ᵗ) + eps).
    Raises TypeError for a non-number hyper-parameter, ValueError for one out of range.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    decoupled = False

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("lr", "eps", "weight_decay"):
            check_hyper(owner, name, getattr(self, name))
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise TypeError(f"{owner}: betas must be a pair of numbers, got {self.betas!r}")
        for i, b in enumerate(self.betas):
            check_hyper(owner, f"betas[{i}]", b, high=1.0, open_high=True)

    def slots(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def update(self, params: dict, grads: dict, state: dict) -> tuple[dict, dict]:
        """One step; returns ``(new_params, new_state)``. Shapes and dtypes are kept."""
        _check_update(self, params, grads, state)
        beta1, beta2 = self.betas
        step = state["step"] + 1
        step_size = self.lr / _bias_correction(beta1, step)  # float64, as torch.optim's Python floats
        bc2_sqrt = torch.sqrt(_bias_correction(beta2, step))
        new_params, m_new, v_new = {}, {}, {}
        for k, p in params.items():
            g = grads[k]
            if self.decoupled:
                p = p * (1 - self.lr * self.weight_decay)
            elif self.weight_decay != 0:
                g = g + self.weight_decay * p
            m = state["exp_avg"][k]
            m = m + (1 - beta1) * (g - m)  # torch.lerp with weight < 0.5
            v = state["exp_avg_sq"][k] * beta2 + (1 - beta2) * (g * g)
            denom = torch.sqrt(v) / _scalar_as(bc2_sqrt, v.dtype) + self.eps
            new_params[k] = p - _scalar_as(step_size, p.dtype) * (m / denom)
            m_new[k], v_new[k] = m, v
        return new_params, {"step": step, "exp_avg": m_new, "exp_avg_sq": v_new}


@dataclass(frozen=True)
class AdamW(Adam):
    """``torch.optim.AdamW`` (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019).

    As ``Adam`` but the weight decay is decoupled: p ← p·(1 − lr·weight_decay) before the Adam
    step (PyTorch docs, torch.optim.AdamW; default weight_decay 1e-2).
    """

    weight_decay: float = 1e-2

    decoupled = True


def _scalar_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 0-d hyper-parameter ``x`` as the scalar torch.optim's kernels use for a ``dtype`` tensor.

    ATen reads a Python-float scalar at the tensor's op-math precision: float64 for float64
    tensors, float32 for float32 and the 16-bit types (then rounded to the tensor's dtype here,
    as the traced elementwise ops compute in it).
    """
    return x.to(dtype) if dtype == torch.float64 else x.to(torch.float32).to(dtype)


def clip_grad_norm(grads: dict, max_norm: float) -> tuple[dict, torch.Tensor]:
    """Scale ``grads`` so their global 2-norm is at most ``max_norm``; returns ``(grads, total_norm)``.

    As ``torch.nn.utils.clip_grad_norm_(norm_type=2)``: total = ‖(‖g₁‖, ‖g₂‖, ...)‖₂,
    coef = min(max_norm / (total + 1e-6), 1), every g ← g·coef. ``total_norm`` is a 0-d tensor
    (the norm before clipping). Raises TypeError for a non-number ``max_norm``, ValueError for a
    negative one.
    """
    check_hyper("clip_grad_norm", "max_norm", max_norm)
    _check_params(grads, "grads")
    if not grads:
        return {}, torch.zeros(())
    norms = [torch.linalg.vector_norm(g, 2) for g in grads.values()]
    total = torch.linalg.vector_norm(torch.stack(norms), 2)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return {k: g * coef for k, g in grads.items()}, total
