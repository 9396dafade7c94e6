# Where the optimizer state of the "optimizer" offload mode is, and moving it:
# host buffers between steps; device copies prefetched during backward, as
# gradients arrive (bounded by a byte cap); the rest copied in by step(); all of
# it copied back out after the step, as much of it overlapped with the next
# forward as that forward's memory allows (overlap.py).
#
# Scope: the host buffers, the gradient hooks that prefetch, the per-step
# bookkeeping (accumulation, arrival order, the cap) and the figures of stats().
# Non-goals: the torch.optim.Optimizer surface (_state/optimizer.py), streams and
# events (copies.py, copy_chain.py), splitting the wrapped optimizer's step.
#
# The life of one state tensor (AdamW's exp_avg of one parameter), step n:
#   host buffer ──(gradient hook of the window's last backward: copy-in on the
#   H2D chain, unless the cap is reached)──► device copy ──(step(): the rest is
#   copied in; compute waits for all copy-ins; the wrapped optimizer steps)──►
#   ──(copy-out on the D2H chain after the step, before the next forward or
#   during it; the device copy is freed once copied)──►
#   host buffer, read by the copy-in of step n+1 only after that copy-out.

from __future__ import annotations

import sys
import threading
import time
import warnings
import weakref

import torch

from cpu_offload._common.backward_end import watch_backward
from cpu_offload._common.checks import position_of
from cpu_offload._common.dtensor import as_dtensor_like, local_of
from cpu_offload._common.interrupts import deferred_interrupts
from cpu_offload._state.copies import make_state_copies
from cpu_offload._state.overlap import WritebackOverlap

