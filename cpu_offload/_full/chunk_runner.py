# What the worker thread does to one chunk: wait for its gradient copies,
# accumulate or run the optimizer kernel, hand the compute copy to the device,
# and count a parameter's step once all of its pieces have been stepped.
# With norm tracking on, each optimizer chunk's gradient norms are read (or, for
# host accumulators, computed) before it is stepped: a non-finite gradient
# stops the window's remaining steps (so a NaN loss changes nothing), and every
# stepped piece is recorded for a later rollback (validation.py).
#
# Scope: per-chunk work on the worker thread, the cached tensor lists the
# kernels see. Non-goals: forming chunks, the queue and the thread
# (pipeline.py), the math (kernels.py), the copy mechanics (transfer.py).

from __future__ import annotations

import array
import collections
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch

from cpu_offload import kernels
from cpu_offload._full.grad_norms import local_norm
from cpu_offload._full.packing import align_up
from cpu_offload._full.trace import NO_TRACE, Trace
from cpu_offload._full.transfer import HostRing, Slot, wait_until

__all__ = ["ChunkRunner", "SteppedPiece"]

# Largest |factor * g| whose square, times (1 - beta2) <= 1, stays far from float32's
# maximum (3.4e38 = (1.8e19)**2).
_SAFE_GRAD = 2.0**61


class SteppedPiece(NamedTuple):
    """A piece the window's step has stepped: what a rollback needs to undo it."""

    rec: Any  # ParamRecord
    start: int
    numel: int
    step: int  # the count its step used (1 for the first)
    hparams: dict  # those of its step, grad_scale included


class _AccumulateCall(NamedTuple):
    accumulators: list
    grads: list
    add: bool  # add to the accumulators (True) or overwrite them


class _OptimizerCall(NamedTuple):
    """One kernel call: the pieces of one group with the same gradient and compute dtypes."""

    group: int
    recs: list
    params: list
    grads: list
    exp_avgs: list
    exp_avg_sqs: list
    counts: array.array  # the memory of ``steps``, refilled with the records' counts before each call
    steps: torch.Tensor  # int64
    outs: list  # the compute copies' views in the h2d slot


class _ComputeCopy(NamedTuple):
    rec: Any  # ParamRecord
    start: int
    numel: int
    out: torch.Tensor  # its view in the h2d slot
    shaped: Optional[torch.Tensor]  # a piece of the whole parameter: ``out`` in its shape, else None


@dataclass(eq=False)
class _Plan:
    """Per-chunk tensor lists, built once per chunk layout and reused, so the
    kernels see the same tensor objects every step (their validation is cached)."""

    accumulate_calls: list  # of _AccumulateCall
    retain_copies: list  # (host copy of the gradient, slot view): without accumulation
    optimizer_calls: list  # of _OptimizerCall
    copies: list  # of _ComputeCopy
    h2d_bytes: int


def _add_new_norms(total: float, chunk, device_norms: list, seen: set) -> float:
    """``total`` plus the squared 2-norm of each parameter of ``chunk`` not in ``seen`` (then
    added to it), in the order of its pieces: a parameter's norm is its whole gradient's.

    NOTE: the one sum of a window's norms. ``ChunkRunner.would_clip`` predicts what the worker
    (``_read_norms``) holds back only while both add the same terms in the same order."""
    for p in chunk.pieces:
        if p.rec.index not in seen:
            seen.add(p.rec.index)
            n = device_norms[p.rec.index]
            total += n * n
    return total


