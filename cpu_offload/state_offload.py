# The "optimizer" offload mode: the wrapped optimizer's state tensors (AdamW's
# moments, ...) live in pinned host RAM between steps and visit the device only
# for step(). Weights and gradients stay on the device, so everything that
# reads ``param.grad`` (clipping, logging) keeps working.
#
# Scope: moving state tensors host <-> device around the wrapped optimizer's
# own step(); state_dict / load_state_dict that keep the state on the host,
# run the hooks registered on the wrapper and keep param_groups shared.
# Non-goals: running the optimizer on the CPU (that is offload="full"),
# splitting one step into pieces to cap the device memory of the step itself.

from __future__ import annotations

import torch

from cpu_offload.dtensor import as_dtensor_like, local_of
from cpu_offload.wrapping import adopt_optimizer, load_state_dict_with_hooks, state_dict_with_hooks

__all__ = ["StateOffloadOptimizer"]


class StateOffloadOptimizer(torch.optim.Optimizer):
    """Keeps a torch optimizer's state in host RAM between steps.

    Any ``torch.optim.Optimizer`` works: its ``step()`` runs unchanged on the
    device, after the state tensors were copied in; afterwards they are copied
    back into host buffers (pinned when CUDA is available, allocated once at
    the first step) and the device copies are freed. With CPU parameters the
    same copies run between two host tensors (that is how it is tested).

    Args:
        optimizer: the optimizer to wrap (its ``param_groups`` and ``state`` are shared).
        pin_memory: page-lock the host buffers (default: when CUDA is available;
            True without CUDA is a ValueError).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, pin_memory=None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be True, False or None, got {pin_memory!r}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (pinned host memory is allocated through the CUDA driver) "
                             "and torch.cuda.is_available() is False: leave pin_memory unset (it pins only when "
                             "CUDA is available) or pass pin_memory=False")
        adopt_optimizer(self, optimizer)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._host: dict = {}  # (id(param), key) -> host tensor (the local shard for DTensors)
        # NOTE: a list mutated in place, never rebound: Lightning's optimizer proxy
        # runs these methods with itself as ``self`` and reads missing attributes
        # from the wrapper, so a rebound flag would land on the proxy.
        self._unwaited: list = []  # CUDA events recorded after D2H copies into the host buffers

    @property
    def state(self):
        """The wrapped optimizer's state; between steps its tensors are the host buffers."""
        self._wait()  # the last step's copies into them may still be running
        return self.optimizer.state

    def _to_device(self) -> None:
        for p, st in self.optimizer.state.items():
            device = local_of(p).device
            for key, value in st.items():
                if not isinstance(value, torch.Tensor) or self._host.get((id(p), key)) is not local_of(value):
                    continue
                host = local_of(value)
                dev = torch.empty(host.shape, dtype=host.dtype, device=device)
                st[key] = as_dtensor_like(dev.copy_(host, non_blocking=True), value)

    def _to_host(self) -> None:
        streams = {}
        for p, st in self.optimizer.state.items():
            device = local_of(p).device
            for key, value in st.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue  # scalars such as AdamW's "step" stay where they are
                local = local_of(value)
                if local.device != device or local is self._host.get((id(p), key)):
                    continue
                host = self._host.get((id(p), key))
                if host is None or host.shape != local.shape or host.dtype != local.dtype:
                    host = torch.empty(local.shape, dtype=local.dtype, pin_memory=self.pin_memory)
                    self._host[(id(p), key)] = host
                # NOTE: asynchronous on the current stream: the next step's copy
                # back is ordered after it on the same stream; host readers call
                # _wait() first.
                host.copy_(local, non_blocking=self.pin_memory)
                st[key] = as_dtensor_like(host, value)
                if self.pin_memory and local.device.type == "cuda":
                    streams.setdefault(local.device, torch.cuda.current_stream(local.device))
        for stream in streams.values():
            event = torch.cuda.Event()
            event.record(stream)
            self._unwaited.append(event)

    def _wait(self) -> None:
        """Block until every D2H copy into the host buffers has landed."""
        while self._unwaited:
            self._unwaited.pop().synchronize()

    def step(self, closure=None):
        """Copy the state in, run the wrapped optimizer's step, copy it out."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._to_device()
        self.optimizer.step()
        self._to_host()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state_dict (its tensors are the host buffers),
        with the state_dict hooks registered on this wrapper run around it."""
        return state_dict_with_hooks(self, self._build_state_dict)

    def _build_state_dict(self) -> dict:
        self._wait()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped optimizer, keeping ``param_groups`` the same list
        of the same dicts; the load_state_dict hooks of this wrapper run around it."""
        load_state_dict_with_hooks(self, state_dict, self._apply_state_dict)

    def _apply_state_dict(self, state_dict: dict) -> None:
        self._wait()
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
        self._to_host()
        self._wait()

    def __repr__(self) -> str:
        return f"StateOffloadOptimizer({self.optimizer!r})"
