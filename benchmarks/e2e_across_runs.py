# Ratios of kept end-to-end runs to their own `none` step, summarised across runs: for each
# mode, the step's median over the run and the last timed step's CPU kernel, each divided by
# the `none` step of the same file, and the step minus that kernel. Also the step against the
# floor the host's own bandwidth probe allows, where the file has the probe and the model's
# size:
#   floor = n_params * B / probe + forward_s,  B = 28 bytes (fp32 moments) or 20 (bf16 moments)
# the bytes the all-host AdamW step moves per parameter, and forward_s (0.04 s at 0.95B) the
# forward that no overlap hides. Reads benchmarks/e2e.py's JSON files, also those that hold
# several arms (a dict of such reports).
# Run: python benchmarks/e2e_across_runs.py [--modes full_overlap,full_bf16_overlap] FILE...
# Non-goals: running anything (benchmarks/e2e.py does).
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cli_checks, also when loaded by path
from cli_checks import read_json  # noqa: E402

__all__ = ["ratios", "summary", "main"]


def _reports(data: dict) -> list:
    """The e2e reports in one file: the file itself, or the arms of a dict of reports, at any
    depth (kept arm comparisons hold theirs under "runs" or "arms", beside their commands)."""
    if "results" in data:
        return [data]
    return [rep for v in data.values() if isinstance(v, dict) for rep in _reports(v)]


def _why_not_a_report(data) -> str | None:
    reports = _reports(data) if isinstance(data, dict) else []
    if not reports or not all(isinstance(rep["results"], list) and all(isinstance(r, dict) and "mode" in r
                                                                      for r in rep["results"]) for rep in reports):
        return "not an e2e report (benchmarks/e2e.py --json writes one) nor a dict of such reports"
    return None


# Bytes the all-host AdamW step moves per parameter: gradient 2 and compute copy 2, master 4 + 4,
# and each moment read and written (4 + 4 each in fp32, 2 + 2 each in bf16).
STEP_BYTES = {"float32": 28, "bfloat16": 20}
FIGURES = ("step_x_none", "kernel_x_none", "step_minus_kernel_s", "step_x_host_floor")


def host_floor_s(mode: str, n_params: int, probe_gbs: float, forward_s: float) -> float:
    """The least all-host step time the host's probed bandwidth allows (the header's floor)."""
    moments = "bfloat16" if "bf16" in mode else "float32"
    return n_params * STEP_BYTES[moments] / (probe_gbs * 1e9) + forward_s


def ratios(data: dict, modes: set, forward_s: float = 0.04) -> list:
    """(mode, step / none, kernel / none, step - kernel seconds, step / host floor or None) for
    each row of ``modes`` with a kernel time, in a file's JSON whose reports have a ``none`` step
    (their median if several); the last figure needs the report's probe and the row's ``n_params``."""
    reports = _reports(data)
    nones = [statistics.median(r["step_times_s"]) for rep in reports for r in rep["results"]
             if r["mode"] == "none" and r.get("step_times_s")]
    if not nones:
        return []
    none = statistics.median(nones)
    out = []
    for rep in reports:
        probe = rep.get("host_bandwidth_gbs")
        for r in rep["results"]:
            kernel = (r.get("offload_stats") or {}).get("kernel_s")
            if r["mode"] in modes and r.get("step_times_s") and kernel:
                step = statistics.median(r["step_times_s"])
                floor = host_floor_s(r["mode"], r["n_params"], probe, forward_s) if probe and r.get("n_params") else None
                out.append((r["mode"], step / none, kernel / none, step - kernel, None if floor is None else step / floor))
    return out


def summary(rows: list) -> dict:
    """Per mode: runs, and (min, median, max) of each figure over the runs that have it
    (``host_floor_runs`` of them have the last)."""
    by_mode: dict = {}
    for mode, *figures in rows:
        by_mode.setdefault(mode, []).append(figures)
    out = {}
    for mode, fs in by_mode.items():
        out[mode] = {"runs": len(fs), "host_floor_runs": sum(f[-1] is not None for f in fs)}
        for name, col in zip(FIGURES, zip(*fs)):
            col = [x for x in col if x is not None]
            if col:
                out[mode][name] = (min(col), statistics.median(col), max(col))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Kept e2e runs against their own none step.")
    p.add_argument("--modes", default="full_overlap,full_bf16_overlap")
    p.add_argument("--forward-s", type=float, default=0.04, help="the floor's forward time, s")
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    modes = set(args.modes.split(","))
    rows, files = [], 0
    for path in args.files:
        found = ratios(read_json(p, path, _why_not_a_report), modes, args.forward_s)
        files += bool(found)
        rows += found
    print(f"{files} files")
    for mode, s in summary(rows).items():
        figures = {name: s[name] for name in FIGURES if name in s}
        cells = "; ".join(f"{name} {lo:.3f} / {mid:.3f} / {hi:.3f}" for name, (lo, mid, hi) in figures.items())
        print(f"{mode}: {s['runs']} runs ({s['host_floor_runs']} with a probe); min / median / max: {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
