# Ratios of kept end-to-end runs to their own `none` step, summarised across runs: for each
# mode, the step's median over the run and the last timed step's CPU kernel, each divided by
# the `none` step of the same file, and the step minus that kernel. Reads benchmarks/e2e.py's
# JSON files, also those that hold several arms (a dict of such reports).
# Run: python benchmarks/e2e_across_runs.py [--modes full_overlap,full_bf16_overlap] FILE...
# Non-goals: running anything (benchmarks/e2e.py does).
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

__all__ = ["ratios", "summary", "main"]


def _reports(data: dict) -> list:
    """The e2e reports in one file: the file itself, or the arms of a dict of reports."""
    if "results" in data:
        return [data]
    return [v for v in data.values() if isinstance(v, dict) and "results" in v]


def ratios(path: Path, modes: set) -> list:
    """(mode, step / none, kernel / none, step - kernel seconds) for each row of ``modes`` with a
    kernel time, in a file whose reports have a ``none`` step (their median if several)."""
    reports = _reports(json.loads(path.read_text()))
    nones = [statistics.median(r["step_times_s"]) for rep in reports for r in rep["results"]
             if r["mode"] == "none" and r.get("step_times_s")]
    if not nones:
        return []
    none = statistics.median(nones)
    out = []
    for rep in reports:
        for r in rep["results"]:
            kernel = (r.get("offload_stats") or {}).get("kernel_s")
            if r["mode"] in modes and r.get("step_times_s") and kernel:
                step = statistics.median(r["step_times_s"])
                out.append((r["mode"], step / none, kernel / none, step - kernel))
    return out


def summary(rows: list) -> dict:
    """Per mode: runs, and (min, median, max) of each of the three figures."""
    by_mode: dict = {}
    for mode, *figures in rows:
        by_mode.setdefault(mode, []).append(figures)
    return {mode: {"runs": len(fs), **{name: (min(col), statistics.median(col), max(col))
                                       for name, col in zip(("step_x_none", "kernel_x_none", "step_minus_kernel_s"),
                                                            zip(*fs))}}
            for mode, fs in by_mode.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Kept e2e runs against their own none step.")
    p.add_argument("--modes", default="full_overlap,full_bf16_overlap")
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    modes = set(args.modes.split(","))
    rows, files = [], 0
    for path in args.files:
        found = ratios(path, modes)
        files += bool(found)
        rows += found
    print(f"{files} files")
    for mode, s in summary(rows).items():
        figures = {name: v for name, v in s.items() if name != "runs"}
        cells = "; ".join(f"{name} {lo:.3f} / {mid:.3f} / {hi:.3f}" for name, (lo, mid, hi) in figures.items())
        print(f"{mode}: {s['runs']} runs; min / median / max: {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
