# Loss curves of two or more runs of examples/train_fsdp.py, compared.
#
# Scope: reads the example's --metrics files (JSON lines, one object per step with keys
# step, loss, lr, ...), prints per run the final loss and the mean loss over the last
# steps (20 by default), each with its difference from the first run (absolute and
# relative), and plots loss against step (--plot, when matplotlib is importable): the
# curves, and each run's loss minus the first run's at the same step.
#
#   python benchmarks/plot_curves.py --metrics fp32.jsonl bf16.jsonl \
#       --labels "fp32 moments" "bf16 moments" --plot curves.png
#
# Non-goals: training or measuring anything, smoothing, statistics across seeds.

from __future__ import annotations

import argparse
import json
import math
import statistics
import warnings
from pathlib import Path
from typing import Optional

__all__ = ["read_metrics", "summarize", "format_summary", "plot", "main"]


def read_metrics(path: str) -> list[dict]:
    """The step records of one --metrics file, sorted by step, one per step.

    NOTE: the example appends to its --metrics file, so a run resumed from a checkpoint
    (or run again) adds records for steps the file already holds: the last record of a
    step wins, with a warning, as it is the one the resumed run continued from.
    """
    by_step: dict[int, dict] = {}
    repeated = False
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from e
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}: line {number} is not JSON ({e})") from e
        if not (isinstance(rec, dict) and "step" in rec and "loss" in rec):
            raise ValueError(f"{path}: line {number}: a record without 'step' and 'loss': {line.strip()[:120]}")
        if not (isinstance(rec["step"], (int, float)) and float(rec["step"]).is_integer()):
            raise ValueError(f"{path}: line {number}: a record whose 'step' is not a whole number: {rec['step']!r}")
        if isinstance(rec["loss"], bool) or not isinstance(rec["loss"], (int, float)):
            raise ValueError(f"{path}: line {number}: a record whose 'loss' is not a number: {rec['loss']!r}")
        step = int(rec["step"])
        repeated |= step in by_step
        by_step[step] = rec
    if not by_step:
        raise ValueError(f"{path}: no step records")
    if repeated:
        warnings.warn(f"{path} holds some steps more than once (a resumed or repeated run appended to it): "
                      "the last record of each step is used", stacklevel=2)
    return [by_step[s] for s in sorted(by_step)]


def _difference(value: float, base: float) -> tuple[float, float]:
    """value - base, and that as a share of base (nan when base is 0)."""
    diff = value - base
    return diff, (diff / base if base else math.nan)


def summarize(runs: list[tuple[str, list[dict]]], *, last: int = 20) -> list[dict]:
    """One row per (label, records) run: final loss, mean of the last `last` losses (all
    of them when the run is shorter), and both against the first run's."""
    if last < 1:
        raise ValueError(f"last must be >= 1, got {last}")
    rows = []
    for label, records in runs:
        losses = [float(r["loss"]) for r in records]
        tail = losses[-last:]
        rows.append({"label": label, "steps": len(records), "last_step": int(records[-1]["step"]),
                     "final_loss": losses[-1], "last_n": len(tail), "last_mean": statistics.fmean(tail)})
    first = rows[0]
    for row in rows:
        row["final_diff"], row["final_rel"] = _difference(row["final_loss"], first["final_loss"])
        row["mean_diff"], row["mean_rel"] = _difference(row["last_mean"], first["last_mean"])
    return rows


def _against(diff: float, rel: float) -> str:
    return f"{diff:+.4f} ({rel:+.2%})"


def format_summary(rows: list[dict]) -> str:
    """A fixed-width table, one line per run; differences are against the first run."""
    base = rows[0]["label"]
    counts = sorted({r["last_n"] for r in rows})
    mean_head = f"mean last {counts[0]}" if len(counts) == 1 else "mean last N"
    width = max(len("run"), *(len(r["label"]) for r in rows))
    header = (f"{'run':<{width}}  {'last step':>9}  {'final loss':>10}  {mean_head:>12}  "
              f"{'final vs ' + base:>24}  {'mean vs ' + base:>24}")
    lines = [header, "-" * len(header)]
    for i, r in enumerate(rows):
        versus = ("-", "-") if i == 0 else (_against(r["final_diff"], r["final_rel"]),
                                            _against(r["mean_diff"], r["mean_rel"]))
        lines.append(f"{r['label']:<{width}}  {r['last_step']:>9d}  {r['final_loss']:>10.4f}  "
                     f"{r['last_mean']:>12.4f}  {versus[0]:>24}  {versus[1]:>24}")
    if len(counts) > 1:
        lines.append(f"mean last N: the mean loss over each run's last {' or '.join(map(str, counts))} steps")
    if len({r["last_step"] for r in rows}) > 1:
        lines.append("NOTE: the runs end at different steps; their final losses are not at the same step")
    return "\n".join(lines)


def plot(runs: list[tuple[str, list[dict]]], path: str, *, title: Optional[str] = None) -> bool:
    """Loss against step for every run, and each later run's loss minus the first run's
    at the steps both have. False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (curves, diffs) = plt.subplots(1, 2, figsize=(12, 4.5))
    base_label, base_records = runs[0]
    base = {int(r["step"]): float(r["loss"]) for r in base_records}
    diffs.axhline(0.0, color="C0", linewidth=1, label=base_label)
    for i, (label, records) in enumerate(runs):
        steps = [int(r["step"]) for r in records]
        curves.plot(steps, [float(r["loss"]) for r in records], label=label, color=f"C{i}", linewidth=1)
        if i:
            common = [r for r in records if int(r["step"]) in base]
            diffs.plot([int(r["step"]) for r in common], [float(r["loss"]) - base[int(r["step"])] for r in common],
                       label=label, color=f"C{i}", linewidth=1)
    curves.set(xlabel="step", ylabel="loss", title="training loss")
    curves.legend()
    diffs.set(xlabel="step", ylabel=f"loss − loss of {base_label}", title=f"against {base_label}")
    diffs.legend()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Compare the loss curves of examples/train_fsdp.py runs "
                                "(their --metrics files); differences are against the first run.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--metrics", nargs="+", required=True, metavar="PATH", help="two or more --metrics JSONL files")
    p.add_argument("--labels", nargs="+", metavar="LABEL", help="one per --metrics file (default: the file names)")
    p.add_argument("--last", type=int, default=20, help="steps at the end whose mean loss is reported")
    p.add_argument("--plot", metavar="PNG", help="write the curves here (needs matplotlib)")
    p.add_argument("--title", help="title of the plot")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    if len(args.metrics) < 2:
        p.error("--metrics needs two or more files to compare")
    if args.labels is None:
        args.labels = [Path(m).stem for m in args.metrics]
    if len(args.labels) != len(args.metrics):
        p.error(f"--labels needs one label per --metrics file: got {len(args.labels)} for {len(args.metrics)}")
    if args.last < 1:
        p.error("--last must be >= 1")
    return args


def main(argv=None) -> list[dict]:
    """Print the summary (and write the plot) as the flags say; return the summary rows."""
    args = parse_args(argv)
    try:
        runs = [(label, read_metrics(path)) for label, path in zip(args.labels, args.metrics)]
    except ValueError as e:
        _parser().error(str(e))
    rows = summarize(runs, last=args.last)
    print(format_summary(rows))
    if args.plot:
        print(f"wrote {args.plot}" if plot(runs, args.plot, title=args.title) else "matplotlib not importable: no plot")
    return rows


if __name__ == "__main__":
    main()
