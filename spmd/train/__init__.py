"""Training: pure optimizers (``spmd.train.optim``) and a compiled, sharded train step (``make_train_step``)."""

from spmd.train.optim import SGD, Adam, AdamW, Optimizer, clip_grad_norm

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "clip_grad_norm"]
