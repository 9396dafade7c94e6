# The CPU AdamW pass of full offload as its step worker calls the kernel: N elements in chunks
# of one staging slot each (256 and 64 MiB of bf16 gradients by default), every chunk through
# the same tensor views each pass, as the worker's cached plans do. Each slot size's first pass
# is checked bit for bit against the reference on the first CHECK elements, then the sizes are
# timed alternately. Reports, per size, ms and GB/s of the minimal bytes per element (fp32
# moments 28 B, bf16 moments 20 B), and the cost of one more kernel call: the difference of two
# sizes' passes over the difference of their call counts. Two builds of the native code compare
# by running it under each, one after the other.
# Run: python benchmarks/kernel_calls.py [--numel N] [--slots-mib 256,64] [--threads T] [--repeats R]
#      [--json PATH]
# Non-goals: the end-to-end step (benchmarks/e2e.py), one call's speed against torch
# (python -m cpu_offload.bench).
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # adamw_pass, also when loaded by path
from adamw_pass import BYTES_PER_ELEMENT, CHECK, HP, check_fits, check_step, median_times, state  # noqa: E402
from cli_checks import check_at_least, whole_count, check_output_paths  # noqa: E402

from cpu_offload import kernels  # noqa: E402
from cpu_offload.reference import adamw_reference_  # noqa: E402

__all__ = ["rows_for", "main"]


def chunk_calls(t: dict, elements_per_call: int) -> list:
    """One argument tuple per chunk, built once: the kernel sees the same tensors every pass."""
    n, calls = t["p"].numel(), []
    for lo in range(0, n, elements_per_call):
        s = slice(lo, min(n, lo + elements_per_call))
        calls.append(([t["p"][s]], [t["g"][s]], [t["m"][s]], [t["v"][s]], torch.zeros(1, dtype=torch.int64),
                      [t["out"][s]]))
    return calls


def adamw_pass(calls: list) -> None:
    for p, g, m, v, steps, out in calls:
        kernels.adamw_step(p, g, m, v, steps, compute_params=out, **HP)


def rows_for(moments: torch.dtype, n: int, slots_mib: list, repeats: int) -> list:
    t = state(n, moments)
    ref = {k: v[:CHECK].clone() for k, v in t.items()}
    arms = {mib: chunk_calls(t, (mib << 20) // 2) for mib in slots_mib}  # bf16 gradients: 2 B each
    for mib, calls in arms.items():  # each arm's first pass is step 1 of its own step counts
        adamw_pass(calls)
        adamw_reference_(ref["p"], ref["g"], ref["m"], ref["v"], 1, **HP)
        check_step(t, ref, f"{mib} MiB slots")
    medians = median_times({mib: (lambda calls=calls: adamw_pass(calls)) for mib, calls in arms.items()}, repeats)
    rows = []
    for mib, calls in arms.items():
        s = medians[mib]
        rows.append({"moments": str(moments).replace("torch.", ""), "slot_mib": mib, "calls": len(calls),
                     "ms": s * 1e3, "gb_s": BYTES_PER_ELEMENT[moments] * n / s / 1e9})
    first, last = rows[0], rows[-1]
    if last["calls"] != first["calls"]:
        # cost of one more call = extra time / extra calls, largest against smallest slots
        last["ms_per_extra_call"] = (last["ms"] - first["ms"]) / (last["calls"] - first["calls"])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="The AdamW pass in slot-sized kernel calls, per slot size.")
    p.add_argument("--numel", type=float, default=2.7e8, help="elements (default 2.7e8)")
    p.add_argument("--slots-mib", default="256,64", help="slot sizes in MiB of bf16 gradients, largest first")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, help="native threads (default: the CPUs this process may use); "
                   "full offload leaves one CPU of its set to Python")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    n = whole_count(p, "--numel", args.numel)
    check_fits(p, n, states=1)
    check_at_least(p, "--repeats", args.repeats)
    check_output_paths(p, ("--json", args.json))
    if args.threads is not None:
        check_at_least(p, "--threads", args.threads)
        try:
            kernels.set_num_threads(args.threads)
        except ValueError as e:
            p.error(f"--threads {args.threads}: {e}")
    try:
        slots = [int(x) for x in args.slots_mib.split(",")]
    except ValueError:
        slots = []
    if not slots or any(s < 1 for s in slots):
        p.error(f"--slots-mib must list positive sizes, got {args.slots_mib!r}")
    rows = []
    for moments in (torch.float32, torch.bfloat16):
        rows += rows_for(moments, n, slots, args.repeats)
    report = {"threads": kernels.get_num_threads(), "isa": kernels.isa(), "torch": torch.__version__,
              "numel": n, "rows": rows}
    print(f"{report['threads']} threads, {report['isa']} | {n} elements")
    for r in rows:
        extra = f"  {r['ms_per_extra_call']:.3f} ms per extra call" if "ms_per_extra_call" in r else ""
        print(f"{r['moments']:>9} moments, {r['slot_mib']:4d} MiB slots ({r['calls']:3d} calls) "
              f"{r['ms']:8.2f} ms  {r['gb_s']:6.1f} GB/s{extra}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
