# Gradient norms of a full-offload window, computed as torch.nn.utils.clip_grad_norm_
# computes them: the norm of the per-parameter norms, over every rank.
#
#   total = (sum_i |g_i|_p^p)^(1/p)   (p finite)      total = max_i |g_i|_inf   (p = inf)
#
# Each rank holds the local shards of its DTensor gradients; the partial sums (or
# maxima) are all-reduced over the mesh dimensions the parameter is sharded on,
# one collective per distinct set of groups. A NaN anywhere makes the total NaN
# (counted separately: a MAX reduction may drop NaN), an Inf makes it Inf.
# NOTE: the per-parameter norms are accumulated in float64 (a float32 reduction
# over millions of elements on a GPU drifts by 1e-5 relative), so the total is
# the exact norm of the gradients to float32 precision.
#
# Scope: combining per-parameter local norms, the all-reduce, torch's clipping
# coefficient. Non-goals: where the per-parameter norms come from (the hooks on
# the device, the chunk runner on the host accumulators).

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["check_norm_type", "local_norm", "shard_groups", "total_norm", "clip_coefficient"]


def check_norm_type(norm_type) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}") from None
    if not p > 0:
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return p


def local_norm(grad: torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    """|grad|_p of one (local) gradient as a 0-d float64 tensor on ``grad``'s device: the
    reduction runs in float64 (the NOTE above), whatever ``grad``'s dtype. An empty gradient (a
    0-element parameter, an FSDP2 shard of a parameter with fewer rows than ranks) gives 0 for
    every order, inf included, where torch's inf-norm of it raises: each rank then reaches the
    norm's all-reduce."""
    if grad.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=grad.device)
    return torch.linalg.vector_norm(grad, norm_type, dtype=torch.float64)


def shard_groups(rec) -> tuple:
    """The groups of more than one rank that ``rec``'s gradient is sharded over. NOTE: a group
    of one rank has nothing to reduce, and on one GPU its first NCCL collective would set up
    the communicator at the end of backward, where the device is fullest (at 21B it failed to
    allocate 4 bytes)."""
    if not rec.is_dtensor:
        return ()
    mesh = rec.param.device_mesh
    groups = (mesh.get_group(d) for d, placement in enumerate(rec.param.placements) if placement.is_shard())
    return tuple(g for g in groups if dist.get_world_size(g) > 1)


def total_norm(local_norms, norm_type: float) -> float:
    """The global norm from ``[(record, norm of its local gradient)]``; every rank must
    call it with the same records in the same order."""
    inf = math.isinf(norm_type)
    buckets: dict = {}  # ids of the groups -> [groups, device, sum of n^p (or max n), NaN count]
    for rec, n in local_norms:
        groups = shard_groups(rec)
        bucket = buckets.setdefault(tuple(id(g) for g in groups), [groups, rec.local().device, 0.0, 0.0])
        if math.isnan(n):
            bucket[3] += 1.0
        elif inf:
            bucket[2] = max(bucket[2], n)
        else:
            bucket[2] += n ** norm_type
    acc, nans = 0.0, 0.0
    for groups, device, value, nan in buckets.values():
        if groups:
            t = torch.tensor([value, nan], dtype=torch.float64, device=device)
            for group in groups:
                dist.all_reduce(t, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
            value, nan = t.tolist()
        acc = max(acc, value) if inf else acc + value
        nans += nan
    if nans:
        return math.nan
    return acc if inf else acc ** (1.0 / norm_type)


def clip_coefficient(max_norm: float, total: float) -> float:
    """torch's ``clamp(max_norm / (total + 1e-6), max=1)``, in float32 like torch."""
    t = torch.tensor(total, dtype=torch.float32)
    return float(torch.clamp(max_norm / (t + 1e-6), max=1.0))
