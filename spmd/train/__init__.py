"""Training: pure optimizers (``spmd.train.optim``) and a compiled, sharded train step (``make_train_step``)."""

from spmd.train.optim import SGD, Adam, AdamW, Optimizer, clip_grad_norm

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "clip_grad_norm"]
from spmd.train.step import TrainStep, grad_step_fn, make_train_step  # noqa: E402

__all__ += ["TrainStep", "grad_step_fn", "make_train_step"]
