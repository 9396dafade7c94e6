# Bulk host<->device copies issued as a chain of slices that alternate between
# two streams, so that other copies in the same direction are never held back
# behind them for long.
#
# Why: measured on one H200, a small device-to-host copy on another stream (the
# `loss.item()` after step()) waited for all 4 GiB of copies queued before it
# on one stream, 75 ms, and so did FSDP2's small host-to-device copy in each
# block's backward (3 ms a block). The copy engine runs a stream's queued copies
# back to back and lets another stream's copy in only where that stream stops.
# With each slice on the other stream than the one before, waiting for its
# event, the chain stops after every slice: the small copy went through in
# 0.15 ms (0.31 ms at most), and the bulk still moved 54.5 GB/s (55.0 in one
# stream).
#
# Scope: one direction's copies of whole tensors, as slices; the stream waits
# before a job, an event after it, the device tensors marked used by both
# streams. Non-goals: what to copy and when (staging.py), allocation and
# the compute stream's waits (copies.py).

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["CopyChain", "SLICE_BYTES"]

# One slice: about 0.6 ms at the ~55 GB/s of a PCIe 5 x16 link; what another
# copy in the same direction waits for at most.
SLICE_BYTES = 32 << 20


def _slices(dst: torch.Tensor, src: torch.Tensor) -> list:
    """(dst part, src part) pieces of ``dst.copy_(src)``: flat slices of
    ``SLICE_BYTES`` when both are contiguous, else the whole tensor at once."""
    nbytes = src.numel() * src.element_size()
    if nbytes <= SLICE_BYTES or not (dst.is_contiguous() and src.is_contiguous()):
        return [(dst, src)]
    flat_dst, flat_src = dst.view(-1), src.view(-1)
    step = SLICE_BYTES // src.element_size()
    return [(flat_dst[i:i + step], flat_src[i:i + step]) for i in range(0, src.numel(), step)]


class CopyChain:
    """The copies of one direction of one device, in issue order, one slice at a time.

    NOTE: every slice waits for the one issued before it, whatever its job: the
    copies of a direction run strictly one after another, so the event after a
    job also covers every job issued before it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        self.turn = 0
        self.last: Optional[torch.cuda.Event] = None  # after the latest slice issued

    def wait_event(self, event: torch.cuda.Event) -> None:
        """Nothing issued from now on starts before ``event``."""
        self.streams[self.turn].wait_event(event)

    def record_event(self, event: Optional[torch.cuda.Event] = None) -> torch.cuda.Event:
        """An event after everything issued so far (``event`` recorded, or a new one)."""
        stream = self.streams[self.turn]
        if self.last is not None:
            stream.wait_event(self.last)
        event = event if event is not None else torch.cuda.Event()
        event.record(stream)
        self.last = event
        return event

    def copy(self, pairs: list, waits: tuple = (), device_side: tuple = ()) -> torch.cuda.Event:
        """Issue ``dst.copy_(src)`` for each pair, after ``waits`` and after every
        copy issued before; returns the event after the last slice.

        ``device_side``: the device tensors of the pairs. Each is marked used by
        both streams, so the caller may drop it at once: the caching allocator
        hands its block out again only once the copies are past it."""
        for event in waits:
            self.wait_event(event)
        before = self.last
        with torch.cuda.device(self.device):
            for dst, src in pairs:
                for part_dst, part_src in _slices(dst, src):
                    stream = self.streams[self.turn]
                    if self.last is not None:
                        stream.wait_event(self.last)
                    with torch.cuda.stream(stream):
                        part_dst.copy_(part_src, non_blocking=True)
                    self.last = stream.record_event()
                    self.turn ^= 1
            for tensor in device_side:
                for stream in self.streams:
                    tensor.record_stream(stream)
        if self.last is before:  # nothing copied: still an event after the waits
            return self.record_event()
        return self.last

    def synchronize(self) -> None:
        for stream in self.streams:
            stream.synchronize()
