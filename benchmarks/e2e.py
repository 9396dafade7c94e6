# End-to-end GPU benchmark of the offload modes against existing offload systems.
#
# Scope: trains the model of examples/train_fsdp.py (imported, not copied) for each
# mode × tokens-per-step budget, each configuration in a fresh subprocess (clean peak
# memory statistics, no pinned memory left over from the previous one): `warmup` steps,
# then the median of `steps` timed steps. Modes:
#   none, optimizer, full   cpu_offload through the example's own code path
#   full+clip               full, with opt.clip_grad_norm_(1e6) before each step: clipping
#                           enabled on steps that never clip (the mechanism's cost)
#   full+clip_all           full, with a max_norm of 1e-6: every step is rolled back and
#                           redone with the clipping coefficient (the cost of a clipped step)
#   full_bf16               full, with AdamW's moments stored in bf16 (state_dtype)
#   full_overlap, full_bf16_overlap   full / full_bf16 with overlap_forward=model: the next
#                           forward starts while the CPU steps the last chunks
#   full_auto, full_bf16_auto   full / full_bf16 with gpu_state="auto": the state the GPU
#                           has room for moves there once the warm-up windows are seen
#   full_stream, full_bf16_stream, full_overlap_stream, full_bf16_overlap_stream
#                           the modes above with stream_share=--stream-share: the GPU steps
#                           that share of the host state, which crosses PCIe each step
#   torchao                 torchao.optim.CPUOffloadOptimizer (fused CPU AdamW,
#                           offload_gradients=True) on the plain, unsharded model under
#                           bf16 autocast: it supports single-GPU training only
#   fsdp_cpu                FSDP2's CPUOffloadPolicy with torch's fused CPU AdamW
# Measures host memory bandwidth once, prints one table and a summary, writes JSON
# (--json) and a PNG plot (--plot, when matplotlib is importable).
#
#   python benchmarks/e2e.py --json e2e.json --plot e2e.png
#
# The report code (table, summary, JSON, plot) lives in benchmarks/e2e_report.py.
# Non-goals: multi-node runs, real data.

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # e2e_report, also when loaded by path
from e2e_report import (LABELS, MODES, build_report, format_table, plot,  # noqa: E402
                        summarize, summary_lines, write_json)
from cli_checks import check_output_paths  # noqa: E402
from worker_process import run_worker  # noqa: E402

# The max_norm each clipping mode passes to the example's clip_gradients().
CLIP_NORMS = {"full+clip": 1e6, "full+clip_all": 1e-6}

# The cpu_offload modes: mode -> (offload=, state_dtype name) for the example's build_optimizer().
# The "_auto" modes add gpu_state="auto" (settled during the warm-up steps, see AUTO_WINDOWS),
# the "_overlap" modes overlap_forward=model, the "_stream" modes stream_share=--stream-share.
OFFLOAD_OPTIONS = {"none": ("none", "float32"), "optimizer": ("optimizer", "float32"), "full": ("full", "float32"),
                   "full_auto": ("full", "float32"), "full_bf16_auto": ("full", "bfloat16"),
                   "full+clip": ("full", "float32"), "full+clip_all": ("full", "float32"),
                   "full_bf16": ("full", "bfloat16"), "full_overlap": ("full", "float32"),
                   "full_bf16_overlap": ("full", "bfloat16"), "full_stream": ("full", "float32"),
                   "full_bf16_stream": ("full", "bfloat16"), "full_overlap_stream": ("full", "float32"),
                   "full_bf16_overlap_stream": ("full", "bfloat16")}

# The report functions are re-exported: one module to import for the whole benchmark.
__all__ = ["LABELS", "MODES", "build_report", "format_table", "plot", "summarize", "summary_lines",
           "write_json", "exposed_wait", "host_bandwidth_gbs", "run_config", "worker", "main"]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_fsdp.py"
RESULT_TAG = "E2E_RESULT "


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
    """The seconds the loop blocked on the optimizer's tail: FullCPUOffloadOptimizer.stats()'s
    ``step_blocked_s``; None for optimizers without stats()."""
    value = (stats or {}).get("step_blocked_s")
    return None if value is None else float(value)


