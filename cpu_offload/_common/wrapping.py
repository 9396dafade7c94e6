# What an offload wrapper shares with the torch optimizer it wraps.
#
# Scope: make a wrapper behave as a torch.optim.Optimizer without running
# Optimizer.__init__: the same param_groups list and dicts (so LR schedulers
# drive the wrapped optimizer), its defaults, the hook tables torch's
# step/state_dict machinery expects, and running the state-dict hooks
# registered on the wrapper exactly as torch.optim.Optimizer runs them; one live
# wrapper per torch optimizer.
# Non-goals: what a wrapper's state_dict contains (its own ``build``/``apply``).

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ["adopt_optimizer", "check_not_offloaded", "release_optimizer", "state_dict_with_hooks",
           "load_state_dict_with_hooks", "step_without_global_hooks", "refuse_copy"]

_HOOK_TABLES = ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                "load_state_dict_pre", "load_state_dict_post")
# torch optimizer -> weak reference to the live wrapper that drives it
_wrappers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check_not_offloaded(optimizer) -> None:
    """An offload wrapper takes a torch optimizer, never another wrapper: the outer one would
    move or step the inner one's state behind its back (a state-offload wrapper around full
    offload trained on other numbers)."""
    if isinstance(getattr(optimizer, "_offloads", None), torch.optim.Optimizer):
        raise TypeError(f"optimizer is already offloaded (a {type(optimizer).__name__}, from offload_optimizer()): "
                        f"wrap the torch optimizer once; this wrapper's .optimizer is the one it wraps")
    ref = _wrappers.get(optimizer)
    wrapper = None if ref is None else ref()
    if wrapper is not None:
        # NOTE: two live wrappers would each move or step the one state: a state-offload
        # wrapper's copy-in would read the host buffers whose copy-out the other one's
        # stream may still be writing, and a state-offload wrapper over full offload would
        # checkpoint the torch optimizer's empty state instead of the masters.
        raise RuntimeError(f"optimizer is already driven by a live {type(wrapper).__name__} (from offload_optimizer()): "
                           f"a torch optimizer can have one offload wrapper at a time; keep using that one, or "
                           f"close() it before wrapping the optimizer again")


class _WithTorchOptimizersHooks(OrderedDict):
    """A hook table of a wrapper that never calls its torch optimizer's step or state-dict
    methods (full offload): it holds the hooks registered on the wrapper, and ``values()``,
    which torch's Optimizer reads to run them, gives the torch optimizer's own first.

    NOTE: the torch optimizer's table is read, never written: a hook registered on the
    wrapper does not outlive it there (a step of the torch optimizer after close(), or of
    a second wrapper around it, does not run it)."""

    def __init__(self, torch_hooks: OrderedDict) -> None:
        super().__init__()
        self.torch_hooks = torch_hooks

    def values(self):
        return [*self.torch_hooks.values(), *super().values()]


def adopt_optimizer(wrapper: torch.optim.Optimizer, optimizer: torch.optim.Optimizer, *,
                    runs_torch_hooks: bool) -> None:
    """Share ``optimizer``'s groups and defaults with ``wrapper`` and set up its hooks;
    ``wrapper`` drives ``optimizer`` until ``release_optimizer`` or its end.

    ``runs_torch_hooks``: the wrapper never calls ``optimizer``'s step or state-dict
    methods (full offload), so it runs the hooks registered on ``optimizer`` around its
    own, once. Else ``optimizer``'s run when the wrapper calls its methods."""
    _wrappers[optimizer] = weakref.ref(wrapper)
    wrapper.optimizer = wrapper._offloads = optimizer
    wrapper.defaults = optimizer.defaults
    wrapper.param_groups = optimizer.param_groups  # NOTE: the same list and dicts
    for name in _HOOK_TABLES:
        table = f"_optimizer_{name}_hooks"
        setattr(wrapper, table, _WithTorchOptimizersHooks(getattr(optimizer, table)) if runs_torch_hooks
                else OrderedDict())
    wrapper._patch_step_function()


def release_optimizer(wrapper: torch.optim.Optimizer) -> None:
    """``wrapper`` no longer drives its torch optimizer (closed, or its construction undone)."""
    optimizer = getattr(wrapper, "_offloads", None)
    if optimizer is not None and (ref := _wrappers.get(optimizer)) is not None and ref() is wrapper:
        del _wrappers[optimizer]


