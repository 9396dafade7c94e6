# Construction-time helpers of full offload: which optimizers it can run, and
# the one-time binding of the process's CPU work to the device's NUMA node.
#
# Scope: checks and binding done once per wrapper (or per process). Non-goals:
# host state (host_state.py), the protocol (full_offload.py).

from __future__ import annotations

from typing import Optional

import torch

from cpu_offload.optim import SignSGD

__all__ = ["check_optimizer", "bind_for"]

_UNSUPPORTED_ADAMW = ("amsgrad", "maximize", "capturable", "differentiable")
_BOUND_PLAN = None


def check_optimizer(optimizer) -> str:
    """The algorithm full offload runs for ``optimizer``: "adamw" or "sign_sgd"."""
    if type(optimizer) is torch.optim.AdamW:
        for g, group in enumerate(optimizer.param_groups):
            for key in _UNSUPPORTED_ADAMW:
                if group.get(key):
                    raise ValueError(f"full offload cannot honour AdamW option {key}=True (param_groups[{g}])")
        return "adamw"
    if type(optimizer) is SignSGD:
        return "sign_sgd"
    raise TypeError(
        f"offload='full' supports torch.optim.AdamW and cpu_offload.SignSGD, got {type(optimizer).__name__}"
    )


def bind_for(device: torch.device, sysfs_root: str) -> "Optional[object]":
    """Apply the topology binding once per process (the plan must be computed
    before the first bind narrows the affinity, so it is cached)."""
    # NOTE: imported here, not at the top, so `python -m cpu_offload.topology` runs a module
    # that importing the package has not already loaded.
    from cpu_offload import topology

    global _BOUND_PLAN
    if _BOUND_PLAN is None:
        if device.type == "cuda":
            local_rank, local_world = topology.local_rank_info()
            if local_world == 1:  # not under torchrun: bind to the device actually used
                pci = topology.gpu_pci_addresses()[device.index]
                plan = topology.plan_for_rank(0, local_world_size=1, pci_addresses=[pci],
                                              sysfs_root=sysfs_root, require_topology=True)
            else:
                plan = topology.plan_for_rank(sysfs_root=sysfs_root, require_topology=True)
        else:  # CPU parameters: no GPU to bind to, only the thread budget
            plan = topology.plan_for_rank(pci_addresses=[], sysfs_root=sysfs_root)
        topology.bind(plan)
        _BOUND_PLAN = plan
    return _BOUND_PLAN
