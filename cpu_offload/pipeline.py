# The full-offload pipeline: gradients are packed into chunks in the order they
# arrive, each chunk's bytes go to the host through one staging slot, and a
# worker thread runs the native kernels on whole chunks and sends the compute
# copy back.
#
# Scope: chunk formation (main thread, inside gradient hooks), the worker
# thread (accumulate / optimizer step / H2D issue), error propagation to the
# main thread, timeouts with a readable diagnostic.
# Non-goals: hook registration and the optimizer API (full_offload.py), the
# copy mechanics (transfer.py), the math (kernels.py).

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from cpu_offload import kernels
from cpu_offload.host_state import ParamRecord
from cpu_offload.transfer import HostRing, Slot, align_up, wait_until

__all__ = ["Pipeline", "Piece", "Chunk"]

_PLAN_CACHE_MAX = 4096


@dataclass(eq=False)
class Piece:
    """Elements ``[start, start + numel)`` of one parameter inside a chunk."""

    rec: ParamRecord
    start: int
    numel: int
    offset: int  # byte offset in the D2H slot; -1: the gradient is the accumulator
    dtype: torch.dtype  # gradient dtype in the slot
    add: bool  # accumulation: add to the accumulator (True) or overwrite it


@dataclass(eq=False)
class Chunk:
    seq: int
    micro: int  # micro-batch index within the accumulation window
    final: bool  # last micro-batch: run the optimizer on this chunk
    slot: Optional[Slot]
    hparams: Optional[list]  # per-group hyper-parameters, snapshot at backward start
    pieces: list = field(default_factory=list)
    used: int = 0  # bytes used in the slot
    marker: Any = None  # completion of the D2H copies into the slot

    def describe(self) -> str:
        names = []
        for p in self.pieces:
            if not names or names[-1] != p.rec.name:
                names.append(p.rec.name)
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} parameters)" if len(names) > 8 else "")
        kind = "optimizer step" if self.final else "accumulation"
        return f"chunk {self.seq} (micro-batch {self.micro}, {kind}) with parameters [{shown}]"


@dataclass(eq=False)
class _Plan:
    """Per-chunk tensor lists, built once per chunk layout and reused, so the
    kernels see the same tensor objects every step (their validation is cached)."""

    accum_calls: list  # (accumulators, grads, add)
    opt_calls: list  # (group, recs, params, grads, exp_avgs, exp_avg_sqs, steps, outs)
    copies: list  # (rec, start, numel, out view)
    h2d_bytes: int


