# The DDP refusal of full offload without a walk over the heap: the refusal
# still happens, gc.get_objects is never called, and no deprecation warning of
# torch.distributed (a heap walk touches torch.distributed.reduce_op) is raised.
import gc
import warnings

import pytest
import torch
import torch.nn as nn

from cpu_offload._full.optimizer import FullCPUOffloadOptimizer

SMALL = dict(pinned_bytes=1 << 15, num_slots=2)


def _no_heap_walk(*args, **kwargs):
    raise AssertionError("gc.get_objects() called: a walk over the whole heap")


def test_ddp_refused_without_heap_walk_or_warning(gloo_group, monkeypatch):
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    model = nn.parallel.DistributedDataParallel(inner)
    monkeypatch.setattr(gc, "get_objects", _no_heap_walk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match=r"DistributedDataParallel model"):
            FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL)
        with pytest.raises(RuntimeError, match=r"DistributedDataParallel model"):  # the inner module's too
            FullCPUOffloadOptimizer(torch.optim.AdamW(inner[2].parameters()), **SMALL)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing changed
    assert not [str(w.message) for w in caught if "deprecated" in str(w.message)]


def test_model_without_ddp_under_a_process_group_is_accepted(gloo_group, monkeypatch):
    torch.manual_seed(1)
    other = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))  # a live DDP over other parameters
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    monkeypatch.setattr(gc, "get_objects", _no_heap_walk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL)
    try:
        assert not [str(w.message) for w in caught if "deprecated" in str(w.message)]
        x = torch.randn(3, 8).to(torch.bfloat16)
        before = model[0].weight.detach().clone()
        model(x).float().sum().backward()
        opt.step()
        assert not torch.equal(before, model[0].weight.detach())
    finally:
        opt.close()
    del other


def test_ddp_built_after_the_wrap_is_refused_at_its_construction(gloo_group):
    """The frameworks' multi-process path without FSDP (accelerate's MULTI_GPU, HF Trainer's
    DDP) wraps the model in DDP after the optimizer was wrapped. That DDP was accepted: each
    backward stepped every rank with its own gradient, before DDP's all-reduce, so the ranks
    diverged, and step() then blamed FSDP2 or swapped tensors. DDP's construction is refused
    now, naming the parameter, and the optimizer trains on as before."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    opt = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL)
    try:
        with pytest.raises(RuntimeError, match=r"parameter 0\.weight is trained by a full-offload optimizer: "
                                               r"DistributedDataParallel .* use FSDP2"):
            nn.parallel.DistributedDataParallel(model)
        with pytest.raises(RuntimeError, match=r"parameter weight is trained"):  # a part of the model too
            nn.parallel.DistributedDataParallel(model[2])
        before = model[0].weight.detach().clone()
        model(torch.randn(3, 8).to(torch.bfloat16)).float().sum().backward()
        opt.step()
        assert not torch.equal(before, model[0].weight.detach())
    finally:
        opt.close()
    nn.parallel.DistributedDataParallel(model)  # closed: the parameters are free again
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    opt = FullCPUOffloadOptimizer(torch.optim.AdamW(model[0].parameters()), **SMALL)
    try:  # parameters DDP is told to leave alone (rank-local ones) may be full offload's
        model._ddp_params_and_buffers_to_ignore = ["0.weight", "0.bias"]
        nn.parallel.DistributedDataParallel(model)
    finally:
        opt.close()
