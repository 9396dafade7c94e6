# Copies of optimizer state between host buffers and the device, for the
# "optimizer" offload mode: a chain of copies per direction and the events that
# order them against the compute stream, plus the synchronous fallback for CPU
# parameters.
#
# Scope: issue copy-ins (host -> device) and copy-outs (device -> host) of
# whole state tensors, make the compute stream wait for the copy-ins (and for
# the copy-outs that must free memory before the next forward), tell when
# copy-outs have landed. The orderings are written down where they are made.
# Non-goals: deciding what to copy and when (staging.py); the staging
# rings of full offload (transfer.py).

from __future__ import annotations

from typing import Any, Optional

import torch

from cpu_offload._state.copy_chain import CopyChain

__all__ = ["CudaStateCopies", "SyncStateCopies", "make_state_copies"]


class CudaStateCopies:
    """Copies of one CUDA device, as chains of slices (copy_chain.py says why):
    one chain host -> device, one device -> host.

    The four hand-offs, each an event waited on a stream (never the CPU):

    1. copy-in after compute: the device tensors come from the compute stream's
       pool, whose freed blocks may still be read by kernels queued there, so
       the copy-in first waits for everything queued on the compute stream.
    2. copy-in after the last copy-out from the same host buffer (``after``).
    3. the step after its copy-ins: ``compute_waits_for_copy_ins``.
    4. copy-out after the step: the copy-out waits for the compute stream.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.h2d = CopyChain(device)
        self.d2h = CopyChain(device)
        self.compute = torch.cuda.current_stream(device)
        self.last_out: Optional[torch.cuda.Event] = None  # after the latest copy-out issued

    def set_compute_stream(self) -> None:
        """The calling thread's current stream runs the optimizer step (step() calls this)."""
        self.compute = torch.cuda.current_stream(self.device)

    def copy_in(self, hosts: list, after: Any = None) -> list:
        """Device copies of ``hosts`` (same shapes, dtypes and strides), issued on the H2D chain."""
        with torch.cuda.device(self.device):
            with torch.cuda.stream(self.compute):
                devs = [torch.empty_like(h, device=self.device) for h in hosts]
            # NOTE (1): may be called from a gradient hook, whose current stream
            # is the autograd or FSDP2 reduce stream: the allocation above is
            # made for the compute stream explicitly, and the copies wait for
            # every kernel already queued there.
            waits = [self.compute.record_event()]
        if after is not None:
            waits.append(after)  # NOTE (2): the host buffer holds the last step's values
        # NOTE: a copy that is dropped unused (a discarded prefetch) frees its
        # block only once the H2D chain is past the write.
        self.h2d.copy(list(zip(devs, hosts)), waits=tuple(waits), device_side=devs)
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

    def copy_out(self, groups: list, overlap_bytes: int = 0) -> tuple:
        """``host.copy_(dev)`` for each pair of each group, on the D2H chain.

        The compute stream waits for all but the last ``overlap_bytes``: their
        device copies must be gone before the next forward's activations need
        the memory. The rest overlaps what follows. Returns, per group, the
        event after its copies, and timing events around the part the compute
        stream waits for, with its bytes (None when there is none)."""
        total = sum(dev.numel() * dev.element_size() for pairs in groups for _, dev in pairs)
        waited_for = max(0, total - overlap_bytes)
        with torch.cuda.device(self.device):
            # NOTE (4): the copies read the values the step just wrote.
            self.d2h.wait_event(self.compute.record_event())
            start = end = None
            if waited_for:
                start = self.d2h.record_event(torch.cuda.Event(enable_timing=True))
            events, copied, waited_bytes = [], 0, 0
            for pairs in groups:
                events.append(self.d2h.copy(list(pairs), device_side=[dev for _, dev in pairs]))
                copied += sum(dev.numel() * dev.element_size() for _, dev in pairs)
                if start is not None and end is None and copied >= waited_for:
                    end = self.d2h.record_event(torch.cuda.Event(enable_timing=True))
                    self.compute.wait_event(end)
                    waited_bytes = copied
        timing = (start, end, waited_bytes) if start is not None else None
        if events:
            self.last_out = events[-1]
        return events, timing

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

    def copy_out(self, groups: list, overlap_bytes: int = 0) -> tuple:
        for pairs in groups:
            for host, dev in pairs:
                host.copy_(dev)
        return [None] * len(groups), None

    def wait_copy_outs(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def make_state_copies(device: torch.device):
    """The copy engine for parameters on ``device``: streams for CUDA, plain copies otherwise."""
    if device.type == "cuda":
        return CudaStateCopies(device)
    return SyncStateCopies(device)
