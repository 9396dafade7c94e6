# FSDP2's DTensors, as the host-side code needs them: recognise one, take its local
# shard, and wrap a host tensor with the layout of a DTensor.
#
# Scope: the three helpers every module that touches DTensors uses (host_state,
# checkpoint, state_offload, full_offload). Non-goals: collectives, redistribution,
# anything that moves data between ranks or devices.

from __future__ import annotations

import torch

__all__ = ["is_dtensor", "local_of", "as_dtensor_like"]


def is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor object it holds), or ``t`` itself.

    NOTE: the object itself, not ``to_local()``: that returns an autograd view when grad
    is enabled and a new view for a DTensor Parameter, while host buffers are recognised
    by identity (_state/optimizer.py) and must be written in place.
    """
    return t._local_tensor if is_dtensor(t) else t


def as_dtensor_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` wrapped with the mesh, placements, global shape and stride of ``like``
    (its dtype is ``local``'s), or ``local`` itself when ``like`` is not a DTensor.

    NOTE: ``DTensor.from_local`` would move the shard to the mesh's device; the
    constructor keeps it where it is (host RAM), as FSDP2's own CPU offload does.
    """
    if not is_dtensor(like):
        return local
    from torch.distributed.tensor import DTensor

    spec = like._spec
    if local.dtype == like.dtype:
        return DTensor(local, spec, requires_grad=False)
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        meta = TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, local.dtype)
        return DTensor(local, DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta), requires_grad=False)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - other torch layouts
        return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape,
                                  stride=like.stride(), run_check=False)
