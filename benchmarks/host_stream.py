# Whether the GPU can take part of the all-host step's work without the state leaving the host.
#
# With every state on the host the CPU step of AdamW moves 20 B per element over the host's
# memory with bf16 moments (28 B with fp32 ones), and the copies each way 4 B more (the bf16
# gradient lands in pinned memory, the bf16 compute copy leaves it). A share of the elements
# could instead keep its master and moments in pinned host memory and be stepped on the GPU:
# the state crosses PCIe into a ring of GPU slots, the fused device kernel steps it (bit for
# bit the CPU kernel's result) and it goes back, 16 B per element over the host's memory with
# bf16 moments (24 B with fp32 ones) and no gradient or compute copy through the host.
#
# For each share f of --numel elements this times, on one device, with one process's CPU
# binding: the CPU part alone (the native kernel over the other 1 - f, its gradient copies to
# the host before and its compute copies to the GPU after each chunk), the streamed part alone,
# and both at once, in alternation; the arms' medians, host GB/s and PCIe GB/s per direction.
# Every gradient is on the GPU when an arm starts: it bounds the busy part of a step, not the
# arrival order of a backward. Before timing, one piece is stepped both ways and compared bit
# for bit.
# Run: python benchmarks/host_stream.py [--numel N] [--shares 0,0.25,0.5,0.75] [--moments bf16]
#                                        [--repeats 7] [--json PATH]
from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cli_checks, also when loaded by path
from cli_checks import check_at_least, check_output_paths, whole_count  # noqa: E402

from cpu_offload import kernels  # noqa: E402
from cpu_offload._full.binding import bind_for  # noqa: E402
from cpu_offload._full.device_kernel import fused_adamw_  # noqa: E402
from cpu_offload._full.device_state import same_bits  # noqa: E402
from cpu_offload.bench import measure_bandwidth, probe_numel  # noqa: E402

HP = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=1.0)
CHUNK = 1 << 25   # elements per chunk on either path (128 MiB of fp32 master)
SLOTS = 4         # GPU slots of the streamed path's ring


