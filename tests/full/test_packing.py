# Chunk packing (a pure function): pieces cover the tensor exactly once, in
# order, inside the slot, aligned, and a tensor that fits a slot is never split;
# a tensor of no elements gets exactly one empty piece. The staging rings' default size.
import random

import pytest

from cpu_offload._full.packing import ALIGN_BYTES, Placement, align_up, place


def replay(sizes, esize, cap):
    """Place tensors one after the other; return [(tensor index, chunk index, placement)]."""
    used, chunk, out = None, -1, []
    for t, numel in enumerate(sizes):
        placements, after = place(numel, esize, cap, used)
        for pl in placements:
            if pl.new_chunk:
                chunk += 1
            out.append((t, chunk, pl))
        used = after
    return out


@pytest.mark.parametrize("seed", range(20))
def test_random_layouts_cover_each_tensor_once_within_slots(seed):
    rng = random.Random(seed)
    esize = rng.choice([2, 4])
    cap = rng.choice([256, 1024, 4096])
    sizes = [rng.choice([0, 1, 7, 31, 64, 300, 1000, 5000]) for _ in range(rng.randint(1, 30))]
    layout = replay(sizes, esize, cap)
    ends = {}
    for t, _chunk, pl in layout:
        assert pl.start == ends.get(t, 0) and (pl.numel > 0) == (sizes[t] > 0)  # in order, no gap, no overlap
        ends[t] = pl.start + pl.numel
        assert pl.offset % ALIGN_BYTES == 0 and pl.offset + pl.numel * esize <= cap
    assert all(ends.get(t, 0) == n for t, n in enumerate(sizes))
    assert all(sum(tt == t for tt, _, _ in layout) == 1 for t, n in enumerate(sizes) if n == 0)
    by_chunk = {}
    for _t, chunk, pl in layout:  # pieces of one chunk do not overlap
        spans = by_chunk.setdefault(chunk, [])
        assert all(pl.offset >= e or pl.offset + pl.numel * esize <= s for s, e in spans)
        spans.append((pl.offset, align_up(pl.offset + pl.numel * esize)))
    for t, n in enumerate(sizes):
        chunks = {c for tt, c, _ in layout if tt == t}
        if 0 < n * esize <= cap:
            assert len(chunks) == 1, (t, n)  # fits a slot: never split


def test_keep_whole_opens_a_fresh_chunk_and_large_tensors_continue():
    placements, used = place(50, 2, 256, 128)  # 100 bytes fit the 128 left
    assert [(p.new_chunk, p.offset) for p in placements] == [(False, 128)] and used is None  # now full
    placements, used = place(80, 2, 256, 128)  # 160 bytes do not fit the 128 left, but fit a slot
    assert [(p.new_chunk, p.offset, p.numel) for p in placements] == [(True, 0, 80)] and used == align_up(160)
    placements, used = place(300, 2, 256, 128)  # larger than a slot: fills the open chunk first
    assert [(p.new_chunk, p.start, p.numel, p.offset, p.close_after) for p in placements] == [
        (False, 0, 64, 128, True), (True, 64, 128, 0, True), (True, 192, 108, 0, True)]
    assert used is None  # 216 bytes round up to the whole slot, which is then closed
    assert place(0, 2, 256, None) == ([Placement(0, 0, 0, True, False)], 0)  # one empty piece
    assert place(0, 2, 256, 128) == ([Placement(0, 0, 128, False, False)], 128)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="bad sizes"):
        place(10, 4, 2, None)


# ------------------------------------------------------ the staging rings' size
class _Rec:
    def __init__(self, numel):
        self.numel, self.param = numel, object()


def _rings(numels, **kw):
    import torch

    from cpu_offload._full.options import staging_rings
    return staging_rings([_Rec(n) for n in numels], set(), torch.bfloat16, **kw)


