# Host <-> device transfers for full offload: bounded host staging rings, side
# streams and completion markers, plus the synchronous fallback used when the
# parameters live on the CPU.
#
# Scope: allocating the staging rings once (pinned when CUDA is present),
# issuing gradient copies device -> host and compute-copy copies host -> device,
# and waiting for them with a timeout.
# Non-goals: deciding which bytes go where (pipeline.py), any arithmetic
# (kernels.py), and multi-device placement (one device per optimizer).

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from cpu_offload._full.grad_norms import local_norm
from cpu_offload._full.packing import ALIGN_BYTES, align_up

__all__ = ["HostRing", "Slot", "CudaTransfer", "SyncTransfer", "make_transfer", "wait_until"]


@dataclass(eq=False)
class Slot:
    """One fixed-size staging buffer of a ring.

    ``owner`` names the chunk that holds the slot (``None`` when free);
    ``marker`` is the completion marker of the last transfer that read the slot.
    """

    index: int
    buf: torch.Tensor  # uint8, ``nbytes`` long
    owner: Optional[int] = None
    marker: Any = None

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A ``dtype`` view of ``numel`` elements starting ``offset`` bytes in."""
        return self.buf[offset : offset + numel * dtype.itemsize].view(dtype)


class HostRing:
    """``num_slots`` host buffers of ``slot_bytes`` each, allocated once.

    Args:
        name: used in diagnostics ("d2h" or "h2d").
        num_slots: number of slots (>= 1).
        slot_bytes: size of each slot, rounded up to ``ALIGN_BYTES``.
        pin: allocate page-locked memory (needs CUDA).
    """

    def __init__(self, name: str, *, num_slots: int, slot_bytes: int, pin: bool) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        slot_bytes = align_up(max(int(slot_bytes), ALIGN_BYTES))
        self.name = name
        self.slot_bytes = slot_bytes
        # NOTE: one allocation for the whole ring: pinning is slow (it maps and
        # locks every page), so it happens here, once, never in a backward hook.
        self._storage = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, pin_memory=pin)
        self.slots = [
            Slot(i, self._storage[i * slot_bytes : (i + 1) * slot_bytes]) for i in range(num_slots)
        ]

    @property
    def nbytes(self) -> int:
        return 0 if self._storage is None else self._storage.numel()

    def free(self) -> None:
        """Drop the ring's memory (pinned memory returns to the allocator once the
        last view of it is gone)."""
        self._storage = None
        self.slots = []

    def describe(self) -> str:
        parts = []
        for s in self.slots:
            parts.append(f"{s.index}:{'free' if s.owner is None else f'chunk {s.owner}'}")
        return f"{self.name} ring [{', '.join(parts)}]"


def wait_until(done: Callable[[], bool], *, timeout_s: float, what: str, diagnose: Callable[[], str]) -> None:
    """Poll ``done`` until it returns True; raise TimeoutError with a diagnostic."""
    deadline = time.monotonic() + timeout_s
    delay = 20e-6
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"cpu_offload: timed out after {timeout_s:g}s waiting for {what}\n{diagnose()}")
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


class CudaTransfer:
    """Copies on two side streams of one CUDA device; markers are CUDA events."""

    pin = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h_stream = torch.cuda.Stream(device)
        self.h2d_stream = torch.cuda.Stream(device)
        self.compute_stream = torch.cuda.current_stream(device)
        self._index = self.d2h_stream.device_index

    def set_compute_stream(self) -> None:
        """Remember the calling thread's current stream as the one forward and backward run on."""
        self.compute_stream = torch.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def d2h_issue(self) -> Iterator[None]:
        """Make the D2H stream the current one for the block, after ordering it behind
        everything queued so far on the current stream: ``d2h_copy`` calls go inside.

        NOTE: called from the gradient hook, so the current stream is the one that
        produced the gradient (the compute stream, or FSDP2's reduce-scatter stream).
        Once the event recorded here has completed, every kernel that read the parameter
        in this backward has completed too, which is what makes the later H2D copy into
        the parameter safe.
        NOTE: a hook runs once per parameter inside backward, where the autograd thread also
        launches the GPU's work: ``torch.cuda.stream()`` and ``current_stream()`` without a
        device cost tens of microseconds each in Python, enough to leave the GPU idle between
        the blocks' kernels. So one switch per gradient, with the device index given.
        """
        if torch.cuda.current_device() != self._index:  # not the hooks' case: the general path
            with torch.cuda.device(self._index):
                with self.d2h_issue():
                    yield
            return
        producer = torch.cuda.current_stream(self._index)
        self.d2h_stream.wait_event(producer.record_event())
        try:  # NOTE: the switch inside: an interrupt right after it still restores the producer
            torch.cuda.set_stream(self.d2h_stream)
            yield
        finally:
            torch.cuda.set_stream(producer)

    def d2h_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the D2H stream (inside ``d2h_issue``)."""
        dst.copy_(src, non_blocking=True)
        # NOTE: the caching allocator may hand the gradient's memory to the next
        # kernel on its own stream as soon as the hook drops it; recording the
        # side stream keeps the block alive until our copy has read it.
        if src.is_cuda:
            src.record_stream(self.d2h_stream)

    def d2h_norm(self, dst: torch.Tensor, grad: torch.Tensor) -> None:
        """``dst`` (one float64 host element) = |grad|_2, reduced in float64 (grad_norms.py) on
        the D2H stream (inside ``d2h_issue``), where it overlaps the rest of backward instead
        of delaying it: the float64 reduction of a bf16 gradient also writes and reads a
        float64 copy of it (on an H200 about four times a float32 reduction's time)."""
        self.d2h_copy(dst, local_norm(grad).reshape(1))
        if grad.is_cuda:  # NOTE: read on this stream, see d2h_copy; a zero-filled gradient is on the host
            grad.record_stream(self.d2h_stream)

    def d2h_marker(self) -> Any:
        return self.d2h_stream.record_event()

    def compute_marker(self) -> Any:
        """An event after everything queued so far on the compute stream."""
        return self.compute_stream.record_event()

    def h2d_copies(self, dsts: list, srcs: list, after: Any = None) -> Any:
        """Issue ``dsts[i].copy_(srcs[i])`` on the H2D stream (worker thread, ``worker_init``).

        NOTE: the copies wait for everything queued on the compute stream so far,
        not only up to the gradient's hook: a kernel launched after the hook that
        still reads the old weights (a weight also used through ``.detach()``)
        finishes first, and one launched after this call sees the bumped version
        counter, so autograd reports it instead of reading torn weights.
        ``after`` (a ``compute_marker``): wait for that point of the compute stream instead.
        NOTE: one ``_foreach_copy_`` for the chunk: each torch call drops and retakes the GIL
        (chunk_runner.ChunkRunner._copy_lists).
        """
        self.h2d_stream.wait_event(after if after is not None else self.compute_stream.record_event())
        if dsts:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        return self.h2d_stream.record_event()

    @staticmethod
    def is_done(marker: Any) -> bool:
        return marker is None or marker.query()

    def compute_waits_for_h2d(self) -> None:
        self.compute_stream.wait_stream(self.h2d_stream)
        current = torch.cuda.current_stream(self.device)
        if current != self.compute_stream:
            current.wait_stream(self.h2d_stream)

    def synchronize(self) -> None:
        self.d2h_stream.synchronize()
        self.h2d_stream.synchronize()

    def worker_init(self) -> None:
        """Called once on the worker thread: its device, and its current stream the H2D one.

        NOTE: the worker's only device work is the copies of ``h2d_copies`` (and events), so its
        current stream stays the H2D stream: no stream or device context per chunk."""
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self.h2d_stream)


class SyncTransfer:
    """CPU parameters: the same calls, done synchronously; markers are ``None``."""

    pin = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def set_compute_stream(self) -> None:
        pass

    @contextlib.contextmanager
    def d2h_issue(self) -> Iterator[None]:
        yield

    def d2h_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def d2h_norm(self, dst: torch.Tensor, grad: torch.Tensor) -> None:
        dst.copy_(local_norm(grad).reshape(1))

    def d2h_marker(self) -> Any:
        return None

    def compute_marker(self) -> Any:
        return None

    def h2d_copies(self, dsts: list, srcs: list, after: Any = None) -> Any:
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return None

    @staticmethod
    def is_done(marker: Any) -> bool:
        return True

    def compute_waits_for_h2d(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def worker_init(self) -> None:
        pass


def make_transfer(device: torch.device):
    """The transfer engine for parameters on ``device`` (CUDA or CPU)."""
    if device.type == "cuda":
        return CudaTransfer(device)
    if device.type == "cpu":
        return SyncTransfer(device)
    raise ValueError(f"full offload supports CUDA or CPU parameters, got device {device}")