class Workload:
    """Host state (pinned) and the device's gradients and compute copies of ``n`` elements."""

    def __init__(self, n: int, moments: torch.dtype, chunk: int = CHUNK):
        self.chunk = chunk
        gen = torch.Generator().manual_seed(0)
        pinned = dict(pin_memory=True)
        self.p = torch.empty(n, **pinned).copy_(torch.randn(n, generator=gen))
        self.m = torch.empty(n, dtype=moments, **pinned).copy_(torch.randn(n, generator=gen) * 1e-2)
        self.v = torch.empty(n, dtype=moments, **pinned).copy_(torch.rand(n, generator=gen) * 1e-4)
        self.g_host = torch.empty(n, dtype=torch.bfloat16, **pinned)
        self.w_host = torch.empty(n, dtype=torch.bfloat16, **pinned)
        self.g = torch.randn(n, device="cuda").to(torch.bfloat16)
        self.w = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        self.state_bytes = 4 + 2 * moments.itemsize
        self.slots = [(torch.empty(chunk, device="cuda"), torch.empty(chunk, dtype=moments, device="cuda"),
                       torch.empty(chunk, dtype=moments, device="cuda")) for _ in range(SLOTS)]
        self.h2d, self.d2h, self.step_stream = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        self.cpu_h2d, self.cpu_d2h = torch.cuda.Stream(), torch.cuda.Stream()
        self.count = 100   # a step count far from 1, as in training

    def cpu_part(self, start: int, stop: int) -> None:
        """Full offload's host path over [start, stop): gradient down, native step, weight up."""
        landed = []
        with torch.cuda.stream(self.cpu_d2h):
            for lo in range(start, stop, self.chunk):
                hi = min(lo + self.chunk, stop)
                self.g_host[lo:hi].copy_(self.g[lo:hi], non_blocking=True)
                landed.append((lo, hi, torch.cuda.Event()))
                landed[-1][2].record()
        for lo, hi, event in landed:
            event.synchronize()
            steps = torch.tensor([self.count - 1])
            kernels.adamw_step([self.p[lo:hi]], [self.g_host[lo:hi]], [self.m[lo:hi]], [self.v[lo:hi]], steps,
                               compute_params=[self.w_host[lo:hi]], **HP)
            with torch.cuda.stream(self.cpu_h2d):
                self.w[lo:hi].copy_(self.w_host[lo:hi], non_blocking=True)

    def streamed_part(self, start: int, stop: int) -> None:
        """The state of [start, stop) to a GPU slot, stepped there, and back; issued only."""
        free = [None] * SLOTS
        for i, lo in enumerate(range(start, stop, self.chunk)):
            hi, slot = min(lo + self.chunk, stop), i % SLOTS
            p, m, v = (t[:hi - lo] for t in self.slots[slot])
            with torch.cuda.stream(self.h2d):
                if free[slot] is not None:
                    self.h2d.wait_event(free[slot])
                for dst, src in ((p, self.p), (m, self.m), (v, self.v)):
                    dst.copy_(src[lo:hi], non_blocking=True)
            self.step_stream.wait_stream(self.h2d)
            with torch.cuda.stream(self.step_stream):
                fused_adamw_(p, self.g[lo:hi], m, v, self.count, out=self.w[lo:hi], **HP)
            self.d2h.wait_stream(self.step_stream)
            with torch.cuda.stream(self.d2h):
                for src, dst in ((p, self.p), (m, self.m), (v, self.v)):
                    dst[lo:hi].copy_(src, non_blocking=True)
                free[slot] = torch.cuda.Event()
                free[slot].record()

    def run(self, split: int, cpu: bool, streamed: bool) -> float:
        """Seconds until both parts (those asked for) are done: streamed [0, split), CPU the rest.
        An error of the CPU part's thread is raised here."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            cpu_done = pool.submit(self.cpu_part, split, self.p.numel()) if cpu else None
            if streamed:
                self.streamed_part(0, split)
            if cpu_done:
                cpu_done.result()
        torch.cuda.synchronize()
        return time.perf_counter() - start


def check_same_bits(moments: torch.dtype) -> None:
    """One piece stepped by the CPU kernel and by the streamed path must agree bit for bit."""
    n = (1 << 20) + 37
    work = Workload(n, moments, chunk=1 << 18)   # five chunks: every slot, and one again
    start = (work.p.clone(), work.m.clone(), work.v.clone())
    work.run(0, cpu=True, streamed=False)
    cpu = (work.p.clone(), work.m.clone(), work.v.clone(), work.w.cpu())
    for dst, src in zip((work.p, work.m, work.v), start):
        dst.copy_(src)
    work.run(n, cpu=False, streamed=True)
    gpu = (work.p, work.m, work.v, work.w.cpu())
    for name, a, b in zip(("master", "exp_avg", "exp_avg_sq", "compute copy"), cpu, gpu):
        if not same_bits(a, b):
            raise AssertionError(f"the streamed step's {name} differs from the CPU kernel's")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="The all-host step with a share of the host state stepped on the GPU.")
    ap.add_argument("--numel", type=float, default=1 << 28, help=f"elements, at least {CHUNK}")
    ap.add_argument("--shares", default="0,0.25,0.4,0.5,0.6,0.75,1")
    ap.add_argument("--moments", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    n = whole_count(ap, "--numel", args.numel)
    check_at_least(ap, "--numel", n, CHUNK)
    moments = torch.bfloat16 if args.moments == "bf16" else torch.float32
    needed = n * (4 + 2 * moments.itemsize + 4) + 4 * probe_numel(n)   # pinned state and copies, the probe
    if needed > (available := psutil.virtual_memory().available):
        ap.error(f"--numel {n} needs about {needed / 2**30:.1f} GiB of host RAM with {args.moments} moments; "
                 f"{available / 2**30:.1f} GiB is available")
    check_at_least(ap, "--repeats", args.repeats)
    check_output_paths(ap, ("--json", args.json))
    try:
        shares = [float(s) for s in args.shares.split(",")]
    except ValueError:
        ap.error(f"--shares {args.shares}: expected numbers between 0 and 1, separated by commas")
    if not all(0 <= s <= 1 for s in shares) or 0 not in shares:
        ap.error(f"--shares {args.shares}: each share must lie in [0, 1], and 0 (all on the CPU) must be among them")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device: it streams host state through the GPU")
    bind_for(torch.device("cuda", torch.cuda.current_device()), "/sys")
    check_same_bits(moments)
    probe = measure_bandwidth(probe_numel(n), args.repeats)
    work = Workload(n, moments)
    splits = sorted({min(n, round(s * n / CHUNK) * CHUNK) for s in shares})   # whole chunks streamed
    arms = [(split, part) for split in splits for part in ("cpu", "streamed", "both")
            if not (split == 0 and part != "cpu") and not (split == n and part != "streamed")]
    times = {arm: [] for arm in arms}
    for _ in range(args.repeats + 1):   # the first round warms up and is dropped
        for split, part in arms:
            times[(split, part)].append(work.run(split, cpu=part != "streamed", streamed=part != "cpu"))
    kernel_bytes = 20 if moments == torch.bfloat16 else 28
    rows = []
    for (split, part), seconds in times.items():
        cpu_n = 0 if part == "streamed" else n - split
        stream_n = 0 if part == "cpu" else split
        median = statistics.median(seconds[1:])
        host = (kernel_bytes + 4) * cpu_n + 2 * work.state_bytes * stream_n
        pcie = 2 * cpu_n + work.state_bytes * stream_n   # each direction
        rows.append(dict(share=split / n, part=part, s=median, host_gb_s=host / median / 1e9,
                         pcie_gb_s=pcie / median / 1e9, of_probe=host / median / 1e9 / probe))
    base = next(r["s"] for r in rows if r["share"] == 0)
    print(f"{torch.cuda.get_device_name()}, {n} elements, {args.moments} moments, "
          f"{kernels.get_num_threads()} kernel threads, host probe {probe:.1f} GB/s, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| streamed share | parts run | ms | vs all on the CPU | host GB/s (of probe) | PCIe GB/s each way |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        r["vs_cpu_only"] = r["s"] / base
        print(f"| {r['share']:.2f} | {r['part']} | {1e3 * r['s']:.1f} | {r['vs_cpu_only']:.2f}× | "
              f"{r['host_gb_s']:.0f} ({r['of_probe']:.0%}) | {r['pcie_gb_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), numel=n, moments=args.moments,
                           threads=kernels.get_num_threads(), probe_gb_s=probe, torch=torch.__version__,
                           date=time.strftime("%Y-%m-%d"), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
