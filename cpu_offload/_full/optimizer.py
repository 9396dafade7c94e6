# FullCPUOffloadOptimizer: optimizer-in-backward with everything but the
# compute copy in host RAM.
#
# The device keeps only each parameter's compute copy (bf16 by default). The
# fp32 masters, the AdamW moments and the accumulated gradients live in host
# RAM; per-parameter post-accumulate-grad hooks stream gradients to the host
# during backward, the native kernels step each chunk as soon as its last
# gradient landed, and the new compute copy goes back during the same backward.
#
# The backward/step protocol is one state machine: its phases and allowed transitions are
# protocol.py's table; every phase change goes through ``ProtocolState.move``.
#
# A worker failure is raised once on the caller's thread; the window it hit is
# closed as after an aborted backward, and the next window works again. When the
# last backward ends, the speculative step is validated (validation.py):
# skipped on a non-finite gradient, redone when clipping changes its factor.
# NOTE: a rollback or redo (and a load), and the work at the end of a backward, are atomic
# against Ctrl-C (_common/interrupts.py): the KeyboardInterrupt is raised once the mutation is
# complete. A backward that raised is recovered at the next call, or before the next module
# forward (_common/backward_end.py's NextForwardHook), whichever comes first.
#
# Scope: construction (checks, binding, host state, pinned rings, hooks), the
# protocol above, zero_grad, clip_grad_norm_, stats, close. Non-goals:
# optimizers other than torch AdamW and cpu_offload.SignSGD, parameters on
# several devices.

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import warnings
import weakref
from typing import Iterable, Optional, Union

import torch

from cpu_offload._full import checkpoint
from cpu_offload._full import ownership
from cpu_offload._common.backward_end import NextForwardHook, outside_backward, watch_backward
from cpu_offload._common.checks import position_of
from cpu_offload._full.host_state import (
    adopt_edits_before_step, adopt_external_weights, allocate_host_state, allocate_retained, available_host_ram,
    cast_to_compute, check_fsdp_not_started, check_fsdp_uniform_dtypes, check_host_ram, check_moved_storage,
    collect_records, host_bytes_needed, note_versions, restore_dtypes, show_steps, take_masters_written_in_place,
    write_compute_copies,
)
from cpu_offload._common.dtensor import local_of
from cpu_offload._full.dtype_hint import add_note, watch_first_forward
from cpu_offload._common.interrupts import deferred_interrupts
from cpu_offload._full.options import (
    check_clipping_options, check_gpu_state, check_keep_fp32, check_optimizer, check_options, check_stream_share,
    check_timeout, read_hparams, ring_rooms, staging_rings,
)
from cpu_offload._full.binding import bind_for
from cpu_offload._full.pipeline import Pipeline
from cpu_offload._full.streamed_step import StreamedStep, choose_streamed
from cpu_offload._full.rank_agreement import check_ranks_agree
from cpu_offload._full.protocol import Phase, ProtocolError, ProtocolState
from cpu_offload._full.state_mapping import StateMapping, for_device_placement, step_edits, take_step_edits
from cpu_offload._full.validation import StepValidator
from cpu_offload._full.trace import trace_from_env
from cpu_offload._full.transfer import HostRing, make_transfer
from cpu_offload._full.window import finish_window, land_window, reset_window, salvage_window
from cpu_offload._full.forward_overlap import attach_forward_waits, check_overlap_model
from cpu_offload._full import device_state
from cpu_offload._full.device_state import (
    AutoSplit, DeviceState, auto_margin, choose_device_records, device_bytes_per_element, records_to_free_host,
)
from cpu_offload._full.controls import WindowControls
from cpu_offload._full import torch_clipping, torch_zero_grad
from cpu_offload._common.wrapping import (
    adopt_optimizer, load_state_dict_with_hooks, refuse_copy, release_optimizer, state_dict_with_hooks,
)

__all__ = ["FullCPUOffloadOptimizer"]

# NOTE: at import, so that a script importing clip_grad_norm_ from torch after cpu_offload
# gets the function that clips full offload's gradients through the optimizer.
torch_clipping.install()
torch_zero_grad.install()


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this
    package and torch (whose optimizer and autograd wrappers sit in between)."""
    skip = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__))  # the package
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def _in_compiled_autograd() -> bool:
    """Whether this backward runs under compiled autograd. NOTE: looked up in sys.modules, not
    imported: importing dynamo costs a second, and a module nobody imported is not active."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(module, "in_compiled_autograd_region", False))


def _shutdown(records, pipeline, transfer, handles, trace, pid: int, proto, *, finish_queued: bool = True) -> None:
    """Release what a wrapper holds and write its trace; must not reference the wrapper (it
    runs from a finalizer). ``finish_queued``: the chunks queued or running are stepped
    first (close() has landed them already). NOTE: whole or not at all against Ctrl-C: run
    by the garbage collector, an interrupt is dropped where it lands, and left hooks and an
    owner behind. NOTE: in a child forked from process ``pid`` (its exit, or the wrapper
    dropped there) nothing is done: the worker thread it would wait for is the parent's
    only, and the trace is the parent's to write."""
    if os.getpid() != pid:
        return
    if finish_queued and pipeline.on_worker_thread():
        # NOTE: the garbage collector ran this finalizer on the worker, in a chunk: it cannot
        # wait for itself, so another thread waits for the queued chunks, then releases
        threading.Thread(target=_shutdown, args=(records, pipeline, transfer, handles, trace, pid, proto),
                         name="cpu_offload-shutdown", daemon=True).start()
        return
    # NOTE: warned once everything is released: under -W error a warning raises, and the
    # worker, the rings and the trace would be left behind
    said = []
    if proto.phase is Phase.APPLIED:
        said.append("cpu_offload: a full-offload optimizer was released after a window's last backward pass without "
                    "step() (in a reference cycle, at exit, or on its worker thread): the window's step was not "
                    "completed, so parameters whose state is on the device, or whose update a clipping factor "
                    "changes, did not take it; call step() or close() before dropping it")
    with deferred_interrupts():
        _unhook(records, handles)
        if finish_queued:
            # NOTE: chunks of a step() that returned before they ran (overlap_forward): a
            # wrapper dropped right after its last step left some weights without it. A
            # failure there cannot be raised from a finalizer (the next forward would have):
            # it warns, or a run whose last step half failed would end as if it had not.
            try:
                pipeline.drain()
                err = pipeline.take_error()
            except Exception as exc:
                err = exc
            if err is not None and proto.landing:
                said.append(f"cpu_offload: the last step() had not landed when its optimizer was released, and no "
                            f"forward or close() followed to raise this: {err}; {_landing_note(records)}")
        pipeline.close()
        try:
            transfer.synchronize()
        except Exception:  # the device may already be gone at interpreter exit
            pass
        trace.write()
    for message in said:
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def _keeps_grad_mode_on_failure(init):
    """A construction that raises leaves torch's grad mode as it found it. NOTE: a Ctrl-C in
    ``torch.no_grad``'s ``__exit__`` (the casts run under it) is raised before that restores
    the mode, and the next backward would fail, saying nothing requires a gradient."""
    @functools.wraps(init)
    def construct(self, *args, **kwargs):
        enabled = torch.is_grad_enabled()
        try:
            init(self, *args, **kwargs)
        except BaseException:
            torch.set_grad_enabled(enabled)
            raise
    return construct


def _landing_note(records) -> str:
    """Which parameters took a step whose chunks failed after step() returned (overlap_forward),
    before the window's bookkeeping is reset."""
    stepped = [r for r in records if r.stepped and not r.on_device]
    torn = [r.name for r in records if r.torn]
    unfinished = [r.name for r in records if r.pieces_total and not r.stepped and not r.torn]
    return (f"after step() returned, so {len(stepped)} of {len(records)} parameters took that step and "
            f"{unfinished[:8]} did not (as if they had no gradient)"
            + (f"; {torn} were only partly updated: reload the last checkpoint" if torn else ""))


def _unhook(records, handles) -> None:
    """Remove a wrapper's forward waits and gradient hooks, and its claim on the parameters."""
    for handle in handles:
        handle.remove()
    handles.clear()
    for rec in records:
        if rec.hook is not None:
            rec.hook.remove()
            rec.hook = None
    ownership.release(rec.param for rec in records)


# Why the state cannot be read or saved between the window's last backward and step().
_STEP_APPLIED = ("full offload applies the step's update during the window's last backward, so the state is (partly) "
                 "the step's already, where torch's optimizer would show the one before it; call it after step()")


def _late_masters_message(records) -> str:
    return (f"cpu_offload: the masters of {[r.name for r in records][:8]} (opt.state[p]['master']) were written in place "
            "after the window's last backward pass and before step(); with offload='full' that backward had already "
            "applied their update, so it could not update the written masters as torch's step() would. The written "
            "masters are kept without this step's update (the weights are now round(master)); their moments and step "
            "counts are this step's. Write masters after step(), or before the window's last backward pass")


def _late_edits_error(records, call: str, counts=(), masters=()) -> RuntimeError:
    """The error for weights (``records``), step counts (``counts``: their records) and masters
    (``masters``: their records) changed in place after their update ran in the window's last
    backward."""
    said = [_late_masters_message(masters)] if masters else []
    if records:
        said.append(
            f"cpu_offload: {[r.name for r in records][:8]} changed in place after the window's last backward pass and "
            f"before {call}; with offload='full' that backward had already applied their update, so it could not "
            "update the changed weights as torch's step() would. The change was undone: the weights are this step's "
            "result. Change weights after step(), or before the window's last backward pass")
    if counts:
        said.append(
            f"cpu_offload: the step counts of {[r.name for r in counts][:8]} (opt.state[p]['step']) changed in place "
            f"after the window's last backward pass and before {call}; with offload='full' that backward had already "
            "applied their update with the count as it was, so the changed count could not be used as torch's step() "
            "would. The change was undone: the counts are this step's result. Change step counts after step(), or "
            "before the window's last backward pass")
    return RuntimeError(". ".join(said))


