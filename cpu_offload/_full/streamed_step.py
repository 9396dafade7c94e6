# Host state stepped on the device (``stream_share=``): a share of the host parameters keeps
# its fp32 master and moments in pinned host memory, and the device steps them when the window
# closes, as it steps gpu_state's device parameters: their state crosses the link into a ring
# of device slots, device_state.step_flat steps it there (bit-identical to the host kernel) and
# writes the compute copy, and the state crosses back. Per parameter that moves 16 B over the
# host's memory by DMA with bf16 moments (24 B with fp32), where the CPU kernel and the copies
# move 24 B (32 B), and the gradient and the compute copy never leave the device: the CPU's
# part of the step shrinks by the share, the link carries the rest
# (docs/full-offload-profile.md, "Host state stepped on the GPU").
#
# NOTE: stepped when the window closes, never speculatively (device_state.py's rule): no
# rollback touches them and a skipped step leaves them as they were. Their host buffers are
# read and written only here and by the training thread; every copy back has landed when
# step() returns.
#
# Scope: the pinned buffers' layout in slots, the copies and their order on the streams.
# Non-goals: which parameters (optimizer.py), the step's arithmetic (device_state.step_flat),
# their gradients and norms (device_state.DeviceState).

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from cpu_offload._full.device_state import step_flat
from cpu_offload._full.host_state import HostBuffers

__all__ = ["StreamedStep", "choose_streamed", "SLOT_ELEMENTS", "SLOTS"]

# Elements per device slot (128 MiB with bf16 moments, 192 MiB with fp32) and slots in the
# ring: one slot's copies in, one's step and one's copies back run at once, with one spare.
SLOT_ELEMENTS = 1 << 24
SLOTS = 4


def choose_streamed(records: list, share: float) -> list:
    """The records to stream: spread evenly over ``records``' order, about ``share`` of their
    elements. Walking in order, a record is taken when the elements taken, counting half of
    its own, stay within the share of the elements walked so far: the total then lands within
    half of the largest record of the share."""
    if share <= 0:
        return []
    chosen, used, seen = [], 0, 0
    for rec in records:
        seen += rec.numel
        if used + rec.numel / 2 <= share * seen:
            chosen.append(rec)
            used += rec.numel
    return chosen


