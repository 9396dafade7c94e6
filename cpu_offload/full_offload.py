# FullCPUOffloadOptimizer: optimizer-in-backward with everything but the
# compute copy in host RAM.
#
# The device keeps only each parameter's compute copy (bf16 by default). The
# fp32 masters, the AdamW moments and the accumulated gradients live in host
# RAM; per-parameter post-accumulate-grad hooks stream gradients to the host
# during backward, the native kernels step each chunk as soon as its last
# gradient landed, and the new compute copy goes back during the same backward.
# step() only waits for the tail of that work.
#
# Scope: construction (checks, binding, host state, pinned rings, hooks), the
# backward/step protocol with gradient accumulation, zero_grad, stats, close.
# Non-goals: gradient clipping (raises), optimizers other than torch AdamW and
# cpu_offload.SignSGD, parameters on several devices, FSDP2's
# ``set_requires_gradient_sync(False)`` (accumulate with grad_accum_steps).

from __future__ import annotations

import atexit
import time
import weakref
from typing import Iterable, Optional

import torch

from cpu_offload import checkpoint
from cpu_offload.host_state import (
    allocate_host_state, cast_to_compute, check_fsdp_not_started, check_host_ram, collect_records,
    host_bytes_needed, local_of,
)
from cpu_offload.optim import SignSGD
from cpu_offload.pipeline import Pipeline
from cpu_offload.transfer import HostRing, align_up, make_transfer
from cpu_offload.wrapping import adopt_optimizer

__all__ = ["FullCPUOffloadOptimizer"]

_MIB = 1 << 20
_UNSUPPORTED_ADAMW = ("amsgrad", "maximize", "capturable", "differentiable")
_BOUND_PLAN: Optional[topology.BindingPlan] = None


def _bind_for(device: torch.device, sysfs_root: str) -> topology.BindingPlan:
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


def _check_optimizer(optimizer) -> str:
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


def _close_at_exit(ref) -> None:
    opt = ref()
    if opt is not None:
        opt.close()


