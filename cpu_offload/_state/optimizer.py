# The "optimizer" offload mode: the wrapped optimizer's state tensors (AdamW's
# moments, ...) live in pinned host RAM between steps and visit the device only
# around step(). Weights and gradients stay on the device, so everything that
# reads ``param.grad`` (clipping, logging) keeps working.
#
# Scope: the torch.optim.Optimizer surface of the mode: options, step() around
# the wrapped optimizer's own step, state / state_dict / load_state_dict that
# wait for the copies, keep the state on the host, run the hooks registered on
# the wrapper and keep param_groups shared, stats().
# Non-goals: running the optimizer on the CPU (that is offload="full"),
# splitting one step into pieces to cap the device memory of the step itself.
# The copies themselves, and their overlap with backward and the next forward,
# are staging.py's (what and when) and copies.py's (streams, events).

from __future__ import annotations

import functools

import torch

from cpu_offload._common.checks import check_int
from cpu_offload._common.interrupts import deferred_interrupts, interruptible
from cpu_offload._full import ownership
from cpu_offload._state.staging import StateStaging
from cpu_offload._common.wrapping import (
    adopt_optimizer, check_not_offloaded, load_state_dict_with_hooks, refuse_copy, release_optimizer,
    state_dict_with_hooks, step_without_global_hooks,
)

__all__ = ["StateOffloadOptimizer"]


