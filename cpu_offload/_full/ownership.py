# Who may drive a parameter: full offload owns its parameters' updates, so it
# refuses parameters that another live wrapper owns, parameters whose fp32
# values an earlier wrapper already cast away, and models driven by DDP (whose
# reducer would never see the gradients the hooks consume).
#
# Scope: a process-wide registry of owned parameters (who drives this one) and of live
# offload="optimizer" wrappers, the cast marker, the DDP check (a registry of live DDP
# instances), the fork check. Non-goals:
# anything per step.

from __future__ import annotations

import os
import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["check_unowned", "check_not_full_offloaded", "claim", "release", "owner_of", "owned_count", "live_owners",
           "note_other_wrapper", "forget_other_wrapper",
           "mark_cast", "unmark_cast", "check_not_cast", "check_not_ddp", "check_same_process"]

# NOTE: reentrant: the garbage collector may run inside a section holding it (claim() allocates)
# and finalize a dropped wrapper there, whose release() takes it again on the same thread.
_lock = threading.RLock()
# id(param) -> (the param, weakref to the owning wrapper). NOTE: the param itself, not a weak
# reference: torch.utils.swap_tensors refuses a tensor that has one, and Module._apply swaps
# parameters (DTensors under FSDP2; every parameter under
# torch.__future__.set_swap_module_params_on_conversion) in model.to() and load_state_dict().
# The entries go at release() (close() or the wrapper's finalizer), and the wrapper's records
# hold the parameters until then anyway.
_owners: dict = {}
_CAST_ATTR = "_cpu_offload_cast_from"
_ddp_instances: "weakref.WeakSet" = weakref.WeakSet()  # live DistributedDataParallel wrappers
_other_wrappers: "weakref.WeakSet" = weakref.WeakSet()  # live offload="optimizer" wrappers


def _note_ddp(owner, name, submodule):
    """Global module-registration hook: remember every DDP that adopts a module.

    NOTE: DistributedDataParallel leaves no marker on its parameters or module
    (its reducer's autograd hooks are C++ only), but its ``__init__`` assigns
    ``self.module = module``, which runs torch's global module-registration
    hooks. Installed when this module is imported (``import cpu_offload``), so
    it sees every DDP built after that: one isinstance check per submodule
    registration, no walk over the heap. Returns None (keeps the submodule).

    A DDP over parameters a full-offload optimizer already trains (the frameworks'
    multi-process path without FSDP wraps the model after the optimizer) is refused
    here, in DDP's ``__init__``, before any collective: full offload would step each rank
    with its own gradient before DDP's all-reduce.
    """
    if name == "module" and isinstance(owner, torch.nn.parallel.DistributedDataParallel):
        ignored = set(getattr(submodule, "_ddp_params_and_buffers_to_ignore", ()))  # DDP leaves these alone
        for param_name, p in submodule.named_parameters():
            if param_name not in ignored and owner_of(p) is not None:
                raise RuntimeError(
                    f"parameter {param_name} is trained by a full-offload optimizer: DistributedDataParallel would "
                    "all-reduce its gradient after full offload stepped each rank with its own, so the ranks would "
                    "diverge; use FSDP2 (fully_shard; with accelerate or HF Trainer, an FSDP config) or "
                    "offload='optimizer'")
        _ddp_instances.add(owner)


torch.nn.modules.module.register_module_module_registration_hook(_note_ddp)


def note_other_wrapper(wrapper) -> None:
    """Remember a live wrapper of another mode (offload="optimizer"): full offload refuses its parameters."""
    _other_wrappers.add(wrapper)


def forget_other_wrapper(wrapper) -> None:
    """An offload="optimizer" wrapper was closed: its parameters are free again."""
    _other_wrappers.discard(wrapper)


def check_unowned(records) -> None:
    """Raise if a live wrapper already drives one of the records' parameters."""
    for other in list(_other_wrappers):
        theirs = {id(p) for group in other.param_groups for p in group["params"]}
        for rec in records:
            if id(rec.param) in theirs:
                raise RuntimeError(
                    f"parameter {rec.name} is driven by a live {type(other).__name__}: full offload would take its "
                    "gradient during backward, and that optimizer would never step it again; give each parameter "
                    "one optimizer (close() the other first)")
    with _lock:
        for rec in records:
            entry = _owners.get(id(rec.param))
            if entry is not None and entry[0] is rec.param and entry[1]() is not None:
                raise RuntimeError(
                    f"parameter {rec.name} is already driven by another full-offload optimizer, whose fp32 masters "
                    "hold its values; a parameter can have one owner: keep using the first one instead of wrapping "
                    "again (Lightning calls configure_optimizers on every fit(): build the optimizer once there and "
                    "return it again). To start a new one, close() the first, convert the parameters back with "
                    "model.float() and load the first's state_dict() into the new one"
                )


def check_not_full_offloaded(param_groups) -> None:
    """Raise if a live full-offload optimizer drives one of the parameters (for a wrapper of
    another mode): its hooks take their gradients during backward, so the other optimizer
    would never see one and never step them."""
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            owner = owner_of(p)
            if owner is not None:
                raise RuntimeError(
                    f"parameter param_groups[{gi}][{pi}] is driven by a live {type(owner).__name__}, whose hooks take "
                    "its gradient during backward: this optimizer would never see one and never step it; give each "
                    "parameter one optimizer (close() the full-offload one first)")


