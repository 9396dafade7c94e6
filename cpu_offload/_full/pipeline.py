# The full-offload pipeline: gradients are packed into chunks in the order they
# arrive, each chunk's bytes go to the host through one staging slot, and one
# worker thread hands whole chunks to the chunk runner (accumulate or optimizer
# step, then the compute copy back to the device).
#
# Scope: chunk formation (main thread, inside gradient hooks and at window
# ends), the queue and the worker thread, slot ownership, error hand-over to
# the caller's thread, draining, timeouts with a readable diagnostic.
# Non-goals: the backward/step protocol (protocol.py, optimizer.py), the layout rule
# (packing.py), what is done to a chunk (chunk_runner.py), copy mechanics
# (transfer.py).

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from cpu_offload._full.chunk_runner import ChunkRunner
from cpu_offload._full.host_state import ParamRecord
from cpu_offload._full.packing import Placement, align_up, place
from cpu_offload._full.trace import NO_TRACE, Trace
from cpu_offload._full.transfer import HostRing, Slot, wait_until

__all__ = ["Pipeline", "Piece", "Chunk"]


@dataclass(eq=False)
class Piece:
    """Elements ``[start, start + numel)`` of one parameter inside a chunk."""

    rec: ParamRecord
    start: int
    numel: int
    offset: int  # byte offset in the D2H slot; -1: the gradient is the host accumulator
    dtype: torch.dtype  # gradient dtype in the slot
    add: bool  # accumulation: add to the accumulator (True) or overwrite it


@dataclass(frozen=True)
class Pass:
    """The backward pass whose gradients are being staged."""

    micro: int = 0  # index within the accumulation window
    final: bool = False  # the window's last: its chunks run the optimizer
    hparams: Optional[list] = None  # per-group hyper-parameters of its optimizer steps
    speculative: bool = False  # the factor on its gradients may still change (validated later)
    deferred: bool = False  # its chunks wait for the window's final factor (validation steps them)


@dataclass(eq=False)
class _Staging:
    """A parameter whose gradient is being staged: the placements issued so far."""

    rec: ParamRecord
    grad: torch.Tensor  # flat
    add: bool
    placements: list  # of packing.Placement
    norm_pending: bool = False  # |g|_2 still to be computed and copied to the host
    issued: int = 0  # placements whose copy was issued
    opened: int = -1  # the placement a chunk was last opened for


@dataclass(eq=False)
class Chunk:
    seq: int
    micro: int  # micro-batch index within the accumulation window
    final: bool  # last micro-batch: run the optimizer on this chunk
    slot: Optional[Slot]
    hparams: Optional[list]  # per-group hyper-parameters, snapshot at the final backward's start
    speculative: bool = False  # stepped before the window's factor is final
    deferred: bool = False  # not stepped before the window's factor is final
    pieces: list = field(default_factory=list)
    used: int = 0  # bytes used in the slot
    marker: Any = None  # completion of the D2H copies into the slot
    taken: bool = False  # the worker has taken it from the queue
    arrival: Optional[int] = None  # its place among the window's optimizer chunks, in queueing order
    held: bool = False  # not stepped speculatively (ChunkRunner._held)

    def describe(self) -> str:
        names = []
        for p in self.pieces:
            if not names or names[-1] != p.rec.name:
                names.append(p.rec.name)
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} parameters)" if len(names) > 8 else "")
        kind = "optimizer step" if self.final else "accumulation"
        return f"chunk {self.seq} (micro-batch {self.micro}, {kind}) with parameters [{shown}]"


