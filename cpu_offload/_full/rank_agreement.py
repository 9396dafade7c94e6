# The settings every rank sharding a parameter must share, compared once at construction:
# each rank's step runs the collectives of its own options (the norm's all-reduce for
# clipping and the non-finite guard) and steps its shards with its own factors, so a
# difference left unseen makes the ranks wait in different collectives until the process
# group's timeout, pair unrelated values in one, or step the shards of one model with
# different math.
#
# Scope: what is compared (the optimizer's options, its parameter groups' hyper-parameters
# and parameters), the comparison over each group of ranks the parameters are sharded over,
# the error. Non-goals: the collectives of the step (grad_norms.py); values changed after
# construction (an LR scheduler, ``WindowControls``) are not compared again.

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from cpu_offload._full.grad_norms import shard_groups

__all__ = ["check_ranks_agree"]


def _settings_of(records: list, hparams: list, options: dict, keep_fp32: set) -> dict:
    """What must be the same on every rank, as ``{name: value}`` in a fixed order: ``options``,
    each group's hyper-parameters (``options.read_hparams``) and its parameters' global shapes,
    and the parameters kept in fp32."""
    settings = dict(options)
    for g, values in enumerate(hparams):
        for key, value in values.items():
            settings[f"param_groups[{g}]['{key}']"] = value
        settings[f"param_groups[{g}]'s parameters (global shapes)"] = [
            tuple(rec.param.shape) for rec in records if rec.group == g]
    settings["keep_fp32"] = [rec.name for rec in records if id(rec.param) in keep_fp32]
    return settings


def _gather(obj, group, device: torch.device) -> list:
    """Every rank's ``obj`` (pickled) over ``group``, through tensors on ``device``, the device
    its parameters' collectives use. NOTE: not ``all_gather_object``, which puts them on the
    current CUDA device, the first GPU on every rank where the script never set it."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    counts = [int(s) for s in sizes]
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    out = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(out, padded, group=group)
    return [pickle.loads(t[:count].cpu().numpy().tobytes()) for t, count in zip(out, counts)]


def check_ranks_agree(records: list, hparams: list, *, options: dict, keep_fp32: set) -> None:
    """Compare the settings (``_settings_of``) over each group of more than one rank that a
    parameter of ``records`` is sharded over (gathered once per group, in the records' order);
    raise a ValueError naming what differs and each rank's value.

    NOTE: every rank of a group calls this at the same point of its construction; a rank that
    raised before it leaves the others waiting here until the process group's timeout, as in
    any collective."""
    groups: dict = {}
    for rec in records:
        for group in shard_groups(rec):
            groups.setdefault(id(group), (group, rec.local().device))
    settings = _settings_of(records, hparams, options, keep_fp32) if groups else None
    for group, device in groups.values():
        gathered = _gather(settings, group, device)
        ranks = [dist.get_global_rank(group, i) for i in range(len(gathered))]
        differ = []
        for name in dict.fromkeys(k for theirs in gathered for k in theirs):
            values = [theirs.get(name, "(none)") for theirs in gathered]
            if any(v != values[0] for v in values[1:]):
                shown = ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, values))
                differ.append(f"{name} ({shown})")
        if differ:
            listed = "; ".join(differ[:4]) + (f"; and {len(differ) - 4} more" if len(differ) > 4 else "")
            raise ValueError(f"cpu_offload: the ranks sharding the optimizer's parameters were given different settings: "
                             f"{listed}. Full offload runs each rank's step with its own settings (the clipping "
                             "and non-finite collectives, the step's factors): give every rank the same ones")
