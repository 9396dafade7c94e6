# The CPU AdamW pass of full offload on host state advised as transparent huge pages (each
# buffer on a 2 MiB boundary, madvise(MADV_HUGEPAGE) before its first touch) against the same
# pass on ordinary allocations (the library's host state), in one run: both arms step the same
# data once and their first CHECK elements are compared bit for bit with the reference, then
# they are timed alternately, chunk by chunk as the step worker calls the kernel (slots of
# 256 MiB of bf16 gradients). Reports ms, GB/s of the minimal bytes per element (fp32 moments
# 28 B, bf16 moments 20 B), the ratio of the two arms, the host's THP setting and the huge
# pages the process holds with both arms allocated.
# Run: python benchmarks/huge_pages.py [--numel N] [--repeats R] [--json PATH]
# Non-goals: the end-to-end step (benchmarks/e2e.py), other kernels (python -m cpu_offload.bench).
# Why the library allocates its host state without the advice: benchmarks/README.md.
from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # adamw_pass, also when loaded by path
from adamw_pass import BYTES_PER_ELEMENT, CHECK, HP, check_fits, check_step, median_times, state  # noqa: E402
from cli_checks import check_at_least, whole_count, check_output_paths  # noqa: E402

from cpu_offload import kernels  # noqa: E402
from cpu_offload.reference import adamw_reference_  # noqa: E402

CHUNK = 1 << 27  # elements: a 256 MiB slot of bf16 gradients
HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # Linux


def huge_page_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor on a 2 MiB boundary whose pages are advised as transparent huge
    pages before anything touches them (a hint: ordinary pages where the OS refuses it)."""
    nbytes = numel * dtype.itemsize
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    return raw[start:start + nbytes].view(dtype)


def thp_setting() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.read_text().strip() if path.exists() else "absent"


def anon_huge_kib() -> int:
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def adamw_pass(t: dict, steps: torch.Tensor) -> None:
    n = t["p"].numel()
    for lo in range(0, n, CHUNK):
        s = slice(lo, min(n, lo + CHUNK))
        kernels.adamw_step([t["p"][s]], [t["g"][s]], [t["m"][s]], [t["v"][s]], steps,
                           compute_params=[t["out"][s]], **HP)


def rows_for(moments: torch.dtype, n: int, repeats: int) -> list:
    arms = {"huge pages": state(n, moments, huge_page_buffer),
            "ordinary pages": state(n, moments, lambda k, d: torch.empty(k, dtype=d))}
    huge_kib = anon_huge_kib()  # both arms allocated and touched
    ref = {k: v[:CHECK].clone() for k, v in arms["huge pages"].items()}
    steps = {name: torch.zeros(1, dtype=torch.int64) for name in arms}
    for name, t in arms.items():
        adamw_pass(t, steps[name])
    adamw_reference_(ref["p"], ref["g"], ref["m"], ref["v"], 1, **HP)
    for name, t in arms.items():
        check_step(t, ref, name)
    medians = median_times({name: (lambda t=t, st=steps[name]: adamw_pass(t, st)) for name, t in arms.items()},
                           repeats)
    rows = []
    for name in arms:
        s = medians[name]
        rows.append({"moments": str(moments).replace("torch.", ""), "arm": name, "numel": n, "ms": s * 1e3,
                     "gb_s": BYTES_PER_ELEMENT[moments] * n / s / 1e9})
    rows[0]["x_ordinary"] = rows[1]["ms"] / rows[0]["ms"]
    rows[0]["process_anon_huge_kib"] = huge_kib
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="AdamW on host state with and without transparent huge pages.")
    p.add_argument("--numel", type=float, default=2.7e8, help="elements per buffer (default 2.7e8)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    n = whole_count(p, "--numel", args.numel)
    check_fits(p, n, states=2)
    check_at_least(p, "--repeats", args.repeats)
    check_output_paths(p, ("--json", args.json))
    rows = []
    for moments in (torch.float32, torch.bfloat16):
        rows += rows_for(moments, n, args.repeats)
    report = {"thp": thp_setting(), "threads": kernels.get_num_threads(),
              "isa": kernels.isa(), "torch": torch.__version__, "rows": rows}
    print(f"THP: {report['thp']} | {report['threads']} threads, {report['isa']} | {n} elements per buffer")
    for r in rows:
        ratio = (f"  {r['x_ordinary']:.3f}x the ordinary pages' speed; the process held "
                 f"{r['process_anon_huge_kib'] / 2**20:.2f} GiB of huge pages") if "x_ordinary" in r else ""
        print(f"{r['moments']:>9} moments, {r['arm']:<15} {r['ms']:8.2f} ms  {r['gb_s']:6.1f} GB/s{ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
