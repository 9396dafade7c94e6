# Checkpoints of full offload: the optimizer state in torch's optimizer-state
# format, keyed like the wrapped optimizer, with the fp32 masters added.
#
# Scope: ``state`` views, ``state_dict()`` and ``load_state_dict()`` of
# FullCPUOffloadOptimizer; for FSDP2 the tensors are DTensors over the host
# shards, so torch.distributed.checkpoint saves and loads them per rank.
# Non-goals: the accumulators (a checkpoint is taken between steps), converting
# checkpoints of other optimizers' formats beyond a plain torch AdamW one.

from __future__ import annotations

import torch

from cpu_offload.host_state import ParamRecord, local_of

__all__ = ["state_view", "state_dict", "load_state_dict"]

_HOST_KEYS = ("master", "exp_avg", "exp_avg_sq")


def _as_dtensor_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (a host shard) as a DTensor laid out like the FSDP2 ``param``.

    NOTE: ``DTensor.from_local`` would move the shard to the mesh's device; the
    constructor keeps it in host RAM, as FSDP2's own CPU offload does.
    """
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        spec = param._spec
        meta = TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, local.dtype)
        return DTensor(local, DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta), requires_grad=False)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - other torch layouts
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride(), run_check=False)


def _entry(opt, rec: ParamRecord) -> dict:
    out = {"step": torch.tensor(float(rec.step), dtype=torch.float32)}
    for key in _HOST_KEYS:
        flat = getattr(rec, key)
        if flat is None:
            continue
        t = flat.view(rec.shape)
        out[key] = _as_dtensor_like(t, rec.param) if rec.is_dtensor else t
    return out


def state_view(opt) -> dict:
    """``{param: entry}`` for every trainable parameter (views, not copies)."""
    return {rec.param: _entry(opt, rec) for rec in opt._records}


def state_dict(opt) -> dict:
    """torch's optimizer ``state_dict`` layout plus ``"master"`` per parameter.

    Tensors are views of the live host state, as torch returns its live state
    tensors; clone them to keep a snapshot.
    """
    groups = []
    index = 0
    for group in opt.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(index, index + len(group["params"])))
        index += len(group["params"])
        groups.append(packed)
    state = {rec.index: _entry(opt, rec) for rec in opt._records}
    return {"state": state, "param_groups": groups}


def _host(value, name: str, rec: ParamRecord) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"state_dict['state'][{rec.index}]['{name}'] ({rec.name}) must be a tensor, got {type(value).__name__}")
    local = local_of(value)
    if local.numel() != rec.numel:
        raise ValueError(
            f"state_dict['state'][{rec.index}]['{name}'] ({rec.name}) has {local.numel()} local elements, "
            f"expected {rec.numel} (shape {tuple(rec.shape)})"
        )
    return local.detach().reshape(-1)


def load_state_dict(opt, sd: dict) -> None:
    """Restore masters, moments, step counts and group options; refresh the
    device compute copy from the restored masters.

    A plain torch AdamW state_dict (no ``"master"``) keeps the current masters.
    """
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups'")
    saved_groups = sd["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, the optimizer has {len(opt.param_groups)}")
    for g, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"state_dict param_groups[{g}] has {len(saved['params'])} parameters, the optimizer has {len(group['params'])}"
            )
    # Map saved ids to our indices in order, like torch's load_state_dict.
    id_map = {}
    start = 0
    for saved in saved_groups:
        for i, saved_id in enumerate(saved["params"]):
            id_map[start + i] = saved_id
        start += len(saved["params"])
    state = sd["state"]
    for rec in opt._records:
        saved_id = id_map[rec.index]
        entry = state.get(saved_id, state.get(str(saved_id)))
        if entry is None:  # never stepped in the saved run
            rec.step = 0
            for key in ("exp_avg", "exp_avg_sq"):
                if getattr(rec, key) is not None:
                    getattr(rec, key).zero_()
            continue
        rec.step = int(torch.as_tensor(entry["step"]).item())
        for key in _HOST_KEYS:
            flat = getattr(rec, key)
            if flat is None:
                continue
            if key not in entry:
                if key == "master":
                    continue
                raise ValueError(f"state_dict['state'][{saved_id}] ({rec.name}) has no '{key}'")
            src = _host(entry[key], key, rec)
            if src.data_ptr() != flat.data_ptr():  # DCP may have loaded into our own views
                flat.copy_(src)
    for saved, group in zip(saved_groups, opt.param_groups):
        for k, v in saved.items():
            if k not in ("params", "param_names"):
                group[k] = v  # in place: LR schedulers hold these dicts
    with torch.no_grad():
        for rec in opt._records:
            local = rec.local()
            local.view(-1).copy_(rec.master.to(local.dtype))  # compute copy <- round(master)
    opt._transfer.synchronize()
