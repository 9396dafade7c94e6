# What the CPU AdamW-pass benchmarks (huge_pages.py, kernel_calls.py) share: the pass's
# hyper-parameters and minimal bytes per element, host state filled with the same values
# whatever the allocator (and whether it fits in RAM), the check of a stepped state against the
# reference, and arms timed alternately. Non-goals: what an arm varies (each benchmark).
from __future__ import annotations

import argparse
import statistics
import time

import psutil
import torch

__all__ = ["HP", "BYTES_PER_ELEMENT", "CHECK", "state", "check_fits", "check_step", "median_times"]

HP = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
BYTES_PER_ELEMENT = {torch.float32: 28, torch.bfloat16: 20}
CHECK = 4099  # elements checked against the reference


def check_fits(parser: argparse.ArgumentParser, n: int, states: int) -> None:
    """``parser.error()`` (exit 2) unless ``states`` states of ``n`` elements with fp32 moments
    (``state``: 16 B an element) and the fill's temporary (4 B) fit in the available RAM.
    NOTE: before anything is allocated: a usage error, not the allocator's."""
    needed, available = n * (16 * states + 4), psutil.virtual_memory().available
    if needed > available:
        parser.error(f"--numel {n} needs about {needed / 2**30:.1f} GiB of RAM ({states} host state(s) with fp32 "
                     f"moments); {available / 2**30:.1f} GiB is available")


def state(n: int, moments: torch.dtype, alloc=lambda k, d: torch.empty(k, dtype=d)) -> dict:
    """p, g, m, v, out of ``n`` elements from ``alloc(numel, dtype)``, filled with the same
    values whatever the allocator (first touch after the allocation)."""
    gen = torch.Generator().manual_seed(0)
    t = {"p": alloc(n, torch.float32), "g": alloc(n, torch.bfloat16), "m": alloc(n, moments),
         "v": alloc(n, moments), "out": alloc(n, torch.bfloat16)}
    t["p"].copy_(torch.randn(n, generator=gen))
    t["g"].copy_(torch.randn(n, generator=gen))
    t["m"].copy_(torch.randn(n, generator=gen) * 1e-2)
    t["v"].copy_(torch.rand(n, generator=gen) * 1e-4)
    t["out"].zero_()
    return t


def check_step(t: dict, ref: dict, label: str) -> None:
    """The first CHECK elements of ``t`` equal ``ref`` (the reference's p, m, v after the same
    steps) bit for bit, and ``out`` is the bf16 copy of that p."""
    for key in ("p", "m", "v"):
        assert torch.equal(t[key][:CHECK], ref[key]), f"{label}: {key} differs from the reference"
    assert torch.equal(t["out"][:CHECK], ref["p"].bfloat16()), f"{label}: the bf16 copy differs"


def median_times(arms: dict, repeats: int) -> dict:
    """The median seconds of each arm (name -> a call that runs it once), the arms timed in turn
    ``repeats`` times, so drifts of the host touch every arm."""
    times = {name: [] for name in arms}
    for _ in range(repeats):
        for name, run in arms.items():
            time.sleep(0.05)
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}
