# Chunk packing: where the pieces of one flat tensor go in a sequence of
# fixed-size staging slots. A pure function of sizes, shared by every path that
# forms chunks (gradients arriving in backward, gradients already on the host).
#
# Scope: the layout rule only. Non-goals: slots, copies, threads (pipeline.py).

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Placement", "place", "ALIGN_BYTES", "align_up"]

# NOTE: every piece starts at a multiple of 64 bytes, so the native kernels see
# cache-line aligned tensors and pieces of different dtypes never share a line.
ALIGN_BYTES = 64


def align_up(nbytes: int, align: int = ALIGN_BYTES) -> int:
    return (nbytes + align - 1) // align * align


@dataclass(frozen=True)
class Placement:
    """Elements ``[start, start + numel)`` of the tensor at byte ``offset`` of a slot.

    ``new_chunk``: close the open chunk (if any) and open a fresh one first.
    ``close_after``: the chunk is full after this piece; close it.
    """

    start: int
    numel: int
    offset: int
    new_chunk: bool
    close_after: bool


def place(numel: int, esize: int, cap: int, used: Optional[int]) -> tuple[list[Placement], Optional[int]]:
    """Lay out a tensor of ``numel`` elements of ``esize`` bytes into slots of ``cap`` bytes.

    ``used`` is the byte count already used in the open chunk, ``None`` when no
    chunk is open. Returns the placements and the open chunk's byte count
    afterwards (``None`` when the last chunk was closed).

    Rules: a tensor that fits in a fresh slot is never split (it starts a fresh
    chunk when the open one lacks room); a larger one fills the open chunk and
    continues in fresh ones; a tensor of no elements gets one empty piece.

    NOTE: every tensor gets at least one piece: a parameter's step is counted when
    all of its pieces were stepped (and ``pieces_total > 0`` means "stepped in this
    window"), so an empty one needs a piece to count its steps as torch does.
    """
    if numel < 0 or esize < 1 or cap < esize:
        raise ValueError(f"place: bad sizes numel={numel}, esize={esize}, cap={cap}")
    if numel == 0:  # at the open chunk's end, which it leaves as it was
        return [Placement(0, 0, 0 if used is None else used, used is None, False)], 0 if used is None else used
    out: list[Placement] = []
    start = 0
    while start < numel:
        remaining = numel - start
        new = used is None
        if not new:
            room = (cap - used) // esize
            keep_whole = start == 0 and used > 0 and remaining > room and remaining * esize <= cap
            new = room == 0 or keep_whole
        if new:
            used = 0
        n = min((cap - used) // esize, remaining)
        offset = used
        used = align_up(used + n * esize)
        full = used >= cap
        out.append(Placement(start, n, offset, new, full))
        if full:
            used = None
        start += n
    return out, used
