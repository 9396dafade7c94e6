# Capacity benchmark: the largest Llama-shaped model each mode trains on one device.
#
# Scope: for each mode (none, full, full_bf16) and each configuration from smallest to
# largest, train 3 steps of the model of examples/llama_model.py at 8K tokens per step,
# each configuration in a fresh subprocess, and record step time, tokens/s, peak GPU
# memory and peak host RSS, or "does not fit" (GPU out of memory, the host RAM check's
# MemoryError, a process killed by the kernel). A mode stops at its first configuration
# that does not fit (or times out): the larger ones are not tried. Each full-offload row
# also gets its configuration's GPU floor (the floor mode's step), its median CPU kernel
# time per step and its efficiency, max(floor, kernel) / step: 1 is a step that costs only
# the larger of its two real costs. Prints a table, writes JSON (--json) and a PNG plot
# (--plot, when matplotlib is importable).
#
#   python benchmarks/capacity.py --json capacity.json --plot capacity.png --time-limit-s 460
#
# --profile times each step's phases instead, synchronising the GPU between them (forward;
# backward, with the pipeline's waits inside it; the tail in step()): the breakdown of
# docs/full-offload-profile.md.
#
# Modes:
#   floor       the GPU floor: the model as the full modes keep it on the GPU (bf16), every
#               gradient dropped as soon as it is final (after FSDP2's reduce-scatter), no
#               optimizer: forward + backward and nothing else
#   none        torch AdamW on the device: FSDP2 with bf16 mixed precision, fp32 weights,
#               gradients and moments on the GPU (16 B per parameter plus activations)
#   full        offload_optimizer(offload="full"): bf16 weights on the GPU; fp32 masters and
#               moments in host RAM (12 B per parameter)
#   full_bf16   the same with state_dtype=torch.bfloat16 (8 B per parameter of host RAM)
#   full_auto, full_bf16_auto   the same with gpu_state="auto": at construction parameters
#               spread over the model whose state on the GPU makes the rest fit in host RAM;
#               after 3 windows, as much state as the GPU has room for. These modes run 3
#               more steps and time those after the split settled
#   full_overlap, full_bf16_overlap   full / full_bf16 with overlap_forward=model: the next
#               forward starts while the CPU steps the last chunks
#   full_auto_overlap, full_bf16_auto_overlap   both options
#   full_stream, full_bf16_stream, full_overlap_stream, full_bf16_overlap_stream   the modes
#               above with stream_share=--stream-share: the GPU steps that share of the host
#               state, which crosses PCIe each step
#
# Configurations (ModelConfig of examples/llama_model.py; vocab 32000, untied head, no GQA
# since the example's attention has none, so the counts differ a little from Llama's own):
#
#   name   d_model  n_layers  n_heads  ffn_dim   parameters
#   1b        2048        16       16     5632   0.95 B  (the e2e benchmark's model)
#   3b        3072        26       24     8192   3.14 B
#   8b        4096        32       32    14336   8.05 B
#   14b       5120        44       40    13824  14.28 B
#   20b       6144        44       48    16384  20.33 B
#   21b       6144        46       48    16384  21.23 B
#   22b       6144        48       48    16384  22.14 B
#   tiny-a..c   64      2..4        4      128   CPU plumbing checks (vocab 256)
#
# NOTE: no full fp32 copy of a model ever exists in host or GPU memory: the model is built
# on the meta device and materialised one parameter at a time on the device, directly in the
# dtype its mode keeps there (llama_model.materialize_: bf16 for the full modes, fp32 for
# none, whose optimizer needs fp32 weights), then wrapped in per-block activation
# checkpointing (torch.utils.checkpoint, non-reentrant) and sharded with FSDP2 as in
# examples/train_fsdp.py. Each mode gets an even share of the time left when it starts (what
# an earlier mode left over carries forward). The workers run with
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless it is set. Non-goals: several
# GPUs, real data, tuning each configuration's batch shape.

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import resource
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # worker_process, also when loaded by path
from cli_checks import check_output_paths  # noqa: E402
from worker_process import run_worker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RESULT_TAG = "CAPACITY_RESULT "
GIB = float(1 << 30)