class Pipeline:
    """Chunks, staging slots and the worker thread of one full-offload optimizer.

    Args:
        transfer: a ``CudaTransfer`` or ``SyncTransfer``.
        algorithm: ``"adamw"`` or ``"sign_sgd"``.
        d2h, h2d: the staging rings (same slot size).
        accumulate: records own fp32 accumulators (grad_accum_steps > 1).
        timeout_s: limit for every wait.
        norm_slots: with norm tracking, one more than the largest record index.
        copy_grads: without accumulation, copy each stepped gradient to ``ParamRecord.retained``.
        skip_nonfinite: a non-finite gradient stops the window's remaining steps.
        forward_order: the worker takes optimizer chunks last-arrived first (``_take``).
        trace: where the chunks' events go (trace.py).
    """

    def __init__(self, *, transfer, algorithm: str, d2h: HostRing, h2d: HostRing, accumulate: bool, timeout_s: float,
                 norm_slots: int = 0, skip_nonfinite: bool = False, copy_grads: bool = False,
                 forward_order: bool = False, trace: Trace = NO_TRACE) -> None:
        if d2h.slot_bytes != h2d.slot_bytes:
            raise ValueError("d2h and h2d slots must have the same size")
        self.transfer = transfer
        self.d2h, self.h2d = d2h, h2d
        self.timeout_s = timeout_s
        self.forward_order = forward_order
        self.trace = trace
        self.stats = collections.Counter()
        # NOTE: blocks take the lock itself (``with self._lock:``), not the Condition: a
        # Condition's ``__enter__``/``__exit__`` are Python functions, and a Ctrl-C whose handler
        # runs on entering ``__exit__`` would leave the lock held (the worker then never runs
        # again); the C lock's own methods leave no such point.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        device_norms = (torch.zeros(norm_slots, dtype=torch.float64, pin_memory=transfer.pin)
                        if norm_slots and not accumulate else None)
        self._runner = ChunkRunner(transfer=transfer, algorithm=algorithm, h2d=h2d, accumulate=accumulate,
                                   timeout_s=timeout_s, track_norms=norm_slots > 0,
                                   skip_nonfinite=skip_nonfinite and norm_slots > 0, copy_grads=copy_grads,
                                   device_norms=device_norms, stats=self.stats, lock=self._lock,
                                   release=self._release_input, diagnose=self.diagnose, trace=trace)
        self._queue: collections.deque = collections.deque()
        self._open: Optional[Chunk] = None
        self._busy: Optional[Chunk] = None
        self._seq = 0
        self._d2h_next = 0
        self._cur = Pass()
        self._error: Optional[tuple] = None  # the worker's failure, until taken by the caller
        self._failed = False  # skip chunks until the window that failed is closed
        self._staging: Optional[_Staging] = None  # a parameter whose staging an exception interrupted
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="cpu_offload-worker", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- main thread
    def take_error(self) -> Optional[RuntimeError]:
        """The worker's failure as a RuntimeError naming the chunk (once), or None."""
        with self._lock:
            err, self._error = self._error, None
        if err is None:
            return None
        exc, where = err
        wrapped = RuntimeError(f"cpu_offload worker failed on {where}: {type(exc).__name__}: {exc}")
        wrapped.__cause__ = exc
        return wrapped

    def reset_window(self) -> None:
        """The window is closed (after a drain): forget what it stepped, run chunks again after a failure."""
        with self._lock:
            self._failed = False
        self._runner.reset_window()

    @property
    def stepped(self) -> list:
        """Every piece stepped in this window (``chunk_runner.SteppedPiece``)."""
        return self._runner.stepped

    @property
    def hparams(self) -> Optional[list]:
        """The hyper-parameters of the running (or last) backward's optimizer steps."""
        return self._cur.hparams

    @property
    def deferred(self) -> bool:
        """The running (or last) backward's chunks wait for the window's final factor."""
        return self._cur.deferred

    @property
    def held_back(self) -> bool:
        """Chunks of this window were not stepped: the window defers its step, or their
        speculative step could overflow."""
        return self._runner.held_back

    @property
    def nonfinite(self) -> bool:
        """A gradient of this window was NaN or Inf (known once drained; with norm tracking)."""
        return self._runner.nonfinite

    def raise_error(self) -> None:
        err = self.take_error()
        if err is not None:
            raise err

    def begin_backward(self, *, micro: int, final: bool, hparams: Optional[list], speculative: bool = False,
                       deferred: bool = False, clip_limit: Optional[float] = None) -> None:
        """``clip_limit``: the 2-norm the window's gradients will likely be clipped to (None: unknown)."""
        self._cur = Pass(micro, final, hparams, speculative, deferred)
        if final:
            self._runner.clip_limit = clip_limit
        self._runner.after = None
        self.trace.mark("backward_begin", micro)

    def stage_grad(self, rec: ParamRecord, grad: torch.Tensor, *, add: bool) -> None:
        """Stage the flat gradient ``grad`` of ``rec`` into the open chunk(s)."""
        dtype = torch.bfloat16 if grad.dtype == torch.bfloat16 else torch.float32
        used = None if self._open is None else self._open.used
        placements, _ = place(rec.numel, dtype.itemsize, self.d2h.slot_bytes, used)
        self.trace.mark("grad_staged", rec.index)
        if self._cur.final:
            # NOTE: set before any piece is queued: the runner counts the step when
            # it has processed this many pieces, whichever chunk finishes last.
            rec.plan_step(len(placements))
        self._staging = _Staging(rec, grad, add, placements,
                                 norm_pending=self._cur.final and self._runner.device_norms is not None)
        self._issue_staged()

    def resume_staging(self) -> bool:
        """Finish a parameter whose staging an exception interrupted; True if there was one."""
        if self._staging is None:
            return False
        self._issue_staged()
        return True

    def drop_staging(self) -> None:
        self._staging = None

    def _issue_staged(self) -> None:
        st = self._staging
        dtype = torch.bfloat16 if st.grad.dtype == torch.bfloat16 else torch.float32
        with self.transfer.d2h_issue():
            if st.norm_pending:
                # NOTE: queued before the pieces, so the marker of the chunk holding the
                # first piece also covers this copy: the runner reads it before stepping.
                index = st.rec.index
                self.transfer.d2h_norm(self._runner.device_norms[index : index + 1], st.grad)
                st.norm_pending = False
            # NOTE: resumable after an exception at any call (resume_staging): a chunk is
            # opened once per placement, and a piece is added after its copy was issued and
            # only if the open chunk's last piece is not already this one.
            while st.issued < len(st.placements):
                pl: Placement = st.placements[st.issued]
                if pl.new_chunk and st.opened != st.issued:
                    self._close_open()
                    self._open_chunk()
                    st.opened = st.issued
                chunk = self._open
                self.transfer.d2h_copy(chunk.slot.view(pl.offset, pl.numel, dtype),
                                       st.grad[pl.start : pl.start + pl.numel])
                last = chunk.pieces[-1] if chunk.pieces else None
                if last is None or last.rec is not st.rec or last.start != pl.start:
                    chunk.pieces.append(Piece(st.rec, pl.start, pl.numel, pl.offset, dtype, st.add))
                    chunk.used = align_up(pl.offset + pl.numel * dtype.itemsize)
                    self.stats["d2h_bytes"] += pl.numel * dtype.itemsize
                st.issued += 1
                if pl.close_after:
                    self._close_open()
        self._staging = None

    def stage_from_host(self, recs: list) -> None:
        """Queue optimizer-step chunks for ``recs``, whose window's gradient is on the host
        (the accumulator, or the copy kept for a redo; no D2H copy); the chunks are sized
        by the H2D slot."""
        cur = self._cur
        cap = self.h2d.slot_bytes
        chunk, used = None, None
        for rec in recs:
            placements, used = place(rec.numel, rec.local().element_size(), cap, used)
            rec.plan_step(len(placements))
            for pl in placements:
                if pl.new_chunk:
                    if chunk is not None:
                        self._submit(chunk)
                    chunk = Chunk(self._next_seq(), cur.micro, True, None, cur.hparams, cur.speculative, cur.deferred)
                chunk.pieces.append(Piece(rec, pl.start, pl.numel, -1, torch.float32, True))
        if chunk is not None:
            self._submit(chunk)

    def restep(self, recs: list, hparams: list, *, grads_on_host: bool) -> None:
        """Step ``recs`` again after validation rolled their speculative step back (or held
        it back): a fresh final pass over the window's gradients with ``hparams``, read from
        the host (accumulators or kept copies: ``grads_on_host``) or from the device
        (``ParamRecord.retained``); drained, a worker failure raised."""
        self.reset_window()
        for rec in recs:
            rec.grad_sq = 0.0
        self.begin_backward(micro=0, final=True, hparams=hparams)
        if grads_on_host:
            self.stage_from_host(recs)
        else:
            for rec in recs:
                self.stage_grad(rec, rec.retained, add=False)
        self.drain()
        self.transfer.compute_waits_for_h2d()
        self.raise_error()

    def end_backward(self, *, forward_next: bool = False) -> None:
        """Queue the open chunk. ``forward_next`` (overlap_forward): the next forward may run
        before the queued chunks: their copies to the device wait for the compute stream only
        up to here, not for that forward's kernels.
        NOTE: a forward kernel reading one of their parameters is queued after its module's
        pre-hook waited for the step (forward_overlap.py), and so after the copy."""
        self._close_open()
        if forward_next:
            self._runner.after = self.transfer.compute_marker()

    @property
    def in_flight(self) -> bool:
        """Chunks are queued or running, or their copies to the device have not completed."""
        with self._lock:
            if self._queue or self._busy is not None:
                return True
        return not all(self.transfer.is_done(s.marker) for s in self.h2d.slots)

    def read_norms_now(self, recs: list) -> bool:
        """Without accumulation, with norm tracking: set each record's ``grad_sq`` from the
        norm copied from the device (the worker reads the same values later) once every
        gradient copy has landed, before the worker stepped it. True if one is NaN or Inf,
        or if stepping it speculatively could overflow or clips (the worker would hold it back)."""
        marker = self.transfer.d2h_marker()
        wait_until(lambda: self.transfer.is_done(marker), timeout_s=self.timeout_s, what="the gradient copies",
                   diagnose=self.diagnose)
        norms = self._runner.device_norms.tolist()  # NOTE: one read, not one per record (GIL)
        for rec in recs:
            n = norms[rec.index]
            rec.grad_sq = n * n
        return (any(not math.isfinite(rec.grad_sq) for rec in recs) or self._runner.could_overflow(recs, self._cur)
                or self._runner.would_clip(norms, self._cur))

    def wait_stepped(self, recs: list) -> None:
        """Wait until each of ``recs`` has its window's step counted, or until the worker has
        nothing left to do (after a failure some stay unstepped: ``take_error`` says why)."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while any(r.pieces_done < r.pieces_total for r in recs) and (self._queue or self._busy is not None):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"cpu_offload: timed out after {self.timeout_s:g}s waiting for the step of "
                                       f"{[r.name for r in recs if r.pieces_done < r.pieces_total][:8]}\n"
                                       f"{self._diagnose()}")
                self._cv.wait(min(left, 0.5))

    def drain(self) -> None:
        """Wait until every queued chunk has been processed and its copies have
        completed. A worker failure stays pending for ``take_error``."""
        self._close_open()
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while self._queue or self._busy is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"cpu_offload: timed out after {self.timeout_s:g}s draining the pipeline\n{self._diagnose()}")
                self._cv.wait(min(left, 0.5))
        wait_until(lambda: all(self.transfer.is_done(s.marker) for s in self.h2d.slots),
                   timeout_s=self.timeout_s, what="host-to-device copies", diagnose=self.diagnose)

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = self._runner.timeout_s = timeout_s

    def finish_queued(self) -> bool:
        """A failed window's drain or staging timed out: queue the open chunk, and wait, past
        ``timeout_s``, until the worker has run every chunk queued; False if it is not running.
        NOTE: left queued, they ran once the window had closed and been reset: masters and
        weights changed with no step counted (dropped, a parameter split over several chunks
        would be left partly stepped). The wait ends: a chunk's own waits are bounded by
        timeout_s, its kernels by its size, and after a failure the rest are skipped."""
        self._close_open()
        with self._lock:
            while (self._queue or self._busy is not None) and self._thread.is_alive():
                self._cv.wait(0.5)
            return self._thread.is_alive()

    def on_worker_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self) -> None:
        """Stop the worker and drop the staging rings (the pinned memory is freed
        once the last view is gone)."""
        with self._lock:
            self._stop = True
            self._queue.clear()
            self._cv.notify_all()
        if self._thread.is_alive() and not self.on_worker_thread():
            self._thread.join(timeout=self.timeout_s)
        self._open = self._staging = None
        self._runner.forget_plans()
        self.d2h.free()
        self.h2d.free()

    def diagnose(self) -> str:
        with self._lock:
            return self._diagnose()

    def _diagnose(self) -> str:
        lines = [
            f"pipeline: micro-batch {self._cur.micro} (final={self._cur.final}), open chunk: "
            + (f"{self._open.seq} ({self._open.used}/{self.d2h.slot_bytes} bytes)" if self._open else "none"),
            f"queued chunks: {[c.seq for c in self._queue]}; worker: "
            + (f"{self._busy.describe()} [{self._runner.phase}]" if self._busy else "idle")
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

    def _open_chunk(self) -> None:
        cur = self._cur
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        waited = False
        with self._lock:
            while True:
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
                waited = True
                self._cv.wait(min(left, 0.5))
            slot = free[0]
            t1 = time.perf_counter()
            self.stats["slot_wait_s"] += t1 - t0  # backward blocked on the worker
            if waited:
                self.trace.mark("slot_wait_begin", at=t0)
                self.trace.mark("slot_wait_end", at=t1)
            self._d2h_next = (slot.index + 1) % n
            chunk = Chunk(self._next_seq(), cur.micro, cur.final, slot, cur.hparams, cur.speculative, cur.deferred)
            slot.owner = chunk.seq
        self._open = chunk

    def _close_open(self) -> None:
        """Queue the open chunk.
        NOTE: resumable after an exception at any point (the recovery's ``drain`` calls it
        again): the chunk stays open until it is queued, and a chunk already queued or taken
        by the worker is not queued again."""
        chunk = self._open
        if chunk is None:
            return
        with self._lock:
            queued = chunk.taken or any(c is chunk for c in self._queue)
        if not queued:
            chunk.marker = self.transfer.d2h_marker()
            self._submit(chunk)
        self._open = None

    def _submit(self, chunk: Chunk) -> None:
        self.trace.mark("chunk_queued", chunk.seq)
        with self._lock:
            # NOTE: notified first: the worker wakes only once the lock is released, and an
            # exception between the two lines then leaves the chunk unqueued (queued again on
            # recovery) rather than queued with the worker left asleep.
            self._cv.notify_all()
            self._runner.arrived(chunk)
            self._queue.append(chunk)

    def _release_input(self, chunk: Chunk) -> None:
        """The runner has read the chunk's gradients: its D2H slot may be reused
        (called with the condition held)."""
        if chunk.slot is not None and chunk.slot.owner == chunk.seq:
            chunk.slot.owner = None
            self._cv.notify_all()

    # --------------------------------------------------------- worker thread
    def _take(self) -> Chunk:
        """The next chunk (condition held): the oldest; with ``forward_order``, once only
        optimizer chunks are queued, the last-arrived one whose gradients have landed (the
        oldest if none has).
        NOTE: for a model whose backward mirrors its forward, last-arrived first is the
        order in which the next forward reads the parameters, and what is left when backward
        ends is what that forward reads last: the CPU steps it while the forward runs the
        layers before. Accumulation chunks stay first, in order: the optimizer chunks read
        the sums they complete, and float sums depend on their order."""
        queue = self._queue
        if not self.forward_order or not queue[0].final:
            return queue.popleft()
        pick = next((i for i in range(len(queue) - 1, 0, -1) if self.transfer.is_done(queue[i].marker)), 0)
        chunk = queue[pick]
        del queue[pick]
        return chunk

    def _run(self) -> None:
        try:
            self.transfer.worker_init()
        except BaseException as e:  # surfaces at the next hook / public call
            self._error, self._failed = (e, "worker start-up"), True
        while True:
            with self._lock:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                chunk = self._take()
                chunk.taken = True
                self._busy = chunk
                self.trace.mark("chunk_take", chunk.seq)
                # NOTE: after a failure the rest of the window is skipped (until
                # ``reset_window``); the pieces of skipped chunks are not counted,
                # so no parameter counts a step its master did not take.
                skip = self._failed
            try:
                if not skip:
                    with torch.no_grad():  # grad mode is per thread
                        self._runner.run(chunk)
            except BaseException as e:
                with self._lock:
                    self._failed = True
                    if self._error is None:
                        self._error = (e, chunk.describe())
            finally:
                with self._lock:
                    self._release_input(chunk)
                    self._busy = None
                    self.trace.mark("chunk_done", chunk.seq)
                    self._cv.notify_all()
