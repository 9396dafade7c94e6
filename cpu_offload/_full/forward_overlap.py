# overlap_forward: the model's next forward starts while the CPU still steps the last
# chunks of the step before; each module waits, when its forward starts, for the new
# weights of the parameters it reads.
#
# Which parameters a module's forward pre-hook waits for:
#   - a module that FSDP2 manages (fully_shard): every parameter of its group, the ones in
#     its subtree outside nested FSDP2 modules (its all-gather reads them all at once);
#   - torch's layers whose forward reads their children's weights without calling them
#     (nn.MultiheadAttention its out_proj's; the Transformer layers' fast path all of
#     theirs): every parameter of their subtree;
#   - any other module: its own parameters (``recurse=False``).
# A parent's hook runs before its children's, so it must not wait for theirs: that would
# make the root wait for everything.
# NOTE: a read that no module's forward precedes (a parent of one's own reading a child's
# weight directly, an EMA or a log after step()) sees the old or a partly written weight; the
# optimizer's own calls, ``state_dict()`` and ``load_state_dict()`` of a hooked module and
# the next backward wait for every weight first, and
# ``FullCPUOffloadOptimizer.wait_for_weights()`` does it on request.
#
# The hooks are objects, not closures: a model holding them pickles (``torch.save(model)``), and
# a copy of it (``copy.deepcopy``, an EMA or a teacher; an unpickled one) gets inert ones, as its
# weights are its own.
#
# Scope: choosing the parameters of each hook, registering and removing the hooks.
# Non-goals: the waiting itself (optimizer.py, pipeline.py).

from __future__ import annotations

import functools
from typing import Callable

import torch

__all__ = ["attach_forward_waits", "check_overlap_model"]

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - older torch has no FSDP2 module class
    FSDPModule = ()


def check_overlap_model(model, records) -> None:
    """``overlap_forward`` is None or the ``nn.Module`` that holds the optimizer's parameters."""
    if model is None:
        return
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"overlap_forward must be None or the model (a torch.nn.Module) whose forward reads the "
                        f"optimizer's parameters, got {type(model).__name__}")
    owned = {id(p) for p in model.parameters()}
    missing = [rec.name for rec in records if id(rec.param) not in owned]
    if missing:
        raise ValueError(f"overlap_forward: the model does not hold the optimizer's parameters {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}; pass the model the optimizer was built over")


# torch modules whose forward reads their children's parameters directly.
_READS_ITS_CHILDREN = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)


class _Inert:
    """A copied model's hook in place of an ``_OptimizerHook``: it waits for nothing."""

    def __call__(self, *_args) -> None:
        return None


class _OptimizerHook:
    """A module hook that calls ``action()`` (waits for weights through the optimizer)."""

    __slots__ = ("action",)

    def __init__(self, action: Callable[[], None]):
        self.action = action

    def __call__(self, *_args) -> None:
        self.action()

    def __reduce__(self):
        return (_Inert, ())  # NOTE: also what copy.deepcopy makes of it


def _group_params(module) -> list:
    """The parameters an FSDP2 module's all-gather reads: its subtree's, less nested FSDP2 modules'."""
    nested = set()
    for name, child in module.named_modules():
        if name and isinstance(child, FSDPModule):
            nested.update(id(p) for p in child.parameters())
    return [p for p in module.parameters() if id(p) not in nested]


def attach_forward_waits(model, records, *, wait: Callable, land: Callable) -> list:
    """Register a forward pre-hook on every module of ``model`` whose forward reads
    parameters of ``records``: ``wait(recs, fsdp_state)`` with the records it reads; and a
    ``state_dict`` and a ``load_state_dict`` pre-hook on the same modules that call ``land()``.
    Returns the handles."""
    by_param = {id(rec.param): rec for rec in records}
    handles = []
    for module in model.modules():
        fsdp = isinstance(module, FSDPModule)
        if fsdp:
            params = _group_params(module)
        else:
            params = list(module.parameters(recurse=isinstance(module, _READS_ITS_CHILDREN)))
        recs = [by_param[id(p)] for p in params if id(p) in by_param]
        if not recs:
            continue
        state = module._get_fsdp_state() if fsdp else None
        # NOTE: prepended, so it runs before FSDP2's own pre-forward (registered at
        # fully_shard, before the optimizer existed), which all-gathers the group.
        handles.append(module.register_forward_pre_hook(_OptimizerHook(functools.partial(wait, recs, state)),
                                                        prepend=True))
        handles.append(module.register_state_dict_pre_hook(_OptimizerHook(land)))
        # NOTE: a load into the model right after step() would be overwritten by the weights still landing
        handles.append(_load_pre_hook(module, _OptimizerHook(land)))
    return handles


def _load_pre_hook(module, hook):
    """``module.register_load_state_dict_pre_hook(hook)``: public from torch 2.5 on."""
    if hasattr(module, "register_load_state_dict_pre_hook"):
        return module.register_load_state_dict_pre_hook(hook)
    return module._register_load_state_dict_pre_hook(hook, with_module=True)  # pragma: no cover - torch < 2.5