def _refuse_other_optimizers_step(optimizer, args, kwargs) -> None:
    """Global step pre-hook: an optimizer other than the full-offload one (or a proxy sharing
    its ``param_groups``: Lightning's, accelerate's; not the torch optimizer it wraps) stepping
    a parameter that full offload drives raises before anything changes: it would never see
    that parameter's gradient.

    NOTE: installed when this module is imported; while no parameter is owned it returns at
    once, and for the owner it returns at the first owned parameter."""
    if not _owners:
        return None
    groups = optimizer.param_groups
    for group in groups:
        for p in group["params"]:
            owner = owner_of(p)
            if owner is not None:
                if optimizer is getattr(owner, "optimizer", None):  # NOTE: it shares the groups; never stepped
                    raise RuntimeError(f"step() of the torch optimizer a live {type(owner).__name__} wraps: full "
                                       "offload takes its gradients during backward and steps them on the host, "
                                       "so this step would never see one; step that one (offload_optimizer()'s "
                                       "result) instead")
                if owner.param_groups is groups:
                    return None
                check_not_full_offloaded(groups)
    return None


register_optimizer_step_pre_hook(_refuse_other_optimizers_step)


def claim(records, wrapper) -> None:
    """Register ``wrapper`` as the owner of every record's parameter."""
    with _lock:
        ref = weakref.ref(wrapper)
        for rec in records:
            _owners[id(rec.param)] = (rec.param, ref)


def owner_of(param):
    """The live wrapper that drives ``param``, or None."""
    entry = _owners.get(id(param))
    if entry is None or entry[0] is not param:
        return None
    return entry[1]()


def owned_count(wrapper) -> int:
    """How many live parameters ``wrapper`` drives."""
    with _lock:
        return sum(1 for _, owner_ref in _owners.values() if owner_ref() is wrapper)


def live_owners() -> list:
    """The live wrappers that drive a parameter."""
    with _lock:
        found = {id(w): w for _, owner_ref in list(_owners.values()) if (w := owner_ref()) is not None}
    return list(found.values())


def release(params) -> None:
    with _lock:
        for p in params:
            _owners.pop(id(p), None)


def mark_cast(param: torch.nn.Parameter, original: torch.dtype) -> None:
    """Remember that full offload cast this parameter from ``original`` (to its current dtype)."""
    setattr(param, _CAST_ATTR, (original, param.dtype))


def unmark_cast(param: torch.nn.Parameter) -> None:
    """Forget ``mark_cast``: the cast was undone (a construction that failed)."""
    if hasattr(param, _CAST_ATTR):
        delattr(param, _CAST_ATTR)


def check_not_cast(records) -> None:
    """Refuse parameters that an earlier full-offload optimizer cast to another
    dtype and that have not been converted back: their real values lived in that
    optimizer's fp32 masters, and masters must never be initialised from the cast copy.

    NOTE: dtypes, not item sizes, are compared: fp16 -> bf16 keeps the size but not
    the values. The one cast that loses nothing is to fp32 (the compute copy then
    equals the master bit for bit), so a parameter still in fp32 after it is accepted.
    """
    for rec in records:
        original, cast_to = getattr(rec.param, _CAST_ATTR, (None, None))
        if original is None or rec.param.dtype == original:
            continue
        if cast_to == torch.float32 and rec.param.dtype == torch.float32:
            continue
        raise RuntimeError(
            f"parameter {rec.name} was cast from {original} to {cast_to} by a full-offload optimizer (this model's, "
            f"or that of the model it was pickled from), whose fp32 masters held its real values, and is "
            f"{rec.param.dtype} now: convert the parameters back with model.to({original}) and load a state_dict() "
            f"saved from that optimizer, which has the masters, into this one; with none saved, "
            f"model.to({original}) alone takes the {cast_to} values as they are"
        )


def check_not_ddp(records) -> None:
    """Refuse parameters of a module wrapped by DistributedDataParallel.

    NOTE: looks through the DDP instances built since ``import cpu_offload``
    (``_note_ddp``); a DDP built before that import is not seen.
    """
    ours = {id(r.param): r for r in records}
    for ddp in list(_ddp_instances):
        module = getattr(ddp, "module", None)
        if module is not None:
            ignored = set(getattr(ddp, "parameters_to_ignore", ()))  # DDP leaves these alone
            for param_name, p in module.named_parameters():
                if id(p) in ours and param_name not in ignored:
                    raise RuntimeError(
                        f"parameter {ours[id(p)].name} belongs to a DistributedDataParallel model: full offload "
                        "consumes each gradient on the host before DDP's all-reduce, so ranks would diverge; "
                        "shard the model with FSDP2 (fully_shard) instead, or use offload='optimizer'"
                    )


def check_same_process(pid: int) -> None:
    if os.getpid() != pid:
        raise RuntimeError(
            f"this full-offload optimizer was built in process {pid}; after fork() its worker thread and "
            "pinned buffers do not exist in this process: build the model and optimizer in the child"
        )
