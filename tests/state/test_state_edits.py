# The "optimizer" mode when the state is edited between a backward and step() through
# references taken before that backward: the state mapping kept from the start, a state tensor
# read between steps, a tensor or a parameter's whole dict replaced. The copies made during the
# backward are then stale; the step must use the edited state, bit-identical to AdamW. On CPU
# parameters (the synchronous copies run the same prefetch and bookkeeping), under FSDP2 on a
# one-rank gloo group (DTensor state), and on CUDA (marked gpu, skipped without it).
import pytest
import torch

from cpu_offload import StateOffloadOptimizer
from cpu_offload._common.dtensor import local_of
from helpers import StateNet as Net
from helpers import sharded_state_nets, state_staging_of

CPU = torch.device("cpu")
EDITS = ["in place", "in place through a view", "in place, tensor read between steps", "tensor replaced",
         "dict replaced", "step in place", "step replaced"]


def edit(how, state, read, p):
    """Edit ``p``'s AdamW state as ``how`` says, through ``state`` (a mapping kept from the
    start) or ``read`` (its exp_avg, read from ``opt.state`` after the last step)."""
    if how == "in place":
        state[p]["exp_avg"].mul_(0.5)
    elif how == "in place through a view":
        state[p]["exp_avg"][1:].zero_()
    elif how == "in place, tensor read between steps":
        read[p].mul_(0.5)
    elif how == "tensor replaced":
        state[p]["exp_avg"] = state[p]["exp_avg"] * 0.5
    elif how == "dict replaced":
        state[p] = {**state[p], "exp_avg": state[p]["exp_avg"] * 0.5}
    elif how == "step in place":
        state[p]["step"].add_(5)
    elif how == "step replaced":
        state[p]["step"] = state[p]["step"] + 5


def train_editing_state(model, opt, how, device=CPU):
    """Two steps, then two whose state is edited between backward and step()."""
    kept = opt.state
    read = {}
    for s in range(4):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(s)).to(device)
        model(x).pow(2).mean().backward()
        if s >= 2:
            if isinstance(opt, StateOffloadOptimizer):
                assert len(state_staging_of(opt).prefetched) == 4  # copied in during this backward
            if device.type == "cuda":
                # NOTE: until the last step's copy-out has landed it may still write a kept host
                # tensor (opt.state waits for it; a reference kept from before cannot).
                torch.cuda.synchronize()
            for p in read:
                edit(how, kept, read, p)
        opt.step()
        opt.zero_grad()
        read = {p: opt.state[p]["exp_avg"] for p in model.parameters() if p in opt.state}
    for s in range(4, 6):  # and on, without edits
        model(torch.randn(8, 12, generator=torch.Generator().manual_seed(s)).to(device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def assert_same(m1, plain, m2, wrapped):
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(local_of(a), local_of(b))
        assert plain.state.get(a, {}).keys() == wrapped.state.get(b, {}).keys()
        for key, value in plain.state.get(a, {}).items():
            assert torch.equal(local_of(value).cpu(), local_of(wrapped.state[b][key]).cpu()), key


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def edited_moment_bytes(how, wrapped):
    """What step() copies in again after the edit: each edited exp_avg, nothing for a step count."""
    if how.startswith("step"):
        return 0
    return sum(local_of(st["exp_avg"]).numel() * 4 for st in wrapped.state.values())


@pytest.mark.parametrize("how", EDITS)
def test_edits_through_references_taken_before_backward_are_seen(how):
    m1, m2 = Net(), Net()
    plain, wrapped = adamw(m1), StateOffloadOptimizer(adamw(m2))
    train_editing_state(m1, plain, how)
    train_editing_state(m2, wrapped, how)
    assert_same(m1, plain, m2, wrapped)
    for p, st in wrapped.state.items():  # between steps: the host buffers again
        assert all(st[key] is state_staging_of(wrapped).host[(id(p), key)] for key in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("how", EDITS)
def test_only_the_edited_state_is_copied_in_again(how):
    model = Net()
    wrapped = StateOffloadOptimizer(adamw(model))
    train_editing_state(model, wrapped, how)
    model(torch.randn(8, 12)).pow(2).mean().backward()
    kept, read = wrapped.optimizer.state, {}
    for p in model.parameters():
        if p in kept:
            read[p] = kept[p]["exp_avg"]
            edit(how, kept, read, p)
    wrapped.step()
    stats = wrapped.stats()
    assert stats["step_copied_bytes"] == edited_moment_bytes(how, wrapped)
    assert stats["prefetched_bytes"] + stats["step_copied_bytes"] == stats["d2h_bytes"]


@pytest.mark.parametrize("how", EDITS)
def test_edits_of_fsdp2_dtensor_state_are_seen(gloo_group, how):
    """An in-place op on a DTensor bumps its own version counter, not its local shard's."""
    m1, m2 = sharded_state_nets()
    plain, wrapped = adamw(m1), StateOffloadOptimizer(adamw(m2))
    train_editing_state(m1, plain, how)
    train_editing_state(m2, wrapped, how)
    assert_same(m1, plain, m2, wrapped)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("how", EDITS)
def test_edits_on_cuda_are_seen(how):
    """Pinned host buffers, copies on side streams; a replaced tensor is a host tensor."""
    cuda = torch.device("cuda")
    m1, m2 = Net().to(cuda), Net().to(cuda)
    plain, wrapped = adamw(m1), StateOffloadOptimizer(adamw(m2))
    train_editing_state(m1, plain, how, cuda)
    train_editing_state(m2, wrapped, how, cuda)
    assert_same(m1, plain, m2, wrapped)
    assert all(local_of(st["exp_avg"]).is_pinned() for st in wrapped.state.values())
