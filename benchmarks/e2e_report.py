# Report code of the end-to-end benchmark (benchmarks/e2e.py): table rows, the text
# table, the summary against the targets, JSON and the PNG plot.
#
# Scope: pure functions of the raw per-configuration results, so they are tested on
# fake measurements without a GPU (tests/test_examples.py). Nothing here measures.

from __future__ import annotations

import json
import math
import statistics
from typing import Optional

MODES = ("none", "optimizer", "full", "full+clip", "full+clip_all", "full_bf16", "full_overlap", "full_bf16_overlap",
         "full_stream", "full_bf16_stream", "full_overlap_stream", "full_bf16_overlap_stream",
         "full_auto", "full_bf16_auto", "torchao", "fsdp_cpu")
LABELS = {
    "none": "none",
    "optimizer": "optimizer",
    "full": "full",
    "full+clip": "full + clip_grad_norm_ (never clips)",
    "full+clip_all": "full + clip_grad_norm_ (clips every step)",
    "full_bf16": "full, bf16 moments",
    "full_overlap": "full, overlap_forward",
    "full_bf16_overlap": "full, bf16 moments, overlap_forward",
    "full_stream": "full, stream_share",
    "full_bf16_stream": "full, bf16 moments, stream_share",
    "full_overlap_stream": "full, overlap_forward, stream_share",
    "full_bf16_overlap_stream": "full, bf16 moments, overlap_forward, stream_share",
    "full_auto": "full, gpu_state=auto",
    "full_bf16_auto": "full, bf16 moments, gpu_state=auto",
    "torchao": "torchao CPUOffloadOptimizer",
    "fsdp_cpu": "FSDP2 CPUOffloadPolicy",
}
# The project's stated targets for the default model on 1x H200 with 16 host cores:
# tokens/step -> full's step time at most this many times none's, and the GiB of peak
# GPU memory full must save against none. Reported, never enforced.
TARGET_RATIO = {32768: 1.05, 8192: 2.6}
TARGET_SAVED_GIB = {32768: 11.0}


# ------------------------------------------------------------------ report (pure)


def summarize(results: list[dict]) -> list[dict]:
    """Table rows from raw per-configuration results.

    A result: mode, tokens_per_step, step_times_s (the timed steps), peak_gpu_gib,
    exposed_wait_s (or None), losses, n_gpus, error (None when it ran). Ratios and
    savings are taken against the `none` result of the same tokens/step budget.
    """
    baseline = {r["tokens_per_step"]: r for r in results if r["mode"] == "none" and not r.get("error")}
    rows = []
    for r in results:
        row = {"mode": r["mode"], "label": LABELS.get(r["mode"], r["mode"]),
               "tokens_per_step": r["tokens_per_step"], "error": r.get("error")}
        if not r.get("error"):
            step_s = statistics.median(r["step_times_s"])
            n_gpus = r.get("n_gpus", 1)
            row.update(step_s=step_s, tokens_per_s=r["tokens_per_step"] / step_s,
                       tokens_per_s_per_gpu=r["tokens_per_step"] / step_s / n_gpus,
                       peak_gpu_gib=r["peak_gpu_gib"], exposed_wait_s=r.get("exposed_wait_s"))
            base = baseline.get(r["tokens_per_step"])
            if base is not None:
                base_step = statistics.median(base["step_times_s"])
                row["ratio_to_none"] = step_s / base_step
                row["gib_saved"] = (None if None in (base["peak_gpu_gib"], r["peak_gpu_gib"])
                                    else base["peak_gpu_gib"] - r["peak_gpu_gib"])
                row["max_loss_diff_vs_none"] = _max_loss_diff(r.get("losses"), base.get("losses"))
        rows.append(row)
    return rows


def _max_loss_diff(a: Optional[list], b: Optional[list]) -> Optional[float]:
    """The largest |loss - none's loss| over the steps both ran with finite losses; NaN where a
    loss is not finite and none's is (a diverged run; max() alone would skip a NaN after the
    first step); None where no step has both finite."""
    if not a or not b:
        return None
    pairs = list(zip(a, b))
    if any(not math.isfinite(x) and math.isfinite(y) for x, y in pairs):
        return math.nan
    finite = [abs(x - y) for x, y in pairs if math.isfinite(x) and math.isfinite(y)]
    return max(finite) if finite else None


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


