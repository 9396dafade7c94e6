# Linux cpulists ("0-15,32-47"): parsing and formatting, as sysfs and taskset write them.
#
# Scope: the two pure functions. Non-goals: reading sysfs (topology), affinity masks.

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["parse_cpulist", "format_cpulist"]


def parse_cpulist(text: str) -> set[int]:
    """Parse a kernel cpulist such as ``"0-15,32-47"`` or ``"3,5-6"`` ("" is empty)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"invalid cpulist {text!r}: bad entry {part!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"invalid cpulist {text!r}: bad range {part!r}")
        cpus.update(range(first, last + 1))
    return cpus


def format_cpulist(cpus: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpulist`: sorted, consecutive ids folded into ranges."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
