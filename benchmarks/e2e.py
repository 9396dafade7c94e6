# End-to-end GPU benchmark of the offload modes against existing offload systems.
#
# Scope: trains the model of examples/train_fsdp.py (imported, not copied) for each
# mode × tokens-per-step budget, each configuration in a fresh subprocess (clean peak
# memory statistics, no pinned memory left over from the previous one): `warmup` steps,
# then the median of `steps` timed steps. Modes:
#   none, optimizer, full   cpu_offload through the example's own code path
#   torchao                 torchao.optim.CPUOffloadOptimizer (fused CPU AdamW,
#                           offload_gradients=True) on the plain, unsharded model under
#                           bf16 autocast: it supports single-GPU training only
#   fsdp_cpu                FSDP2's CPUOffloadPolicy with torch's fused CPU AdamW
# Measures host memory bandwidth once, prints one table and a summary, writes JSON
# (--json) and a PNG plot (--plot, when matplotlib is importable).
#
#   python benchmarks/e2e.py --json e2e.json --plot e2e.png
#
# The report code (summarize, format_table, summary_lines) is pure and tested on fake
# measurements in tests/test_examples.py. Non-goals: multi-node runs, real data.

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_fsdp.py"
RESULT_TAG = "E2E_RESULT "
MODES = ("none", "optimizer", "full", "torchao", "fsdp_cpu")
LABELS = {
    "none": "none",
    "optimizer": "optimizer",
    "full": "full",
    "torchao": "torchao CPUOffloadOptimizer",
    "fsdp_cpu": "FSDP2 CPUOffloadPolicy",
}
# Targets this benchmark is judged by (1x H200, d_model 2048 / 16 layers, seq 2048).
# (tokens/step, full step time at most this × none) and the GiB full must save vs none.
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
    if not a or not b:
        return None
    n = min(len(a), len(b))
    return max(abs(x - y) for x, y in zip(a[:n], b[:n]))


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
            lines.append(f"{head}  failed: {row['error'].strip()[:120]}")
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
        if full.get("max_loss_diff_vs_none") is not None:
            line += f", loss within {full['max_loss_diff_vs_none']:.4f} of none"
        for ref in ("torchao", "fsdp_cpu"):
            r = ok.get((ref, tokens))
            if r is not None:
                line += "; " + _speed_phrase(full["step_s"], r["step_s"], LABELS[ref])
        out.append(line)
        out.extend(_target_lines(tokens, full, [ok.get((m, tokens)) for m in ("torchao", "fsdp_cpu")]))
    return out


def _speed_phrase(ours_s: float, theirs_s: float, name: str) -> str:
    if ours_s <= theirs_s:
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
    when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in report["rows"] if not r.get("error")]
    budgets = sorted({r["tokens_per_step"] for r in rows})
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(modes))
    for ax, key, title in ((axes[0], "step_s", "step time (s)"), (axes[1], "peak_gpu_gib", "peak GPU memory (GiB)")):
        for i, mode in enumerate(modes):
            values = [next((r[key] for r in rows if r["mode"] == mode and r["tokens_per_step"] == b), 0.0)
                      for b in budgets]
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


# --------------------------------------------------------------- measurement


