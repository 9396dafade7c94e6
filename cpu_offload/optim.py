"""SignSGD as a torch.optim.Optimizer (any device, any floating-point dtype).

p <- p - lr*wd*p (decoupled weight decay, when wd > 0), then p <- p - lr*sign(g),
sign(0) = 0. The same update as the native ``sign_sgd_step`` kernel, bit for bit on fp32
CPU tensors, so full offload can take a SignSGD optimizer and run it on the CPU.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch.optim import Optimizer

from cpu_offload._common.checks import check_float32

__all__ = ["SignSGD"]


def _check_group(g: int, group: dict) -> None:
    """Raise naming ``param_groups[g][key]`` unless lr and weight_decay are finite real
    numbers >= 0 whose float32 constants (lr, 1 - lr*weight_decay) are finite too."""
    values = {}
    for key in ("lr", "weight_decay"):
        v = group[key]
        name = f"param_groups[{g}]['{key}']"
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a number, got {v!r}")
        try:
            values[key] = float(v)
        except OverflowError:  # an int beyond any double
            values[key] = math.inf
        if not (math.isfinite(values[key]) and values[key] >= 0):
            raise ValueError(f"{name} is {v}: it must be finite and >= 0")
        check_float32(name, values[key])
    check_float32(f"param_groups[{g}]['weight_decay']", 1.0 - values["lr"] * values["weight_decay"],
                  "1 - lr * weight_decay")


class SignSGD(Optimizer):
    """Sign descent with decoupled weight decay.

    Args:
        params: iterable of parameters or param groups.
        lr: step size (default 1e-3).
        weight_decay: decoupled weight decay coefficient (default 0).

    Every group's lr and weight_decay must be finite real numbers >= 0 whose float32
    constants (lr, 1 - lr*weight_decay) are finite, as the native kernel needs; a group is
    checked when it is added and again at each ``step()`` (after ``load_state_dict`` or an
    edit), and a bad value raises naming ``param_groups[g]['lr']`` or ``['weight_decay']``.
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

    def add_param_group(self, param_group: dict) -> None:
        # NOTE: torch's __init__ adds its groups through here, so this checks them too.
        if isinstance(param_group, dict):
            _check_group(len(self.param_groups), {**self.defaults, **param_group})
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # NOTE: load_state_dict and direct edits (schedulers, users) bypass add_param_group;
        # every group and every gradient is checked before any parameter changes.
        for g, group in enumerate(self.param_groups):
            _check_group(g, group)
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"SignSGD does not support sparse gradients (param_groups[{g}][{i}])")
                if not (p.is_floating_point() and p.grad.is_floating_point()):
                    raise TypeError(f"SignSGD steps floating-point parameters and gradients; param_groups[{g}][{i}] "
                                    f"is {p.dtype} with a {p.grad.dtype} gradient")
        for group in self.param_groups:
            # NOTE: as Python floats (doubles), as the kernel takes them: 1 - lr*wd computed in a
            # numpy float32 lr's own precision could round to another float32 than the kernel's
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if wd > 0:
                    p.mul_(1.0 - lr * wd)
                p.add_(torch.sign(p.grad), alpha=-lr)
                # NOTE: SignSGD keeps no state; a step count loaded with a full-offload checkpoint
                # advances, so that the masters carried beside it ("master_step") read as stale
                counted = self.state.get(p)
                if counted and "step" in counted:
                    counted["step"] = counted["step"] + 1  # NOTE: a new tensor: the loaded dict keeps its own
        return loss