def test_default_rings_grow_with_the_gradient_bytes_in_256_mib_slots():
    from cpu_offload._full.options import Rings

    mib = 1 << 20
    # a 14B model in 44 blocks of bf16 gradients: 1/8 of 28.6 GB, in slots of about 256 MiB
    r = _rings([325_000_000] * 44, pinned_bytes=None, num_slots=None, room=1 << 40)
    assert r.nbytes <= 44 * 325_000_000 * 2 // 8 and r.d2h_slots == r.h2d_slots == 6
    assert 256 * mib <= r.slot_bytes < 512 * mib
    # a 1B model: the 512 MiB floor, 4 slots of 64 MiB, as before
    assert _rings([10_000_000] * 95, pinned_bytes=None, num_slots=None, room=1 << 40) == Rings(4, 4, 64 * mib)
    # no room in host RAM for the larger rings: the floor; with fill, the largest 512 MiB
    # multiple the room holds (2.3 GiB: 2 GiB, 4 slots of 256 MiB), never below the floor
    assert _rings([325_000_000] * 44, pinned_bytes=None, num_slots=None, room=1 << 30) == Rings(4, 4, 64 * mib)
    assert _rings([325_000_000] * 44, pinned_bytes=None, num_slots=None, room=2355 * mib,
                  fill=True) == Rings(4, 4, 256 * mib)
    assert _rings([325_000_000] * 44, pinned_bytes=None, num_slots=None, room=3 << 30, fill=True) == Rings(6, 6, 256 * mib)
    for room in (0, 511 * mib, -(1 << 30)):
        assert _rings([325_000_000] * 44, pinned_bytes=None, num_slots=None, room=room,
                      fill=True) == Rings(4, 4, 64 * mib)
    # fill changes nothing when the default fits, or when the sizes are given
    assert _rings([325_000_000] * 44, pinned_bytes=None, num_slots=None, room=1 << 40, fill=True) == \
        _rings([325_000_000] * 44, pinned_bytes=None, num_slots=None, room=1 << 40)
    assert _rings([325_000_000] * 44, pinned_bytes=1024 * mib, num_slots=None, room=0, fill=True) == Rings(4, 4, 128 * mib)
    # a 70B model: capped at 4 GiB
    r = _rings([1_000_000_000] * 70, pinned_bytes=None, num_slots=None, room=1 << 40)
    assert r.nbytes == 4096 * mib and r.slot_bytes == 256 * mib
    # given sizes are kept; small models get slots no larger than all their gradients
    assert _rings([325_000_000] * 44, pinned_bytes=1024 * mib, num_slots=None, room=0) == Rings(4, 4, 128 * mib)
    assert _rings([325_000_000] * 44, pinned_bytes=1024 * mib, num_slots=2, room=0) == Rings(2, 2, 256 * mib)
    assert _rings([1000], pinned_bytes=None, num_slots=None, room=1 << 40) == Rings(4, 4, 4096)


def test_a_backlog_grows_only_the_device_to_host_ring_within_half_of_the_room():
    from cpu_offload._full.options import BACKLOG_MAX

    mib, gib = 1 << 20, 1 << 30
    # 0.95B of bf16 gradients (1.9 GB): every gradient with its packing slack, in 256 MiB
    # slots; the host-to-device ring keeps its 512 MiB default bytes, at least 4 slots
    grads = 95 * 10_000_000 * 2
    r = _rings([10_000_000] * 95, pinned_bytes=None, num_slots=None, room=1 << 40, backlog=True)
    assert r.slot_bytes == 256 * mib and r.h2d_slots == 4
    assert grads + grads // 16 <= r.d2h_slots * r.slot_bytes < grads + grads // 16 + r.slot_bytes
    # 14B (28.6 GB of gradients) with 14 GiB left: the two rings fill half of it
    r = _rings([325_000_000] * 44, pinned_bytes=None, num_slots=None, room=14 * gib, backlog=True)
    default = _rings([325_000_000] * 44, pinned_bytes=None, num_slots=None, room=14 * gib)
    assert r.h2d_slots * r.slot_bytes >= default.h2d_slots * default.slot_bytes
    assert 7 * gib - r.slot_bytes < r.nbytes <= 7 * gib and r.d2h_slots > default.d2h_slots
    # 70B with room to spare: BACKLOG_MAX
    r = _rings([1_000_000_000] * 70, pinned_bytes=None, num_slots=None, room=1 << 40, backlog=True)
    assert r.d2h_slots * r.slot_bytes == BACKLOG_MAX
    # too little room to grow, or sizes given: the default rings
    for kw in (dict(pinned_bytes=None, num_slots=None, room=gib), dict(pinned_bytes=1024 * mib, num_slots=None,
                                                                       room=1 << 40)):
        assert _rings([325_000_000] * 44, backlog=True, **kw) == _rings([325_000_000] * 44, **kw)