COLUMNS = (  # header, row key, format, width
    ("mode", "label", "", 28),
    ("tokens/step", "tokens_per_step", "d", 11),
    ("step s", "step_s", ".3f", 8),
    ("tokens/s", "tokens_per_s", ",.0f", 10),
    ("tok/s/GPU", "tokens_per_s_per_gpu", ",.0f", 10),
    ("vs none", "ratio_to_none", ".2f", 7),
    ("peak GPU GiB", "peak_gpu_gib", ".2f", 12),
    ("GiB saved", "gib_saved", ".2f", 9),
    ("exposed wait s", "exposed_wait_s", ".3f", 14),
)


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table, one line per configuration (failed ones say why)."""
    header = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, _, _, w) in enumerate(COLUMNS))
    lines = [header, "-" * len(header)]
    for row in rows:
        if row.get("error"):
            head = "  ".join((row["label"].ljust(28), str(row["tokens_per_step"]).rjust(11)))
            why = row["error"].strip()
            lines.append(f"{head}  {why[:120] if why.startswith('skipped') else 'failed: ' + why[:120]}")
            continue
        cells = []
        for i, (_, key, fmt, width) in enumerate(COLUMNS):
            text = row[key] if i == 0 else _cell(row.get(key), fmt)
            if key == "ratio_to_none" and text != "-":
                text += "x"
            cells.append(text.ljust(width) if i == 0 else text.rjust(width))
        lines.append("  ".join(cells))
    return "\n".join(lines)


def summary_lines(rows: list[dict], bandwidth_gbs: Optional[float] = None) -> list[str]:
    """Short conclusions per budget: full vs none, vs each reference, against the targets."""
    out = []
    if bandwidth_gbs is not None:
        out.append(f"host memory bandwidth (read+write): {bandwidth_gbs:.1f} GB/s")
    ok = {(r["mode"], r["tokens_per_step"]): r for r in rows if not r.get("error")}
    for tokens in sorted({r["tokens_per_step"] for r in rows}):
        full, none = ok.get(("full", tokens)), ok.get(("none", tokens))
        if full is None or none is None:
            out.append(f"{tokens} tokens/step: full or none missing, no comparison")
            continue
        line = f"{tokens} tokens/step: full {full['ratio_to_none']:.2f}x none step time"
        if full.get("gib_saved") is not None:
            line += f", {full['gib_saved']:.2f} GiB less peak GPU memory"
        diff = full.get("max_loss_diff_vs_none")
        if diff is not None:
            line += (", loss not finite where none's is (diverged)" if math.isnan(diff)
                     else f", loss within {diff:.4f} of none")
        for ref in ("torchao", "fsdp_cpu"):
            r = ok.get((ref, tokens))
            if r is not None:
                line += "; " + _speed_phrase(full["step_s"], r["step_s"], LABELS[ref])
        out.append(line)
        out.extend(_target_lines(tokens, full, [ok.get((m, tokens)) for m in ("torchao", "fsdp_cpu")]))
    return out


def _speed_phrase(ours_s: float, theirs_s: float, name: str) -> str:
    if ours_s == theirs_s:
        return f"as fast as {name}"
    if ours_s < theirs_s:
        return f"{theirs_s / ours_s:.2f}x faster than {name}"
    return f"{ours_s / theirs_s:.2f}x slower than {name}"


def _target_lines(tokens: int, full: dict, refs: list[Optional[dict]]) -> list[str]:
    lines = []
    if tokens in TARGET_RATIO:
        bound = TARGET_RATIO[tokens]
        held = full["ratio_to_none"] <= bound
        lines.append(f"  target full <= {bound}x none: {'held' if held else 'NOT held'} ({full['ratio_to_none']:.3f}x)")
    if tokens in TARGET_SAVED_GIB and full.get("gib_saved") is not None:
        bound = TARGET_SAVED_GIB[tokens]
        held = full["gib_saved"] >= bound
        lines.append(f"  target >= {bound} GiB saved: {'held' if held else 'NOT held'} ({full['gib_saved']:.2f} GiB)")
    present = [r for r in refs if r is not None]
    if present:
        held = all(full["step_s"] < r["step_s"] for r in present)
        lines.append(f"  target full faster than every reference row: {'held' if held else 'NOT held'}")
    return lines


def build_report(results: list[dict], *, bandwidth_gbs: Optional[float], meta: dict) -> dict:
    return {"meta": meta, "host_bandwidth_gbs": bandwidth_gbs,
            "results": results, "rows": summarize(results)}


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def plot(report: dict, path: str) -> bool:
    """Step time and peak GPU memory per mode, one bar group per budget. False
    when matplotlib is missing; ValueError when no configuration ran."""
    rows = [r for r in report["rows"] if not r.get("error")]
    if not rows:
        raise ValueError("no configuration ran (each failed or was skipped): nothing to plot")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    budgets = sorted({r["tokens_per_step"] for r in rows})
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(modes))
    for ax, key, title in ((axes[0], "step_s", "step time (s)"), (axes[1], "peak_gpu_gib", "peak GPU memory (GiB)")):
        for i, mode in enumerate(modes):
            values = [next((r.get(key) or 0.0 for r in rows if r["mode"] == mode and r["tokens_per_step"] == b),
                           0.0) for b in budgets]  # no bar where nothing was measured (CPU runs: no GPU peak)
            ax.bar([j + i * width for j in range(len(budgets))], values, width, label=LABELS[mode])
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(budgets))])
        ax.set_xticklabels([f"{b} tok/step" for b in budgets])
        ax.set_title(title)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(modes), fontsize=8, frameon=False)
    meta = report.get("meta", {})
    fig.suptitle(f"{meta.get('gpu', '?')} x{meta.get('n_gpus', 1)}, {meta.get('cpu_cores', '?')} CPU cores, "
                 f"torch {meta.get('torch', '?')}, {meta.get('date', '')}", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # room for the legend under the axes
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