MODES = ("floor", "none", "full", "full_bf16", "full_overlap", "full_bf16_overlap", "full_auto", "full_bf16_auto",
         "full_auto_overlap", "full_bf16_auto_overlap", "full_stream", "full_bf16_stream", "full_overlap_stream",
         "full_bf16_overlap_stream")
FULL_MODES = MODES[2:]
DEFAULT_MODES = ("floor", "none", "full", "full_bf16", "full_auto", "full_bf16_auto")
AUTO_MODES = ("full_auto", "full_bf16_auto", "full_auto_overlap", "full_bf16_auto_overlap")
AUTO_WINDOWS = 3  # cpu_offload/_full/device_state.py: windows before the split settles
# mode -> (offload=, state_dtype, dtype the model is materialised in on the device)
MODE_OPTIONS = {"floor": (None, None, "bfloat16"), "none": ("none", "float32", "float32"),
                "full": ("full", "float32", "bfloat16"), "full_bf16": ("full", "bfloat16", "bfloat16"),
                "full_auto": ("full", "float32", "bfloat16"), "full_bf16_auto": ("full", "bfloat16", "bfloat16"),
                "full_overlap": ("full", "float32", "bfloat16"),
                "full_bf16_overlap": ("full", "bfloat16", "bfloat16"),
                "full_auto_overlap": ("full", "float32", "bfloat16"),
                "full_bf16_auto_overlap": ("full", "bfloat16", "bfloat16"),
                "full_stream": ("full", "float32", "bfloat16"), "full_bf16_stream": ("full", "bfloat16", "bfloat16"),
                "full_overlap_stream": ("full", "float32", "bfloat16"),
                "full_bf16_overlap_stream": ("full", "bfloat16", "bfloat16")}
_LLAMA = dict(vocab_size=32000)
CONFIGS = {
    "1b": dict(_LLAMA, d_model=2048, n_layers=16, n_heads=16, ffn_dim=5632),
    "3b": dict(_LLAMA, d_model=3072, n_layers=26, n_heads=24, ffn_dim=8192),
    "8b": dict(_LLAMA, d_model=4096, n_layers=32, n_heads=32, ffn_dim=14336),
    "14b": dict(_LLAMA, d_model=5120, n_layers=44, n_heads=40, ffn_dim=13824),
    "20b": dict(_LLAMA, d_model=6144, n_layers=44, n_heads=48, ffn_dim=16384),
    "21b": dict(_LLAMA, d_model=6144, n_layers=46, n_heads=48, ffn_dim=16384),
    "22b": dict(_LLAMA, d_model=6144, n_layers=48, n_heads=48, ffn_dim=16384),
    "tiny-a": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, ffn_dim=128),
    "tiny-b": dict(vocab_size=256, d_model=64, n_layers=3, n_heads=4, ffn_dim=128),
    "tiny-c": dict(vocab_size=256, d_model=64, n_layers=4, n_heads=4, ffn_dim=128),
}
CONFIG_SETS = {"llama": ("1b", "3b", "8b", "14b", "20b", "21b", "22b"), "tiny": ("tiny-a", "tiny-b", "tiny-c")}

OK, NO_FIT, TIMED_OUT, ERROR, NOT_TRIED = "ok", "does not fit", "timed out", "error", "not tried"


def format_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def n_params(model: dict) -> int:
    """Parameters of a ModelConfig's keyword dict (untied head), without building it."""
    d, f, v, n = model["d_model"], model["ffn_dim"], model["vocab_size"], model["n_layers"]
    block = 4 * d * d + 3 * d * f + 2 * d  # qkv + proj, SwiGLU, two RMSNorms
    return n * block + d + v * d * (1 if model.get("tie_embeddings") else 2)


# ------------------------------------------------------------------- the worker


