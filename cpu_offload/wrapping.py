# What an offload wrapper shares with the torch optimizer it wraps.
#
# Scope: make a wrapper behave as a torch.optim.Optimizer without running
# Optimizer.__init__: the same param_groups list and dicts (so LR schedulers
# drive the wrapped optimizer), its defaults, and the hook tables torch's
# step/state_dict machinery expects.

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["adopt_optimizer"]

_HOOK_TABLES = ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                "load_state_dict_pre", "load_state_dict_post")


def adopt_optimizer(wrapper: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> None:
    """Share ``optimizer``'s groups and defaults with ``wrapper`` and set up its hooks."""
    wrapper.optimizer = optimizer
    wrapper.defaults = optimizer.defaults
    wrapper.param_groups = optimizer.param_groups  # NOTE: the same list and dicts
    for name in _HOOK_TABLES:
        setattr(wrapper, f"_optimizer_{name}_hooks", OrderedDict())
    wrapper._patch_step_function()
