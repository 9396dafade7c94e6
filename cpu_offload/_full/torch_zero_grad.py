# torch.nn.Module.zero_grad over a full-offload model's parameters. Their gradients are
# summed on the host and ``.grad`` stays None, so torch's method finds nothing to drop: a
# window left open (a loop stopped in the middle of one, then HF Trainer's train() again,
# which clears with model.zero_grad()) would be stepped with its stale micro-batches.
# ``install()``, run when the package is imported, puts in its place a method that runs
# torch's and, for each full-offload optimizer whose parameters the module holds, that
# optimizer's zero_grad() when the module holds all of them; when it holds part of them and
# a window is open it raises first, naming what to call (a window cannot drop part of
# itself); between windows, with ``set_to_none``, it drops the zero gradients they hold since
# the optimizer's ``zero_grad(set_to_none=False)``, so that step() skips them as torch's does.
#
# Scope: Module.zero_grad. Non-goals: the optimizer's own zero_grad (optimizer.py).

from __future__ import annotations

import functools

import torch

from cpu_offload._full import ownership

__all__ = ["install"]

_torch_zero_grad = torch.nn.Module.zero_grad


@functools.wraps(_torch_zero_grad)
def zero_grad(self: torch.nn.Module, set_to_none: bool = True) -> None:
    owners: dict = {}
    for p in self.parameters():
        owner = ownership.owner_of(p)
        if owner is not None:
            owners.setdefault(id(owner), (owner, set()))[1].add(id(p))
    whole, part = [], []
    for owner, held in owners.values():
        owned = ownership.owned_count(owner)
        if len(held) == owned:
            whole.append(owner)
            continue
        phase = owner._window_phase()
        if phase is not None:
            raise ValueError(
                f"model.zero_grad() over {len(held)} of the {owned} parameters of a full-offload optimizer {phase}: "
                "their gradients are summed on the host for the whole window, which cannot drop part of itself; "
                "call the optimizer's zero_grad() (or zero_grad() on a module that holds all of its parameters)")
        part.append((owner, held))
    _torch_zero_grad(self, set_to_none)
    for owner in whole:
        owner.zero_grad(set_to_none)
    if set_to_none:
        for owner, held in part:
            owner._drop_held_grads(held)


def install() -> None:
    """Put the method above in place of torch's (idempotent)."""
    torch.nn.Module.zero_grad = zero_grad