def _param_ids(param_groups) -> list:
    """The identity of each group's parameters, in order. NOTE: the wrapped parameters stay
    alive (the wrapper holds each one), so no other object can take one of their ids."""
    return [[id(p) for p in group["params"]] for group in param_groups]


_GRAD_SCALER_STEP = torch.amp.GradScaler.step.__code__


class FullCPUOffloadOptimizer(WindowControls, torch.optim.Optimizer):
    """Wraps a torch.optim.AdamW or cpu_offload.SignSGD and runs it on the CPU
    during backward.

    After construction the model's trainable parameters hold their compute copy
    (cast in place), and ``param.grad`` is ``None`` after backward: the
    gradients went to the host. Call ``step()`` after every ``grad_accum_steps``
    backward passes (after fewer, it steps on what was accumulated).

    Args:
        optimizer: the optimizer to wrap (its ``param_groups`` dicts are shared,
            so LR schedulers keep working; a changed lr applies to the next step).
        grad_accum_steps: backward passes per optimizer step; the first ones
            accumulate gradients in fp32 host buffers (which exist only when
            this is > 1). It may be set again before each window (see
            ``WindowControls.grad_accum_steps``).
        compute_dtype: dtype of the compute copy, ``torch.bfloat16`` (default)
            or ``torch.float32``.
        state_dtype: dtype of AdamW's two moments in host RAM, ``torch.float32``
            (default) or ``torch.bfloat16`` (8 instead of 12 B per parameter;
            masters stay fp32; each step computes in fp32 and rounds the moments
            to bf16 afterwards, which torch.optim.AdamW does not). AdamW only.
        keep_fp32: parameters whose compute copy stays fp32.
        pinned_bytes: total size of the two staging rings (default None: 1/8 of the
            gradient bytes, between 512 MiB and 4 GiB; 512 MiB when the host RAM has no
            room for more; with ``overlap_forward``, the device-to-host ring grows towards
            every gradient, within half of the host RAM left: ``options.staging_rings``).
        num_slots: slots per ring (default None: slots of about 256 MiB, at least 4).
        timeout_s: limit for every wait of the pipeline (default 600 s; settable later). The
            recovery after a wait that timed out runs the chunks already queued first, past it.
        sysfs_root: where sysfs is mounted (for the topology binding).
        max_grad_norm: clip every step to this total 2-norm, as
            ``torch.nn.utils.clip_grad_norm_`` would (default None: only when
            ``clip_grad_norm_`` is called).
        skip_nonfinite: skip a step whose gradients hold NaN or Inf on any rank,
            leaving masters, moments and step counts as before it (default True;
            False: torch's behaviour).
        grad_copy: where each step's gradient is kept (without accumulation)
            so that clipping can redo the step: ``"device"`` (default: the
            gradients stay on the device until the window closes, 2 B per
            parameter of device memory at the end of backward) or ``"host"``
            (a copy in host RAM, 2 B per parameter, made by the CPU during the
            step: no device memory, but more host memory traffic).
        gpu_state: bytes of device memory for the state of parameters spread evenly over
            the optimizer's order (fp32 master and moments, and the fp32 accumulator with
            grad_accum_steps > 1), which then stay on the device and are stepped there when
            the window closes, bit-identically to the host kernel (device_state.py); the
            rest stays on the host. ``"auto"``: after the first 3 windows, what their peak
            leaves free on the device less a margin (10%, at least 4 GiB); at construction,
            parameters spread over the model that make the host state fit when it would not.
            Default None: all on the host.
        overlap_forward: the model (``nn.Module``) whose forward reads the parameters. Then
            ``step()`` returns while the CPU still steps the window's last chunks, stepped in
            the order the next forward reads them; each module of the model waits for its own
            new weights when its forward starts (forward_overlap.py). A read of a weight
            outside the model's module forwards before that (an EMA or a log after
            ``step()``) must call ``wait_for_weights()`` first; the optimizer's own calls,
            a module's ``state_dict()`` and the next backward wait by themselves. Default
            None: ``step()`` returns once every new weight is on the device, as in torch.
        stream_share: the share (0 to 1, of their elements) of the host parameters, spread
            evenly over the optimizer's order, whose master and moments stay in pinned host
            memory and are stepped on the device when the window closes: their state crosses
            to the device and back, the CPU steps the rest (streamed_step.py). The same bits
            as the CPU's step. The window's last backward then returns without waiting for the
            CPU's last chunks; step() waits for them (and a module forward before it). Default
            0: the CPU steps every host parameter.
    """

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """True when torch.amp.GradScaler.step() asks: it then calls step() with its grad_scale and
        found_inf set, which step() refuses, saying why (else it raised "No inf checks were
        recorded"). NOTE: False for anyone else: Lightning's mixed precision refuses to clip an
        optimizer that unscales its own gradients, which this one does not."""
        return sys._getframe(1).f_code is _GRAD_SCALER_STEP

    @_keeps_grad_mode_on_failure
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        grad_accum_steps: int = 1,
        compute_dtype: torch.dtype = torch.bfloat16,
        state_dtype: torch.dtype = torch.float32,
        keep_fp32: Iterable[torch.Tensor] = (),
        pinned_bytes: Optional[int] = None,
        num_slots: Optional[int] = None,
        timeout_s: float = 600.0,
        sysfs_root: str = "/sys",
        max_grad_norm: Optional[float] = None,
        skip_nonfinite: bool = True,
        grad_copy: str = "device",
        gpu_state: Optional[Union[int, str]] = None,
        overlap_forward: Optional[torch.nn.Module] = None,
        stream_share: float = 0.0,
    ) -> None:
        self._proto = ProtocolState()  # CLOSED until fully constructed
        self._algorithm = check_optimizer(optimizer)
        self._bf16_moments = state_dtype == torch.bfloat16
        check_options(algorithm=self._algorithm, grad_accum_steps=grad_accum_steps, compute_dtype=compute_dtype,
                      state_dtype=state_dtype, num_slots=num_slots, pinned_bytes=pinned_bytes, timeout_s=timeout_s,
                      sysfs_root=sysfs_root)
        max_grad_norm = check_clipping_options(max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite,
                                               grad_copy=grad_copy)
        hparams = read_hparams(optimizer.param_groups, self._algorithm, bf16_moments=self._bf16_moments)
        # NOTE: the state of an optimizer that has stepped (or loaded a checkpoint) carries over,
        # as a load of its state_dict would; read now, before the weights are cast
        carried = optimizer.state_dict() if any(optimizer.state.values()) else None
        if carried is not None:  # NOTE: an entry a lookup made (torch's state is a defaultdict) holds nothing
            carried["state"] = {i: entry for i, entry in carried["state"].items() if entry}
        check_gpu_state(gpu_state)
        stream_share = check_stream_share(stream_share)
        keep = check_keep_fp32(keep_fp32, optimizer)
        trace = trace_from_env()
        tracking = skip_nonfinite or max_grad_norm is not None
        records, frozen = collect_records(optimizer)
        check_overlap_model(overlap_forward, records)
        ownership.check_unowned(records)
        ownership.check_not_cast(records)
        ownership.check_not_ddp(records)
        check_fsdp_not_started(records)
        check_fsdp_uniform_dtypes(records, compute_dtype=compute_dtype, keep_fp32=keep)
        options = dict(algorithm=self._algorithm, grad_accum_steps=grad_accum_steps, compute_dtype=str(compute_dtype),
                       state_dtype=str(state_dtype), max_grad_norm=max_grad_norm, skip_nonfinite=bool(skip_nonfinite))
        check_ranks_agree(records, hparams, options=options, keep_fp32=keep)
        device = records[0].local().device
        moments = self._algorithm == "adamw"
        accumulate = grad_accum_steps > 1
        if accumulate:
            grad_copy = None  # the accumulators hold the window's gradient
        # NOTE: with accumulation and norm tracking the norms come from the accumulators the
        # window's chunks complete: such windows land before validation, as without the option
        overlap = overlap_forward is not None and not (accumulate and tracking)
        copy_itemsize = 0 if grad_copy != "host" else 2 if compute_dtype == torch.bfloat16 else 4
        per_element = device_bytes_per_element(moments=moments, state_dtype=state_dtype, accumulate=accumulate)

        def host_needed(recs):
            return host_bytes_needed(recs, moments=moments, accumulate=accumulate, state_dtype=state_dtype,
                                     grad_itemsize=lambda r: 4 if copy_itemsize and id(r.param) in keep
                                     else copy_itemsize)

        def rings(recs, room, backlog=overlap, fill=False):
            return staging_rings(recs, keep, compute_dtype, pinned_bytes=pinned_bytes, num_slots=num_slots, room=room,
                                 backlog=backlog, fill=fill)

        def on_host(on_device):
            moved = {id(r) for r in on_device}
            return [r for r in records if id(r) not in moved]

        on_device = choose_device_records(records, gpu_state, per_element) if isinstance(gpu_state, int) else []
        host_records = on_host(on_device)
        needed = host_needed(host_records)
        available = available_host_ram()  # NOTE: one reading for every sizing decision below
        shape = rings(host_records, available - needed)
        reading, why = None, ""
        if gpu_state == "auto":
            margin = device_state.host_margin()
            shortage = needed + shape.nbytes + margin - available
            reading = device_state.free_memory(device) if shortage > 0 else None
        if reading is not None:
            # NOTE: the all-host run would not start: put parameters spread over the model on
            # the device that make the host state fit, if the device has room for them now;
            # then size the rings for what stays on the host. The host is to keep room for the
            # rings' default size; when the device cannot take that much state, for the
            # largest rings, in steps of 512 MiB down to the smallest, that it can (at 21B, in
            # two runs of the same code, backward waited 2.6 s a step for slots with the
            # smallest rings, where the device's free memory fell short of the default's
            # state, and 1.1 s with the default). The device's room is what it has free less
            # the margin and less every gradient the window keeps on it at the end of
            # backward: a device parameter's own (its step reads it when the window closes)
            # and, with grad_copy="device", each host parameter's too (at 22B they would not
            # fit with the state that the host RAM could not hold: a clear MemoryError now,
            # not an out-of-memory in backward).
            free, total = reading
            ring_sizes = dict.fromkeys(rings(records, host_room, backlog=False, fill=True).nbytes
                                       for host_room in ring_rooms())
            grad_itemsize = 0 if accumulate else compute_dtype.itemsize
            kept_on_device = sum(r.numel for r in records) * grad_itemsize if grad_copy == "device" else 0
            own_grad = 0 if grad_copy == "device" else grad_itemsize
            room = free - auto_margin(total) - kept_on_device
            for short in dict.fromkeys(needed + ring + margin - available for ring in ring_sizes):
                chosen = records_to_free_host(records, short, lambda r: host_needed([r]))
                cost = None if chosen is None else sum(r.numel * (per_element + own_grad) for r in chosen)
                if cost is not None and cost <= room:
                    on_device = chosen
                    break
            else:
                why = ("; gpu_state='auto' cannot help: the host RAM falls short even with every parameter's state "
                       "on the device") if cost is None else (
                       f"; gpu_state='auto' would put the state the host cannot hold on the device, which needs {cost} "
                       f"bytes there, but the device has room for {max(room, 0)} (free {free}, less a margin of "
                       f"{auto_margin(total)} and {kept_on_device} for the gradients kept there)")
            host_records = on_host(on_device)
            needed = host_needed(host_records)
            shape = rings(host_records, available - needed - margin, fill=True)
        # the streamed records: host state, no host gradient or accumulator (device_state.py)
        streamed = choose_streamed(host_records, stream_share)
        if streamed:
            host_records = on_host(on_device + streamed)
            needed = host_needed(host_records) + host_bytes_needed(
                streamed, moments=moments, accumulate=False, state_dtype=state_dtype, grad_itemsize=lambda r: 0)
        check_host_ram(needed, shape.nbytes, available, why)

        self.binding = bind_for(device, sysfs_root)  # before any host state is touched
        transfer = make_transfer(device)
        self._host = allocate_host_state(host_records, moments=moments, accumulate=accumulate,
                                         state_dtype=state_dtype)
        stream = None
        if streamed:
            stream = StreamedStep(streamed, allocate_host_state(streamed, moments=moments, accumulate=False,
                                                                state_dtype=state_dtype, pin=transfer.pin),
                                  algorithm=self._algorithm, device=device)
        self._device = DeviceState(on_device, algorithm=self._algorithm, state_dtype=state_dtype,
                                   accumulate=accumulate, track_norms=tracking, streamed=stream)
        self._device_per_element = per_element
        self._auto = AutoSplit(device) if gpu_state == "auto" else None
        # NOTE: the pinned rings are allocated before anything touches the model,
        # so a failed allocation leaves the parameters as they were.
        d2h = HostRing("d2h", num_slots=shape.d2h_slots, slot_bytes=shape.slot_bytes, pin=transfer.pin)
        h2d = HostRing("h2d", num_slots=shape.h2d_slots, slot_bytes=shape.slot_bytes, pin=transfer.pin)
        originals: dict = {}
        handles: list = []
        cleared: dict = {}  # the torch optimizer's state entries, once carried over and cleared
        try:
            cast_to_compute(records, compute_dtype=compute_dtype, keep_fp32=keep, originals=originals)
            if grad_copy == "host":
                allocate_retained(host_records, self._host)
            self._pipeline = Pipeline(transfer=transfer, algorithm=self._algorithm, d2h=d2h, h2d=h2d,
                                      accumulate=accumulate, timeout_s=float(timeout_s), skip_nonfinite=skip_nonfinite,
                                      copy_grads=grad_copy == "host",
                                      norm_slots=1 + max(r.index for r in records) if tracking else 0,
                                      forward_order=overlap, trace=trace)
            ref = weakref.ref(self)
            for rec in records:
                rec.hook = rec.param.register_post_accumulate_grad_hook(
                    lambda param, rec=rec: None if (w := ref()) is None else w._on_grad(rec, param))
                rec.hooked_tensor = rec.param._cdata
            # NOTE: what follows registers the wrapper (its parameters' owner, their cast marks,
            # the forward waits, the finalizer). It is quick, so a Ctrl-C waits for its end and
            # is then undone below like any failure: else the parameters stayed owned by a
            # wrapper nobody holds, and wrapping them again was refused.
            with deferred_interrupts():
                ownership.claim(records, self)
                for rec in records:
                    if id(rec.param) in originals:
                        rec.cast_from = originals[id(rec.param)]
                        ownership.mark_cast(rec.param, rec.cast_from)
                adopt_optimizer(self, optimizer, runs_torch_hooks=True)
                self._proto.window = grad_accum_steps
                self._records, self._frozen = records, frozen
                self._frozen_entries = {}  # the loaded state of parameters frozen at wrap time (checkpoint.py)
                self._group_ids = _param_ids(optimizer.param_groups)
                self._accumulate = accumulate
                self._transfer = transfer
                self.grad_copy = grad_copy
                self._validator = StepValidator(records=records, pipeline=self._pipeline,
                                                algorithm=self._algorithm, accumulate=accumulate, grad_copy=grad_copy,
                                                skip_nonfinite=skip_nonfinite, max_grad_norm=max_grad_norm,
                                                stacklevel=_user_stacklevel)
                self._pinned_bytes = d2h.nbytes + h2d.nbytes
                self._pid = os.getpid()
                self._owned_ids = frozenset(id(rec.param) for rec in records)
                note_versions(records)
                self._state = StateMapping(
                    records, frozen=frozen, guard=lambda what: None if (w := ref()) is None else w._check_idle(what),
                    read_guard=lambda what: None if (w := ref()) is None else w._check_state_read(what))
                self._overlap = overlap
                # NOTE: the window's last chunks may land after its last backward: in step()
                # (stream_share: beside the streamed step), or after it (overlap_forward)
                self._lands_late = (overlap_forward is not None or bool(streamed)) and not (accumulate and tracking)
                self._multi_rank = (torch.distributed.is_available() and torch.distributed.is_initialized()
                                    and torch.distributed.get_world_size() > 1)
                if overlap_forward is not None:
                    handles.extend(attach_forward_waits(
                        overlap_forward, records,
                        wait=lambda recs, fsdp: None if (w := ref()) is None else w._await_weights(recs, fsdp),
                        land=lambda: None if (w := ref()) is None else w.wait_for_weights()))
                self._next_forward = NextForwardHook(
                    lambda module: None if (w := ref()) is None else w._recover_before_forward(module))
                handles.append(self._next_forward)
                self._finalizer = weakref.finalize(self, _shutdown, records, self._pipeline, transfer, handles, trace,
                                                   self._pid, self._proto)
                self._dtype_hint = None
                if any(dtype.itemsize > compute_dtype.itemsize for dtype in originals.values()):
                    self._dtype_hint = watch_first_forward(compute_dtype)  # explains the dtype error of fp32 inputs
                    handles.append(self._dtype_hint)
                if carried is not None:
                    try:  # the masters: the weights before the cast
                        checkpoint.load_state_dict(self, carried)
                    except (TypeError, ValueError) as e:
                        raise type(e)(f"the wrapped optimizer's state cannot be carried over: {e}") from None
                    # NOTE: the torch optimizer's own copy would hold device memory full offload frees;
                    # an abort below (a Ctrl-C held back to this block's end) puts its entries back
                    cleared = dict(optimizer.state)
                    optimizer.state.clear()
                self._proto.move(Phase.IDLE)
                self._take_zero_grads()
        except BaseException:
            self._abort_construction(records, originals, handles)
            if cleared and not optimizer.state:
                optimizer.state.update(cleared)
            raise

    def _take_zero_grads(self) -> None:
        """Zero gradients in ``.grad`` at wrapping (``zero_grad(set_to_none=False)`` after a
        backward): the state that call leaves, as if made on this optimizer. The gradient goes
        (full offload keeps none in ``.grad``), its parameter holds a zero gradient, which torch
        steps when no other comes. Non-zero ones were refused (``collect_records``)."""
        for rec in self._records:
            if rec.param.grad is not None:
                rec.param.grad = None
                rec.holds_grad = True
                self._proto.zero_fill = self._proto.zeroed = True

    def _abort_construction(self, records, originals: dict, handles: list) -> None:
        """Undo a construction that raised: the parameters get their dtypes and values back
        and no owner, hook or cast mark; the worker stops."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        release_optimizer(self)
        _unhook(records, handles)
        for rec in records:
            if id(rec.param) in originals:
                ownership.unmark_cast(rec.param)
        restore_dtypes(records, originals)
        if hasattr(self, "_pipeline"):
            self._pipeline.close()

    # ------------------------------------------------------------ backward
    @torch.no_grad()
    def _on_grad(self, rec, param) -> None:
        try:
            self._take_grad(rec, param)
        except BaseException:
            # NOTE: autograd would add the next backward's gradient to one left here.
            param.grad = None
            raise

    def _take_grad(self, rec, param) -> None:
        if torch.compiler.is_dynamo_compiling() or _in_compiled_autograd():
            # NOTE: first, before anything that dynamo would trace: compiled autograd traces
            # this hook into its backward graph, where the pipeline cannot run
            raise RuntimeError(
                "cpu_offload: a backward under compiled autograd (torch._dynamo.compiled_autograd, "
                "torch._dynamo.config.compiled_autograd=True) cannot run offload='full': its gradient hooks copy "
                "each gradient to the host and step it there, which cannot be traced into a graph. Turn compiled "
                "autograd off (torch.compile of the model's modules works)")
        ownership.check_same_process(self._pid)
        self._settle(in_backward=True)
        if self._proto.phase is Phase.APPLIED:
            raise RuntimeError(
                f"a backward pass started after the last one of the window (grad_accum_steps="
                f"{self.grad_accum_steps}) had already applied its update, before step(): call step() "
                "(or zero_grad()) after every window; full offload updates the weights during backward. "
                "(A loop stopped in the middle of a window and started again must call zero_grad() first, "
                "the optimizer's or the whole model's)"
            )
        if self._proto.phase is not Phase.BACKWARD:
            if self._proto.phase is Phase.ACCUMULATING:
                self._take_grads_set_between_passes(current=rec)
            self._begin_backward()
        grad = param.grad
        if grad is None:
            return
        if grad.layout != torch.strided:
            raise TypeError(f"the gradient of {rec.name} is {grad.layout}: full offload needs dense gradients "
                            "(build nn.Embedding / EmbeddingBag with sparse=False)")
        if rec.arrived == self._proto.micro:
            raise RuntimeError(
                f"the gradient of {rec.name} arrived twice in one backward pass. A parameter used in a reentrant "
                "activation-checkpoint segment (torch.utils.checkpoint(..., use_reentrant=True)) and again elsewhere "
                "in the same backward (another segment, or outside any) gets its gradient in parts, one per "
                "segment's own backward, and full offload steps it at the first: use "
                "use_reentrant=False (HF: gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False})). After a backward that was interrupted and whose exception is still "
                "held, call zero_grad() first")
        grad = local_of(grad)
        compute = rec.local()
        if grad.dtype != compute.dtype:
            raise RuntimeError(
                f"gradient of {rec.name} is {grad.dtype} but its compute copy is {compute.dtype}: the backward's "
                "graph was recorded by a forward before offload_optimizer cast the weights (or, for an FSDP2 model, "
                "its first forward ran before wrapping); run the forward again after wrapping"
            )
        if grad.shape != rec.shape:
            raise RuntimeError(f"gradient of {rec.name} has shape {tuple(grad.shape)}, expected {tuple(rec.shape)}")
        grad = grad.detach().reshape(-1)
        if rec.on_device:
            self._device.take_grad(rec, grad, final=self._proto.final, add=rec.has_accum)
        else:
            self._pipeline.stage_grad(rec, grad, add=rec.has_accum)
            if self.grad_copy == "device":
                rec.retained = grad  # NOTE: kept on the device until the window closes, for a redo
        rec.arrived = self._proto.micro
        rec.has_accum = self._accumulate
        rec.holds_grad = True
        param.grad = None  # the device copy of the gradient is no longer needed
        if not self._proto.warned_late_hook:
            self._warn_late_hook(rec, param)

    def _warn_late_hook(self, rec, param) -> None:
        """A post-accumulate-grad hook registered after ours runs after the gradient has left
        the device, and sees ``param.grad`` None (one guarded on None does nothing). Said once."""
        hooks = param._post_accumulate_grad_hooks
        if hooks and next(reversed(hooks)) != rec.hook.id:
            self._proto.warned_late_hook = True
            warnings.warn(
                f"cpu_offload: a post-accumulate-grad hook registered on {rec.name!r} after offload_optimizer runs "
                "after full offload has taken that gradient off the device, so it sees param.grad None (hooks run "
                "in the order they were registered): register it before wrapping", RuntimeWarning,
                stacklevel=_user_stacklevel())

    def _stale_weights(self, records) -> None:
        """Masters written in place (``opt.state[p]["master"].copy_(t)``) whose weights the forward
        before this backward read as they were, now taken: raise, or under FSDP2 or over several
        ranks warn (FSDP2 does not train on after a backward that raised, and each rank decides
        from its own shards: a raise on some ranks would leave the others in a collective)."""
        said = (f"cpu_offload: the masters of {[r.name for r in records][:8]} (opt.state[p]['master']) were written "
                "in place since their weights were last written from them; with offload='full' the weight on the device "
                "is round(master), written when a master is assigned, so the forward before this backward read other "
                "weights (the old ones). The written masters are taken: the weights are now round(master). Write a "
                "master by assignment (opt.state[p]['master'] = t) or load_state_dict()")
        if self._multi_rank or any(r.is_dtensor for r in records):
            warnings.warn(f"{said}. This window's gradients, of the weights the forward read, update the written "
                          "masters", RuntimeWarning, stacklevel=_user_stacklevel())
            return
        raise RuntimeError(f"{said}. This backward was stopped")

    def _begin_backward(self) -> None:
        self._land()
        new_window = self._proto.phase is Phase.IDLE
        self._proto.final = self._proto.micro == self.grad_accum_steps - 1
        self._proto.gen += 1
        gen, ref = self._proto.gen, weakref.ref(self)
        # NOTE: watched before the checks below: a check that raises aborts this
        # backward, and the next call recovers the window like any other abort.
        watch_backward(lambda: None if (w := ref()) is None else w._backward_ended(gen),
                       lambda: None if (w := ref()) is None else w._backward_died(gen))
        self._proto.move(Phase.BACKWARD)
        self._rearm_hooks([rec for rec in self._records if rec.param._cdata != rec.hooked_tensor])
        stale = take_masters_written_in_place(self._records)
        if stale:
            self._stale_weights(stale)
        if new_window or self._proto.final:
            # NOTE: also before the window's last pass, whose chunks read each group's
            # hyper-parameters by its index: groups changed between two passes would step them
            # with another group's values
            self._check_parameters()
            if new_window:
                self._warn_grads_left()
            # NOTE: also before the window's last pass: an edit between two passes is the
            # weight the step (run during that pass) updates, as in torch's step(); the same
            # for a step count written in place (a bad one raises here, before anything changes)
            counts = step_edits(self._records)
            check_moved_storage(self._records)
            adopt_external_weights(self._records)
            take_step_edits(counts)
        # NOTE: hyper-parameters are read when the last backward of a window
        # starts (the chunks are stepped during it), so an LR scheduler stepped
        # after step() applies to the next step, as with torch.
        hparams = self._read_hparams(speculate=True) if self._proto.final else None
        self._validator.pass_begins()
        self._pipeline.begin_backward(micro=self._proto.micro, final=self._proto.final, hparams=hparams,
                                      speculative=self._proto.final,
                                      deferred=self._proto.final and self._validator.defers(),
                                      clip_limit=self._validator.clip_limit)

    def _backward_ended(self, gen: int) -> None:
        # NOTE: a Ctrl-C once a backward has ended is raised when the pass is recorded (and,
        # after the last pass, the window complete: step() then takes it); aborted here, the
        # window would lose the gradients that had all arrived.
        with deferred_interrupts():
            self._end_backward(gen)

    def _end_backward(self, gen: int) -> None:
        if gen != self._proto.gen or self._proto.phase is not Phase.BACKWARD:
            return
        self._next_forward.remove()  # NOTE: one armed by a stale death report (another thread's, racing a recovery)
        self._end_dtype_hint()
        self._pipeline.trace.mark("backward_end", self._proto.micro)
        self._pipeline.end_backward()
        if not self._proto.final:
            self._proto.micro += 1
            self._proto.move(Phase.ACCUMULATING)
            return
        self._complete_window()

    def _take_grads_set_between_passes(self, current) -> None:
        """A gradient assigned to ``param.grad`` between two backward passes of a window (the
        hooks leave it None): the next pass adds to it in ``.grad``, so that sum replaces the
        window's sum so far, as in torch. Looked for at the pass's first gradient.

        NOTE: ``current``, whose ``.grad`` already holds that pass's gradient, cannot be told
        apart from one added to an assigned value. A process-wide forward hook armed between
        passes would see it, but a module hook present while a backward recomputes compiled
        checkpointed blocks (losses computed before their backwards) makes torch.compile
        pick another graph (``_backward_died``)."""
        for rec in self._records:
            if rec is not current and rec.has_accum and rec.param.grad is not None:
                rec.has_accum = False

    def _end_dtype_hint(self) -> None:
        # NOTE: at the end of a backward, not of the first forward: dtype_hint.py says why
        if self._dtype_hint is not None:
            self._dtype_hint.remove()
            self._dtype_hint = None

    def _backward_died(self, gen: int) -> None:
        # NOTE: may run on another thread: only record it, and arm the hook that recovers
        # before the next forward. Armed here, not for every backward: a process-wide module
        # hook present while a backward recomputes checkpointed compiled blocks makes
        # torch.compile pick another graph there (CheckpointError) and compile twice.
        if gen == self._proto.gen:
            self._next_forward.arm()
            self._proto.died = gen

    def _recover_before_forward(self, module: torch.nn.Module) -> None:
        """A module forward while a backward that died is not yet recovered: recover first.
        Later (at the next backward's first gradient) the recovery would write weights the
        forward already read: autograd then raises that they changed in place.

        NOTE: any module's forward on the thread that last called this optimizer (or built it;
        a functional model reads its weights through modules that hold none); on another
        thread only that of a module holding one of its parameters: another model's forward
        there leaves it. A forked child leaves the parent's window alone."""
        if os.getpid() != self._pid:
            return
        if self._proto.phase is Phase.APPLIED and not self._proto.landed and not self._overlap:
            # NOTE: armed by _complete_window: the window's last chunks land in step() (stream_share)
            if threading.get_ident() == self._proto.thread or any(id(p) in self._owned_ids
                                                                  for p in module.parameters()):
                self.wait_for_weights()
            return
        if not self._proto.died_unrecovered():
            return
        if threading.get_ident() == self._proto.thread or any(id(p) in self._owned_ids for p in module.parameters()):
            self._settle()

    def _settle(self, *, in_backward: bool = False) -> None:
        """Recover from a backward that raised; raise a pending worker failure once.

        NOTE: under the protocol's lock, the phase read again there: two threads (a call
        beside a forward) would both find the window unrecovered and both recover it."""
        proto = self._proto
        with proto.lock:
            if proto.died_unrecovered() or (proto.phase is Phase.BACKWARD and not in_backward and outside_backward()):
                proto.move(Phase.ABORTED)
                self._recover()
            err = self._pipeline.take_error()
            if err is not None:
                if not in_backward and proto.phase in (Phase.ACCUMULATING, Phase.APPLIED):
                    proto.move(Phase.ABORTED)
                    self._recover(quiet=True)
                raise err

    def _recover(self, *, quiet: bool = False) -> list:
        """ABORTED -> IDLE: finish what was staged, count what was stepped, drop the rest;
        returns the records whose update was applied and counts."""
        micro, final = self._proto.micro, self._proto.final
        self._proto.gen += 1  # signals of the dead backward are stale from here on
        self._next_forward.remove()
        self._end_dtype_hint()
        try:
            stepped, torn = salvage_window(self._records, self._pipeline, self._transfer)
        finally:
            self._close_window(abandoned=True)
            self._proto.move(Phase.IDLE)
            self._proto.zeroed = False  # the window's gradients are discarded, not zeros
            self._proto.grads_left = False
            if outside_backward():
                # NOTE: a gradient the dead backward left in .grad (its hook never took it)
                # is discarded with the window: autograd would add the next one to it.
                # (Inside the next backward, one may already be that backward's.)
                for rec in self._records:
                    rec.param.grad = None
        if torn:
            raise RuntimeError(f"parameters {torn} were only partly updated when the window failed; "
                               "their masters no longer match a whole step: reload the last checkpoint")
        if not quiet:
            where = f"backward pass {micro + 1} of {self.grad_accum_steps}"
            done = (f"{len(stepped)} of {len(self._records)} parameters had their update applied and count this "
                    "step (as if the others had no gradient); " if final else "")
            warnings.warn(f"cpu_offload: {where} raised; {done}the rest of the accumulation window was discarded",
                          RuntimeWarning, stacklevel=_user_stacklevel())
        return stepped

    def _read_hparams(self, *, speculate: bool = False) -> list:
        hparams = read_hparams(self.param_groups, self._algorithm, bf16_moments=self._bf16_moments)
        for hp in hparams:
            hp["grad_scale"] = self._validator.speculative_scale() if speculate else self._validator.factor()
        return hparams

    def _complete_window(self) -> None:
        """The window's optimizer step is complete and validated on the host and the
        device (the window stays open for clip_grad_norm_ until step()): APPLIED.

        With overlap_forward its last chunks may still run, once their gradients' norms
        show that validation will keep their speculative step (finite, and no factor
        that could overflow): a redo or a skip waits for them (validation.py)."""
        late = self._lands_late and not self._pipeline.deferred
        self._guarded(lambda: finish_window(self._records, self._pipeline, self._transfer,
                                            zero_fill=self._proto.zero_fill, device=self._device, land=not late))
        if late and self._validator.tracking and not self._accumulate:
            if self._pipeline.read_norms_now(self._validator.window_records()):
                late = False
                # NOTE: also when every chunk has run: it notes the weights they wrote, so
                # that step() can tell an edit made since from them
                self._guarded(lambda: land_window(self._records, self._pipeline, self._transfer))
        self._proto.landed = not late
        if late and not self._overlap:
            self._next_forward.arm()  # NOTE: a forward before step() waits for the new weights
        self._guarded(self._device.read_norms, completes_step=True)
        self._guarded(self._validator.after_final_pass, completes_step=True)
        self._proto.move(Phase.APPLIED)

    def _guarded(self, work, *, completes_step: bool = False) -> None:
        """Run ``work`` on an open window, counting its time as blocked; on a failure
        the window is closed as after an aborted backward, then it raises.

        ``completes_step``: ``work`` makes the window's speculative step the final one (its
        validation, a redo, the device records' step). A failure there leaves the updates made
        before it, which are not the step torch would make: that raises, naming them."""
        t0 = time.perf_counter()
        try:
            work()
        except BaseException as exc:
            if self._proto.phase in (Phase.BACKWARD, Phase.ACCUMULATING, Phase.APPLIED):
                final = self._proto.final
                self._proto.move(Phase.ABORTED)
                kept = self._recover(quiet=True)
                # NOTE: not a KeyboardInterrupt: a real one waits for this work (deferred_interrupts)
                if completes_step and kept and not isinstance(exc, KeyboardInterrupt):
                    raise RuntimeError(
                        f"the optimizer step did not complete ({type(exc).__name__}: {exc}); parameters "
                        f"{[rec.name for rec in kept]} keep the update made during backward, before the step's "
                        "clipping, scale_grads_ factor, non-finite check or late hyper-parameters were applied, so "
                        "their state is not the step torch would make: reload the last checkpoint") from exc
                if final and not isinstance(exc, KeyboardInterrupt):
                    add_note(exc, f"cpu_offload: the window was closed: {len(kept)} of {len(self._records)} "
                                   "parameters had their update applied and count this step (as if the others had "
                                   "no gradient)" + ("; the other ranks may have stepped otherwise: reload the last "
                                                     "checkpoint on every rank" if self._multi_rank else ""))
            raise
        self._proto.blocked_s += time.perf_counter() - t0

    def _settle_split(self) -> None:
        """gpu_state="auto": once the first windows' peak is known, move the state of host
        parameters spread over the model that fit in what they leave free to the device
        (between windows)."""
        if self._auto is None or self._auto.settled:
            return
        budget = self._auto.observe()
        if not budget:
            return
        self._land()  # NOTE: the records chosen may be in a chunk still in flight
        chosen = choose_device_records([r for r in self._records if not r.on_device], budget,
                                       self._device_per_element)
        try:
            self._device.add(chosen)
        except torch.OutOfMemoryError:  # NOTE: each record moves whole: those moved stay, the rest stay on the host
            warnings.warn("cpu_offload: gpu_state='auto' stopped moving state to the device: out of memory",
                          RuntimeWarning, stacklevel=_user_stacklevel())

    def _step_device_state(self, hparams: Optional[list] = None) -> None:
        """The window closes with its final factor: step the device records (none after a
        skipped step) with ``hparams`` (None: those of the window's last backward)."""
        if not self._validator.skipped:
            # NOTE: their weights are still those before the step, as in torch: an edit made
            # since the last backward is what the step updates (else its compute copy was lost)
            if self._device.records:  # NOTE: step() and _close_without_step() checked for tied storage
                adopt_external_weights(self._device.records)
            note_versions(self._device.step(hparams or self._pipeline.hparams, self._validator.factor()))

    def _close_window(self, *, abandoned: bool = False, landing: bool = False) -> None:
        if self._lands_late and not self._overlap:
            self._next_forward.remove()  # NOTE: armed by _complete_window for the window's landing
        if not landing:  # NOTE: the worker still counts the steps of a landing window
            reset_window(self._records, self._pipeline)
        self._device.reset_window()
        if self.grad_copy == "device":
            for rec in self._records:
                rec.retained = None
        self._validator.close_window(abandoned=abandoned)
        self._proto.micro = 0
        self._proto.final = False
        self._proto.landed = False

    # ---------------------------------------------------------------- step
    def step(self, closure=None):
        """Finish the step: wait for the optimizer work of the last backward pass.

        After fewer than ``grad_accum_steps`` backward passes it steps on what was
        accumulated. With no backward pass since the last step it steps the zero gradients
        ``zero_grad(set_to_none=False)`` left (as torch), else it does nothing.
        """
        self._enter()
        self._refuse_grad_scaler()
        # NOTE: what the torch optimizer's step(), patched by an LR scheduler built on it before
        # wrapping, would note: it never runs here, and the scheduler would warn that its first
        # step() came before the optimizer's
        self.optimizer._opt_called = True
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self._enter()
        if self._proto.phase is Phase.BACKWARD:
            raise RuntimeError("step() called during a backward pass")
        self._check_parameters()
        self._check_no_bypassed_grads()
        t0, blocked_before = time.perf_counter(), self._proto.blocked_s
        if self._proto.phase is Phase.IDLE and not (self._proto.zeroed and any(r.holds_grad for r in self._records)):
            self._validator.open_window()  # a factor announced for a window that never ran
            self._warn_no_gradient()
            return loss
        self._pipeline.trace.mark("step_begin", at=t0)
        passes = self.grad_accum_steps if self._proto.phase is Phase.APPLIED else self._proto.micro
        # NOTE: read as torch's step() reads them: values set since the last backward began
        # make the step be redone with them (validation.py); a bad one raises before anything changes
        current = self._read_hparams()
        check_moved_storage(self._records)  # NOTE: before any edit is taken
        late_counts = self._take_count_edits()  # NOTE: a bad count raises before anything changes
        late_edits = self._take_edits_before_step()
        late_masters = self._masters_written_after_their_step()
        # NOTE: IDLE here: after zero_grad(set_to_none=False) torch's step() steps every parameter
        # holding a gradient, here zeros, though no backward ran: a window of no passes.
        # (After a step() and no zero_grad, torch would step its kept gradients again:
        # they are not kept here, so that step() does nothing; README.)
        if self._proto.phase in (Phase.IDLE, Phase.ACCUMULATING):  # a short window
            # NOTE: a Ctrl-C while the window completes is delivered once it has: raised in
            # between, it aborted the window (the parameters not yet stepped lost the step)
            # and the step() made again found nothing to do.
            with deferred_interrupts():
                # NOTE: held back (deferred): every gradient is on the host already, so the
                # window is stepped once, with its final factor (max_grad_norm, the non-finite
                # guard), never speculatively and rolled back
                self._pipeline.begin_backward(micro=self._proto.micro, final=True, hparams=current, speculative=True,
                                              deferred=True)
                self._proto.final = True
                self._validator.short_window_ends()
                self._complete_window()
        # NOTE: a Ctrl-C during the rollback and redo is delivered once the step is complete
        # and the window closed, so the state is the one after this step.
        with deferred_interrupts():
            self._finish_step(passes, t0, blocked_before, current)
            late_masters = self._keep_masters_written(late_masters)
            if late_edits or late_counts or late_masters:
                # NOTE: raised inside the block: a Ctrl-C held back here is raised with it as context
                write_compute_copies(late_edits)  # the edits are undone
                for rec in late_counts:
                    rec.show_step(over_edit=True)
                self._pipeline.trace.mark("step_end")
                raise _late_edits_error(late_edits, "step()", late_counts, late_masters)
        self._pipeline.trace.mark("step_end")
        return loss

    def _refuse_grad_scaler(self) -> None:
        """step() called by torch.amp.GradScaler.step(), which set these attributes: refused
        before anything changes, the attributes removed (the scaler removes them only when
        step() returns)."""
        if "found_inf" not in vars(self) and "grad_scale" not in vars(self):
            return
        vars(self).pop("found_inf", None)
        vars(self).pop("grad_scale", None)
        raise RuntimeError(
            "torch.amp.GradScaler does not work with offload='full': the update runs during backward, on the "
            "gradients as they arrive, scaled by the loss scale, before the scaler can unscale them or look for "
            "Inf. bf16 needs no loss scaling: drop the scaler (or GradScaler(enabled=False)) and call step() "
            "yourself; opt.scale_grads_(factor) scales a step's gradients, and skip_nonfinite=True (the default) "
            "skips a step with NaN or Inf gradients. This window's update ran with the scaled gradients: step() "
            "closes it")

    def _warn_no_gradient(self) -> None:
        """step() with no gradient since the last one does nothing, as torch's; said once, as a
        model whose parameters were replaced since wrapping leads there without an error."""
        if self._proto.warned_no_gradient:
            return
        self._proto.warned_no_gradient = True
        warnings.warn(
            f"cpu_offload: step() found no gradient for any of the optimizer's {len(self._records)} parameters since "
            "the last step(), so nothing was updated (as torch's step() without gradients). If the model's parameters "
            "were replaced since wrapping (PEFT's load_adapter, which HF Trainer's resume_from_checkpoint calls, "
            "makes new fp32 parameters in place of bf16 adapters), the optimizer still holds the old ones: wrap after "
            "loading, or keep the adapters in fp32 (compute_dtype=torch.float32), into which a load copies",
            RuntimeWarning, stacklevel=_user_stacklevel())

    def _warn_grads_left(self) -> None:
        """A window begins after a step() with no zero_grad() since: torch would add its
        gradients to those the step left in .grad. Said once."""
        if not self._proto.grads_left or self._proto.warned_grads_left:
            return
        self._proto.grads_left = False
        self._proto.warned_grads_left = True
        warnings.warn(
            "cpu_offload: backward() after step() with no zero_grad() between: torch would add this window's "
            "gradients to the last step's, which it keeps in .grad; full offload keeps no gradient after step() and "
            "steps each window on its own gradients. Call opt.zero_grad() after step() (or before backward()) to "
            "train as torch does; gradients cleared with p.grad = None are not seen here",
            RuntimeWarning, stacklevel=_user_stacklevel())

    def _take_edits_before_step(self) -> list:
        """step() begins: host parameters whose window step has not run take the edits made
        since the library last wrote their weights (their step updates the edited weights,
        as in torch); returns those whose step already ran and whose weights were changed.

        NOTE: with overlap_forward or stream_share, while the window's weights may still be on
        their way (wait_for_weights() not called), a version change is no sign of an edit:
        nothing is checked then (an edit may be overwritten, docs/full-offload.md)."""
        if self._proto.phase is not Phase.APPLIED or self._proto.landed or not self._lands_late:
            # NOTE: device records take theirs when they are stepped (_step_device_state)
            return adopt_edits_before_step([r for r in self._records if not r.on_device])
        return []

    def _masters_written_after_their_step(self) -> list:
        """step() (or zero_grad(), close() after the window's last backward) begins:
        ``[(record, its master)]`` for the host masters written in place, through a master
        tensor taken before, after their window step ran during the last backward: that update
        is in them no more, so their step cannot update the written master as torch's would."""
        if self._proto.phase is not Phase.APPLIED or (self._lands_late and not self._proto.landed):
            return []  # NOTE: the worker may be stepping them (overlap_forward, stream_share): the next backward takes them
        return [(r, r.master.clone()) for r in self._records
                if not r.on_device and r.pieces_done and r.master_written()]

    def _keep_masters_written(self, written: list, *, said: bool = True) -> list:
        """The window closed: the masters written after their step are what was written (over
        a rollback or redo, which read them as the step's result), their weights round(master);
        their moments and counts are the step's. Returns the records to raise for (``said``);
        under FSDP2 or over several ranks it warns instead (_stale_weights says why)."""
        if not written:
            return []
        for rec, master in written:
            rec.master.copy_(master)
        records = [rec for rec, _ in written]
        write_compute_copies(records)
        if not said:
            return []
        if self._multi_rank or any(r.is_dtensor for r in records):
            warnings.warn(_late_masters_message(records), RuntimeWarning, stacklevel=_user_stacklevel())
            return []
        return records

    def _take_count_edits(self) -> list:
        """step() begins (or zero_grad(), close() close the window after its last backward): a
        record whose window step has not run takes the count written into its live step tensor
        since the library last wrote it (its step counts from it, as in torch's step()); returns
        those whose step already ran, or with overlap_forward may be running, and whose count was
        edited: their edit cannot be honoured. A bad count raises before anything changes.

        NOTE: the live tensors are written on this thread only, so an edit is seen whatever the
        worker does (unlike an edit of the weights)."""
        edits = step_edits(self._records)
        if not edits:
            return []
        running = self._proto.phase is Phase.APPLIED and not self._proto.landed and self._lands_late
        late = [rec for rec, _ in edits if rec.pieces_done or (running and rec.pieces_total and not rec.on_device)]
        take_step_edits([(rec, count) for rec, count in edits if rec not in late])
        return late

    def _finish_step(self, passes: int, t0: float, blocked_before: float, hparams: list) -> None:
        """``blocked_before``: the window's blocked time up to this step() call, whose own
        time (its guarded work included) counts once, from ``t0``; ``hparams``: the groups'
        hyper-parameters as step() read them."""
        self._guarded(lambda: self._validator.apply(hparams), completes_step=True)
        self._guarded(lambda: self._step_device_state(hparams), completes_step=True)
        self._transfer.set_compute_stream()
        landing = self._overlap and self._pipeline.in_flight
        if self._lands_late and not landing:
            # NOTE: a window whose chunks all ran before step() still notes the weights they
            # wrote: else the next window would take them for the user's and compare each one
            self._guarded(lambda: land_window(self._records, self._pipeline, self._transfer))
        elif not landing:
            self._transfer.compute_waits_for_h2d()
        v = self._validator
        stats = dict(step_blocked_s=blocked_before + time.perf_counter() - t0,
                     pinned_bytes=self._pinned_bytes, host_bytes=self._host.nbytes + self._device.host_nbytes,
                     gpu_state_bytes=self._device.nbytes, backward_passes=passes,
                     grad_norm=v.grad_norm, clip_coef=v.clip_coef, skipped=v.skipped)
        self._close_window(landing=landing)
        self._proto.move(Phase.IDLE)
        self._proto.zeroed = self._proto.zeroed and not passes  # torch's .grad now holds this window's
        self._proto.grads_left = self._proto.grads_left or bool(passes)
        self._proto.blocked_s = 0.0
        self._proto.landing_stats = stats
        self._proto.landing = landing
        if not landing:
            self._note_stats()
            show_steps(self._records)
        self._settle_split()

    def _note_stats(self) -> None:
        """The landed step's figures: those of step() and the pipeline's."""
        stats = dict(self._pipeline.stats, **self._proto.landing_stats)
        self._pipeline.stats.clear()
        for key in ("d2h_bytes", "h2d_bytes", "chunks", "kernel_s", "accumulate_s", "worker_overhead_s"):
            stats.setdefault(key, 0)
        self._proto.last_stats = stats

    def wait_for_weights(self) -> None:
        """Wait until the last step's new weights are all on the device (with
        ``overlap_forward``, step() and the window's last backward may return before; with
        ``stream_share``, the window's last backward; else they already are)."""
        self._enter()
        if self._proto.phase is Phase.APPLIED and not self._proto.landed:
            self._guarded(lambda: land_window(self._records, self._pipeline, self._transfer))
            self._proto.landed = True
            if not self._overlap:
                self._next_forward.remove()

    def _await_weights(self, recs: list, fsdp_state) -> None:
        """overlap_forward's forward pre-hook: the new weights of ``recs`` are on the
        device (on the current stream) before the module's forward reads them: after
        step() returned, or between the window's last backward and step()."""
        if not (self._proto.landing or self._proto.phase is Phase.APPLIED):
            return
        if fsdp_state is not None and getattr(fsdp_state, "_states_to_forward_prefetch", None):
            self._land()  # NOTE: FSDP2's explicit prefetch all-gathers later groups now
            return
        trace = self._pipeline.trace
        trace.mark("forward_wait_begin", len(recs))
        self._pipeline.wait_stepped(recs)
        trace.mark("forward_wait_end", len(recs))
        if any(r.pieces_done < r.pieces_total for r in recs):
            self._land()  # the worker failed before stepping them: raises its error
            return
        self._transfer.compute_waits_for_h2d()
        if fsdp_state is not None and self._multi_rank:
            # NOTE: FSDP2's all-gather copies the shards in on its own stream, ordered after
            # the compute stream only at the root's forward: wait for the copies here.
            self._transfer.synchronize()
        if not self._pipeline.in_flight:
            self._land()  # the last chunk has run: close the window's bookkeeping now

    def _land(self) -> None:
        """The last step's chunks have all run and their weights are on the device; the
        window's bookkeeping is closed. A worker failure raises here, once: the parameters
        it did not step keep their state and do not count the step."""
        if not self._proto.landing:
            return
        # NOTE: an interrupted drain leaves the window landing (the worker may still count
        # its steps): the next call lands it again.
        self._pipeline.drain()
        self._transfer.compute_waits_for_h2d()
        with deferred_interrupts():
            err = self._pipeline.take_error()
            note = _landing_note(self._records) if err is not None else ""
            held_back = self._pipeline.held_back
            note_versions([r for r in self._records if r.stepped and not r.on_device])
            reset_window(self._records, self._pipeline)
            self._proto.landing = False
            self._note_stats()
            show_steps(self._records)
        if err is not None:
            err.args = (f"{err.args[0]}; {note}",)
            raise err
        if held_back:
            raise ProtocolError("overlap_forward: the worker held back a chunk after step() had returned")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop gradients. In the middle of an accumulation window this discards
        the window, like torch. After the window's last backward the update has
        already been applied (full offload steps during backward): it stays
        applied and counted, with a one-time warning.

        ``set_to_none=False`` keeps torch's semantics: parameters that had a
        gradient before are stepped with a zero gradient in later steps.
        """
        self._enter(land=False)  # NOTE: touches nothing the worker reads: overlap_forward keeps running
        if self._proto.phase is Phase.BACKWARD:
            raise RuntimeError("zero_grad() called during a backward pass")
        if self._proto.phase is Phase.ACCUMULATING:
            self._pipeline.drain()  # NOTE: only a wait: a Ctrl-C may still stop it
        # NOTE: a Ctrl-C lands once the window is closed and the phase has moved on, as in
        # step(): delivered in between, the call made again closed the window a second time.
        with deferred_interrupts():
            self._drop_window(set_to_none)

    def _window_phase(self) -> Optional[str]:
        """Where an open window stands (``Phase``'s words), or None between windows."""
        return None if self._proto.phase in (Phase.IDLE, Phase.CLOSED) else self._proto.phase.value

    def _drop_held_grads(self, param_ids: set) -> None:
        """A module's ``zero_grad()`` between windows: the parameters ``param_ids`` no longer
        hold the zero gradient that ``zero_grad(set_to_none=False)`` left them."""
        for rec in self._records:
            if id(rec.param) in param_ids:
                rec.holds_grad = False

    def _drop_window(self, set_to_none: bool) -> None:
        late_edits = None
        if self._proto.phase is Phase.ACCUMULATING:
            self._close_window(abandoned=True)
        elif self._proto.phase is Phase.IDLE:
            self._validator.open_window()  # a factor announced for the window being dropped
        elif self._proto.phase is Phase.APPLIED:
            late_edits = self._close_without_step("zero_grad()")
        self._proto.move(Phase.IDLE)
        self._proto.zero_fill = self._proto.zeroed = not set_to_none
        self._proto.grads_left = False
        if set_to_none:
            for rec in self._records:
                rec.holds_grad = False
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()
        if late_edits is not None:  # NOTE: raised inside zero_grad()'s deferred-interrupt block, as in step()
            raise late_edits

    def _close_without_step(self, call: str) -> Optional[RuntimeError]:
        """``call`` (zero_grad(), close()) after the window's last backward, with no step():
        the update that backward applied stays applied and counts, and the window closes as
        step() closes it, with the hyper-parameters of that backward. Returns the error naming
        the host records whose weights or step counts were changed in place after their update
        ran, their change undone (the caller raises it), or None."""
        check_moved_storage(self._records)  # NOTE: before any edit is taken
        late_counts = self._take_count_edits()
        late_edits = self._take_edits_before_step()
        late_masters = self._masters_written_after_their_step()
        self._guarded(self._validator.apply)
        self._guarded(self._step_device_state)
        self._guarded(lambda: land_window(self._records, self._pipeline, self._transfer))
        self._close_window()
        self._keep_masters_written(late_masters, said=False)  # NOTE: torch's zero_grad() keeps a written master too
        write_compute_copies(late_edits)
        show_steps(self._records)
        for rec in late_counts:
            rec.show_step(over_edit=True)
        if not self._proto.warned_zero_grad:
            self._proto.warned_zero_grad = True
            warnings.warn(f"cpu_offload: {call} without step() after a window's last backward pass: full offload "
                          "applied that update during backward; it stays applied and counts as a step. If that was "
                          "another loss's backward passing through these parameters (a GAN's generator loss through "
                          "the discriminator), whose gradients torch's zero_grad() drops, freeze them for it: "
                          "requires_grad_(False) before that backward, requires_grad_(True) after",
                          RuntimeWarning, stacklevel=_user_stacklevel())
        return _late_edits_error(late_edits, call, late_counts) if late_edits or late_counts else None

    def add_param_group(self, param_group) -> None:
        raise RuntimeError(
            "FullCPUOffloadOptimizer cannot add parameter groups: host state and hooks are built at "
            "construction; add every group to the optimizer before wrapping it"
        )

    @property
    def timeout_s(self) -> float:
        """The limit, in seconds, of each wait of the pipeline; may be set between calls."""
        return self._pipeline.timeout_s

    @timeout_s.setter
    def timeout_s(self, value) -> None:
        check_timeout(value)
        self._pipeline.set_timeout(float(value))

    # ---------------------------------------------------- state and checkpoints
    @property
    def state(self):
        """``{param: {"step", "master", "exp_avg", "exp_avg_sq"}}``: one mapping, built at construction,
        of live views of the host state (the step count one live tensor), for every trainable parameter
        (step 0 and zero moments before its first step). Assigning a key copies the values in, between
        steps (state_mapping.py)."""
        return self._state

    @state.setter
    def state(self, value) -> None:
        raise TypeError("opt.state cannot be replaced under full offload: it is a view of the host state (masters, "
                        "moments, step counts), fixed at construction. To reset a parameter's state, write its "
                        "entry: opt.state[p]['exp_avg'].zero_(), opt.state[p]['exp_avg_sq'].zero_(), "
                        "opt.state[p]['step'] = 0; or load a state_dict")

    def state_dict(self) -> dict:
        """torch's format plus the masters (checkpoint.py). In the middle of an accumulation
        window it is the state of the last step, as torch's (which saves no gradients either):
        the window's passes so far only added to the host accumulators."""
        self._check_between_steps("state_dict()", in_window=True)
        if self._proto.phase is Phase.APPLIED:
            raise RuntimeError(f"state_dict() {Phase.APPLIED.value}: {_STEP_APPLIED}")
        check_moved_storage(self._records)
        adopt_external_weights(self._records)
        show_steps(self._records)  # NOTE: an edit of a step count stays: the entry's step is that tensor
        host_state = not for_device_placement()  # accelerate's set-up round trip moves nothing
        return state_dict_with_hooks(self, lambda: checkpoint.state_dict(self, host_state=host_state))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, with the masters (checkpoint.py): the whole dict is checked before anything
        is written. Refused in the middle of an accumulation window and between the window's
        last backward and step(), where it changes nothing."""
        self._check_between_steps("load_state_dict()")
        if self._proto.phase is Phase.APPLIED:
            # NOTE: torch's step() would step the loaded state with the window's gradients; here
            # the window's update has already run on the state before the load, and the window
            # (its gradients, late hyper-parameters, clipping) is left as it was for step()
            raise RuntimeError(
                f"load_state_dict() {Phase.APPLIED.value}: full offload applied the step's update during that "
                "backward, so the loaded state could not be the one step() steps, as torch's optimizer would; nothing "
                "was loaded and the window is as it was. Call step() first (the checkpoint then replaces the state "
                "after it), or zero_grad() to drop the window (its update, already applied, is then replaced by the "
                "checkpoint's state)")

        def apply(sd: dict) -> None:
            with deferred_interrupts():  # NOTE: every parameter is loaded, or (on an error) none
                checkpoint.load_state_dict(self, sd)
                self._transfer.synchronize()
                note_versions(self._records)
        load_state_dict_with_hooks(self, state_dict, apply)

    def stats(self) -> dict:
        """Figures of the last step: bytes D2H/H2D, CPU kernel seconds, seconds
        the loop blocked on the optimizer's tail (``step_blocked_s``, the exposed
        cost), seconds backward waited for a free staging slot (``slot_wait_s``) and
        the worker for gradient copies and h2d slots (``grad_wait_s``,
        ``h2d_slot_wait_s``), the worker's own time on its chunks besides the kernels and
        those waits (``worker_overhead_s``), pinned and host bytes, the bytes of state on the device
        (``gpu_state_bytes``), chunks, ``grad_norm`` and
        ``clip_coef`` (None when not computed), whether it was ``skipped``;
        ``skipped_steps`` counts since construction. With ``overlap_forward``: of the last
        step whose chunks have all run (empty before the first one has)."""
        return dict(self._proto.last_stats, skipped_steps=self._validator.skipped_steps)

    # ------------------------------------------------------------- helpers
    def _check_parameters(self) -> None:
        """The parameters are those the host state was built for: a parameter put into a
        group later would never be stepped, and a frozen one unfrozen never either."""
        for p in self._frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"{position_of(self.param_groups, p)}, frozen (requires_grad=False) when the optimizer was "
                    "wrapped, now requires grad; full offload built its host state at construction: set "
                    "requires_grad before wrapping, or freeze it again")
        if _param_ids(self.param_groups) != self._group_ids:
            raise RuntimeError(
                "the optimizer's param_groups no longer hold the parameters they held when offload_optimizer wrapped "
                "it (a group or parameter added, removed or replaced); full offload built its host state at "
                "construction: give the optimizer every parameter before wrapping it")

    @staticmethod
    def _rearm_hooks(records) -> None:
        """Register the records' gradient hooks on the tensors their parameters hold now.

        NOTE: torch.utils.swap_tensors gives a parameter another C++ tensor, without its hooks
        (Module._apply and load_state_dict swap under set_swap_module_params_on_conversion).
        The parameter keeps its dict of them, and setting it again registers it on the new
        tensor, every hook in it; setting it twice is harmless. The swap also took the
        parameter's Python attributes, the mark of its cast among them: marked again."""
        for rec in records:
            rec.param._post_accumulate_grad_hooks = rec.param._post_accumulate_grad_hooks
            rec.hooked_tensor = rec.param._cdata
            if rec.cast_from is not None:
                ownership.mark_cast(rec.param, rec.cast_from)

    def _check_no_bypassed_grads(self) -> None:
        """A gradient left in ``param.grad`` never reached the hooks: it would be lost silently.
        Those parameters get their hooks again (``_rearm_hooks``), for the windows after this
        one. NOTE: again whether or not the tensor looks swapped: the address a swap gives
        may be the old one's."""
        left = [rec for rec in self._records if rec.param.grad is not None]
        if not left:
            return
        swapped = [rec.name for rec in left if rec.param._cdata != rec.hooked_tensor]
        self._rearm_hooks(left)
        names = [rec.name for rec in left]
        cause = (f"; the hooks of {swapped[:8]} were removed by a swap" if swapped else
                 " (under FSDP2 after an exception in backward: call reset_iter_state() on the root module before the "
                 "next forward; or the parameters were swapped)")
        raise RuntimeError(
            f"gradients of {names[:8]}{' ...' if len(names) > 8 else ''} reached param.grad without passing through "
            f"full offload's hooks, so no update used them{cause}. torch.utils.swap_tensors drops a tensor's hooks, "
            "and model.load_state_dict() and model.to() swap parameters under "
            "torch.__future__.set_swap_module_params_on_conversion(True): the hooks are registered again for the "
            "next windows; call zero_grad() to drop these gradients")

    def _enter(self, *, land: bool = True) -> None:
        ownership.check_same_process(self._pid)
        if self._proto.phase is Phase.CLOSED:
            raise RuntimeError("this FullCPUOffloadOptimizer is closed: take opt.state_dict() (the fp32 masters and "
                               "moments) before close() to keep its state")
        self._proto.thread = threading.get_ident()
        self._settle()
        if land:
            self._land()

    def _check_idle(self, what: str) -> None:
        self._check_between_steps(what)
        if self._proto.phase is not Phase.IDLE:
            raise RuntimeError(f"{what} {self._proto.phase.value}: call it after step()")

    def _check_state_read(self, what: str) -> None:
        """``opt.state[p][key]``: the last step lands first (overlap_forward may still be
        stepping it). Refused once the window's last backward has begun, until step(): the
        state is already (partly) this step's, where torch's would be the one before it.
        NOTE: a read in the middle of an accumulation window is torch's: nothing stepped yet."""
        self._enter()
        phase = self._proto.phase
        if phase is Phase.APPLIED or (phase is Phase.BACKWARD and self._proto.final):
            raise RuntimeError(f"{what} {phase.value}: {_STEP_APPLIED}")

    def _check_between_steps(self, what: str, *, in_window: bool = False) -> None:
        """Refused during a backward pass and, unless ``in_window``, in the middle of an
        accumulation window; then no chunk is left running."""
        self._enter()
        phase = self._proto.phase
        if phase is Phase.BACKWARD or (phase is Phase.ACCUMULATING and not in_window):
            raise RuntimeError(f"{what} called {phase.value} ({self._proto.micro} of {self.grad_accum_steps} backward "
                               "passes); call it after step(), or call zero_grad() first to drop the window (the "
                               "optimizer's or the whole model's)")
        self._pipeline.drain()

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Remove the hooks, stop the worker and free the staging rings. Idempotent."""
        self._close("close()")

    def __del__(self) -> None:
        # NOTE: dropped after a window's last backward without step(), the window closes as
        # close() closes it: the finalizer alone only lets the worker finish, so the host
        # records kept a speculative update (without the window's clipping factor) and the
        # device records none, the split deciding which weights took the step. Where the
        # finalizer runs first (a reference cycle, the interpreter's exit) it says so.
        finalizer, proto = getattr(self, "_finalizer", None), getattr(self, "_proto", None)
        if finalizer is None or not finalizer.alive or proto is None or proto.phase is not Phase.APPLIED:
            return
        if os.getpid() != self._pid or self._pipeline.on_worker_thread():
            return  # a forked child's window is the parent's; the worker cannot wait for itself: the finalizer says
        try:
            # NOTE: whole: a Ctrl-C here would leave the window open, with no one to close it again;
            # delivered after it, it surfaces as an exception __del__ can only print
            with deferred_interrupts():
                self._close("dropping the optimizer")
        except Exception as exc:  # NOTE: an exception leaving __del__ is only printed
            warnings.warn(f"cpu_offload: a full-offload optimizer dropped after a window's last backward pass without "
                          f"step(): {exc}", RuntimeWarning, stacklevel=_user_stacklevel())

    def _close(self, call: str) -> None:
        if self._proto.phase is Phase.CLOSED:
            return
        ownership.check_same_process(self._pid)  # NOTE: a forked child has no worker to wait for
        late_edits = None
        try:
            self._settle()  # NOTE: a backward that raised is recovered first: its chunks still count
            self._land()  # NOTE: the last step's weights land before the worker stops
            if self._proto.phase is Phase.APPLIED:  # NOTE: the device records take the update too
                with deferred_interrupts():
                    late_edits = self._close_without_step(call)
                    self._proto.move(Phase.IDLE)
            elif self._proto.phase is Phase.ACCUMULATING:
                warnings.warn(f"cpu_offload: {call} dropped an open accumulation window ({self._proto.micro} of "
                              f"{self.grad_accum_steps} backward passes): their gradients were not stepped; call "
                              "step() first to step them", RuntimeWarning, stacklevel=_user_stacklevel())
        except KeyboardInterrupt:
            # NOTE: the optimizer stays open, its window as it was: close() again finishes it
            # (stopping the worker here would drop the chunks it has not stepped yet)
            raise
        except BaseException:
            self._release()
            raise
        self._release()
        if late_edits is not None:
            raise late_edits

    def _release(self) -> None:
        with deferred_interrupts():  # NOTE: whole, as the finalizer it runs
            self._proto.move(Phase.CLOSED)
            release_optimizer(self)
            detached = self._finalizer.detach()
            if detached is not None:
                _, shutdown, args, _ = detached
                shutdown(*args, finish_queued=False)  # NOTE: close() landed the last step, or raised

    def __getstate__(self):
        refuse_copy(self)

    def __repr__(self) -> str:
        return (f"FullCPUOffloadOptimizer({type(self.optimizer).__name__}, grad_accum_steps={self.grad_accum_steps}, "
                f"params={len(self._records)}, pinned_bytes={getattr(self, '_pinned_bytes', 0)})")
