# The binding of the process's CPU work to the device's NUMA node, for full offload: the
# plan is computed once per process, before the first bind narrows the affinity mask, and
# applied by every full-offload optimizer before it touches any host state (first touch
# places pages).
#
# Scope: choosing the plan for the parameters' device and applying it. Non-goals:
# planning itself and the binding mechanics (cpu_offload.topology).

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["bind_for"]

_BOUND_PLAN = None


def bind_for(device: torch.device, sysfs_root: str) -> "Optional[object]":
    """Apply the process's topology binding (the plan must be computed before the first bind
    narrows the affinity, so it is cached)."""
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
        _BOUND_PLAN = plan
    # NOTE: applied again for each optimizer: the affinity, the native pool or torch's thread
    # count may have changed since the last one.
    topology.bind(_BOUND_PLAN)
    return _BOUND_PLAN
