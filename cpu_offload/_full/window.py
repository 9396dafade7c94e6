# Closing an accumulation window of full offload: normally (queue what only
# lives on the host, drain, note the new weights) or after a failure (finish
# what was staged, drain, find which parameters were stepped), then reset the
# per-window bookkeeping.
#
# Scope: the work on records, pipeline and transfer that ends a window.
# Non-goals: deciding when a window ends (protocol.py and optimizer.py).

from __future__ import annotations

import torch

from cpu_offload._common.interrupts import deferred_interrupts
from cpu_offload._full.host_state import note_versions

__all__ = ["finish_window", "land_window", "salvage_window", "reset_window"]


def finish_window(records, pipeline, transfer, *, zero_fill: bool, device=None, land: bool = True) -> None:
    """The window's last backward has ended (or step() closes a short window):
    step what is only on the host, wait for every update to land on the device.

    ``zero_fill``: torch keeps zero gradients after ``zero_grad(set_to_none=False)``,
    so parameters that hold one but got no gradient are stepped with zeros.
    ``device``: the DeviceState; its records are only marked here (stepped when the
    window closes, device_state.py).
    ``land=False`` (overlap_forward): queue the rest and return (the worker takes the chunks
    in the next forward's order, ``Pipeline._take``); ``land_window`` waits for them later.
    """
    for rec in records:
        if rec.pieces_total or not (rec.has_accum or (zero_fill and rec.holds_grad)):
            continue
        if rec.on_device:
            if rec.has_accum:
                device.take_accumulated(rec)
            else:
                device.stage_zeros(rec)
        elif not rec.has_accum:
            zeros = torch.zeros(rec.numel, dtype=rec.local().dtype)
            pipeline.stage_grad(rec, zeros, add=False)
            if rec.accum is None and rec.retained is None:  # grad_copy="device": the kept gradient
                rec.retained = zeros
    pipeline.stage_from_host([r for r in records if r.has_accum and r.pieces_total == 0 and not r.on_device])
    if land:
        land_window(records, pipeline, transfer)
    else:
        pipeline.end_backward(forward_next=True)


def land_window(records, pipeline, transfer) -> None:
    """Wait for every queued chunk and its copies to the device; note the weights written."""
    pipeline.drain()
    transfer.compute_waits_for_h2d()
    err = pipeline.take_error()
    if err is not None:
        raise err
    note_versions([r for r in records if r.pieces_total and not r.on_device])


def salvage_window(records, pipeline, transfer) -> tuple[list, list]:
    """After a failure: finish staging the parameter an exception interrupted,
    drain, and return ``(stepped records, names of partly stepped ones)``.

    NOTE: a parameter counts its step only once all of its pieces were stepped
    (the chunk runner counts), so the stepped ones are exactly those whose
    master changed whole; a partly stepped one (``torn``) is only possible when a
    chunk failed inside the worker after another chunk of the same parameter
    succeeded, or after its own kernel ran.
    """
    try:
        # NOTE: whole against Ctrl-C (held back until the window's chunks have all run): an
        # interrupt in a wait left chunks queued that ran once the window had been reset, their
        # masters changed with no step counted. Every wait is bounded (``finish_queued``).
        with deferred_interrupts():
            _finish_staging(pipeline)
            try:
                pipeline.drain()
            except TimeoutError:
                pipeline.finish_queued()  # NOTE: the window is then recovered with all it stepped
            transfer.compute_waits_for_h2d()
    finally:
        stepped = [r for r in records if r.stepped]
        torn = [r.name for r in records if r.torn]
        note_versions(stepped)
    return stepped, torn


def _finish_staging(pipeline) -> None:
    """Stage the rest of a parameter an exception cut; dropped if that fails but for a wait
    for a free slot, which the worker frees as it runs what is queued (each round stages at
    least one slot more: the parameter is never left partly stepped for a slow kernel)."""
    while True:
        try:
            pipeline.resume_staging()
            return
        except TimeoutError:
            if pipeline.finish_queued():
                continue
            pipeline.drop_staging()
            return
        except Exception:
            pipeline.drop_staging()
            return


def reset_window(records, pipeline) -> None:
    for rec in records:
        rec.reset_window()
    pipeline.reset_window()