class FullCPUOffloadOptimizer(torch.optim.Optimizer):
    """Wraps a torch.optim.AdamW or cpu_offload.SignSGD and runs it on the CPU
    during backward.

    After construction the model's trainable parameters hold their compute copy
    (cast in place), and ``param.grad`` is always ``None`` after backward: the
    gradients went to the host. Call ``step()`` after every ``grad_accum_steps``
    backward passes.

    Args:
        optimizer: the optimizer to wrap (its ``param_groups`` dicts are shared,
            so LR schedulers keep working; a changed lr applies to the next step).
        grad_accum_steps: backward passes per optimizer step; the first ones
            accumulate gradients in fp32 host buffers.
        compute_dtype: dtype of the compute copy, ``torch.bfloat16`` (default)
            or ``torch.float32``.
        keep_fp32: parameters whose compute copy stays fp32.
        pinned_bytes: total size of the two staging rings (default 512 MiB).
        num_slots: slots per ring (default 4).
        timeout_s: limit for every wait of the pipeline (default 600 s).
        sysfs_root: where sysfs is mounted (for the topology binding).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        grad_accum_steps: int = 1,
        compute_dtype: torch.dtype = torch.bfloat16,
        keep_fp32: Iterable[torch.Tensor] = (),
        pinned_bytes: int = 512 * _MIB,
        num_slots: int = 4,
        timeout_s: float = 600.0,
        sysfs_root: str = "/sys",
    ) -> None:
        self._closed = True  # until fully constructed: close() is a no-op
        self._algorithm = _check_optimizer(optimizer)
        if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be an int >= 1, got {grad_accum_steps!r}")
        if compute_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"compute_dtype must be torch.bfloat16 or torch.float32, got {compute_dtype}")
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if not isinstance(pinned_bytes, int) or pinned_bytes < 2 * num_slots * 4096:
            raise ValueError(f"pinned_bytes must be an int >= {2 * num_slots * 4096} (num_slots={num_slots}), got {pinned_bytes!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        adopt_optimizer(self, optimizer)
        self.grad_accum_steps = grad_accum_steps
        self.timeout_s = float(timeout_s)
        self._accumulate = grad_accum_steps > 1

        self._records, self._frozen = collect_records(optimizer)
        check_fsdp_not_started(self._records)
        keep = {id(p) for p in keep_fp32}
        device = self._records[0].local().device
        self.binding = _bind_for(device, sysfs_root)  # before any host state is touched

        # Staging: slots no larger than the largest need (small models), rings bounded.
        grad_bytes = sum(r.numel * (4 if id(r.param) in keep or compute_dtype == torch.float32 else 2)
                         for r in self._records)
        slot_bytes = min(pinned_bytes // (2 * num_slots), align_up(grad_bytes + 64 * len(self._records), 4096))
        moments = self._algorithm == "adamw"
        check_host_ram(host_bytes_needed(self._records, moments=moments, accumulate=self._accumulate),
                       2 * num_slots * slot_bytes)
        self._host = allocate_host_state(self._records, moments=moments, accumulate=self._accumulate)
        cast_to_compute(self._records, compute_dtype=compute_dtype, keep_fp32=keep)
        self._transfer = make_transfer(device)
        d2h = HostRing("d2h", num_slots=num_slots, slot_bytes=slot_bytes, pin=self._transfer.pin)
        h2d = HostRing("h2d", num_slots=num_slots, slot_bytes=slot_bytes, pin=self._transfer.pin)
        self._pipeline = Pipeline(transfer=self._transfer, algorithm=self._algorithm, d2h=d2h, h2d=h2d,
                                  accumulate=self._accumulate, timeout_s=self.timeout_s)
        self._pinned_bytes = d2h.nbytes + h2d.nbytes
        self._micro = 0
        self._in_backward = False
        self._last_stats: dict = {}
        ref = weakref.ref(self)
        for rec in self._records:
            rec.hook = rec.param.register_post_accumulate_grad_hook(
                lambda param, rec=rec: ref()._on_grad(rec, param) if ref() is not None else None
            )
        self._closed = False
        atexit.register(_close_at_exit, ref)

    # ------------------------------------------------------------ backward
    def _snapshot_hparams(self) -> list:
        snap = []
        for group in self.param_groups:
            hp = {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"])}
            if self._algorithm == "adamw":
                hp.update(beta1=float(group["betas"][0]), beta2=float(group["betas"][1]), eps=float(group["eps"]))
            snap.append(hp)
        return snap

    def _begin_backward(self) -> None:
        k = self.grad_accum_steps
        if self._micro >= k:
            raise RuntimeError(
                f"backward pass {self._micro + 1} since the last step(), but grad_accum_steps={k}: "
                f"call step() after every {k} backward pass{'es' if k > 1 else ''}"
            )
        final = self._micro == k - 1
        # NOTE: hyper-parameters are read when the last backward of a window
        # starts (the chunks are stepped during it), so an LR scheduler stepped
        # after step() applies to the next step, as with torch.
        hparams = self._snapshot_hparams() if final else None
        self._pipeline.begin_backward(micro=self._micro, final=final, hparams=hparams)
        self._in_backward = True
        ref = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: ref()._end_backward() if ref() is not None else None
        )

    def _end_backward(self) -> None:
        self._in_backward = False
        leftovers = []
        if self._accumulate and self._micro == self.grad_accum_steps - 1:
            leftovers = [r for r in self._records if r.has_accum and r.arrived != self._micro]
        self._pipeline.end_backward(leftovers)
        self._micro += 1

    @torch.no_grad()
    def _on_grad(self, rec, param) -> None:
        self._check_open()
        self._pipeline.check()
        if not self._in_backward:
            self._begin_backward()
        if param.grad is None:
            return
        if rec.arrived == self._micro:
            raise RuntimeError(f"the gradient of {rec.name} arrived twice in one backward pass")
        grad = local_of(param.grad)
        compute = rec.local()
        if grad.dtype != compute.dtype:
            raise RuntimeError(
                f"gradient of {rec.name} is {grad.dtype} but its compute copy is {compute.dtype}: an FSDP2 "
                "model must be wrapped by offload_optimizer before its first forward pass"
            )
        if grad.shape != rec.shape:
            raise RuntimeError(f"gradient of {rec.name} has shape {tuple(grad.shape)}, expected {tuple(rec.shape)}")
        self._pipeline.add_grad(rec, grad.detach().reshape(-1), add=rec.has_accum)
        rec.arrived = self._micro
        rec.in_step = True
        rec.has_accum = self._accumulate
        param.grad = None  # the device copy of the gradient is no longer needed

    # ---------------------------------------------------------------- step
    def step(self, closure=None):
        """Wait for the optimizer work of the last backward pass and return.

        Raises RuntimeError when fewer than ``grad_accum_steps`` backward passes
        ran since the last step().
        """
        self._check_open()
        self._pipeline.check()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._in_backward:
            raise RuntimeError("step() called during a backward pass")
        if self._micro < self.grad_accum_steps:
            raise RuntimeError(
                f"step() called after {self._micro} backward pass(es), but grad_accum_steps="
                f"{self.grad_accum_steps}: run {self.grad_accum_steps - self._micro} more first"
            )
        t0 = time.perf_counter()
        self._pipeline.drain()
        self._transfer.compute_waits_for_h2d()
        blocked = time.perf_counter() - t0
        self._reset_window(count_steps=True)
        stats = dict(self._pipeline.stats)
        self._pipeline.stats.clear()
        stats.update(step_blocked_s=blocked, pinned_bytes=self._pinned_bytes, host_bytes=self._host.nbytes,
                     backward_passes=self.grad_accum_steps)
        for key in ("d2h_bytes", "h2d_bytes", "chunks", "kernel_s", "accumulate_s"):
            stats.setdefault(key, 0)
        self._last_stats = stats
        return loss

    def _reset_window(self, *, count_steps: bool) -> None:
        for r in self._records:
            if r.in_step and count_steps:
                r.step += 1
            r.in_step = r.has_accum = False
            r.arrived = -1
        self._micro = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients of offloaded parameters never stay on the device; in the
        middle of an accumulation window this discards the window, like torch."""
        self._check_open()
        if self._in_backward:
            raise RuntimeError("zero_grad() called during a backward pass")
        if self._micro > 0:
            self._pipeline.drain()
            self._reset_window(count_steps=False)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    def clip_grad_norm_(self, *args, **kwargs):
        raise RuntimeError(
            "gradient clipping is not available with offload='full': gradients are consumed on the host "
            "during backward, so torch.nn.utils.clip_grad_norm_ would see no gradients and silently "
            "return 0; use offload='optimizer' or offload='none' if you need clipping"
        )

    def add_param_group(self, param_group) -> None:
        raise RuntimeError(
            "FullCPUOffloadOptimizer cannot add parameter groups: host state and hooks are built at "
            "construction; add every group to the optimizer before wrapping it"
        )

    # ---------------------------------------------------- state and checkpoints
    @property
    def state(self):
        """``{param: {"step", "master", "exp_avg", "exp_avg_sq"}}`` views of the host state."""
        return checkpoint.state_view(self)

    def state_dict(self) -> dict:
        self._check_idle("state_dict()")
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        self._check_idle("load_state_dict()")
        checkpoint.load_state_dict(self, state_dict)

    def stats(self) -> dict:
        """Figures of the last step: bytes D2H/H2D, CPU kernel seconds, seconds
        step() blocked (the exposed cost), pinned and host bytes, chunks."""
        return dict(self._last_stats)

    # ------------------------------------------------------------- lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this FullCPUOffloadOptimizer is closed")

    def _check_idle(self, what: str) -> None:
        self._check_open()
        self._pipeline.check()
        if self._in_backward or self._micro > 0:
            raise RuntimeError(f"{what} called in the middle of an accumulation window "
                               f"({self._micro} of {self.grad_accum_steps} backward passes); call it after step()")
        self._pipeline.drain()

    def close(self) -> None:
        """Remove the hooks, stop the worker and free the staging rings. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for rec in self._records:
            if rec.hook is not None:
                rec.hook.remove()
                rec.hook = None
        self._pipeline.close()
        try:
            self._transfer.synchronize()
        except Exception:  # the device may already be gone at interpreter exit
            pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"FullCPUOffloadOptimizer({type(self.optimizer).__name__}, grad_accum_steps={self.grad_accum_steps}, "
                f"params={len(self._records)}, pinned_bytes={getattr(self, '_pinned_bytes', 0)})")
