# Copies of optimizer state between host buffers and the device, for the
# "optimizer" offload mode: two side streams and the events that order them
# against the compute stream, plus the synchronous fallback for CPU parameters.
#
# Scope: issue copy-ins (host -> device) and copy-outs (device -> host) of
# whole state tensors, make the compute stream wait for the copy-ins, tell when
# copy-outs have landed. The orderings are written down where they are made.
# Non-goals: deciding what to copy and when (state_staging.py); the staging
# rings of full offload (transfer.py).

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["CudaStateCopies", "SyncStateCopies", "make_state_copies"]

# One event per this many bytes of copy-outs: a copy-in of the next step waits
# for the event that covers its own buffers, not for every copy-out.
EVENT_BYTES = 64 << 20


class CudaStateCopies:
    """Copies on two side streams of one CUDA device.

    The four hand-offs, each an event waited on a stream (never the CPU):

    1. copy-in after compute: the device tensors come from the compute stream's
       pool, whose freed blocks may still be read by kernels queued there, so
       the H2D stream first waits for everything queued on the compute stream.
    2. copy-in after the last copy-out into the same host buffer (``after``).
    3. the step after its copy-ins: ``compute_waits_for_copy_ins``.
    4. copy-out after the step: the D2H stream waits for the compute stream.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.compute = torch.cuda.current_stream(device)
        self.last_out: Optional[torch.cuda.Event] = None  # after the latest copy-out issued

    def set_compute_stream(self) -> None:
        """The calling thread's current stream runs the optimizer step (step() calls this)."""
        self.compute = torch.cuda.current_stream(self.device)

    def copy_in(self, hosts: list, after: Any = None) -> list:
        """Device copies of ``hosts`` (same shapes, dtypes and strides), issued on the H2D stream."""
        with torch.cuda.device(self.device):
            with torch.cuda.stream(self.compute):
                devs = [torch.empty_like(h, device=self.device) for h in hosts]
            # NOTE (1): may be called from a gradient hook, whose current stream
            # is the autograd or FSDP2 reduce stream: the allocation above is
            # made for the compute stream explicitly, and this event orders the
            # writes after every kernel already queued there.
            self.h2d.wait_event(self.compute.record_event())
            if after is not None:
                self.h2d.wait_event(after)  # NOTE (2): the host buffer holds the last step's values
            with torch.cuda.stream(self.h2d):
                for dev, host in zip(devs, hosts):
                    dev.copy_(host, non_blocking=True)
                    # NOTE: a copy that is dropped unused (a discarded prefetch)
                    # frees its block only once the H2D stream is past the write.
                    dev.record_stream(self.h2d)
        return devs

    def compute_waits_for_copy_ins(self, timed: bool = False) -> Any:
        """NOTE (3): the compute stream (and the caller's current stream) wait for
        every copy-in issued so far. With ``timed``, returns two timing events
        around the wait: the seconds the compute stream stood still for copies."""
        done = self.h2d.record_event()
        start = end = None
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.compute)
        self.compute.wait_event(done)
        current = torch.cuda.current_stream(self.device)
        if current != self.compute:
            current.wait_event(done)
        if timed:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.compute)
        return (start, end) if timed else None

    def copy_out(self, groups: list) -> list:
        """Issue ``host.copy_(dev)`` for each pair of each group on the D2H stream;
        returns, per group, an event that completes once the group's copies have."""
        # NOTE (4): the copies read the values the step just wrote.
        self.d2h.wait_event(self.compute.record_event())
        events: list = []
        open_groups, pending = 0, 0
        with torch.cuda.device(self.device), torch.cuda.stream(self.d2h):
            for pairs in groups:
                for host, dev in pairs:
                    host.copy_(dev, non_blocking=True)
                    # NOTE: the caller drops ``dev`` right away; the caching
                    # allocator hands its block out again only once the D2H
                    # stream has passed this copy (and, when memory runs short,
                    # waits for that instead of failing).
                    dev.record_stream(self.d2h)
                    pending += dev.numel() * dev.element_size()
                open_groups += 1
                if pending >= EVENT_BYTES:
                    events.extend([self.d2h.record_event()] * open_groups)
                    open_groups, pending = 0, 0
            if open_groups or not events:
                last = self.d2h.record_event()
                events.extend([last] * open_groups)
            else:
                last = events[-1]
        self.last_out = last
        return events

    def wait_copy_outs(self) -> None:
        """Block the CPU until every copy-out issued so far has landed in host memory."""
        if self.last_out is not None:
            self.last_out.synchronize()

    def synchronize(self) -> None:
        """Block the CPU until every copy in either direction has completed."""
        self.h2d.synchronize()
        self.d2h.synchronize()


class SyncStateCopies:
    """CPU parameters: the same calls as CudaStateCopies, as plain copies."""

    last_out = None

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def set_compute_stream(self) -> None:
        pass

    def copy_in(self, hosts: list, after: Any = None) -> list:
        return [torch.empty_like(h).copy_(h) for h in hosts]

    def compute_waits_for_copy_ins(self, timed: bool = False) -> Any:
        return None

    def copy_out(self, groups: list) -> list:
        for pairs in groups:
            for host, dev in pairs:
                host.copy_(dev)
        return [None] * len(groups)

    def wait_copy_outs(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def make_state_copies(device: torch.device):
    """The copy engine for parameters on ``device``: streams for CUDA, plain copies otherwise."""
    if device.type == "cuda":
        return CudaStateCopies(device)
    return SyncStateCopies(device)