class StateOffloadOptimizer(torch.optim.Optimizer):
    """Keeps a torch optimizer's state in host RAM between steps.

    Any ``torch.optim.Optimizer`` works: its ``step()`` runs unchanged on the
    device. Each parameter's state is copied in on a side stream while backward
    still runs, as soon as the parameter's gradient is final (up to
    ``prefetch_bytes``); ``step()`` copies in the rest, runs the wrapped step,
    and starts the copies back into the host buffers (pinned when CUDA is
    available, allocated once at the first step), which overlap whatever comes
    next; each device copy is freed once its copy-out has completed. With CPU
    parameters the same logic runs with plain synchronous copies.

    Args:
        optimizer: the optimizer to wrap (its ``param_groups`` and ``state`` are shared).
        pin_memory: page-lock the host buffers (default: when CUDA is available;
            True without CUDA is a ValueError).
        prefetch_bytes: cap on the device bytes of state copied in during
            backward and not yet stepped; beyond it ``step()`` copies the rest.
            ``None`` (default): no cap; 0: no prefetch.
        grad_accum_steps: backward passes per ``step()``; the copy-in of a
            parameter's state starts with its gradient in the last one (a
            shorter window is fine: ``step()`` copies in what is missing).
            ``None`` (default): the most backward passes completed between two
            steps so far, so nothing is prefetched before the first ``step()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, pin_memory=None, prefetch_bytes=None,
                 grad_accum_steps=None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        check_not_offloaded(optimizer)
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be True, False or None, got {pin_memory!r}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (pinned host memory is allocated through the CUDA driver) "
                             "and torch.cuda.is_available() is False: leave pin_memory unset (it pins only when "
                             "CUDA is available) or pass pin_memory=False")
        check_int("prefetch_bytes", prefetch_bytes, low=0, none="no cap")
        check_int("grad_accum_steps", grad_accum_steps, low=1, none="")
        ownership.check_not_full_offloaded(optimizer.param_groups)
        adopt_optimizer(self, optimizer, runs_torch_hooks=False)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        try:
            # NOTE: every mutable thing lives inside this one object, never in a
            # rebound attribute: Lightning's optimizer proxy runs these methods with
            # itself as ``self`` and reads missing attributes from the wrapper, so a
            # rebound attribute would land on the proxy only.
            self._staging = StateStaging(optimizer, pin=self.pin_memory, prefetch_bytes=prefetch_bytes,
                                         grad_accum_steps=grad_accum_steps)
            self._staging.hook_params()
            ownership.note_other_wrapper(self)
        except BaseException:
            release_optimizer(self)  # the traceback may keep this half-built wrapper alive
            raise

    @property
    def param_groups(self) -> list:
        """The wrapped optimizer's ``param_groups``: a list assigned here (an LR scheduler, or
        accelerate's ``AcceleratedOptimizer.param_groups = ...``) is the one its step reads."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list) -> None:
        self.optimizer.param_groups = groups
        if hasattr(self, "_staging"):
            self._staging.hook_params()

    # NOTE: torch.amp.GradScaler hands its scale to optimizers that unscale in their own step
    # (fused Adam, AdamW, SGD): it reads this flag and sets grad_scale and found_inf on the
    # optimizer it is given, for the wrapped step to read.
    @property
    def _step_supports_amp_scaling(self) -> bool:
        return getattr(self.optimizer, "_step_supports_amp_scaling", False)

    grad_scale = property(lambda self: self.optimizer.grad_scale,
                          lambda self, value: setattr(self.optimizer, "grad_scale", value),
                          lambda self: delattr(self.optimizer, "grad_scale"))
    found_inf = property(lambda self: self.optimizer.found_inf,
                         lambda self, value: setattr(self.optimizer, "found_inf", value),
                         lambda self: delattr(self.optimizer, "found_inf"))

    def __getstate__(self):
        refuse_copy(self)

    @property
    def state(self):
        """The wrapped optimizer's state; between steps its tensors are the host buffers."""
        self._staging.wait()  # the last step's copies into them may still be running
        # NOTE: the caller may edit the host tensors in place: copies made from
        # them during this backward are dropped, and step() makes them again.
        self._staging.discard_prefetched()
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        """Replace the wrapped optimizer's state (``opt.state = defaultdict(dict)`` resets it, as
        in torch); the next step copies in what it holds."""
        self._staging.wait()
        self._staging.discard_prefetched()
        self.optimizer.state = value

    def step(self, *args, **kwargs):
        """Copy in the state not yet on the device, run the wrapped optimizer's
        step, start the copies back to the host.

        The arguments go to the wrapped optimizer's step as they were passed (its step hooks
        see a ``closure=`` as a keyword); it calls a closure when it needs to (LBFGS: several
        times; its backward then runs with the state on the device)."""
        self._check_open("step()")
        result = []
        step = step_without_global_hooks(self.optimizer)
        if args:
            args = (_interruptible(args[0]), *args[1:])
        elif "closure" in kwargs:
            kwargs = {**kwargs, "closure": _interruptible(kwargs["closure"])}
        self._staging.run_step(lambda: result.append(step(*args, **kwargs)))
        return result[0]

    def stats(self) -> dict:
        """Figures of the last step: ``h2d_bytes`` and ``d2h_bytes`` (state bytes
        copied each way), ``prefetched_bytes`` (copied in during backward and
        used) and ``step_copied_bytes`` (copied in by step()), ``step_blocked_s``
        (seconds step() held the calling thread), ``copy_wait_s`` (seconds the
        compute stream waited for copy-ins before the step; None until the GPU
        has got there), ``host_bytes`` (the host buffers)."""
        return self._staging.stats()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._staging.reset_window()

    def add_param_group(self, param_group) -> None:
        groups = self.optimizer.param_groups
        count = len(groups)
        self.optimizer.add_param_group(param_group)
        try:
            self._staging.hook_params()
        except BaseException:
            del groups[count:]  # NOTE: refused: the wrapped optimizer is left as it was
            raise

    def state_dict(self) -> dict:
        """The wrapped optimizer's state_dict (its tensors are the host buffers),
        with the state_dict hooks registered on this wrapper run around it."""
        return state_dict_with_hooks(self, self._build_state_dict)

    def _build_state_dict(self) -> dict:
        self._staging.wait()
        # NOTE: its tensors are the live host buffers, which a checkpoint loader
        # (torch.distributed.checkpoint) writes in place before load_state_dict.
        self._staging.discard_prefetched()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped optimizer, keeping ``param_groups`` the same list
        of the same dicts; the load_state_dict hooks of this wrapper run around it."""
        self._check_open("load_state_dict()")
        load_state_dict_with_hooks(self, state_dict, self._apply_state_dict)

    def _apply_state_dict(self, state_dict: dict) -> None:
        # NOTE: a Ctrl-C lands after the load: every parameter's state loaded, the groups
        # rewired and the state moved to the host, or (an error) the load not begun.
        with deferred_interrupts():
            self._load(state_dict)

    def _load(self, state_dict: dict) -> None:
        self._staging.drain()  # no copy may read or write the host buffers from here on
        groups = self.param_groups
        kept = list(groups)
        self.optimizer.load_state_dict(state_dict)  # torch moves the state to the device
        # NOTE: torch's load_state_dict installs a new list of new group dicts.
        # LR schedulers, accelerate's AcceleratedOptimizer and this wrapper hold
        # the old ones, so the loaded values go into those dicts (``params`` kept)
        # and the wrapped optimizer gets the old list back: one list, the same
        # dicts, through any number of round trips.
        for mine, loaded in zip(kept, self.optimizer.param_groups):
            if loaded is mine:  # the wrapped optimizer kept its dicts (a wrapper itself)
                continue
            params = mine["params"]
            mine.clear()
            mine.update(loaded)
            mine["params"] = params
        groups[:] = kept
        self.optimizer.param_groups = groups
        self._staging.hook_params()
        self._staging.copy_all_out()
        self._staging.wait()

    def close(self) -> None:
        """Wait for the last step's copies, remove the gradient hooks and give the torch
        optimizer back: another wrapper, of either mode, may then take it or its parameters.
        Its state stays in the host buffers. Idempotent; step() and load_state_dict() then
        raise."""
        with deferred_interrupts():
            self._staging.close()
            release_optimizer(self)
            ownership.forget_other_wrapper(self)

    def _check_open(self, call: str) -> None:
        if self._staging.closed:
            raise RuntimeError(f"{call}: this StateOffloadOptimizer was closed; wrap its torch optimizer "
                               "(.optimizer) again to go on training with it")

    def __repr__(self) -> str:
        return f"StateOffloadOptimizer({self.optimizer!r})"


def _interruptible(closure):
    """``closure`` (None stays None), run where a Ctrl-C is raised at once.

    NOTE: the step defers Ctrl-C (staging.run_step); the user's closure, which may block (a
    data fetch, a collective), is interrupted at once, and the step recovers from its
    KeyboardInterrupt as from any exception the closure raises."""
    if closure is None:
        return None

    @functools.wraps(closure)
    def interruptible_closure(*args, **kwargs):
        with interruptible():
            return closure(*args, **kwargs)
    return interruptible_closure