class StreamedStep:
    """The streamed records of one full-offload optimizer and their step.

    Args:
        records: the streamed records, holding views of ``buffers`` (allocate_host_state).
        buffers: their flat host state (pinned when the device is CUDA).
        algorithm: ``"adamw"`` or ``"sign_sgd"``.
        device: the parameters' device.
    """

    def __init__(self, records: list, buffers: HostBuffers, *, algorithm: str, device: torch.device,
                 slot_elements: Optional[int] = None, slots: Optional[int] = None) -> None:
        self.records = records
        self.buffers = buffers
        self.algorithm = algorithm
        self.device = device
        base = buffers.master.data_ptr()
        self._offset = {id(rec): (rec.master.data_ptr() - base) // 4 for rec in records}
        self._slot_elements = max(1, min(slot_elements or SLOT_ELEMENTS, buffers.master.numel()))
        self._num_slots = slots or SLOTS
        self._slots = None  # per state tensor, the ring's device tensors (made at the first step)
        self._streams = None  # (host-to-device, device-to-host) on CUDA

    @property
    def nbytes(self) -> int:
        """Bytes of the pinned host state."""
        return self.buffers.nbytes

    def _flat(self) -> list:
        return [t for t in (self.buffers.master, self.buffers.exp_avg, self.buffers.exp_avg_sq) if t is not None]

    def plan(self, records: list) -> list:
        """The slots that step ``records``: ``[(start, stop, [(record, lo, hi)])]`` over the
        flat buffers, each span at most a slot long, in the buffers' order; a record longer
        than what is left of a slot goes on in the next. Spans copy whatever lies between
        their records (padding, records not stepped): it goes back unchanged."""
        spans: list = []
        for rec in sorted(records, key=lambda r: self._offset[id(r)]):
            lo, end = self._offset[id(rec)], self._offset[id(rec)] + rec.numel
            while lo < end:
                if not spans or lo >= spans[-1][0] + self._slot_elements:
                    spans.append([lo, lo, []])
                span = spans[-1]
                hi = min(end, span[0] + self._slot_elements)
                span[2].append((rec, lo, hi))
                span[1] = hi
                lo = hi
        return [tuple(span) for span in spans]

    def _ring(self) -> list:
        """Per state tensor, the device slots (made at the first step, kept: the caching
        allocator never sees them freed while a copy on another stream may use them)."""
        if self._slots is None:
            self._slots = [[torch.empty(self._slot_elements, dtype=t.dtype, device=self.device)
                            for _ in range(self._num_slots)] for t in self._flat()]
            if self.device.type == "cuda":
                self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._slots

    def step(self, records: list, hparams: list, grad_scale: float, grad_of: Callable, events: dict) -> list:
        """Step ``records`` (each planned as one piece) with ``grad_scale``: their state in,
        step_flat, their state back; returns them, counted. ``grad_of(record)``: its flat
        gradient on the device; ``events``: per ``id(record)``, the CUDA event after which
        that gradient is complete."""
        if not records:
            return []
        flat, ring = self._flat(), self._ring()
        cuda = self.device.type == "cuda"
        compute = torch.cuda.current_stream(self.device) if cuda else None
        h2d, d2h = self._streams if cuda else (None, None)
        on = (lambda stream: torch.cuda.stream(stream)) if cuda else (lambda stream: contextlib.nullcontext())
        free = [None] * self._num_slots  # per slot: its last copy back (CUDA)
        waited, written, sent = set(), set(), set()
        try:
            for i, (start, stop, pieces) in enumerate(self.plan(records)):
                k, n = i % self._num_slots, stop - start
                views = [slots[k][:n] for slots in ring]
                with on(h2d):
                    if free[k] is not None:
                        h2d.wait_event(free[k])
                    for view, src in zip(views, flat):
                        view.copy_(src[start:stop], non_blocking=cuda)
                    landed = h2d.record_event() if cuda else None
                if cuda:
                    compute.wait_event(landed)
                for rec, lo, hi in pieces:
                    if cuda and id(rec) not in waited and events.get(id(rec)) is not None:
                        compute.wait_event(events[id(rec)])
                        waited.add(id(rec))
                    a, b = lo - start, hi - start
                    own = slice(lo - self._offset[id(rec)], hi - self._offset[id(rec)])
                    moments = [view[a:b] for view in views[1:]] or [None, None]
                    step_flat(self.algorithm, views[0][a:b], grad_of(rec)[own], *moments,
                              rec.local().detach().view(-1)[own], rec.step + 1, hparams[rec.group], grad_scale)
                    written.add(id(rec))  # NOTE: its compute copy is ahead of its host state until sent back
                stepped = compute.record_event() if cuda else None
                with on(d2h):
                    if cuda:
                        d2h.wait_event(stepped)
                    for view, dst in zip(views, flat):
                        dst[start:stop].copy_(view, non_blocking=cuda)
                    free[k] = d2h.record_event() if cuda else None
                sent.update(id(rec) for rec, _, hi in pieces if hi == self._offset[id(rec)] + rec.numel)
        except BaseException:
            # NOTE: those sent back whole are stepped; one with a piece stepped and not sent
            # back, or only some of its pieces, matches no whole step (its compute copy is ahead)
            for rec in records:
                if id(rec) in sent:
                    rec.piece_stepped()
                elif id(rec) in written:
                    rec.uncounted = True
            raise
        finally:
            if cuda:
                d2h.synchronize()  # NOTE: also after a failure: no copy lands once step() returned
        for rec in records:
            rec.piece_stepped()
        return records
