# How much of the "optimizer" mode's copy-out of the state may run during the
# next forward pass without raising the peak GPU memory.
#
# The state's device copies are freed as their copy-out completes. The next
# forward allocates its activations much faster than a PCIe link drains the
# state (at 8K tokens on one H200: ~14 GiB in 41 ms, against 7.6 GB in 139 ms),
# and the peak of a step is at the end of the forward. So the copy-out may
# overlap the forward by the bytes the link moves in the forward's time; the
# rest must land before the forward starts.
#
# Scope: the measurements (the forward's time on the compute stream, from the
# end of step() to the first gradient; the copy-out's bytes per second) and the
# estimate made from them. Non-goals: issuing or ordering copies
# (copies.py, copy_chain.py).

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

__all__ = ["WritebackOverlap"]

# NOTE: the first gradient arrives a little after the activation peak (the
# loss's and the last block's backward come first): a margin keeps the copy-out
# ahead of the peak.
MARGIN = 0.9
# A copy-out part shorter than this says too little about the link's speed.
MIN_TIMED_BYTES = 256 << 20


class WritebackOverlap:
    """Estimates the bytes of copy-out that may overlap the next forward."""

    def __init__(self) -> None:
        self.forward_s: deque = deque(maxlen=3)  # NOTE: the least of the last three: an
        # evaluation pass between two steps makes one forward look long
        self.bytes_per_s: Optional[float] = None
        self.forward_start = None  # timing event on the compute stream, at the end of step()
        self.first_grad = None  # timing event on the compute stream, at the first gradient since
        self.copy_timing = None  # (start event, end event, bytes) of the last part issued at once

    def step_ended(self, compute: Optional[torch.cuda.Stream], copy_timing) -> None:
        """After step()'s copy-outs were issued: start timing the next forward."""
        self._collect()
        if copy_timing is not None:
            self.copy_timing = copy_timing
        self.first_grad = None
        self.forward_start = None
        if compute is not None:
            self.forward_start = torch.cuda.Event(enable_timing=True)
            self.forward_start.record(compute)

    def gradient_arrived(self, compute: torch.cuda.Stream) -> None:
        """A gradient hook: the first one since step() ends the forward's time."""
        if self.forward_start is not None and self.first_grad is None:
            self.first_grad = torch.cuda.Event(enable_timing=True)
            self.first_grad.record(compute)

    def _collect(self) -> None:
        """Read the measurements of the last window whose events have completed."""
        if self.first_grad is not None and self.first_grad.query() and self.forward_start.query():
            self.forward_s.append(self.forward_start.elapsed_time(self.first_grad) / 1e3)
        if self.copy_timing is not None:
            start, end, nbytes = self.copy_timing
            if end.query():
                seconds = start.elapsed_time(end) / 1e3
                if nbytes >= MIN_TIMED_BYTES and seconds > 0:
                    self.bytes_per_s = nbytes / seconds
                self.copy_timing = None

    def overlap_bytes(self) -> int:
        """Bytes of the next copy-out that may still run when the forward starts
        (0 until both a forward and a copy-out have been timed)."""
        self._collect()
        if not self.forward_s or self.bytes_per_s is None:
            return 0
        return int(self.bytes_per_s * min(self.forward_s) * MARGIN)
