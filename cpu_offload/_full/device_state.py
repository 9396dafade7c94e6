# Part of full offload's state kept on the device (``gpu_state=``): parameters whose fp32
# master and moments stay in device memory and are stepped there, by the operations of
# cpu_offload/reference.py (each one float32 operation, correctly rounded, in the native
# kernel's order, no fused multiply-add; the square root in float64, rounded once), so a
# parameter's values are bit-identical whichever device stepped it. On CUDA, AdamW runs
# them as one fused pass (device_kernel.py); elsewhere, and for SignSGD, as torch passes.
#
# Which parameters: a share spread evenly over the optimizer's order (over the model's
# depth), up to the byte budget. The host pipeline, which steps chunks in the order their
# gradients arrive, then receives its gradients at an even rate through the whole of
# backward, and backward does not wait for it: with the first parameters on the device
# instead, the host's gradients arrive in one burst in the first part of backward, faster
# than the CPU steps them, the staging rings fill and backward waits for free slots (0.55 s
# a step at 14B, benchmarks/results/capacity_fused_device_step_h200_2026-12-01.json). The
# device steps its share once backward is over, in one fused pass.
#
# NOTE: never stepped speculatively: device parameters are stepped when the window closes
# (step(), or zero_grad() after the window's last backward), with the window's final factor,
# so no rollback touches device state and a skipped step (a non-finite gradient) leaves it as
# it was. Their gradient stays on the device until then: the gradient itself (2 B per
# parameter) or, with accumulation, an fp32 accumulator in device memory.
#
# Scope: choosing the device parameters (a budget, or gpu_state="auto"'s reading of the
# device's memory), their state, their gradients and norms, their step; the same for the
# streamed parameters (stream_share=), whose state streamed_step.py keeps on the host.
# Non-goals: the host pipeline (pipeline.py), deciding skip / clip (validation.py).

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable, Optional

import psutil
import torch

from cpu_offload._full.device_kernel import BLOCK, fused_adamw_, fused_adamw_available
from cpu_offload._full.grad_norms import local_norm

__all__ = ["DeviceState", "AutoSplit", "choose_device_records", "device_bytes_per_element", "memory_reading",
           "free_memory", "auto_margin", "host_margin", "records_to_free_host", "check_fused_step", "same_bits",
           "step_flat"]

# Elements stepped per pass: bounds the temporaries (about 20 B per element: the fp32
# gradient, an fp32 product, the float64 square root; 1.3 GiB) whatever the parameter's size.
_PIECE = 1 << 26


def device_bytes_per_element(*, moments: bool, state_dtype: torch.dtype, accumulate: bool) -> int:
    """Device bytes per element a parameter's state takes when kept on the device."""
    return 4 + (2 * state_dtype.itemsize if moments else 0) + (4 if accumulate else 0)


def choose_device_records(records: list, budget: int, per_element: int) -> list:
    """The records whose state goes on the device: spread evenly over ``records``' order,
    their bytes at most ``budget``. Walking in order, a record is taken when the bytes taken
    stay within the budget's share of the bytes walked so far (all of them when the budget
    holds them all)."""
    if budget <= 0:
        return []
    total = sum(rec.numel for rec in records) * per_element
    chosen, used, seen = [], 0, 0
    for rec in records:
        cost = rec.numel * per_element
        seen += cost
        if (used + cost) * total <= budget * seen:  # NOTE: integers: exact, and never above the budget
            chosen.append(rec)
            used += cost
    return chosen


def records_to_free_host(records: list, shortage: int, host_bytes) -> Optional[list]:
    """Records spread evenly over ``records``' order whose host bytes add up to at least
    ``shortage``; None when all of them together do not. A record is taken while the bytes
    freed are behind the shortage's share of the host bytes walked so far: at the end they
    cover it."""
    total = sum(host_bytes(rec) for rec in records)
    chosen, freed, seen = [], 0, 0
    for rec in records:
        seen += host_bytes(rec)
        if freed * total < shortage * seen:
            chosen.append(rec)
            freed += host_bytes(rec)
    return chosen if freed >= shortage else None


