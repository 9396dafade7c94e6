# How much of the copy-out may overlap the next forward (no GPU: the estimate
# from given measurements; the events themselves are exercised by the gpu tests
# of the "optimizer" mode).
import random

from cpu_offload._state.overlap import MARGIN, WritebackOverlap


def test_nothing_overlaps_until_a_forward_and_a_copy_were_timed():
    overlap = WritebackOverlap()
    assert overlap.overlap_bytes() == 0
    overlap.forward_s.append(0.05)
    assert overlap.overlap_bytes() == 0
    overlap.forward_s.clear()
    overlap.bytes_per_s = 50e9
    assert overlap.overlap_bytes() == 0


def test_the_shortest_of_the_last_three_forwards_sets_the_overlap():
    rng = random.Random()
    overlap = WritebackOverlap()
    overlap.bytes_per_s = rng.uniform(20e9, 60e9)
    seconds = [rng.uniform(0.01, 0.2) for _ in range(6)]
    for i, s in enumerate(seconds):
        overlap.forward_s.append(s)
        expected = int(overlap.bytes_per_s * min(seconds[max(0, i - 2):i + 1]) * MARGIN)
        assert overlap.overlap_bytes() == expected
    # one long forward (an evaluation pass between two steps) does not widen it
    overlap.forward_s.append(10.0)
    assert overlap.overlap_bytes() == int(overlap.bytes_per_s * min(seconds[-2:]) * MARGIN)
