"""``torch.utils.checkpoint`` inside programs that take gradients (``spmd.frontend.joint``).

A non-reentrant checkpoint (``use_reentrant=False``) installs saved-tensor hooks for its region
and recomputes the region inside the autograd engine when the backward unpacks a saved tensor.
The joint importer's torch-function mode does not see that recomputation, so:

- attention inside the region is left to PyTorch in the forward too (``saved_tensors_hooked``):
  ATen's fused SDPA op then runs in both and its saved tensors match (``spmd.frontend.aten_sdpa_ops``
  converts it); the mode's own replacements would save different tensors ("Recomputed values ...
  have different metadata").
- random ops inside the region (``random_in_checkpoint``) are an error: the compiled program draws
  counter-based random numbers per op (``spmd.frontend.aten_random_ops``), so the recomputation
  would draw different ones than the forward (PyTorch restores its generator's state for it) and
  the gradients would not belong to the forward. ``CompileOptions(remat=...)`` recomputes random
  values bit for bit instead.

A reentrant checkpoint (``use_reentrant=True``) is ``torch.utils.checkpoint.CheckpointFunction``,
an autograd.Function whose forward runs the region under ``no_grad`` and whose backward restores
the RNG state it saved (``preserve_rng_state=True``) and runs the region again. The recomputed
random ops of a compiled program draw other numbers all the same, so random ops there are the same
error (``reentrant_checkpoints`` marks the function's forward and backward while the joint trace
runs). With ``preserve_rng_state=False`` eager's recomputation draws other numbers than its forward
too; no compiled program can draw eager's numbers, so that is the same error as well.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["RANDOM_FUNCS", "RandomAtenInCheckpoint", "random_in_checkpoint", "reentrant_checkpoints",
           "saved_tensors_hooked"]


def _top_hooks():
    """The innermost (pack, unpack) saved-tensor hooks, or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        return top(True)
    except TypeError:  # an older signature without the ignore_is_tracing flag
        return top()


def saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks are active (a non-reentrant checkpoint's, or any other)."""
    return _top_hooks() is not None


#: ``depth``: how many reentrant checkpoint forwards / backwards this thread runs (``reentrant_checkpoints``;
#: per thread, so an eager checkpoint on another thread during a trace marks nothing here)
_reentrant = threading.local()


def _marked(fn):
    """``fn`` counting itself in ``_reentrant.depth`` while it runs."""
    def run(*args, **kwargs):
        _reentrant.depth = getattr(_reentrant, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _reentrant.depth -= 1
    return staticmethod(run)


@contextlib.contextmanager
def reentrant_checkpoints():
    """Marks ``torch.utils.checkpoint.CheckpointFunction``'s forward and backward (the region and
    its recomputation) for ``random_in_checkpoint`` while the block runs; restores them on exit,
    errors included. Patches the class for every thread (the marks count per thread); joint traces
    run one at a time (``spmd.compile_lock``)."""
    cls = getattr(torch.utils.checkpoint, "CheckpointFunction", None)
    if cls is None or not all(isinstance(cls.__dict__.get(n), staticmethod) for n in ("forward", "backward")):
        yield  # a PyTorch without this class layout: nothing to mark
        return
    saved = {name: cls.__dict__[name] for name in ("forward", "backward")}
    try:
        for name, fn in saved.items():
            setattr(cls, name, _marked(fn.__func__))
        yield
    finally:
        for name, fn in saved.items():
            setattr(cls, name, fn)


def _in_checkpoint() -> bool:
    if getattr(_reentrant, "depth", 0):
        return True
    hooks = _top_hooks()
    return hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint"


_DROPOUTS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout)
_TORCH_DROPOUTS = tuple(getattr(torch, n) for n in ("dropout", "dropout_", "feature_dropout", "feature_dropout_",
                                                    "alpha_dropout", "alpha_dropout_", "feature_alpha_dropout",
                                                    "feature_alpha_dropout_") if hasattr(torch, n))
_ALWAYS = tuple(f for f in (
    torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like, torch.randperm,
    torch.bernoulli, torch.normal, torch.poisson, torch.multinomial, torch.Tensor.bernoulli, torch.Tensor.bernoulli_,
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.exponential_, torch.Tensor.random_,
    torch.Tensor.cauchy_, torch.Tensor.log_normal_, torch.Tensor.geometric_, torch.Tensor.multinomial,
) if f is not None)

#: the torch functions ``random_in_checkpoint`` looks at (a set, for the mode's quick membership test)
RANDOM_FUNCS = frozenset((*_DROPOUTS, *_TORCH_DROPOUTS, *_ALWAYS, F.multi_head_attention_forward, F.rrelu))


def _bound(func, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, defaults filled in ({} for a call that does not bind: the
    function itself then raises PyTorch's own error)."""
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {}
    bound.apply_defaults()
    return bound.arguments


def _draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether this call of a random torch function draws random numbers."""
    if func in _ALWAYS:
        return True
    if func in _DROPOUTS:
        a = _bound(func, args, kwargs)
        return bool(a.get("training")) and bool(a.get("p"))
    if func in _TORCH_DROPOUTS:  # (input, p, train), builtins
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.0)
        train = args[2] if len(args) > 2 else kwargs.get("train", False)
        return bool(train) and bool(p)
    if func is F.multi_head_attention_forward:
        a = _bound(func, args, kwargs)
        return bool(a.get("training")) and bool(a.get("dropout_p"))
    if func is F.rrelu:
        return bool(_bound(func, args, kwargs).get("training"))
    return False


def random_in_checkpoint(func, args: tuple, kwargs: dict) -> None:
    """NotImplementedError when ``func(*args, **kwargs)`` draws random numbers inside a
    ``torch.utils.checkpoint`` region (see the module docstring)."""
    if not _draws(func, args, kwargs) or not _in_checkpoint():
        return
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
    raise NotImplementedError(
        f"{name} inside torch.utils.checkpoint: its recomputation would draw different random numbers than the "
        "forward in a compiled program, so the gradients would not match; move it out of the checkpointed region, "
        "or drop the checkpoint and compile with spmd.CompileOptions(remat='selective'), which recomputes random "
        "values bit for bit")


def _aten_draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether this ATen call draws random numbers: an op tagged ``nondeterministic_seeded`` other than
    the fused attention ops (their dropout is the converters' error) and a dropout that is off."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()) or "attention" in func.name():
        return False
    if func is torch.ops.aten.native_dropout.default:  # (input, p, train)
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.0)
        train = args[2] if len(args) > 2 else kwargs.get("train")
        return bool(p) and train is not False
    return True


class RandomAtenInCheckpoint(TorchDispatchMode):
    """``random_in_checkpoint`` for ATen calls the torch-function check does not see (a direct
    ``torch.ops.aten.native_dropout`` / ``rand_like`` call inside the region): NotImplementedError
    when such an op draws random numbers inside a checkpoint."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _aten_draws(func, args, kwargs) and _in_checkpoint():
            raise NotImplementedError(
                f"{func.name()} inside torch.utils.checkpoint: its recomputation would draw different random numbers "
                "than the forward in a compiled program, so the gradients would not match; move it out of the "
                "checkpointed region")
        return func(*args, **kwargs)