class Pipeline:
    """Chunks, staging slots and the worker thread of one full-offload optimizer.

    Args:
        transfer: a ``CudaTransfer`` or ``SyncTransfer``.
        algorithm: ``"adamw"`` or ``"sign_sgd"``.
        d2h, h2d: the staging rings (same slot size).
        accumulate: records own fp32 accumulators (grad_accum_steps > 1).
        timeout_s: limit for every wait.
    """

    def __init__(self, *, transfer, algorithm: str, d2h: HostRing, h2d: HostRing, accumulate: bool, timeout_s: float) -> None:
        if d2h.slot_bytes != h2d.slot_bytes:
            raise ValueError("d2h and h2d slots must have the same size")
        self.transfer = transfer
        self.algorithm = algorithm
        self.d2h, self.h2d = d2h, h2d
        self.accumulate = accumulate
        self.timeout_s = timeout_s
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._open: Optional[Chunk] = None
        self._busy: Optional[Chunk] = None
        self._busy_phase = ""
        self._seq = 0
        self._d2h_next = 0
        self._h2d_next = 0
        self._cur = (0, False, None)  # (micro, final, hparams) of the running backward
        self._error: Optional[tuple] = None
        self._stop = False
        self._plans: dict = {}
        self.stats = collections.Counter()
        self._thread = threading.Thread(target=self._run, name="cpu_offload-worker", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- main thread
    def check(self) -> None:
        """Raise the worker's exception (if any) on the calling thread."""
        if self._error is not None:
            exc, where = self._error
            raise RuntimeError(f"cpu_offload worker failed on {where}: {type(exc).__name__}: {exc}") from exc

    def begin_backward(self, *, micro: int, final: bool, hparams: Optional[list]) -> None:
        self._cur = (micro, final, hparams)

    def add_grad(self, rec: ParamRecord, grad: torch.Tensor, *, add: bool) -> None:
        """Stage the flat gradient ``grad`` of ``rec`` into the open chunk(s)."""
        dtype = torch.bfloat16 if grad.dtype == torch.bfloat16 else torch.float32
        esize = 2 if dtype == torch.bfloat16 else 4
        cap = self.d2h.slot_bytes
        self.transfer.grad_ready()
        start = 0
        while start < rec.numel:
            chunk = self._open if self._open is not None else self._open_chunk()
            room = (cap - chunk.used) // esize
            remaining = rec.numel - start
            # Keep a parameter whole when it fits in a fresh slot.
            if start == 0 and chunk.pieces and remaining > room and remaining * esize <= cap:
                self._close_open()
                continue
            if room == 0:
                self._close_open()
                continue
            n = min(room, remaining)
            piece = Piece(rec, start, n, chunk.used, dtype, add)
            chunk.pieces.append(piece)
            chunk.used = align_up(chunk.used + n * esize)
            self.transfer.d2h_copy(chunk.slot.view(piece.offset, n, dtype), grad[start : start + n])
            self.stats["d2h_bytes"] += n * esize
            start += n
            if chunk.used >= cap:
                self._close_open()

    def end_backward(self, leftovers: list) -> None:
        """Close the open chunk; on the final micro-batch, queue the parameters
        whose gradients only live in their accumulators (``leftovers``)."""
        self._close_open()
        micro, final, hparams = self._cur
        if not (final and leftovers):
            return
        cap = self.h2d.slot_bytes
        chunk = None
        for rec in leftovers:
            esize = rec.local().element_size()
            start = 0
            while start < rec.numel:
                if chunk is None or chunk.used + esize > cap:
                    if chunk is not None:
                        self._submit(chunk)
                    chunk = Chunk(self._next_seq(), micro, True, None, hparams)
                n = min(rec.numel - start, (cap - chunk.used) // esize)
                chunk.pieces.append(Piece(rec, start, n, -1, torch.float32, True))
                chunk.used = align_up(chunk.used + n * esize)
                start += n
        if chunk is not None:
            self._submit(chunk)

    def drain(self) -> None:
        """Wait until every queued chunk has been processed."""
        self._close_open()
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            while self._queue or self._busy is not None:
                if self._error is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"cpu_offload: timed out after {self.timeout_s:g}s draining the pipeline\n{self._diagnose()}")
                self._cv.wait(min(left, 0.5))
        self.check()
        wait_until(lambda: all(self.transfer.is_done(s.marker) for s in self.h2d.slots),
                   timeout_s=self.timeout_s, what="host-to-device copies", diagnose=self.diagnose)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            for chunk in self._queue:  # dropped: nobody will wait for them
                if chunk.slot is not None and chunk.slot.owner == chunk.seq:
                    chunk.slot.owner = None
            self._queue.clear()
            self._cv.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s)

    def diagnose(self) -> str:
        with self._cv:
            return self._diagnose()

    def _diagnose(self) -> str:
        micro, final, _ = self._cur
        lines = [
            f"pipeline: micro-batch {micro} (final={final}), open chunk: "
            + (f"{self._open.seq} ({self._open.used}/{self.d2h.slot_bytes} bytes)" if self._open else "none"),
            f"queued chunks: {[c.seq for c in self._queue]}; worker: "
            + (f"{self._busy.describe()} [{self._busy_phase}]" if self._busy else "idle")
            + ("" if self._thread.is_alive() else " (thread not running)"),
            self.d2h.describe(),
            self.h2d.describe(),
        ]
        if self._error is not None:
            lines.append(f"worker error: {self._error[1]}: {self._error[0]!r}")
        return "\n".join(lines)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _open_chunk(self) -> Chunk:
        micro, final, hparams = self._cur
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            while True:
                self.check()
                if self._stop:
                    raise RuntimeError("cpu_offload: the optimizer is closed")
                n = len(self.d2h.slots)
                free = [self.d2h.slots[(self._d2h_next + i) % n] for i in range(n)]
                free = [s for s in free if s.owner is None]
                if free:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"cpu_offload: timed out after {self.timeout_s:g}s waiting for a free d2h slot\n{self._diagnose()}")
                self._cv.wait(min(left, 0.5))
            slot = free[0]
            self._d2h_next = (slot.index + 1) % n
            chunk = Chunk(self._next_seq(), micro, final, slot, hparams)
            slot.owner = chunk.seq
        self._open = chunk
        return chunk

    def _close_open(self) -> None:
        chunk, self._open = self._open, None
        if chunk is None:
            return
        chunk.marker = self.transfer.d2h_marker()
        self._submit(chunk)

    def _submit(self, chunk: Chunk) -> None:
        with self._cv:
            self._queue.append(chunk)
            self._cv.notify_all()

    # --------------------------------------------------------- worker thread
    def _run(self) -> None:
        try:
            self.transfer.worker_init()
        except BaseException as e:  # surfaces at the next hook / step()
            self._error = (e, "worker start-up")
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                chunk = self._queue.popleft()
                self._busy, self._busy_phase = chunk, "start"
            try:
                if self._error is None:
                    with torch.no_grad():  # grad mode is per thread
                        self._process(chunk)
            except BaseException as e:
                with self._cv:
                    self._error = (e, chunk.describe())
            finally:
                with self._cv:
                    # NOTE: _process may have released the slot already, and the
                    # main thread may have handed it to a newer chunk since.
                    if chunk.slot is not None and chunk.slot.owner == chunk.seq:
                        chunk.slot.owner = None
                    self._busy = None
                    self._cv.notify_all()

    def _wait(self, marker: Any, what: str) -> None:
        wait_until(lambda: self.transfer.is_done(marker), timeout_s=self.timeout_s, what=what, diagnose=self.diagnose)

    def _process(self, chunk: Chunk) -> None:
        if chunk.slot is not None:
            self._busy_phase = "waiting for gradient copies"
            self._wait(chunk.marker, f"the gradient copies of {chunk.describe()}")
        out_slot = None
        if chunk.final:
            out_slot = self.h2d.slots[self._h2d_next]
            self._h2d_next = (self._h2d_next + 1) % len(self.h2d.slots)
            self._busy_phase = f"waiting for h2d slot {out_slot.index}"
            self._wait(out_slot.marker, f"h2d slot {out_slot.index} to be copied out")
            out_slot.owner = chunk.seq
        plan = self._plan(chunk, out_slot)
        self._busy_phase = "accumulate"
        t0 = time.perf_counter()
        for accs, grads, add in plan.accum_calls:
            kernels.accumulate_(accs, grads, add)
        t1 = time.perf_counter()
        self._busy_phase = "optimizer kernel"
        for group, recs, params, grads, m, v, steps, outs in plan.opt_calls:
            hp = chunk.hparams[group]
            if self.algorithm == "adamw":
                # steps hold the counts before this step; the kernel increments
                # them and uses step+1 in the bias corrections, like torch.
                steps.copy_(torch.tensor([r.step for r in recs], dtype=torch.int64))
                kernels.adamw_step(params, grads, m, v, steps, lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"],
                                   eps=hp["eps"], weight_decay=hp["weight_decay"], compute_params=outs)
            else:
                kernels.sign_sgd_step(params, grads, lr=hp["lr"], weight_decay=hp["weight_decay"], compute_params=outs)
        t2 = time.perf_counter()
        with self._cv:
            self.stats["accumulate_s"] += t1 - t0
            self.stats["kernel_s"] += t2 - t1
            self.stats["chunks"] += 1
            if chunk.slot is not None and chunk.slot.owner == chunk.seq:  # the kernel has read the gradients
                chunk.slot.owner = None
                self._cv.notify_all()
        if out_slot is not None:
            self._busy_phase = "issuing h2d copies"
            copies = [(rec.local().detach().view(-1)[start : start + n], out) for rec, start, n, out in plan.copies]
            out_slot.marker = self.transfer.h2d_copies(copies)
            out_slot.owner = None
            with self._cv:
                self.stats["h2d_bytes"] += plan.h2d_bytes

    def _plan(self, chunk: Chunk, out_slot: Optional[Slot]) -> _Plan:
        key = (
            -1 if chunk.slot is None else chunk.slot.index,
            -1 if out_slot is None else out_slot.index,
            chunk.final,
            tuple((p.rec.index, p.start, p.numel, p.offset, p.dtype, p.add) for p in chunk.pieces),
        )
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _PLAN_CACHE_MAX:
                self._plans.clear()
            plan = self._plans[key] = self._build_plan(chunk, out_slot)
        return plan

    def _build_plan(self, chunk: Chunk, out_slot: Optional[Slot]) -> _Plan:
        accum: dict = collections.defaultdict(lambda: ([], []))
        opt: dict = collections.defaultdict(lambda: ([], [], [], [], [], []))
        copies = []
        out_off = h2d_bytes = 0
        for p in chunk.pieces:
            end = p.start + p.numel
            grad = None if p.offset < 0 else chunk.slot.view(p.offset, p.numel, p.dtype)
            if self.accumulate and grad is not None:
                accs, grads = accum[(p.add, p.dtype)]
                accs.append(p.rec.accum[p.start : end])
                grads.append(grad)
            if not chunk.final:
                continue
            if self.accumulate:  # the optimizer reads the window's sum
                grad = p.rec.accum[p.start : end]
            cdtype = p.rec.local().dtype
            out = out_slot.view(out_off, p.numel, cdtype)
            out_off = align_up(out_off + p.numel * out.element_size())
            h2d_bytes += p.numel * out.element_size()
            recs, params, grads, m, v, outs = opt[(p.rec.group, grad.dtype, cdtype)]
            recs.append(p.rec)
            params.append(p.rec.master[p.start : end])
            grads.append(grad)
            if self.algorithm == "adamw":
                m.append(p.rec.exp_avg[p.start : end])
                v.append(p.rec.exp_avg_sq[p.start : end])
            outs.append(out)
            copies.append((p.rec, p.start, p.numel, out))
        if out_off > (0 if out_slot is None else out_slot.nbytes):
            raise AssertionError(f"compute copies of {chunk.describe()} overflow the h2d slot")
        accum_calls = [(a, g, add) for (add, _), (a, g) in accum.items()]
        opt_calls = [
            (group, recs, params, grads, m, v, torch.zeros(len(recs), dtype=torch.int64), outs)
            for (group, _, _), (recs, params, grads, m, v, outs) in opt.items()
        ]
        return _Plan(accum_calls, opt_calls, copies, h2d_bytes)