class ChunkRunner:
    """Runs chunks on the worker thread.

    Args:
        transfer, algorithm, h2d, accumulate, timeout_s, copy_grads: as for the Pipeline.
        track_norms: read (or compute) each optimizer chunk's gradient norms before stepping it.
        skip_nonfinite: a non-finite gradient stops the window's remaining steps.
        device_norms: per record index, |g|_2 copied from the device (None with accumulation).
        stats: the Counter the figures go to; lock: guards it and the slots.
        release: called (lock held) once the chunk's gradients have been read.
        diagnose: the pipeline's diagnostic, for timeouts.
        trace: where the chunk's events go (trace.py).
    """

    def __init__(self, *, transfer, algorithm: str, h2d: HostRing, accumulate: bool, timeout_s: float,
                 track_norms: bool, skip_nonfinite: bool, copy_grads: bool, device_norms: Optional[torch.Tensor],
                 stats: collections.Counter, lock, release: Callable, diagnose: Callable[[], str],
                 trace: Trace = NO_TRACE) -> None:
        self.transfer = transfer
        self.algorithm = algorithm
        self.h2d = h2d
        self.accumulate = accumulate
        self.timeout_s = timeout_s
        self.track_norms = track_norms
        self.skip_nonfinite = skip_nonfinite
        self.copy_grads = copy_grads
        self.device_norms = device_norms
        self.stats = stats
        self._lock = lock
        self._release = release
        self._diagnose = diagnose
        self.trace = trace
        self._h2d_next = 0
        self._plans: dict = {}
        # NOTE: a plan's kernel calls (one to four, typically) stay validated in the kernels'
        # LRU cache only while the calls of every plan in use fit in it; with more plans than
        # this the runner starts afresh instead of making every call miss.
        self._plan_limit = kernels.CACHE_ENTRIES // 4
        self.phase = ""
        # a compute_marker the copies to the device wait for instead of a fresh one
        # (Pipeline.end_backward), or None
        self.after = None
        self.clip_limit: Optional[float] = None  # the window's likely clipping 2-norm (``_hold_back``)
        self.reset_window()

    def reset_window(self) -> None:
        self.nonfinite = False  # a gradient of this window is NaN or Inf
        self.held_back = False  # a chunk was not stepped speculatively (deferred, or its g*g could overflow)
        self.stepped: list[SteppedPiece] = []  # each piece this window's step has stepped
        self._norm_sq = 0.0  # squared 2-norm of this rank's gradients read so far in the window
        self._norm_recs: set = set()  # records whose whole-parameter norm _norm_sq holds
        self._arrivals: list = []  # the window's optimizer chunks in the order they were queued
        self._decided = 0  # how many of them have their speculative-step decision (``held``)

    def arrived(self, chunk) -> None:
        """``chunk`` is queued (the pipeline's lock held): optimizer chunks are noted in order."""
        # NOTE: a chunk queued again on recovery keeps its place; placed is read from the list, so
        # that an interrupt between the two lines below leaves it to be placed again
        placed = chunk.arrival is not None and chunk.arrival < len(self._arrivals) and self._arrivals[chunk.arrival] is chunk
        if chunk.final and not placed:
            chunk.arrival = len(self._arrivals)
            self._arrivals.append(chunk)

    def forget_plans(self) -> None:
        self._plans.clear()

    def _wait(self, marker: Any, what: str) -> float:
        """Wait for ``marker``; returns the seconds waited."""
        t0 = time.perf_counter()
        wait_until(lambda: self.transfer.is_done(marker), timeout_s=self.timeout_s, what=what, diagnose=self._diagnose)
        return time.perf_counter() - t0

    def run(self, chunk) -> None:
        start = time.perf_counter()
        grad_wait = h2d_wait = 0.0
        if chunk.slot is not None:
            self.phase = "waiting for gradient copies"
            grad_wait = self._wait(chunk.marker, f"the gradient copies of {chunk.describe()}")
            self.trace.mark("grads_landed", chunk.seq)
        out_slot = None
        if chunk.final:
            out_slot = self.h2d.slots[self._h2d_next]
            self._h2d_next = (self._h2d_next + 1) % len(self.h2d.slots)
            self.phase = f"waiting for h2d slot {out_slot.index}"
            h2d_wait = self._wait(out_slot.marker, f"h2d slot {out_slot.index} to be copied out")
            out_slot.owner = chunk.seq
        # NOTE: the records a kernel call of this chunk changed, until their pieces count: a
        # failure in between leaves their masters matching no whole step (``uncounted``).
        changed: list = []
        try:
            plan = self._plan(chunk, out_slot)
            self.phase = "accumulate"
            t0 = time.perf_counter()
            for call in plan.accumulate_calls:
                kernels.accumulate_(call.accumulators, call.grads, call.add)
            for kept, grad in plan.retain_copies:
                kept.copy_(grad)
            t1 = time.perf_counter()
            if chunk.final and self._held(chunk):
                with self._lock:
                    self.stats["grad_wait_s"] += grad_wait
                    self.stats["h2d_slot_wait_s"] += h2d_wait
                    self._release(chunk)
                return
            self.phase = "optimizer kernel"
            for call in plan.optimizer_calls:
                hp = chunk.hparams[call.group]
                if self.algorithm == "adamw":
                    # steps hold the counts before this step; the kernel increments
                    # them and uses step+1 in the bias corrections, like torch.
                    for i, r in enumerate(call.recs):
                        call.counts[i] = r.step
                    kernels.adamw_step(call.params, call.grads, call.exp_avgs, call.exp_avg_sqs, call.steps,
                                       lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"],
                                       weight_decay=hp["weight_decay"], grad_scale=hp["grad_scale"],
                                       compute_params=call.outs)
                else:
                    kernels.sign_sgd_step(call.params, call.grads, lr=hp["lr"], weight_decay=hp["weight_decay"],
                                          grad_scale=hp["grad_scale"], compute_params=call.outs)
                changed = call.recs + changed
            if chunk.final:
                self.stepped.extend(SteppedPiece(p.rec, p.start, p.numel, p.rec.step + 1, chunk.hparams[p.rec.group])
                                    for p in chunk.pieces)
            t2 = time.perf_counter()
            if plan.optimizer_calls:
                self.trace.mark("kernel_begin", chunk.seq, at=t1)
                self.trace.mark("kernel_end", chunk.seq, at=t2)
            if out_slot is not None:
                # NOTE: issued before the chunk's d2h slot is released: the release wakes a
                # gradient hook waiting for a slot, and the main thread would then hold the
                # GIL these calls need.
                self.phase = "issuing h2d copies"
                out_slot.marker = self.transfer.h2d_copies(*self._copy_lists(plan), self.after)
                self.trace.mark("h2d_issued", chunk.seq)
                # NOTE: counted after the copies are issued: from here on the master,
                # the moments and (once the copy lands) the compute copy are the new ones.
                for p in chunk.pieces:
                    p.rec.piece_stepped()
                changed = []
            with self._lock:
                self.stats["grad_wait_s"] += grad_wait
                self.stats["h2d_slot_wait_s"] += h2d_wait
                self.stats["accumulate_s"] += t1 - t0
                self.stats["kernel_s"] += t2 - t1
                self.stats["chunks"] += 1
                if out_slot is not None:
                    self.stats["h2d_bytes"] += plan.h2d_bytes
                # the worker's own Python on this chunk: plans, copies issued, bookkeeping
                self.stats["worker_overhead_s"] += (time.perf_counter() - start - grad_wait - h2d_wait
                                                    - (t2 - t0))
                self._release(chunk)
        except BaseException:
            for rec in changed:
                rec.uncounted = True
            raise
        finally:
            if out_slot is not None:
                out_slot.owner = None

    @staticmethod
    def _copy_lists(plan: _Plan) -> tuple:
        """The destinations of a chunk's compute copies, looked up now (``ParamRecord.local``),
        and their sources.

        NOTE: the worker holds the GIL only between native calls, and each torch call that
        drops it waits to get it back while the training thread runs Python (up to the
        interpreter's 5 ms switch interval, in the next forward with ``overlap_forward``). A
        piece that is its whole parameter is therefore copied into the tensor itself, from a
        view shaped at planning time, with no view op: most chunks then cost one such call
        for all their copies (``h2d_copies``)."""
        dsts, srcs = [], []
        for c in plan.copies:
            local = c.rec.local()
            if c.shaped is not None and local.shape == c.shaped.shape:
                dsts.append(local)
                srcs.append(c.shaped)
            else:
                dsts.append(local.detach().view(-1)[c.start : c.start + c.numel])
                srcs.append(c.out)
        return dsts, srcs

    def _held(self, chunk) -> bool:
        """Whether the optimizer chunk ``chunk`` is left unstepped until step(): a non-finite
        gradient in it or before it, or ``_hold_back``.

        NOTE: decided in the order the chunks were queued, whatever order the worker runs them in
        (last-arrived first with ``forward_order``): what a rollback undoes, and so its rounding,
        is then the same in every run. Without accumulation the norms of the chunks queued
        before this one are on the host once its own gradients have landed (the copies and the
        norms share one ordered stream); with accumulation the norms are of the sums the chunks
        complete, and the worker runs optimizer chunks in queueing order
        (``Pipeline.forward_order`` is off there)."""
        if not self.track_norms:
            return self._hold_back(chunk)
        self.phase = "gradient norms"
        if self.accumulate:
            self._read_norms(chunk)
            return (self.skip_nonfinite and self.nonfinite) or self._hold_back(chunk)
        device_norms = self.device_norms.tolist()  # NOTE: one read for every chunk decided here (GIL)
        while self._decided <= chunk.arrival:
            earlier = self._arrivals[self._decided]
            self._read_norms(earlier, device_norms)
            earlier.held = (self.skip_nonfinite and self.nonfinite) or self._hold_back(earlier)
            self._decided += 1
        return chunk.held

    def _hold_back(self, chunk) -> bool:
        """Whether this chunk (and the window's later ones) waits for step(): the window
        defers its step (validation.py says when), or its speculative AdamW step could
        overflow.

        NOTE: the speculative step squares each gradient times its factor in float32; once
        (factor*|g|)**2 could overflow, v becomes Inf and no rollback recovers the old v
        (Inf - Inf), whereas a late small factor (scale_grads_, clipping) would have kept the
        step finite, as in torch. Such chunks are not stepped; validation redoes them
        with the final factor. |g_i| <= the 2-norm of the piece's parameter (or accumulator
        so far), so the test is conservative.

        NOTE: also once this rank's gradients read so far have a 2-norm above the window's
        likely clipping limit: the step will clip (the total norm is at least that), so what
        is stepped now is rolled back and redone anyway, and the rest waits for the factor.
        Where a gradient far above its history (a loss spike) dominated the moments, a
        rollback cannot recover the old ones (rollback.py): such chunks are then never
        stepped speculatively."""
        if not chunk.speculative:
            return False
        if chunk.deferred:
            self.held_back = True
        elif not self.held_back and self.track_norms:
            self.held_back = self.could_overflow([p.rec for p in chunk.pieces], chunk) or self._will_clip(chunk)
        return self.held_back

    def _will_clip(self, chunk) -> bool:
        if self.algorithm != "adamw" or self.clip_limit is None:
            return False
        return math.sqrt(self._norm_sq) * chunk.hparams[0]["grad_scale"] > self.clip_limit

    def would_clip(self, device_norms: list, pass_) -> bool:
        """Whether the worker will hold some optimizer chunk of the window back for a known
        clipping limit (``_will_clip``), every chunk queued and ``device_norms`` read: the
        2-norm of their gradients summed as the worker sums it, in arrival order, exceeds it.
        NOTE: the same additions of non-negative terms in the same order: each partial sum the
        worker compares is at most this total, bit for bit, so where this is False it holds
        nothing back."""
        if not (pass_.speculative and self.algorithm == "adamw" and self.track_norms and self.clip_limit is not None):
            return False
        total, seen = 0.0, set()
        for chunk in self._arrivals:
            total = _add_new_norms(total, chunk, device_norms, seen)
        return math.sqrt(total) * pass_.hparams[0]["grad_scale"] > self.clip_limit

    def could_overflow(self, recs: list, chunk) -> bool:
        """Whether the speculative step of one of ``recs`` with the hyper-parameters of
        ``chunk`` (a Chunk or the Pass that forms it) could overflow (``_hold_back``)."""
        if not (chunk.speculative and self.algorithm == "adamw" and self.track_norms):
            return False
        return any(math.sqrt(r.grad_sq) * chunk.hparams[r.group]["grad_scale"] > _SAFE_GRAD for r in recs)

    def _read_norms(self, chunk, device_norms: Optional[list] = None) -> None:
        """Each piece's gradient norm: from the device's per-parameter norm (``device_norms``,
        read by the caller), or of the host accumulator (which now holds the window's sum);
        sets ``nonfinite``."""
        # NOTE: one read of every norm, not one tensor read per piece (each would drop and
        # retake the GIL: _copy_lists).
        for p in chunk.pieces:
            if self.accumulate:
                n = float(local_norm(p.rec.accum[p.start : p.start + p.numel]))
                p.rec.grad_sq += n * n
                self._norm_sq += n * n
            else:
                n = device_norms[p.rec.index]
                p.rec.grad_sq = n * n
            if not math.isfinite(n):
                self.nonfinite = True
        if not self.accumulate:
            self._norm_sq = _add_new_norms(self._norm_sq, chunk, device_norms, self._norm_recs)

    def _plan(self, chunk, out_slot: Optional[Slot]) -> _Plan:
        key = (
            -1 if chunk.slot is None else chunk.slot.index,
            -1 if out_slot is None else out_slot.index,
            chunk.final,
            tuple((p.rec.index, p.start, p.numel, p.offset, p.dtype, p.add) for p in chunk.pieces),
        )
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self._plan_limit:
                self._plans.clear()
            plan = self._plans[key] = self._build_plan(chunk, out_slot)
        return plan

    def _build_plan(self, chunk, out_slot: Optional[Slot]) -> _Plan:
        accum: dict = collections.defaultdict(lambda: ([], []))
        opt: dict = collections.defaultdict(lambda: ([], [], [], [], [], []))
        copies, retain_copies = [], []
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
            elif grad is None:  # stepped again from the host copy (a redo)
                grad = p.rec.retained[p.start : end]
            elif self.copy_grads:
                retain_copies.append((p.rec.retained[p.start : end], grad))
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
            local = p.rec.local()
            whole = p.start == 0 and p.numel == local.numel()
            copies.append(_ComputeCopy(p.rec, p.start, p.numel, out, out.view(local.shape) if whole else None))
        if out_off > (0 if out_slot is None else out_slot.nbytes):
            raise AssertionError(f"compute copies of {chunk.describe()} overflow the h2d slot")
        accumulate_calls = [_AccumulateCall(a, g, add) for (add, _), (a, g) in accum.items()]
        optimizer_calls = []
        for (group, _, _), (recs, params, grads, m, v, outs) in opt.items():
            counts = array.array("q", bytes(8 * len(recs)))
            # NOTE: the step counts are written through ``counts`` in Python: filling the
            # tensor with a torch call would drop the GIL (_copy_lists)
            steps = torch.frombuffer(counts, dtype=torch.int64)
            optimizer_calls.append(_OptimizerCall(group, recs, params, grads, m, v, counts, steps, outs))
        return _Plan(accumulate_calls, retain_copies, optimizer_calls, copies, h2d_bytes)