# gpu_state="auto": the windows whose peak memory is observed before the split settles.
AUTO_WINDOWS = 3


def memory_reading(device: torch.device) -> Optional[tuple[int, int]]:
    """``(total, peak allocated)`` bytes of a CUDA device (the peak since the caller's last
    reset, which covers the window that just ended); None on other devices."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory, torch.cuda.max_memory_allocated(device)


def free_memory(device: torch.device) -> Optional[tuple[int, int]]:
    """``(free, total)`` bytes of a CUDA device now; None on other devices."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)


def auto_margin(total: int) -> int:
    """Device memory ``"auto"`` leaves free above the observed peak: 10% of the device, at
    least 4 GiB. NOTE: it covers the caching allocator's fragmentation, windows that peak
    higher than the observed ones (a longer sequence in the batch), and the device step's
    temporaries (about 20 B x 2**26 elements, 1.3 GiB)."""
    return max(4 << 30, total // 10)


def host_margin() -> int:
    """Host RAM ``"auto"`` keeps free when it moves state to make the host state fit: 5% of
    the host's RAM, at least 4 GiB. NOTE: the process needs memory beyond the host state and
    the pinned rings (the CUDA context, Python, the framework): 2.3 GiB in the capacity
    benchmark's 14B run."""
    return max(4 << 30, psutil.virtual_memory().total // 20)


class AutoSplit:
    """``gpu_state="auto"``: reads the device's peak memory after each of the first windows,
    then gives the budget once (total - peak - margin), or 0 when there is no reading."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: list = []
        self.settled = False

    def observe(self) -> Optional[int]:
        """After a window closed: the budget when the split settles now, else None."""
        if self.settled:
            return None
        reading = memory_reading(self.device)
        if reading is None:
            self.settled = True
            return 0
        total, peak = reading
        self.peaks.append(peak)
        if len(self.peaks) < AUTO_WINDOWS:
            return None
        self.settled = True
        return max(0, total - max(self.peaks) - auto_margin(total))


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-d float32 CPU tensor: torch passes it to a device kernel as a float32 scalar (no
    copy, no synchronisation), and a product or sum with it rounds like the reference's full
    tensor of that value. NOTE: only ever a factor or a term here, never a divisor: a
    division by a CPU scalar may become a multiplication by its reciprocal."""
    return torch.tensor(value, dtype=torch.float32)


def adamw_piece_(p, grad, m, v, step: int, *, lr, beta1, beta2, eps, weight_decay, grad_scale, out=None) -> None:
    """adamw_reference_ on flat views, in place, with fewer temporaries (same operations,
    same order); ``out``: the compute copy, set to round(p)."""
    bc1 = 1.0 - beta1 ** step                      # in double, once per tensor
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    g = grad.float() * _f32(grad_scale, p)
    p.mul_(_f32(1.0 - lr * weight_decay, p))                                  # decoupled weight decay
    m32 = m if m.dtype == torch.float32 else m.float()
    m32.mul_(_f32(beta1, p)).add_(g * _f32(1.0 - beta1, p))                   # m = b1*m + (1-b1)*g
    v32 = v if v.dtype == torch.float32 else v.float()
    v32.mul_(_f32(beta2, p)).add_((g * _f32(1.0 - beta2, p)).mul_(g))         # v = b2*v + ((1-b2)*g)*g
    denom = torch.sqrt(v32.double()).float().add_(_f32(eps * bc2_sqrt, p))   # sqrt(v) + eps*sqrt(bc2)
    p.add_((m32 * _f32(-(lr * bc2_sqrt / bc1), p)).div_(denom))              # p + (c*m)/denom
    if m32 is not m:
        m.copy_(m32)                               # bf16 moments: rounded only here
        v.copy_(v32)
    if out is not None:
        out.copy_(p)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two float32 or bf16 tensors hold the same bit patterns (NaN payloads and
    signed zeros included)."""
    if a.dtype != b.dtype:
        return False
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(a.view(bits), b.view(bits))


def check_fused_step(device: torch.device, fused: Optional[Callable] = None) -> Optional[str]:
    """Why the fused step (``fused``: device_kernel.fused_adamw_) cannot stand in for
    adamw_piece_ on ``device``, or None when it can: it must run, and give the same bits as
    those torch passes, on random data across two of its blocks and a tail, with fp32 and
    with bf16 moments.

    NOTE: checked once per device at the first device step, so a Triton that imports but
    cannot compile for this GPU, or a compiler that rounds differently, costs speed
    (the torch passes, with a warning) instead of a failed step or a parameter whose values
    depend on the device that stepped it."""
    fused = fused_adamw_ if fused is None else fused
    gen = torch.Generator().manual_seed(0)
    n = 2 * BLOCK + 7
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, grad_scale=0.5)
    for dtype in (torch.float32, torch.bfloat16):
        base = [torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 4, (n,), generator=gen).float())
                for _ in range(4)]
        base[3] = base[3].square()  # v >= 0
        for t in base:
            # NOTE: a quarter of each in float32's subnormal range, where moments decay while
            # gradients stay zero: a kernel compiled to flush subnormals would step them otherwise
            t[torch.rand(n, generator=gen) < 0.25] *= 2.0 ** -125
        base[2], base[3] = base[2].to(dtype), base[3].to(dtype)  # the moments
        base[1] = base[1].to(dtype)  # the gradient, in the compute dtype
        want = [t.to(device) for t in base] + [torch.empty(n, dtype=torch.bfloat16, device=device)]
        got = [t.clone() for t in want]
        adamw_piece_(*want[:4], 3, out=want[4], **hp)
        try:
            fused(*got[:4], 3, out=got[4], **hp)
        except Exception as e:  # NOTE: compilation and launch errors alike
            return f"{type(e).__name__}: {e}"
        for name, i in (("master", 0), ("exp_avg", 2), ("exp_avg_sq", 3), ("compute copy", 4)):
            if not same_bits(want[i], got[i]):
                return f"its {name} differs from the reference's operations with {dtype} moments"
    return None


@functools.lru_cache(maxsize=None)
def _fused_step_usable(device: torch.device) -> bool:
    reason = check_fused_step(device)
    if reason is not None:
        warnings.warn(f"cpu_offload: the fused AdamW step cannot be used on {device} ({reason}); the parameters "
                      "stepped on the device run as torch operations instead (the same values, several times slower)",
                      RuntimeWarning, stacklevel=2)
    return reason is None


def sign_sgd_piece_(p, grad, *, lr, weight_decay, grad_scale, out=None) -> None:
    """sign_sgd_reference_ in place on the scaled gradient: p <- p*(1 - lr*wd); p <- p - lr*sign(g*grad_scale)."""
    p.mul_(_f32(1.0 - lr * weight_decay, p))
    p.sub_(torch.sign(grad.float() * _f32(grad_scale, p)).mul_(_f32(lr, p)))
    if out is not None:
        out.copy_(p)


def step_flat(algorithm: str, master: torch.Tensor, grad: torch.Tensor, exp_avg: Optional[torch.Tensor],
              exp_avg_sq: Optional[torch.Tensor], out: torch.Tensor, step: int, hp: dict, grad_scale: float) -> None:
    """One step of flat views on one device, in place (``out``: the compute copy, set to
    round(master)): the fused kernel on CUDA (device_kernel.py) once it has passed
    check_fused_step on this device, else the same operations as torch passes over pieces
    of _PIECE elements."""
    if (algorithm == "adamw" and fused_adamw_available(master, grad, exp_avg, exp_avg_sq, out)
            and _fused_step_usable(master.device)):
        fused_adamw_(master, grad, exp_avg, exp_avg_sq, step, lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"],
                     eps=hp["eps"], weight_decay=hp["weight_decay"], grad_scale=grad_scale, out=out)
        return
    for start in range(0, max(master.numel(), 1), _PIECE):
        piece = slice(start, start + _PIECE)
        if algorithm == "adamw":
            adamw_piece_(master[piece], grad[piece], exp_avg[piece], exp_avg_sq[piece], step, lr=hp["lr"],
                         beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"], weight_decay=hp["weight_decay"],
                         grad_scale=grad_scale, out=out[piece])
        else:
            sign_sgd_piece_(master[piece], grad[piece], lr=hp["lr"], weight_decay=hp["weight_decay"],
                            grad_scale=grad_scale, out=out[piece])


class DeviceState:
    """The device parameters of one full-offload optimizer.

    Args:
        records: the device records at construction (``add`` gives them their state).
        algorithm: ``"adamw"`` or ``"sign_sgd"``.
        state_dtype: AdamW's moments' dtype.
        accumulate: grad_accum_steps > 1.
        track_norms: compute each gradient's norm when it arrives (the non-finite guard, clipping).
        streamed: the streamed step (streamed_step.py) of the host records the device steps
            (``stream_share=``): device records for their gradients and their step, which
            keep their master and moments in its pinned host buffers.
    """

    def __init__(self, records: list, *, algorithm: str, state_dtype: torch.dtype, accumulate: bool,
                 track_norms: bool, streamed=None) -> None:
        self.records: list = []
        self.algorithm = algorithm
        self.state_dtype = state_dtype
        self.accumulate = accumulate
        self.track_norms = track_norms
        self._events: dict = {}  # id(rec) -> event after its gradient (CUDA)
        self._norms: Optional[torch.Tensor] = None
        self._slot: dict = {}
        self.streamed = streamed
        self._streamed_ids = frozenset() if streamed is None else frozenset(id(r) for r in streamed.records)
        self.add(records)
        for rec in [] if streamed is None else streamed.records:
            device = rec.local().device
            rec.accum = torch.zeros(rec.numel, dtype=torch.float32, device=device) if accumulate else None
            self._register(rec)

    def add(self, records: list) -> None:
        """Move ``records``' state to their parameters' device: a new record takes its
        master from its weights and zero moments; one with host state (``gpu_state="auto"``
        settling, between windows) takes its master and moments from there. Its host views
        are dropped (the flat host buffers stay allocated)."""
        moments = self.algorithm == "adamw"
        with torch.no_grad():
            for rec in records:
                device = rec.local().device
                src = rec.local().detach().reshape(-1) if rec.master is None else rec.master
                master = src.to(device=device, dtype=torch.float32, copy=True)
                exp_avg = exp_avg_sq = None
                if moments:
                    exp_avg = torch.zeros(rec.numel, dtype=self.state_dtype, device=device)
                    exp_avg_sq = torch.zeros(rec.numel, dtype=self.state_dtype, device=device)
                    if rec.exp_avg is not None:
                        exp_avg.copy_(rec.exp_avg)
                        exp_avg_sq.copy_(rec.exp_avg_sq)
                accum = torch.zeros(rec.numel, dtype=torch.float32, device=device) if self.accumulate else None
                # NOTE: assigned only once all of its tensors exist: an out-of-memory error on
                # any of them leaves the record whole on the host
                rec.master, rec.exp_avg, rec.exp_avg_sq, rec.accum = master, exp_avg, exp_avg_sq, accum
                self._register(rec)
        self._norms = None

    def _register(self, rec) -> None:
        """``rec`` is a device record from now on: its gradient and its step are this object's."""
        rec.retained = None
        rec.on_device = True
        self._slot[id(rec)] = len(self.records)
        self.records.append(rec)

    @property
    def nbytes(self) -> int:
        """Bytes of state in device memory (a streamed record's own: its accumulator)."""
        return sum(t.numel() * t.element_size() for r in self.records
                   for t in ((r.accum,) if id(r) in self._streamed_ids else (r.master, r.exp_avg, r.exp_avg_sq, r.accum))
                   if t is not None)

    @property
    def host_nbytes(self) -> int:
        """Bytes of the streamed records' pinned host state."""
        return 0 if self.streamed is None else self.streamed.nbytes

    # ------------------------------------------------------------ during backward
    def take_grad(self, rec, grad: torch.Tensor, *, final: bool, add: bool) -> None:
        """The gradient of a device record arrived (flat, on the device)."""
        if self.accumulate:
            if add:
                rec.accum.add_(grad.float())          # fp32 sum in arrival order, like accumulate_
            else:
                rec.accum.copy_(grad)
        else:
            rec.retained = grad  # NOTE: kept until the window closes: the step reads it then
        if final:
            self._mark_final(rec)
        if grad.is_cuda:
            event = torch.cuda.Event()
            event.record()  # the current stream produced the gradient (FSDP2: its reduce-scatter stream)
            self._events[id(rec)] = event

    def take_accumulated(self, rec) -> None:
        """The window's last pass gave no gradient to ``rec``: it is stepped on what its
        accumulator holds from the earlier passes."""
        self._mark_final(rec)

    def _mark_final(self, rec) -> None:
        rec.plan_step(1)
        if self.track_norms:
            window = rec.accum if self.accumulate else rec.retained
            if self._norms is None:
                self._norms = torch.zeros(len(self.records), dtype=torch.float64, device=window.device)
            self._norms[self._slot[id(rec)]] = local_norm(window)

    def read_norms(self) -> None:
        """Set ``grad_sq`` of the window's device records (one device-to-host read)."""
        recs = [r for r in self.records if r.pieces_total]
        if not (self.track_norms and recs and self._norms is not None):
            return
        norms = self._norms.cpu()
        for rec in recs:
            n = float(norms[self._slot[id(rec)]])
            rec.grad_sq = n * n

    def stage_zeros(self, rec) -> None:
        """``zero_grad(set_to_none=False)``: a parameter that holds a zero gradient is stepped with it."""
        self.take_grad(rec, torch.zeros(rec.numel, dtype=rec.local().dtype, device=rec.local().device),
                       final=True, add=False)

    # ------------------------------------------------------------ the step
    def step(self, hparams: list, grad_scale: float) -> list:
        """Step every device record of the window not stepped yet, with ``grad_scale``;
        returns them."""
        stepped = []
        due = [rec for rec in self.records if rec.pieces_total and not rec.stepped]
        streamed = self._streamed_ids
        with torch.no_grad():
            if streamed:
                # NOTE: first: its copies then overlap the device records' step
                stepped += self.streamed.step([r for r in due if id(r) in streamed], hparams, grad_scale,
                                              lambda rec: rec.accum if self.accumulate else rec.retained,
                                              self._events)
            for rec in due:
                if id(rec) in streamed:
                    continue
                event = self._events.get(id(rec))
                if event is not None:
                    torch.cuda.current_stream(rec.master.device).wait_event(event)
                try:
                    self._step_record(rec, rec.accum if self.accumulate else rec.retained, hparams[rec.group],
                                      grad_scale)
                except BaseException:
                    # NOTE: its master and moments change in place, operation by operation and
                    # piece by piece: a failure (an out-of-memory on a temporary) may leave them
                    # matching no whole step
                    rec.uncounted = True
                    raise
                rec.piece_stepped()
                stepped.append(rec)
        return stepped

    def _step_record(self, rec, grad: torch.Tensor, hp: dict, grad_scale: float) -> None:
        step_flat(self.algorithm, rec.master, grad, rec.exp_avg, rec.exp_avg_sq, rec.local().detach().view(-1),
                  rec.step + 1, hp, grad_scale)

    def reset_window(self) -> None:
        self._events.clear()
        for rec in self.records:
            rec.retained = None
