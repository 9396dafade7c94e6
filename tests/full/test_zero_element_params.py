# Parameters with no elements (shape (0,) or (3, 0)) under full offload: torch.optim.AdamW
# counts a step for every step in which such a parameter had a gradient, so their step
# count must follow torch in every path (plain steps, accumulation, a short window, a
# skipped step, clipping's rollback and redo, zero_grad(set_to_none=False), checkpoints),
# and their presence must not change a bit of the other parameters' results.
import contextlib
import math
import os

import pytest
import torch
import torch.nn as nn

from helpers import ReplayRun

class Net(nn.Module):
    def __init__(self, empties=True):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 64), nn.Linear(64, 4)
        if empties:  # NOTE: created after the layers and from no random numbers: the layers match
            self.e1 = nn.Parameter(torch.zeros(0))
            self.e2 = nn.Parameter(torch.zeros(3, 0))
        self.empties = empties

    def forward(self, x, use_empty=True, scale=1.0):
        y = self.l2(torch.tanh(self.l1(x))).float().pow(2).mean() * scale
        if self.empties and use_empty:
            y = y + self.e1.float().sum() + self.e2.float().sum()
        return y


class Run(ReplayRun):
    """The wrapped Net with the gradients it received and a torch AdamW replay."""

    def __init__(self, seed, *, empties=True, k=1, **opts):
        torch.manual_seed(seed)
        super().__init__(Net(empties), k=k, seed=seed, **opts)

    def backward(self, **kw):
        self.model(torch.randn(8, 16, generator=self.gen).to(torch.bfloat16), **kw).backward()

def _seed():
    return int.from_bytes(os.urandom(4), "little")


def _same_layers(a, b):
    ma, mb = a.masters(), b.masters()
    for n in ("l1.weight", "l1.bias", "l2.weight", "l2.bias"):
        assert torch.equal(ma[n], mb[n]), n
    sa, sb = a.steps(), b.steps()
    assert all(sa[n] == sb[n] for n in sb)


@pytest.mark.parametrize("grad_copy", ["host", "device"])
def test_plain_steps_count_like_torch(grad_copy):
    seed = _seed()
    run, plain = Run(seed, grad_copy=grad_copy), Run(seed, empties=False, grad_copy=grad_copy)
    for s in range(4):
        use = s != 2  # no gradient in step 2: no step, as torch
        for r in (run, plain):
            r.window = {}
            r.backward(use_empty=use)
            r.opt.step()
            r.opt.zero_grad()
            r.ref_step(r.window)
    assert run.steps()["e1"] == run.steps()["e2"] == 3
    run.check()
    _same_layers(run, plain)


def test_accumulation_and_a_short_window_count_like_torch():
    seed = _seed()
    run, plain = Run(seed, k=3), Run(seed, empties=False, k=3)
    for passes, use in [(3, [True, False, False]), (2, [False, True]), (3, [False] * 3), (1, [True])]:
        for r in (run, plain):
            r.window = {}
            for u in use[:passes]:
                r.backward(use_empty=u)
            r.opt.step()  # 2 or 1 of 3: a short window
            r.opt.zero_grad()
            r.ref_step(r.window)
    assert run.steps()["e1"] == 3
    run.check()
    _same_layers(run, plain)


@pytest.mark.parametrize("k", [1, 2])
def test_a_skipped_step_counts_nothing(k):
    run = Run(_seed(), k=k)
    for s in range(3):
        run.window = {}
        with pytest.warns(RuntimeWarning, match="skipped") if s == 1 else contextlib.nullcontext():
            for _ in range(k):
                run.backward(scale=float("nan") if s == 1 else 1.0)
            run.opt.step()
        run.opt.zero_grad()
        if s != 1:
            run.ref_step(run.window)
    assert run.opt.stats()["skipped_steps"] == 1
    assert run.steps()["e1"] == 2
    run.check()


@pytest.mark.parametrize("k, grad_copy", [(1, "host"), (1, "device"), (2, "device")])
def test_clipping_rollback_and_redo_count_once(k, grad_copy):
    seed = _seed()
    run, plain = Run(seed, k=k, grad_copy=grad_copy), Run(seed, empties=False, k=k, grad_copy=grad_copy)
    for s in range(4):
        for r in (run, plain):
            r.window = {}
            for _ in range(k):
                r.backward(scale=[3.0, 0.2, 5.0, 1.0][s])
            r.opt.clip_grad_norm_(0.05)  # clips: rolled back and redone at step()
            r.opt.step()
            r.opt.zero_grad()
            params = [p for p in r.ref_params.values()]
            for n, p in r.ref_params.items():
                p.grad = r.window[n].clone()
            torch.nn.utils.clip_grad_norm_(params, 0.05)
            r.ref.step()
    assert run.opt.stats()["clip_coef"] < 1
    assert run.steps()["e1"] == 4
    run.check()
    _same_layers(run, plain)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("norm_type", [float("inf"), 3.0])
def test_clipping_by_any_norm_is_not_changed_by_empty_parameters(k, norm_type):
    """The inf-norm of an empty gradient (a 0-element parameter, or an FSDP2 shard of a
    parameter with fewer rows than ranks) raised torch's "cannot compute the inf norm on an
    empty tensor", and under FSDP2 left the other ranks in the norm's all-reduce; an empty
    gradient adds nothing to any norm."""
    seed = _seed()
    run, plain = Run(seed, k=k), Run(seed, empties=False, k=k)
    for s in range(3):
        norms = []
        for r in (run, plain):
            r.window = {}
            for _ in range(k):
                r.backward(scale=[3.0, 0.2, 5.0][s])
            norms.append(r.opt.clip_grad_norm_(0.05, norm_type=norm_type))
            r.opt.step()
            r.opt.zero_grad()
        assert norms[0] == norms[1] and math.isfinite(norms[0]), norms
    assert run.opt.stats()["clip_coef"] < 1 and run.steps()["e1"] == 3
    _same_layers(run, plain)


def test_zero_filled_gradients_count_like_torch():
    seed = _seed()
    run, plain = Run(seed), Run(seed, empties=False)
    for s in range(4):
        use = s == 0  # afterwards torch still holds their zero gradients, and steps them
        for r in (run, plain):
            r.window = {}
            r.backward(use_empty=use)
            r.opt.step()
            r.opt.zero_grad(set_to_none=False)
            r.ref_step(r.window, zero_held=() if s == 0 else ("e1", "e2"))
    assert run.steps()["e1"] == 4
    run.check()
    _same_layers(run, plain)


def test_checkpoint_round_trip_keeps_the_count():
    seed = _seed()
    run = Run(seed)
    for _ in range(3):
        run.window = {}
        run.backward()
        run.opt.step()
        run.opt.zero_grad()
        run.ref_step(run.window)
    sd = run.opt.state_dict()
    by_param = {id(p): i for i, p in enumerate(run.model.parameters())}
    assert float(sd["state"][by_param[id(run.model.e2)]]["step"]) == 3
    other = Run(seed)
    other.opt.load_state_dict(sd)
    assert other.steps() == run.steps()
    other.ref, other.ref_params = run.ref, run.ref_params
    other.window = {}
    other.backward()
    other.opt.step()
    other.ref_step(other.window)
    assert other.steps()["e1"] == 4
    other.check()

