# The device step of gpu_state= on one CUDA device: the fused AdamW kernel
# (cpu_offload/_full/device_kernel.py) against the same step as torch passes (the fallback)
# and torch's own fused CUDA AdamW (other rounding: a speed reference only). Each row is first
# checked bit for bit against the reference's rounding (the torch passes), then timed; it
# reports ms, GB/s of the minimal bytes per element (bf16 moments: 20 B, fp32: 28 B) and the
# share of a device copy probe measured in the same run.
# Run: python benchmarks/device_step.py [--numel N] [--json PATH]
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cli_checks, also when loaded by path
from cli_checks import check_at_least, check_output_paths  # noqa: E402

from cpu_offload._full.device_kernel import fused_adamw_  # noqa: E402
from cpu_offload._full.device_state import adamw_piece_  # noqa: E402

HP = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=1.0)


def timed(fn, repeats: int) -> float:
    """Median ms of ``repeats`` calls, each between CUDA events."""
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def tensors(n: int, state_dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(n, device="cuda", generator=gen)
    g = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    m = (torch.randn(n, device="cuda", generator=gen) * 1e-2).to(state_dtype)
    v = (torch.rand(n, device="cuda", generator=gen) * 1e-4).to(state_dtype)
    return p, g, m, v, torch.empty(n, dtype=torch.bfloat16, device="cuda")


def probe_gb_s(n: int, repeats: int) -> float:
    """Device copy bandwidth: one read and one write of ``n`` float32 elements."""
    src = torch.empty(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    return 2 * 4 * n / timed(lambda: dst.copy_(src), repeats) / 1e6


def rows_for(state_dtype: torch.dtype, n: int, repeats: int) -> list:
    """The rows of one moments dtype: checked against the reference's rounding, then timed."""
    fused, passes = tensors(n, state_dtype), tensors(n, state_dtype)
    fused_adamw_(*fused[:4], 3, out=fused[4], **HP)
    adamw_piece_(*passes[:4], 3, out=passes[4], **HP)
    for a, b in zip(fused, passes):
        assert torch.equal(a, b), "the fused kernel differs from the reference's rounding"
    runs = {
        "fused (ours)": lambda: fused_adamw_(*fused[:4], 3, out=fused[4], **HP),
        "torch passes (fallback)": lambda: adamw_piece_(*passes[:4], 3, out=passes[4], **HP),
    }
    if state_dtype == torch.float32:
        lists = [fused[0]], [fused[1].float()], [fused[2]], [fused[3]], [], [torch.tensor(3.0, device="cuda")]
        runs["torch._fused_adamw_ (other rounding)"] = lambda: torch._fused_adamw_(
            *lists, lr=HP["lr"], beta1=HP["beta1"], beta2=HP["beta2"], weight_decay=HP["weight_decay"],
            eps=HP["eps"], amsgrad=False, maximize=False)
    per_element = 20 if state_dtype == torch.bfloat16 else 28
    return [dict(moments=str(state_dtype).removeprefix("torch."), kernel=name, ms=ms, gb_s=per_element * n / ms / 1e6)
            for name, ms in ((name, timed(fn, repeats)) for name, fn in runs.items())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="The device step of gpu_state= against torch's passes and fused AdamW.")
    ap.add_argument("--numel", type=int, default=1 << 28)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    n = args.numel
    check_at_least(ap, "--numel", n)
    check_at_least(ap, "--repeats", args.repeats)
    check_output_paths(ap, ("--json", args.json))
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device: it times the device step of gpu_state=")
    probe = probe_gb_s(n, args.repeats)
    rows = rows_for(torch.bfloat16, n, args.repeats) + rows_for(torch.float32, n, args.repeats)
    print(f"{torch.cuda.get_device_name()}, {n} elements, copy probe {probe:.0f} GB/s")
    print("| moments | kernel | ms | GB/s | of probe |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        r["of_probe"] = r["gb_s"] / probe
        print(f"| {r['moments']} | {r['kernel']} | {r['ms']:.2f} | {r['gb_s']:.0f} | {r['of_probe']:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), numel=n, probe_gb_s=probe, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
