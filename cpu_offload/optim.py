"""SignSGD as a torch.optim.Optimizer (any device, any dtype).

p <- p - lr*wd*p (decoupled weight decay, when wd > 0), then p <- p - lr*sign(g),
sign(0) = 0. The same update as the native ``sign_sgd_step`` kernel, bit for bit on fp32
CPU tensors, so full offload can take a SignSGD optimizer and run it on the CPU.
"""
from __future__ import annotations

import numbers

import torch
from torch.optim import Optimizer

__all__ = ["SignSGD"]


class SignSGD(Optimizer):
    """Sign descent with decoupled weight decay.

    Args:
        params: iterable of parameters or param groups.
        lr: step size (default 1e-3).
        weight_decay: decoupled weight decay coefficient (default 0).
    """

    def __init__(self, params, lr: float = 1e-3, *, weight_decay: float = 0.0):
        if isinstance(lr, torch.Tensor):
            raise TypeError("lr must be a float, not a tensor")
        for name, value in (("lr", lr), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a float, got {value!r}")
            if not 0.0 <= value:
                raise ValueError(f"{name} must be >= 0, got {value}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SignSGD does not support sparse gradients")
                if wd > 0:
                    p.mul_(1.0 - lr * wd)
                p.add_(torch.sign(p.grad), alpha=-lr)
        return loss