def state_dict_with_hooks(wrapper: torch.optim.Optimizer, build: Callable[[], dict]) -> dict:
    """``build()`` between the wrapper's state_dict pre and post hooks.

    As ``torch.optim.Optimizer.state_dict``: each pre hook is called as
    ``hook(wrapper)``; each post hook as ``hook(wrapper, state_dict)`` and, when
    it returns something other than ``None``, that becomes the state_dict the
    next hooks see and the caller gets.
    """
    for pre_hook in wrapper._optimizer_state_dict_pre_hooks.values():
        pre_hook(wrapper)
    state_dict = build()
    for post_hook in wrapper._optimizer_state_dict_post_hooks.values():
        result = post_hook(wrapper, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def load_state_dict_with_hooks(wrapper: torch.optim.Optimizer, state_dict: dict,
                               apply: Callable[[dict], None]) -> None:
    """``apply(state_dict)`` between the wrapper's load_state_dict pre and post hooks.

    As ``torch.optim.Optimizer.load_state_dict``: the pre hooks get a shallow
    copy of the caller's dict (``hook(wrapper, state_dict)``) and one that
    returns something other than ``None`` replaces it for the next hooks and
    for ``apply``; then each post hook is called as ``hook(wrapper)``.
    """
    if isinstance(state_dict, dict):
        state_dict = state_dict.copy()  # shallow, so hooks may edit it in place
    for pre_hook in wrapper._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(wrapper, state_dict)
        if result is not None:
            state_dict = result
    apply(state_dict)
    for post_hook in wrapper._optimizer_load_state_dict_post_hooks.values():
        post_hook(wrapper)


def step_without_global_hooks(optimizer: torch.optim.Optimizer) -> Callable:
    """``optimizer.step`` as torch runs it, but without the global step hooks
    (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook``): those ran
    around the wrapper's own step, and torch runs each once per step. The optimizer's own
    step hooks run around it as ``Optimizer.profile_hook_step`` runs them.

    NOTE: an LR scheduler built on the optimizer before it was wrapped patched its step on the
    instance, to mark ``_opt_called`` and call the class step: that mark is set here. Any other
    step patched on the instance (``optimizer.step = ...``) is called as it is, with the global
    hooks skipped for this optimizer while it runs (the hooked class step it may call would run
    them again); a class step torch did not hook is called as it is."""
    hooked = type(optimizer).step
    func = getattr(hooked, "__wrapped__", None)
    patched = vars(optimizer).get("step")
    by_scheduler = (getattr(patched, "_wrapped_by_lr_sched", False)
                    and getattr(patched, "__wrapped__", None) is hooked)
    if not getattr(hooked, "hooked", False) or func is None:
        return optimizer.step
    if patched is not None and not by_scheduler:
        def patched_step(*args, **kwargs):
            with _global_step_hooks_skipped_for(optimizer):
                return patched(*args, **kwargs)
        return patched_step

    def step(*args, **kwargs):
        if by_scheduler:
            optimizer._opt_called = True  # what the scheduler's patch does before the class step
        args = (optimizer, *args)
        for pre_hook in list(optimizer._optimizer_step_pre_hooks.values()):
            result = pre_hook(optimizer, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"{func} must return None or a tuple of (new_args, new_kwargs), but got {result}.")
                args, kwargs = result
        out = func(*args, **kwargs)
        optimizer._optimizer_step_code()
        for post_hook in list(optimizer._optimizer_step_post_hooks.values()):
            post_hook(optimizer, args, kwargs)
        return out
    return step


_global_hooks_lock = threading.Lock()
_skipping = threading.local()  # .optimizers: those whose global step hooks this thread skips now


@contextmanager
def _global_step_hooks_skipped_for(optimizer: torch.optim.Optimizer):
    """Skip torch's global step hooks for ``optimizer`` (only) while the block runs on this thread.

    NOTE: torch calls every hook in ``_global_optimizer_pre_hooks`` / ``_post_hooks`` with the
    optimizer stepping. The first such block after a hook was registered wraps it, in place
    under its own key (so its handle still removes it), in a filter that skips the optimizers
    this thread steps inside such a block and runs it for any other. Filters stay: writing the
    hooks back could put back one that another thread removed meanwhile; for the same reason a
    hook is wrapped only if its key still holds it once its filter is made."""
    with _global_hooks_lock:
        for table in (torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks):
            for key, hook in list(table.items()):
                if not isinstance(hook, _SkipFiltered):
                    filtered = _SkipFiltered(hook)
                    if table.get(key) is hook:
                        table[key] = filtered
    skipped = _skipping.__dict__.setdefault("optimizers", [])
    skipped.append(optimizer)
    try:
        yield
    finally:
        skipped.pop()


class _SkipFiltered:
    """A global step hook that does not run for the optimizers this thread skips now."""

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, optimizer, args, kwargs):
        if any(o is optimizer for o in getattr(_skipping, "optimizers", ())):
            return None
        return self.hook(optimizer, args, kwargs)


def refuse_copy(wrapper) -> None:
    """``copy.deepcopy``, ``pickle`` and ``torch.save`` of a wrapper: refused with a clear
    error (torch's Optimizer.__getstate__ would keep its groups and state only, and the copy
    would fail at its first use). A checkpoint saves ``state_dict()``."""
    raise TypeError(f"a {type(wrapper).__name__} cannot be copied or pickled (it holds host buffers, CUDA "
                    "streams and hooks on the model's parameters): save opt.state_dict() and load it into a new "
                    "wrapper instead")