__all__ = ["StateStaging"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# id() -> every host buffer a copy-out made, held weakly: a later step, of this wrapper or of
# another over the same optimizer, copies them in (state left by a closed or dropped wrapper,
# or kept by torch for a parameter out of the groups), and no other host tensor an optimizer
# keeps for a parameter elsewhere.
_HOST_BUFFERS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _held_elsewhere(host: torch.Tensor) -> bool:
    """Whether anything but ``StateStaging.host`` holds the buffer ``host`` or its memory (a kept
    ``state_dict()`` or state tensor, a view of it, a tensor detached from it)."""
    # NOTE: the references counted besides: StateStaging.host's, the caller's name, this argument
    # and getrefcount's own (a view holds its base); the storage's: the tensor's and the temporary
    # storage object's.
    if sys.getrefcount(host) > 4:
        return True
    use_count = getattr(torch._C, "_storage_Use_Count", None)  # NOTE: internal: if it goes, never reuse
    return use_count is None or use_count(host.untyped_storage()._cdata) > 2


def _on_grad(staging_ref):
    def hook(param):
        staging = staging_ref()
        if staging is not None:
            staging.grad_ready(param)
    return hook


def _versions(value: torch.Tensor):
    """The counters that in-place writes to ``value`` bump, or None (an inference tensor keeps none)."""
    # NOTE: an in-place op on a DTensor bumps the DTensor's counter, one through to_local() its
    # local shard's (a plain tensor: one counter, twice). Writes through ``.data`` bump neither.
    local = local_of(value)
    if local.is_inference():
        return None
    return value._version, local._version


def _remove_hooks(handles: dict) -> None:
    for handle in handles.values():
        handle.remove()
    handles.clear()


class StateStaging:
    """The state of ``optimizer``, kept in host buffers between steps.

    Args:
        optimizer: the wrapped optimizer (its ``state`` is edited in place).
        pin: page-lock the host buffers.
        prefetch_bytes: cap on the bytes copied in during backward and not yet
            stepped; ``None``: no cap (all of it may be).
        grad_accum_steps: backward passes per step, or ``None``: the most seen
            in one window so far (nothing is prefetched before one window was
            seen). The copy-in of a parameter's state starts with its gradient
            in the window's last backward.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, pin: bool, prefetch_bytes, grad_accum_steps: int):
        self.optimizer = optimizer
        self.pin = pin
        self.prefetch_bytes = prefetch_bytes
        self.grad_accum_steps = grad_accum_steps
        self.host: dict = {}  # (id(param), key) -> host tensor (the local shard for DTensors)
        self.placed: dict = {}  # (id(param), key) -> the step's copy of that host tensor, until copied out
        self.copies: dict = {}  # device -> CudaStateCopies | SyncStateCopies
        self.out_events: dict = {}  # id(param) -> event after the last copy-out of its state
        self.prefetched: dict = {}  # id(param) -> {key: (state value, its _versions, device copy)}
        self.overlap = WritebackOverlap()
        self.staged_bytes = 0  # bytes in ``prefetched``
        self.prefetch_failed = False  # a prefetch ran out of device memory: none until the next step
        self.window = 0  # the most backward passes completed between two steps so far
        self.completed = 0  # backward passes completed since the last step (or zero_grad)
        self.watching = False  # the end of the running backward is being watched
        self.in_groups: set = set()  # id() of the groups' parameters when the running backward began
        self.stepping = False  # inside the wrapped step (a closure it calls may run backward)
        self.arrived: set = set()  # id(param) of every gradient since the last step
        self.arrival: list = []  # parameters in the order their first gradient arrived
        self.h2d_bytes = 0  # since the last step, prefetches included
        self.timing = None  # the last step's timing events around the wait for copy-ins
        self.refused = None  # why this optimizer's state cannot be offloaded, once a step showed it
        self.closed = False  # close(): no hooks, no copies; the state stays in the host buffers
        self.kept_on_device: set = set()  # (id(param), key) of sparse state tensors, each warned about once
        self.last_stats = {"h2d_bytes": 0, "d2h_bytes": 0, "prefetched_bytes": 0, "step_copied_bytes": 0,
                           "overlapped_d2h_bytes": 0, "step_blocked_s": 0.0, "copy_wait_s": 0.0, "host_bytes": 0}
        # NOTE: hooks run on autograd's device threads (FSDP2: on its reduce path);
        # the lock keeps them from interleaving with each other and with step().
        self.lock = threading.Lock()
        self.handles: dict = {}  # id(param) -> hook handle
        # NOTE: the hooks hold this object weakly; once it is gone they are removed.
        weakref.finalize(self, _remove_hooks, self.handles)

    # ------------------------------------------------------------- hooks
    def hook_params(self) -> None:
        """Register the gradient hook on every parameter that needs one (new
        groups, parameters unfrozen since)."""
        if self.closed:
            return
        new = [(g, i, p) for g, i, p in self._positions() if p.requires_grad and id(p) not in self.handles]
        for g, i, p in new:  # NOTE: all checked before any is hooked
            if not p.is_leaf:
                raise ValueError(f"param_groups[{g}][{i}] is not a leaf tensor (torch's optimizers take those with "
                                 "differentiable=True): offload=\"optimizer\" follows each gradient with a hook torch "
                                 "allows on leaf tensors only; use offload=\"none\"")
        hook = _on_grad(weakref.ref(self)) if new else None
        for _, _, p in new:
            self.handles[id(p)] = p.register_post_accumulate_grad_hook(hook)

    def grad_ready(self, p: torch.Tensor) -> None:
        """Gradient hook: prefetch ``p``'s state during the window's last backward."""
        if self.stepping:  # a backward of the step's closure: the state is in already
            return
        with self.lock:
            if not self.watching:  # the first gradient of this backward
                self.watching = True
                watch_backward(self._backward_ended, self._backward_died)
                self.in_groups = {id(q) for *_, q in self._positions()}
            if id(p) not in self.arrived:
                if not self.arrived:
                    engine = self.copies.get(local_of(p).device)
                    if engine is not None and engine.device.type == "cuda":
                        self.overlap.gradient_arrived(engine.compute)
                self.arrived.add(id(p))
                self.arrival.append(p)
            # NOTE: a prefetch before the window's last backward would hold the
            # state on the device through the remaining forward passes, at
            # their activation peak; and once per step: a later backward (one
            # more than expected, a rerun after an exception) finds it staged.
            last = max(self.grad_accum_steps or 0, self.window)
            if (last and self.completed + 1 >= last and id(p) not in self.prefetched
                    and not self.prefetch_failed and id(p) in self.in_groups):
                self._prefetch(p)

    def _backward_ended(self) -> None:
        self.completed += 1
        self.watching = False

    def _backward_died(self) -> None:
        # NOTE: may run on another thread, during garbage collection: it only
        # records the fact (a backward that raised does not count).
        self.watching = False

    def _entries(self, p: torch.Tensor) -> list:
        """(key, value, host tensor) for each state tensor of ``p`` now on the host: its host
        buffer, a host tensor the caller put in its place since the last step, or a host
        buffer any copy-out made (``_HOST_BUFFERS``)."""
        state = self.optimizer.state.get(p)
        if not state:
            return []
        entries = []
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            local = local_of(value)
            if local.device.type == "cpu" and ((id(p), key) in self.host or _HOST_BUFFERS.get(id(local)) is local):
                entries.append((key, value, local))
        return entries

    def _engine(self, device: torch.device):
        engine = self.copies.get(device)
        if engine is None:
            engine = self.copies[device] = make_state_copies(device)
        return engine

    def _prefetch(self, p: torch.Tensor) -> None:
        entries = self._entries(p)
        if not entries:
            return  # no state yet (first step), or none of it offloaded
        nbytes = sum(_nbytes(host) for _, _, host in entries)
        if self.prefetch_bytes is not None and self.staged_bytes + nbytes > self.prefetch_bytes:
            return  # copied in by step()
        versions = [_versions(value) for _, value, _ in entries]
        if None in versions:
            return  # copied in by step(): an edit could not be told
        engine = self._engine(local_of(p).device)
        try:
            devs = engine.copy_in([host for _, _, host in entries], after=self.out_events.get(id(p)))
        except torch.cuda.OutOfMemoryError:
            # NOTE: a prefetch must never be what fails a backward: step() copies
            # the rest in, when the activations are gone.
            self.prefetch_failed = True
            return
        self.prefetched[id(p)] = {key: (value, version, dev)
                                  for (key, value, _), version, dev in zip(entries, versions, devs)}
        self.staged_bytes += nbytes
        self.h2d_bytes += nbytes

    def discard_prefetched(self) -> None:
        """Drop the copies made since the last step (the host buffers may be
        about to change); step() copies the state in again."""
        with self.lock:
            self._clear_prefetched()

    def _clear_prefetched(self) -> None:
        self.prefetched.clear()  # NOTE: safe: each device copy was marked used by the H2D chain
        self.staged_bytes = 0

    def reset_window(self) -> None:
        """zero_grad(): the next backward starts a new accumulation window."""
        with self.lock:
            self.completed = 0
            self.arrived.clear()
            self.arrival.clear()
            self.prefetch_failed = False

    # -------------------------------------------------------------- step
    def run_step(self, step) -> None:
        """Copy the rest of the state in, run ``step()``, copy all of it out.

        NOTE: a Ctrl-C lands after the whole of it: ``_copy_out`` issues every copy, then points
        the state entries at their host buffers one by one, so an interrupt in between would
        leave some entries on the device and others on the host; and an interrupt inside the
        wrapped step leaves some parameters stepped and others not. So a Ctrl-C never leaves
        the step half taken."""
        if self.refused is not None:
            raise RuntimeError(self.refused)
        start = time.perf_counter()
        self.hook_params()
        used = copied = 0
        with deferred_interrupts():
            try:
                with self.lock:
                    used, copied = self._bring_in()
                    placed = self._state_ids()
                self.stepping = True
                step()
                self._refuse_shared_storage(placed)
            finally:
                self.stepping = False
                with self.lock:
                    d2h, overlapped = self._copy_out(self.overlap.overlap_bytes())
                    self._clear_prefetched()
                    self.window = max(self.window, self.completed)
                    self.completed = 0
                    self.arrived.clear()
                    self.arrival.clear()
                    self.prefetch_failed = False
                    h2d, self.h2d_bytes = self.h2d_bytes + copied, 0
            self.last_stats = {"h2d_bytes": h2d, "d2h_bytes": d2h, "prefetched_bytes": used,
                               "step_copied_bytes": copied, "overlapped_d2h_bytes": overlapped,
                               "step_blocked_s": time.perf_counter() - start,
                               "copy_wait_s": None if self.timing else 0.0,
                               "host_bytes": sum(_nbytes(t) for t in self.host.values())}

    def _positions(self):
        """(g, i, p) for each parameter of the groups, at its first place (``param_groups[g][i]``).

        NOTE: torch steps a parameter listed twice (with a warning) once, with one state: so it
        gets one hook, one copy each way and one storage check here."""
        seen = set()
        for g, group in enumerate(self.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield g, i, p

    def _params(self) -> list:
        """Every parameter of the groups once, those whose gradient arrived first, in that order.

        NOTE: torch leaves the state of a parameter taken out of the groups where it is: so does
        this mode, with a gradient or without."""
        params = {id(p): p for *_, p in self._positions()}
        arrived = [p for p in self.arrival if id(p) in params]
        return arrived + [p for i, p in params.items() if i not in self.arrived]

    def _state_ids(self) -> set:
        """id() of every value in the wrapped optimizer's state.

        NOTE: torch's state may hold entries under keys other than parameters (a step count,
        say), whose values need not be dicts; they stay where the optimizer keeps them."""
        return {id(value) for state in self.optimizer.state.values() if isinstance(state, dict)
                for value in state.values()}

    def _refuse_shared_storage(self, placed: set) -> None:
        """Raise (and refuse every later step) if the step just run made state tensors that share
        storage: views into a larger tensor, or one storage under two entries. ``placed``: the
        ``_state_ids`` before the step."""
        # NOTE: each state tensor moves to its own host buffer, and the next step gets a fresh
        # device copy of it. An optimizer that keeps views into a buffer it updates through
        # another reference (one flat buffer, one op per step) would go on stepping that
        # buffer while state_dict() saved the first step's values. Only tensors the step
        # itself made (dim >= 1, on its parameter's device) are checked: a checkpoint loaded
        # with views (torch.save keeps them) is moved apart by the load, as a per-tensor
        # optimizer such as AdamW expects.
        owners: dict = {}
        for g, i, p in self._positions():
            for key, value in (self.optimizer.state.get(p) or {}).items():
                if (id(value) in placed or not isinstance(value, torch.Tensor) or value.dim() == 0
                        or value.layout != torch.strided):  # a sparse tensor stays on the device
                    continue
                local = local_of(value)
                if local.device != local_of(p).device or local.numel() == 0:
                    continue
                self._check_own_storage(local, f"{type(self.optimizer).__name__}'s state "
                                               f"param_groups[{g}][{i}]['{key}']", owners)

    def _check_own_storage(self, local: torch.Tensor, where: str, owners: dict) -> None:
        storage = local.untyped_storage()
        if storage.nbytes() > _nbytes(local):
            self.refused = (
                f"{where} is a view into a larger tensor ({storage.nbytes()} bytes, the view {_nbytes(local)}), "
                "which the optimizer's step may update through another reference: offload='optimizer' moves "
                "each state tensor to its own host buffer between steps, so that buffer would no longer be the "
                "state and state_dict() would not save what the step uses. Keep each state tensor in its own "
                "storage, or use offload='none' for this optimizer.")
            raise RuntimeError(self.refused)
        other = owners.setdefault(storage.data_ptr(), where)
        if other != where:
            self.refused = (
                f"{where} shares its storage with {other}: offload='optimizer' moves each state tensor to its "
                "own host buffer between steps, which would part them. Keep each state tensor in its own "
                "storage, or use offload='none' for this optimizer.")
            raise RuntimeError(self.refused)

    def _bring_in(self) -> tuple:
        """Swap the prefetched copies into the state, copy in the rest; returns
        (bytes prefetched and used, bytes copied now)."""
        for engine in self.copies.values():
            engine.set_compute_stream()
        used, later = 0, {}
        for p in self._params():
            entries = self._entries(p)
            if not entries:
                continue
            staged = self.prefetched.pop(id(p), {})
            state = self.optimizer.state[p]
            for key, value, host in entries:
                staged_value, version, dev = staged.get(key, (None, None, None))
                # NOTE: the caller may have edited the state since this backward copied it in,
                # through a reference taken before: a replaced tensor or dict, or an in-place
                # write (a moved version counter), has it copied in again.
                if staged_value is value and version == _versions(value):
                    state[key] = self._place(p, key, as_dtensor_like(dev, value), host)
                    used += _nbytes(host)
                else:
                    later.setdefault(local_of(p).device, []).append((p, state, key, value, host))
        copied = 0
        for device, items in later.items():
            engine = self._engine(device)
            # NOTE: after the latest copy-out of any host buffer (by now long done).
            devs = engine.copy_in([host for *_, host in items], after=engine.last_out)
            for (p, state, key, value, host), dev in zip(items, devs):
                state[key] = self._place(p, key, as_dtensor_like(dev, value), host)
                copied += _nbytes(host)
        self.timing = None
        for engine in self.copies.values():
            timing = engine.compute_waits_for_copy_ins(timed=self.timing is None)
            self.timing = self.timing or timing
        return used, copied

    def _place(self, p: torch.Tensor, key: str, dev: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """``dev``, the step's copy of ``host``; remembered when ``host`` is the buffer ``_copy_out``
        may write it back into."""
        if host is self.host.get((id(p), key)):
            self.placed[(id(p), key)] = dev
        return dev

    def _copy_out(self, overlap_bytes: int = 0) -> tuple:
        """Move every device state tensor (dim >= 1, on its parameter's device)
        to its host buffer, all but ``overlap_bytes`` of it before the compute
        stream goes on; returns the bytes copied, and those left to overlap."""
        by_device: dict = {}
        # NOTE: an entry points at its host buffer only once every copy is issued: a buffer that
        # cannot be allocated, or a copy that fails, leaves the step's device tensors in place.
        entries = []
        for p in self._params():
            state = self.optimizer.state.get(p)
            if not state:
                continue
            device = local_of(p).device
            pairs = []
            for key, value in state.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue  # scalars such as AdamW's "step" stay where they are
                if value.layout != torch.strided:
                    self._keep_on_device(p, key)
                    continue
                local = local_of(value)
                host = self.host.get((id(p), key))
                if local.device != device or local is host:
                    continue
                # NOTE: a buffer takes back the copy the step got from it. A state tensor the
                # step made, or one a load, a reset or an assignment put in its place, gets a new
                # buffer while anything else holds the old one (a state_dict() kept from before,
                # as torch's keeps the tensors the state had then); so pinning, which is slow, and
                # the memory it takes happen once for an optimizer that writes its state in place
                # or out of place.
                if host is None or host.shape != local.shape or host.dtype != local.dtype or (
                        self.placed.get((id(p), key)) is not value and _held_elsewhere(host)):
                    host = torch.empty_like(local, device="cpu", pin_memory=self.pin)
                    self.host[(id(p), key)] = _HOST_BUFFERS[id(host)] = host
                pairs.append((host, local))
                entries.append((state, key, host, value))
            if pairs:
                by_device.setdefault(device, []).append((p, pairs))
        moved = overlapped = 0
        for device, items in by_device.items():
            engine = self._engine(device)
            events, timing = engine.copy_out([pairs for _, pairs in items], overlap_bytes)
            nbytes = sum(_nbytes(host) for _, pairs in items for host, _ in pairs)
            for (p, _), event in zip(items, events):
                self.out_events[id(p)] = event
            moved += nbytes
            if device.type == "cuda":
                overlapped += nbytes - (timing[2] if timing else 0)
                self.overlap.step_ended(engine.compute, timing)
        for state, key, host, value in entries:
            state[key] = as_dtensor_like(host, value)
        self.placed.clear()
        # NOTE: the buffers of state that is gone (a load or reset that did not make it again,
        # ``del opt.state[p]``, a parameter left out of the groups) are freed, not kept for good.
        live = {(id(p), key) for p in self._params() for key in (self.optimizer.state.get(p) or {})}
        for stale in [k for k in self.host if k not in live]:
            del self.host[stale]
        return moved, overlapped

    def _keep_on_device(self, p: torch.Tensor, key: str) -> None:
        """A state tensor that is not strided (SGD's momentum of a sparse gradient) stays where the
        step made it: its size changes from step to step, so no fixed host buffer can hold it."""
        if (id(p), key) in self.kept_on_device:
            return
        self.kept_on_device.add((id(p), key))
        where = position_of(self.optimizer.param_groups, p)
        warnings.warn(f"{type(self.optimizer).__name__}'s state {where}['{key}'] is a sparse tensor: it stays on "
                      "its parameter's device between steps (offload='optimizer' moves only strided state "
                      "tensors to the host)", stacklevel=4)

    # ------------------------------------------------------------ waiting
    def wait(self) -> None:
        """Block until every copy-out has landed in the host buffers."""
        for engine in list(self.copies.values()):
            engine.wait_copy_outs()

    def drain(self) -> None:
        """Block until no copy runs in either direction; drop the prefetched copies."""
        for engine in list(self.copies.values()):
            engine.synchronize()
        self.discard_prefetched()

    def close(self) -> None:
        """Every copy landed, the gradient hooks removed; the state stays in the host buffers."""
        self.drain()
        with self.lock:
            self.closed = True
            _remove_hooks(self.handles)

    def copy_all_out(self) -> None:
        """Move state the wrapped optimizer holds on the device (a loaded state_dict) to the host."""
        with self.lock:
            for engine in self.copies.values():
                engine.set_compute_stream()  # the stream torch's load_state_dict copied on
            self._copy_out()

    def stats(self) -> dict:
        stats = dict(self.last_stats)
        if self.timing is not None and stats["copy_wait_s"] is None:
            start, end = self.timing
            if end.query():
                stats["copy_wait_s"] = self.last_stats["copy_wait_s"] = start.elapsed_time(end) / 1e3
        return stats