def _load_example():
    sys.path.insert(0, str(EXAMPLE.parent))  # train_fsdp imports llama_model from beside it
    spec = importlib.util.spec_from_file_location("train_fsdp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_fsdp"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def _build(ex, mode: str, mcfg, device, cfg: dict):
    """Model, optimizer and autocast dtype for one mode."""
    import torch
    lr, wd = cfg["lr"], cfg["weight_decay"]
    if mode in OFFLOAD_OPTIONS:
        offload, state_dtype = OFFLOAD_OPTIONS[mode]
        model = ex.build_model(mcfg, device, seed=cfg["seed"])
        opt = ex.build_optimizer(model, name="adamw", lr=lr, weight_decay=wd, offload=offload, grad_accum=1,
                                 state_dtype=getattr(torch, state_dtype),
                                 gpu_state="auto" if mode.endswith("_auto") else None,
                                 overlap_forward="_overlap" in mode,
                                 stream_share=cfg["stream_share"] if mode.endswith("_stream") else 0.0)
        return model, opt, None
    if mode == "torchao":
        from torchao.optim import CPUOffloadOptimizer
        # NOTE: torchao documents CPUOffloadOptimizer for single-GPU training, not for
        # FSDP2's DTensor shards: the model stays unsharded (fp32 weights on the GPU)
        # and bf16 compute comes from autocast.
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
    settings = ex.StepSettings(batch_size=per_rank, seq_len=seq, grad_accum=1, vocab_size=mcfg.vocab_size,
                               seed=cfg["seed"], amp_dtype=amp, max_grad_norm=CLIP_NORMS.get(cfg["mode"]))
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


def _error_line(lines: list[str]) -> str:
    """The most telling line of a failed run's output: its last exception message."""
    texts = [line.strip() for line in lines if line.strip()]
    for text in reversed(texts):
        head = text.split("]: ", 1)[-1]  # torchrun prefixes "[rank0]: "
        if head.split(":", 1)[0].endswith(("Error", "Exception")):
            return head
    return texts[-1] if texts else ""


def run_config(cfg: dict, *, nproc: int, timeout_s: float) -> dict:
    """Run one configuration in a fresh process; echo its output; parse its result line."""
    if cfg["mode"] == "torchao" and nproc > 1:
        return {"mode": cfg["mode"], "tokens_per_step": cfg["tokens_per_step"],
                "error": "skipped: torchao's CPUOffloadOptimizer supports single-GPU training only"}
    # NOTE: the workers import the installed cpu_offload (editable or not); putting the
    # source tree on PYTHONPATH would shadow a non-editable install with unbuilt sources.
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if nproc > 1 and "OMP_NUM_THREADS" not in env:
        # NOTE: torchrun would set OMP_NUM_THREADS=1, starving the CPU optimizer steps
        # of the reference rows (torch's CPU AdamW); give each rank its share instead.
        env["OMP_NUM_THREADS"] = str(max(1, _cpu_count() // nproc))
    run = run_worker(_subprocess_cmd(cfg, nproc), env=env, timeout_s=timeout_s, tag=RESULT_TAG, tail_lines=30)
    result, tail = run.result, run.tail
    if result is None:
        why = "timed out" if run.timed_out or run.returncode in (-9, 137) else f"exit code {run.returncode}"
        last = _error_line(tail)
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
    p.add_argument("--stream-share", type=float, default=0.3,
                   help="stream_share of the _stream modes (0 to 1, default 0.3)")
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
    for name in ("seq_len", "d_model", "n_layers", "n_heads", "ffn_dim", "vocab_size", "nproc_per_node"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or not 0 < args.timeout < math.inf or not args.lr >= 0 or not args.weight_decay >= 0:
        p.error("--warmup must be >= 0, --timeout finite and > 0, --lr and --weight-decay >= 0")
    if args.d_model % args.n_heads:
        p.error(f"--d-model {args.d_model} must be a multiple of --n-heads {args.n_heads}")
    if not 0.0 <= args.stream_share <= 1.0:
        p.error(f"--stream-share must be from 0 to 1, got {args.stream_share}")
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.mode_list:
        p.error(f"--modes names no mode: {args.modes!r}")
    if args.device == "cuda" and not args.worker:
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch.cuda.is_available() is False (use --device cpu for the CPU)")
    try:
        args.token_budgets = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        p.error(f"--tokens must be a comma list of integers, got {args.tokens!r}")
    if not args.token_budgets or min(args.token_budgets) < 1:
        p.error(f"--tokens must be a comma list of integers >= 1, got {args.tokens!r}")
    check_output_paths(p, ("--json", args.json), ("--plot", args.plot))
    return args


def configs(args: argparse.Namespace) -> list[dict]:
    modes = args.mode_list
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    budgets = args.token_budgets
    for t in budgets:
        if t % (args.seq_len * args.nproc_per_node):
            raise SystemExit(f"--tokens {t} is not a multiple of seq_len x GPUs = {args.seq_len * args.nproc_per_node}")
    model = {"vocab_size": args.vocab_size, "d_model": args.d_model, "n_layers": args.n_layers,
             "n_heads": args.n_heads, "ffn_dim": args.ffn_dim, "max_seq_len": args.seq_len}
    common = {"model": model, "warmup": args.warmup, "steps": args.steps, "lr": args.lr,
              "weight_decay": args.weight_decay, "seed": args.seed, "device": args.device,
              "stream_share": args.stream_share}
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
        last = results[-1]
        if last.get("error"):
            print(f"   failed: {last['error'].strip()[-300:]}", flush=True)
        else:
            print(f"   median step {statistics.median(last['step_times_s']):.3f} s", flush=True)
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
    ran = [r for r in results if not r.get("error")]
    if not ran:
        print(f"\nno configuration ran ({len(results)} tried, each failed or was skipped: see the table above); "
              "nothing to plot or compare", file=sys.stderr)
        return 1
    if args.plot:
        print(f"wrote {args.plot}" if plot(report, args.plot) else "matplotlib not importable: no plot")
    print()
    for line in summary_lines(report["rows"], bandwidth):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