def host_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> tuple[float, str]:
    """Host memory bandwidth in GB/s counting bytes read plus bytes written, and how
    it was measured: cpu_offload.bench's probe (a read-modify-write stream on the
    library's own worker threads) when present, else the best of `repeats` torch
    copies of `nbytes` (torch parallelises the copy over its threads)."""
    try:
        from cpu_offload.bench import measure_bandwidth
    except ImportError:
        measure_bandwidth = None
    if measure_bandwidth is not None:
        return measure_bandwidth(nbytes // 4, repeats), "cpu_offload.bench.measure_bandwidth"
    import torch
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst's pages
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9, "torch copy"


def exposed_wait(stats: Optional[dict]) -> Optional[float]:
    """The seconds step() blocked, from the offload optimizer's stats()."""
    if not stats:
        return None
    if isinstance(stats.get("step_blocked_s"), (int, float)):  # FullCPUOffloadOptimizer's name
        return float(stats["step_blocked_s"])
    for word in ("exposed", "blocked", "wait"):
        for key, value in stats.items():
            if word in key and isinstance(value, (int, float)):
                return float(value)
    return None


def _load_example():
    spec = importlib.util.spec_from_file_location("train_fsdp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_fsdp"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def _build(ex, mode: str, mcfg, device, cfg: dict):
    """Model, optimizer and autocast dtype for one mode."""
    import torch
    lr, wd = cfg["lr"], cfg["weight_decay"]
    if mode in ("none", "optimizer", "full"):
        model = ex.build_model(mcfg, device, seed=cfg["seed"])
        opt = ex.build_optimizer(model, name="adamw", lr=lr, weight_decay=wd, offload=mode, grad_accum=1)
        return model, opt, None
    if mode == "torchao":
        from torchao.optim import CPUOffloadOptimizer
        # NOTE: CPUOffloadOptimizer keys its host copies by the GPU parameter, so it
        # cannot take FSDP2's DTensor shards: the model stays unsharded (fp32 weights)
        # and bf16 compute comes from autocast, the setting torchao documents.
        model = ex.build_model(mcfg, device, fsdp=False, seed=cfg["seed"])
        opt = CPUOffloadOptimizer(ex.param_groups(model, wd), torch.optim.AdamW, offload_gradients=True,
                                  fused=True, lr=lr, betas=(0.9, 0.95), eps=1e-8)
        return model, opt, torch.bfloat16
    if mode == "fsdp_cpu":
        from torch.distributed.fsdp import CPUOffloadPolicy
        model = ex.build_model(mcfg, device, offload_policy=CPUOffloadPolicy(pin_memory=True), seed=cfg["seed"])
        opt = torch.optim.AdamW(ex.param_groups(model, wd), lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
        return model, opt, None
    raise ValueError(f"unknown mode {mode!r}")


def worker(cfg: dict) -> dict:
    """One configuration, in its own process (or torchrun group): returns its result."""
    import torch
    import torch.distributed as dist
    ex = _load_example()
    device = ex.pick_device(cfg["device"])
    ex.init_distributed(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg["mode"] == "torchao" and world > 1:
        raise RuntimeError("torchao's CPUOffloadOptimizer supports single-GPU training only")
    mcfg = ex.ModelConfig(**cfg["model"])
    t0 = time.perf_counter()
    model, opt, amp = _build(ex, cfg["mode"], mcfg, device, cfg)
    setup_s = time.perf_counter() - t0
    n_steps = cfg["warmup"] + cfg["steps"]
    sched = ex.make_scheduler(opt, lr=cfg["lr"], warmup=cfg["warmup"], total=n_steps, min_ratio=0.1)
    seq = mcfg.max_seq_len
    per_rank = cfg["tokens_per_step"] // (seq * world)
    settings = ex.StepSettings(batch_size=per_rank, seq_len=seq, grad_accum=1,
                               vocab_size=mcfg.vocab_size, seed=cfg["seed"], amp_dtype=amp)
    records = []
    for rec in ex.run_steps(model, opt, sched, settings, first_step=0, last_step=n_steps, device=device):
        records.append(rec)
        if rank == 0:
            print(f"  [{cfg['mode']} {cfg['tokens_per_step']}] " + ex.format_step(rec, n_steps), flush=True)
    timed = records[cfg["warmup"]:]
    waits = [w for w in (exposed_wait(r["offload"]) for r in timed) if w is not None]
    peaks = [r["peak_gpu_gib"] for r in records if r["peak_gpu_gib"] is not None]
    result = {
        "mode": cfg["mode"], "tokens_per_step": cfg["tokens_per_step"], "n_gpus": world,
        "step_times_s": [r["step_time_s"] for r in timed], "losses": [r["loss"] for r in records],
        "peak_gpu_gib": max(peaks) if peaks else None,
        "exposed_wait_s": statistics.median(waits) if waits else None,
        "offload_stats": timed[-1]["offload"] if timed else None,
        "n_params": ex.count_parameters(model), "setup_s": setup_s,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "error": None,
    }
    if hasattr(opt, "close"):
        opt.close()
    dist.destroy_process_group()
    return result


def _subprocess_cmd(cfg: dict, nproc: int) -> list[str]:
    me = [str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
    if nproc <= 1:
        return [sys.executable, *me]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *me]


def run_config(cfg: dict, *, nproc: int, timeout_s: float) -> dict:
    """Run one configuration in a fresh process; echo its output; parse its result line."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    if nproc > 1 and "OMP_NUM_THREADS" not in env:
        # NOTE: torchrun would set OMP_NUM_THREADS=1, starving the CPU optimizer steps
        # of the reference rows (torch's CPU AdamW); give each rank its share instead.
        env["OMP_NUM_THREADS"] = str(max(1, _cpu_count() // nproc))
    proc = subprocess.Popen(_subprocess_cmd(cfg, nproc), env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    tail, result = [], None
    try:
        for line in proc.stdout:
            if line.startswith(RESULT_TAG):
                result = json.loads(line[len(RESULT_TAG):])
                continue
            print(line, end="", flush=True)
            tail = (tail + [line])[-30:]
        proc.wait()
    finally:
        timer.cancel()
    if result is None:
        why = "timed out" if proc.returncode in (-9, 137) else f"exit code {proc.returncode}"
        last = next((l.strip() for l in reversed(tail) if l.strip()), "")
        result = {"mode": cfg["mode"], "tokens_per_step": cfg["tokens_per_step"],
                  "error": f"{why}: {last}", "log_tail": "".join(tail)}
    return result


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(results: list[dict], nproc: int) -> dict:
    """Where the numbers come from. NOTE: the GPU name is the workers' report: this
    process never initialises CUDA, so it holds no GPU memory while they run."""
    import torch
    gpu = next((r["gpu"] for r in results if r.get("gpu")), "unknown (no configuration ran)")
    return {"gpu": gpu, "n_gpus": nproc, "cpu_cores": _cpu_count(), "cpu": _cpu_model(),
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.date.today().isoformat()}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="End-to-end benchmark of the offload modes.")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--tokens", default="8192,32768", help="comma list of tokens per step (all GPUs)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--n-layers", type=int, default=16)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--ffn-dim", type=int, default=5632)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--nproc-per-node", type=int, default=1, help="GPUs per configuration (torchrun)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    p.add_argument("--worker", metavar="CONFIG_JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 5:
        p.error("--steps: at least 5 timed steps")
    return args


def configs(args: argparse.Namespace) -> list[dict]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    budgets = [int(t) for t in args.tokens.split(",") if t.strip()]
    for t in budgets:
        if t % (args.seq_len * args.nproc_per_node):
            raise SystemExit(f"--tokens {t} is not a multiple of seq_len x GPUs = {args.seq_len * args.nproc_per_node}")
    model = {"vocab_size": args.vocab_size, "d_model": args.d_model, "n_layers": args.n_layers,
             "n_heads": args.n_heads, "ffn_dim": args.ffn_dim, "max_seq_len": args.seq_len}
    common = {"model": model, "warmup": args.warmup, "steps": args.steps, "lr": args.lr,
              "weight_decay": args.weight_decay, "seed": args.seed, "device": args.device}
    # Budgets outer, modes inner, so a short run yields whole comparisons early.
    return [dict(common, mode=m, tokens_per_step=t) for t in budgets for m in modes]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        result = worker(json.loads(args.worker))
        if result is not None and int(os.environ.get("RANK", "0")) == 0:
            print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    plan = configs(args)
    bandwidth, how = host_bandwidth_gbs()
    print(f"host memory bandwidth (read+write): {bandwidth:.1f} GB/s ({how})", flush=True)
    results = []
    for cfg in plan:
        print(f"== {cfg['mode']} @ {cfg['tokens_per_step']} tokens/step", flush=True)
        results.append(run_config(cfg, nproc=args.nproc_per_node, timeout_s=args.timeout))
    meta = environment(results, args.nproc_per_node)
    meta.update(model=plan[0]["model"] if plan else None, warmup=args.warmup, steps=args.steps,
                bandwidth_probe=how)
    report = build_report(results, bandwidth_gbs=bandwidth, meta=meta)
    print()
    print(f"{meta['gpu']} x{meta['n_gpus']} | {meta['cpu_cores']} CPU cores ({meta['cpu']}) | "
          f"torch {meta['torch']} | {meta['date']}")
    print(format_table(report["rows"]))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {args.plot}" if plot(report, args.plot) else "matplotlib not importable: no plot")
    print()
    for line in summary_lines(report["rows"], bandwidth):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
