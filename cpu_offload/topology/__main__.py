# The topology diagnostic: `python -m cpu_offload.topology [--json] [--local-world-size N]`.
#
# Scope: print the CPU binding plan of every local rank (one per visible GPU), as a table
# or JSON, and say why nothing is bound to a NUMA node when no GPU is visible.
# Non-goals: binding anything (topology.bind), planning (topology.plan_all).

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence

# NOTE: functions are looked up on the module at each call, so tests can replace them there.
from cpu_offload import topology

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(
        prog="python -m cpu_offload.topology",
        description="Show the CPU binding plan of every local rank (one per visible GPU).",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--sysfs-root", default="/sys", help="where sysfs is mounted")
    parser.add_argument("--local-world-size", type=int, default=None, help="ranks per host "
                        "(default: one per visible GPU; LOCAL_WORLD_SIZE or 1 without GPUs)")
    args = parser.parse_args(argv)
    if args.local_world_size is not None and args.local_world_size < 1:
        parser.error(f"--local-world-size must be >= 1, got {args.local_world_size}")
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s", stream=sys.stderr)

    addresses = topology.gpu_pci_addresses()
    allowed = sorted(os.sched_getaffinity(0))
    try:
        size = args.local_world_size or len(addresses) or topology.local_rank_info()[1]
        plans = topology.plan_all(local_world_size=size, pci_addresses=addresses,
                                  sysfs_root=args.sysfs_root, allowed_cpus=allowed)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    note = None
    if not addresses:
        why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
               else "torch.cuda.is_available() is False")
        note = (f"no CUDA GPU is visible ({why}): nothing to bind to a NUMA node; the thread "
                "budget below is what the CPU work would use")

    if args.json:
        rows = [{**dataclasses.asdict(p), "cpus": list(p.cpus), "cpulist": topology.format_cpulist(p.cpus),
                 "worker_cpus": list(p.worker_cpus), "python_cpu": p.python_cpu} for p in plans]
        print(json.dumps({"gpus_visible": len(addresses), "allowed_cpus": allowed,
                          "local_world_size": size, "note": note, "plans": rows}, indent=2))
        return 0
    if note:
        print(note)
    print(f"allowed CPUs: {topology.format_cpulist(allowed)} ({len(allowed)}); local ranks: {size}")
    dash = lambda v: "-" if v is None else str(v)  # noqa: E731
    table = [("rank", "gpu", "pci address", "node", "cpus", "threads", "python cpu")] + [
        (str(p.local_rank), dash(p.gpu), dash(p.pci_address), dash(p.numa_node),
         topology.format_cpulist(p.cpus), str(p.num_threads), dash(p.python_cpu)) for p in plans
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