def _load_example():
    sys.path.insert(0, str(EXAMPLES))  # train_fsdp imports llama_model from beside it
    spec = importlib.util.spec_from_file_location("train_fsdp", EXAMPLES / "train_fsdp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_fsdp"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def build_checkpointed_model(ex, mcfg, device, *, dtype, seed: int):
    """The example's model built on the meta device, materialised on `device` in `dtype`
    (llama_model.materialize_), each block under non-reentrant activation checkpointing,
    sharded with FSDP2 as the example shards it (train_fsdp.shard_model) under its bf16 policy."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.utils.checkpoint import checkpoint

    import llama_model

    class Checkpointed(nn.Module):
        def __init__(self, block: nn.Module):
            super().__init__()
            self.block = block

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = llama_model.Transformer(mcfg)
    llama_model.materialize_(model, device, dtype)
    model.blocks = nn.ModuleList(Checkpointed(block) for block in model.blocks)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ex.shard_model(model, mesh=mesh, mp_policy=mp)
    return model


def _does_not_fit(exc: BaseException) -> bool:
    import torch
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return "out of memory" in str(exc).lower()  # e.g. a pinned host allocation that failed


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss is in KiB on Linux


def worker(cfg: dict) -> dict:
    """One mode x configuration in its own process: its result, OOM included."""
    ex = _load_example()
    device = ex.pick_device(cfg["device"])
    ex.init_distributed(device)
    base = {"mode": cfg["mode"], "config": cfg["config"], "n_params": n_params(cfg["model"]),
            "tokens_per_step": cfg["tokens_per_step"], "pid": os.getpid()}
    try:
        return dict(base, **_train(ex, cfg, device))
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the parent decides
        status = NO_FIT if _does_not_fit(exc) else ERROR
        if status == ERROR:  # the whole story on stderr: the table keeps one line
            traceback.print_exc()
        message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        return dict(base, status=status, error=message[:500], peak_host_rss_gib=_peak_rss_gib())


def floor_optimizer(model, lr: float):
    """The floor mode's optimizer: every gradient is dropped by a post-accumulate-grad hook
    (where full offload takes it), so SGD with lr 0 finds none and steps nothing; the
    scheduler and the loop run as for the other modes."""
    import torch
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    return torch.optim.SGD(model.parameters(), lr=lr)


def profiled_steps(ex, model, opt, sched, settings, *, steps: int, device):
    """The loop of train_fsdp.run_steps with the GPU synchronised between phases: yields
    its records plus ``forward_s``, ``backward_s`` (the pipeline's waits inside it) and
    ``tail_s`` (step(), zero_grad(), the scheduler, until the GPU is idle).
    NOTE: a sync between phases hides nothing here: the next phase needs the last one's
    results (backward the forward's activations, the next forward the new weights)."""
    import torch
    import torch.nn.functional as F

    def now():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    for step in range(steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        inputs, targets = ex.synthetic_batch(step, 0, rank=0, world=1, batch_size=settings.batch_size,
                                             seq_len=settings.seq_len, vocab_size=settings.vocab_size,
                                             seed=settings.seed, device=device)
        t0 = now()
        loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
        t1 = now()
        loss.backward()
        t2 = now()
        lr = opt.param_groups[0]["lr"]
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        loss_value = loss.item()
        t3 = now()
        yield {"step": step + 1, "loss": loss_value, "lr": float(lr), "step_time_s": t3 - t0,
               "tokens_per_step": settings.batch_size * settings.seq_len,
               "tokens_per_s": settings.batch_size * settings.seq_len / (t3 - t0),
               "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
               "offload": dict(opt.stats()) if callable(getattr(opt, "stats", None)) else None,
               "forward_s": t1 - t0, "backward_s": t2 - t1, "tail_s": t3 - t2}


PROFILE_KEYS = ("forward_s", "backward_s", "tail_s")
OFFLOAD_KEYS = ("kernel_s", "slot_wait_s", "grad_wait_s", "h2d_slot_wait_s", "step_blocked_s", "worker_overhead_s")


def _median_after_first(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values[1:]) if len(values) > 1 else values[0]  # the first step warms up


def _train(ex, cfg: dict, device) -> dict:
    import torch
    if cfg["config"] in cfg.get("force_oom", ()):
        raise MemoryError(f"forced by --force-oom {cfg['config']}")
    offload, state_dtype, param_dtype = MODE_OPTIONS[cfg["mode"]]
    mcfg = ex.ModelConfig(**cfg["model"], max_seq_len=cfg["seq_len"])
    t0 = time.perf_counter()
    model = build_checkpointed_model(ex, mcfg, device, dtype=getattr(torch, param_dtype), seed=cfg["seed"])
    if offload is None:
        opt = floor_optimizer(model, cfg["lr"])
    else:
        opt = ex.build_optimizer(model, name="adamw", lr=cfg["lr"], weight_decay=0.1, offload=offload, grad_accum=1,
                                 state_dtype=getattr(torch, state_dtype),
                                 gpu_state="auto" if cfg["mode"] in AUTO_MODES else None,
                                 overlap_forward="_overlap" in cfg["mode"],
                                 stream_share=cfg["stream_share"] if cfg["mode"].endswith("_stream") else 0.0)
    setup_s = time.perf_counter() - t0
    sched = ex.make_scheduler(opt, lr=cfg["lr"], warmup=1, total=cfg["steps"], min_ratio=0.1)
    settings = ex.StepSettings(batch_size=cfg["tokens_per_step"] // cfg["seq_len"], seq_len=cfg["seq_len"],
                               grad_accum=1, vocab_size=mcfg.vocab_size, seed=cfg["seed"])
    settled = AUTO_WINDOWS if cfg["mode"] in AUTO_MODES else 0  # steps before the timed ones begin
    n_steps = cfg["steps"] + settled
    if cfg.get("profile"):
        steps = profiled_steps(ex, model, opt, sched, settings, steps=n_steps, device=device)
    else:
        steps = ex.run_steps(model, opt, sched, settings, first_step=0, last_step=n_steps, device=device)
    records = []
    for rec in steps:
        records.append(rec)
        print(f"  [{cfg['mode']} {cfg['config']}] " + ex.format_step(rec, n_steps), flush=True)
    if hasattr(opt, "close"):
        opt.close()
    all_times = [r["step_time_s"] for r in records]
    records = records[settled:]
    times = [r["step_time_s"] for r in records]
    step_s = _median_after_first(times)
    peaks = [r["peak_gpu_gib"] for r in records if r["peak_gpu_gib"] is not None]
    out = {"status": OK, "error": None, "step_times_s": all_times, "step_s": step_s,
           "tokens_per_s": cfg["tokens_per_step"] / step_s, "losses": [r["loss"] for r in records],
           "peak_gpu_gib": max(peaks) if peaks else None, "peak_host_rss_gib": _peak_rss_gib(),
           "setup_s": setup_s, "n_params": ex.count_parameters(model),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    last = records[-1]["offload"] or {}
    out["gpu_state_gib"] = last.get("gpu_state_bytes", 0) / GIB if last else None
    for key in OFFLOAD_KEYS:
        out[key] = _median_after_first([(r["offload"] or {}).get(key) for r in records])
    if cfg.get("profile"):
        out["profile"] = {key: _median_after_first([r[key] for r in records]) for key in PROFILE_KEYS}
    return out


# ------------------------------------------------------------------- the parent


def run_config(cfg: dict, *, timeout_s: float) -> dict:
    """Run one mode x configuration in a fresh process; echo its output; parse its result."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # less fragmentation near the limit
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
    run = run_worker(cmd, env=env, timeout_s=timeout_s, tag=RESULT_TAG, tail_lines=20)
    result, tail = run.result, run.tail
    if result is not None:
        return result
    base = {"mode": cfg["mode"], "config": cfg["config"], "n_params": n_params(cfg["model"]),
            "tokens_per_step": cfg["tokens_per_step"], "log_tail": "".join(tail)}
    if run.timed_out:
        return dict(base, status=TIMED_OUT, error=f"timed out after {timeout_s:.0f} s")
    if run.returncode == -signal.SIGKILL:  # not ours: the kernel's out-of-memory killer, most likely
        return dict(base, status=NO_FIT, error="killed (SIGKILL): host out of memory, most likely")
    last = next((text.strip() for text in reversed(tail) if text.strip()), "")
    return dict(base, status=ERROR, error=f"exit code {run.returncode}: {last}"[:500])


def measure(plan: dict, *, time_limit_s: float, run: Callable[..., dict] = run_config,
            clock: Callable[[], float] = time.monotonic) -> list[dict]:
    """Run `plan` ({mode: [cfg, ...] smallest first}) under the time limit: each mode gets an
    even share of what is left when it starts; a mode stops at its first failure."""
    start = clock()
    rows = []
    modes = list(plan)
    for i, mode in enumerate(modes):
        mode_end = clock() + (time_limit_s - (clock() - start)) / (len(modes) - i)
        stop = None
        for cfg in plan[mode]:
            base = {"mode": mode, "config": cfg["config"], "n_params": n_params(cfg["model"]),
                    "tokens_per_step": cfg["tokens_per_step"]}
            left = mode_end - clock()
            if stop is None and left <= 1.0:
                stop = "the time limit was reached"
            if stop is not None:
                rows.append(dict(base, status=NOT_TRIED, error=stop))
                continue
            print(f"== {mode} {cfg['config']} ({format_params(n_params(cfg['model']))} parameters, "
                  f"{left:.0f} s left for this mode)", flush=True)
            row = run(cfg, timeout_s=left)
            rows.append(row)
            if row["status"] != OK:
                print(f"   {row['status']}: {row.get('error')}", flush=True)
                stop = f"{cfg['config']}: {row['status']}"
    return rows


def add_efficiency(rows: list[dict]) -> None:
    """Give each full-offload row its configuration's GPU floor and its efficiency,
    max(floor, CPU kernel) / step (None where a figure is missing)."""
    floors = {r["config"]: r["step_s"] for r in rows if r["mode"] == "floor" and r["status"] == OK}
    for r in rows:
        if r["mode"] not in FULL_MODES or r["status"] != OK:
            continue
        r["floor_s"] = floors.get(r["config"])
        bound = max([x for x in (r["floor_s"], r.get("kernel_s")) if x is not None], default=None)
        r["efficiency"] = None if bound is None or r["floor_s"] is None else bound / r["step_s"]


def largest(rows: list[dict]) -> dict:
    """mode -> the largest configuration it trained (None when none did)."""
    out = {}
    for r in rows:
        out.setdefault(r["mode"], None)
        if r["status"] == OK and (out[r["mode"]] is None or r["n_params"] > out[r["mode"]]["n_params"]):
            out[r["mode"]] = {"config": r["config"], "n_params": r["n_params"]}
    return out


def _note(r: dict) -> str:
    if r["status"] != OK:
        return (r.get("error") or "")[:90]
    return f"gpu_state {r['gpu_state_gib']:.1f} GiB" if r.get("gpu_state_gib") else ""


def format_table(rows: list[dict]) -> str:
    head = (f"{'mode':<10} {'config':<7} {'params':>8} {'status':<13} {'step s':>8} {'tokens/s':>10} "
            f"{'floor s':>8} {'kernel s':>8} {'effic.':>6} {'peak GPU GiB':>12} {'peak RSS GiB':>12}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        ok = r["status"] == OK
        def num(key, fmt, r=r, ok=ok):
            return format(r[key], fmt) if ok and r.get(key) is not None else "-"
        lines.append(f"{r['mode']:<10} {r['config']:<7} {format_params(r['n_params']):>8} {r['status']:<13} "
                     f"{num('step_s', '.3f'):>8} {num('tokens_per_s', ',.0f'):>10} {num('floor_s', '.3f'):>8} "
                     f"{num('kernel_s', '.3f'):>8} {num('efficiency', '.2f'):>6} {num('peak_gpu_gib', '.2f'):>12} "
                     f"{num('peak_host_rss_gib', '.2f'):>12}  {_note(r)}")
        if ok and r.get("profile"):
            prof = r["profile"]
            waits = ", ".join(f"{k} {r[k]:.3f}" for k in OFFLOAD_KEYS if r.get(k) is not None)
            lines.append(f"{'':<10} profile: forward {prof['forward_s']:.3f} s, backward {prof['backward_s']:.3f} s, "
                         f"tail {prof['tail_s']:.3f} s" + (f"; {waits}" if waits else ""))
    return "\n".join(lines)


def plot(report: dict, path: str) -> bool:
    """Tokens/s and peak memory against model size per mode; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    keys = (("tokens_per_s", "tokens/s"), ("peak_gpu_gib", "peak GPU memory (GiB)"),
            ("peak_host_rss_gib", "peak host RSS (GiB)"))
    for ax, (key, title) in zip(axes, keys):
        for mode in dict.fromkeys(r["mode"] for r in report["rows"]):
            ok = [r for r in report["rows"] if r["mode"] == mode and r["status"] == OK and r.get(key) is not None]
            ax.plot([r["n_params"] / 1e9 for r in ok], [r[key] for r in ok], marker="o", label=mode)
        ax.set_xlabel("parameters (B)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    meta = report["meta"]
    fig.suptitle(f"largest model trained at {meta['tokens_per_step']} tokens/step: {meta['device']}, "
                 f"{meta['cpu_cores']} CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _host_ram_gib() -> Optional[float]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError):
        return None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="The largest Llama-shaped model each mode trains on one device.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--configs", default="llama",
                   help=f"a set ({', '.join(CONFIG_SETS)}) or a comma list of {', '.join(CONFIGS)}, smallest first")
    p.add_argument("--steps", type=int, default=3,
                   help="training steps per configuration, >= 2: the step time is the median after the first")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--time-limit-s", type=float, default=460.0, help="for the whole run, all modes")
    p.add_argument("--stream-share", type=float, default=0.3,
                   help="stream_share of the _stream modes (0 to 1, default 0.3)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--profile", action="store_true",
                   help="time forward, backward and the tail separately (synchronising between them)")
    p.add_argument("--force-oom", default="", metavar="NAMES",
                   help="comma list of configurations whose worker raises MemoryError (tests the reporting)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    p.add_argument("--worker", metavar="CONFIG_JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (the first step warms up and is left out of the step time), got {args.steps}")
    if args.seq_len < 1:
        p.error(f"--seq-len must be >= 1, got {args.seq_len}")
    if not 0.0 <= args.stream_share <= 1.0:
        p.error(f"--stream-share must be from 0 to 1, got {args.stream_share}")
    if args.tokens < args.seq_len or args.tokens % args.seq_len:
        p.error(f"--tokens {args.tokens} must be a positive multiple of --seq-len {args.seq_len}")
    if not args.time_limit_s > 0:
        p.error("--time-limit-s must be > 0")
    if not 0 <= args.lr < float("inf"):
        p.error(f"--lr must be finite and >= 0, got {args.lr}")
    check_output_paths(p, ("--json", args.json), ("--plot", args.plot))
    return args


def make_plan(args: argparse.Namespace) -> dict:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    names = list(CONFIG_SETS.get(args.configs, [c.strip() for c in args.configs.split(",") if c.strip()]))
    for what, given, known in (("modes", modes, MODES), ("configs", names, CONFIGS)):
        unknown = sorted(set(given) - set(known))
        if unknown or not given:
            raise SystemExit(f"--{what}: unknown or none {unknown}; choose from {', '.join(known)}")
    names.sort(key=lambda n: n_params(CONFIGS[n]))
    forced = [c.strip() for c in args.force_oom.split(",") if c.strip()]
    common = {"steps": args.steps, "tokens_per_step": args.tokens, "seq_len": args.seq_len, "lr": args.lr,
              "seed": args.seed, "device": args.device, "force_oom": forced, "profile": args.profile,
              "stream_share": args.stream_share}
    return {m: [dict(common, mode=m, config=n, model=CONFIGS[n]) for n in names] for m in modes}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        result = worker(json.loads(args.worker))
        print(RESULT_TAG + json.dumps(result), flush=True)
        sys.stderr.flush()
        # NOTE: no clean-up after an out-of-memory error (process group, optimizer
        # finalizers, CUDA): the process ends here, and the OS takes everything back.
        os._exit(0)
    plan = make_plan(args)
    rows = measure(plan, time_limit_s=args.time_limit_s)
    add_efficiency(rows)
    import torch
    device = next((r["device"] for r in rows if r.get("device")), "unknown (no configuration ran)")
    meta = {"device": device, "cpu_cores": len(os.sched_getaffinity(0)), "host_ram_gib": _host_ram_gib(),
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.date.today().isoformat(), "tokens_per_step": args.tokens, "seq_len": args.seq_len,
            "steps": args.steps, "time_limit_s": args.time_limit_s, "profile": args.profile}
    report = {"meta": meta, "rows": rows, "largest": largest(rows)}
    print()
    print(f"{device} | {meta['cpu_cores']} CPU cores | host RAM {meta['host_ram_gib'] or 0:.0f} GiB | "
          f"torch {meta['torch']} | {args.tokens} tokens/step | {meta['date']}")
    print(format_table(rows))
    for mode, best in report["largest"].items():
        print(f"{mode}: " + (f"largest trained {best['config']} ({format_params(best['n_params'])} parameters)"
                             if best else "no configuration trained"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {args.plot}" if plot(report, args.plot) else "matplotlib not importable: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
