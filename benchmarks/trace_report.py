# Per-step figures from a full-offload pipeline trace (CPU_OFFLOAD_TRACE, cpu_offload/_full/
# trace.py). A step runs from one step() return to the next, so it holds the next forward and
# the backward that the step() closes. For each: its length; the worker's busy time (from
# taking a chunk to being done with it) and, inside it, the kernel time (as stats()'s
# kernel_s: the optimizer kernels with the chunk's gradient-norm read); the worker's idle
# spans longer than --gap-ms, their sum and the longest with its start; the time forwards
# waited for weights; when the first gradient was staged and the first chunk was queued.
# All times are seconds of the host's clock.
#
#   CPU_OFFLOAD_TRACE=/tmp/trace python benchmarks/e2e.py --modes full_bf16_overlap --tokens 8192
#   python benchmarks/trace_report.py /tmp/trace/trace_*.json
#
# Non-goals: GPU-side times (the trace has none), traces of several optimizers merged.
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cli_checks, also when loaded by path
from cli_checks import check_output_paths, read_json  # noqa: E402

__all__ = ["step_rows", "main"]

COLUMNS = ("step_s", "busy_s", "kernel_s", "idle_s", "longest_idle_s", "longest_idle_at_s", "forward_wait_s",
           "first_grad_at_s", "first_chunk_at_s", "chunks")


def _spans(events: list, begin: str, end: str, by_value: bool = True) -> list:
    """(start, stop) of each ``begin`` event closed by the next ``end`` event on the same thread
    with the same value (a chunk's seq; any value when not ``by_value``)."""
    started, out = {}, []
    for t, thread, name, value in events:
        key = (thread, value if by_value else None)
        if name == begin:
            started[key] = t
        elif name == end and key in started:
            out.append((started.pop(key), t))
    return out


def _within(spans: list, lo: float, hi: float) -> list:
    return [(a, b) for a, b in spans if lo <= a < hi]


def step_rows(events: list, gap_s: float = 1e-3) -> list:
    """One dict of COLUMNS per step between two step() returns."""
    events = sorted(events, key=lambda e: e[0])
    ends = [t for t, _, name, _ in events if name == "step_end"]
    busy = _spans(events, "chunk_take", "chunk_done")
    kernel = _spans(events, "kernel_begin", "kernel_end")
    waits = _spans(events, "forward_wait_begin", "forward_wait_end", by_value=False)
    rows = []
    for lo, hi in zip(ends, ends[1:]):
        own = _within(busy, lo, hi)
        idle = []
        last = lo
        for a, b in own:
            if a - last > gap_s:
                idle.append((last, a))
            last = max(last, b)
        if hi - last > gap_s:
            idle.append((last, hi))
        longest = max(idle, key=lambda s: s[1] - s[0], default=(lo, lo))
        firsts = {name: next((t - lo for t, _, n, _ in events if n == name and lo <= t < hi), None)
                  for name in ("grad_staged", "chunk_queued")}
        rows.append({
            "step_s": hi - lo, "busy_s": sum((b - a for a, b in own), 0.0),
            "kernel_s": sum((b - a for a, b in _within(kernel, lo, hi)), 0.0),
            "idle_s": sum((b - a for a, b in idle), 0.0), "longest_idle_s": longest[1] - longest[0],
            "longest_idle_at_s": longest[0] - lo,
            "forward_wait_s": sum((b - a for a, b in _within(waits, lo, hi)), 0.0),
            "first_grad_at_s": firsts["grad_staged"], "first_chunk_at_s": firsts["chunk_queued"], "chunks": len(own),
        })
    return rows


def _fmt(v) -> str:
    return "-" if v is None else f"{v:d}" if isinstance(v, int) else f"{v:.4f}"


def _why_not_a_trace(data) -> str | None:
    events = data.get("events") if isinstance(data, dict) else None
    if not (isinstance(events, list) and all(isinstance(e, list) and len(e) == 4 for e in events)):
        return "not a pipeline trace (an object whose 'events' are [time, thread, name, value] lists)"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Per-step figures from full-offload pipeline traces.")
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--gap-ms", type=float, default=1.0, help="idle spans shorter than this are not counted")
    p.add_argument("--skip", type=int, default=2, help="steps left out of the medians (warm-up)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if not args.skip >= 0:
        p.error(f"--skip must be >= 0, got {args.skip}")
    if not args.gap_ms >= 0:
        p.error(f"--gap-ms must be >= 0, got {args.gap_ms}")
    check_output_paths(p, ("--json", args.json))
    report = {}
    for path in args.traces:
        rows = step_rows(read_json(p, path, _why_not_a_trace)["events"], args.gap_ms / 1e3)
        if not rows:
            p.error(f"{path}: fewer than two step() returns, so no step to report (a step runs from one to the next)")
        timed = rows[args.skip:] or rows
        medians = {c: statistics.median(r[c] for r in timed) if all(r[c] is not None for r in timed) else None
                   for c in COLUMNS}
        report[str(path)] = {"steps": rows, "medians": medians}
        print(f"{path}: {len(rows)} steps between step() returns, medians of the last {len(timed)}")
        print(f"  {'step':>6} " + "  ".join(f"{c:>17}" for c in COLUMNS))
        for label, r in [*((str(i + 1), r) for i, r in enumerate(rows)), ("median", medians)]:
            print(f"  {label:>6} " + "  ".join(f"{_fmt(r[c]):>17}" for c in COLUMNS))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
