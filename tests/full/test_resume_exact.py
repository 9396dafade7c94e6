# Resuming full offload from a checkpoint: bit-identical to the uninterrupted run after
# clipped steps (the factor the next step speculates with is part of the checkpoint; a
# checkpoint without it still loads), and a plain torch.optim.AdamW checkpoint migrated in
# the usual resume order (wrap, model.load_state_dict, opt.load_state_dict): the loaded
# weights stay, also for parameters the saved run never stepped.
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cpu_offload
from helpers import SMALL, records_of

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LOSS_SCALES = [0.3, 4.0, 1.0, 12.0, 0.1, 2.5, 0.7, 5.0]  # clips on most steps, by varying factors


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(24, 64)
        self.l2 = nn.Linear(64, 8)
        self.late = nn.Linear(8, 8)  # used only from step 3 on

    def forward(self, x, step):
        y = self.l2(F.gelu(self.l1(x)))
        return self.late(y) if step >= 3 else y


def fresh(seed=0, **opts):
    torch.manual_seed(seed)
    model = Net()
    opt = cpu_offload.offload_optimizer(torch.optim.AdamW(model.parameters(), **HP), offload="full", **SMALL, **opts)
    return model, opt


def train(model, opt, steps, *, clip_call=False):
    for s in steps:
        x = torch.randn(16, 24, generator=torch.Generator().manual_seed(s))
        (model(x.to(torch.bfloat16), s).float().pow(2).mean() * LOSS_SCALES[s]).backward()
        if clip_call:
            opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def host_state(opt):
    return [(r.master.clone(), r.exp_avg.clone(), r.exp_avg_sq.clone(), r.step) for r in records_of(opt)]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["max_grad_norm", "clip_grad_norm_"])
def test_resume_after_clipped_steps_is_bit_identical(state_dtype, how):
    opts = dict(state_dtype=state_dtype, **({"max_grad_norm": 0.05} if how == "max_grad_norm" else {}))
    clip_call = how == "clip_grad_norm_"
    model, opt = fresh(**opts)
    train(model, opt, range(8), clip_call=clip_call)
    straight = host_state(opt)
    assert opt.stats()["clip_coef"] < 1

    model, opt = fresh(**opts)
    train(model, opt, range(4), clip_call=clip_call)
    ck = roundtrip({"model": model.state_dict(), "optim": opt.state_dict()})
    model, opt = fresh(seed=1, **opts)  # another process: other initial weights
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optim"])
    train(model, opt, range(4, 8), clip_call=clip_call)
    for i, (a, b) in enumerate(zip(host_state(opt), straight)):
        assert a[3] == b[3], i
        for x, y in zip(a[:3], b[:3]):
            assert torch.equal(x, y), i


def test_checkpoint_without_the_speculation_factor_still_loads():
    model, opt = fresh(max_grad_norm=0.05)
    train(model, opt, range(4))
    sd = roundtrip(opt.state_dict())
    for group in sd["param_groups"]:
        group.pop("speculation_factor")
    model2, opt2 = fresh(max_grad_norm=0.05)
    opt2.load_state_dict(sd)
    assert all("speculation_factor" not in g for g in opt2.param_groups)  # never leaks into the groups
    train(model2, opt2, range(4, 6))
    train(model, opt, range(4, 6))
    for a, b in zip(host_state(opt2), host_state(opt)):  # the first redo starts from factor 1: float32 rounding
        assert a[3] == b[3]
        assert float((a[0] - b[0]).norm() / b[0].norm()) < 1e-6


def test_plain_adamw_checkpoint_migrates_in_the_usual_resume_order():
    torch.manual_seed(5)
    source = Net()
    sopt = torch.optim.AdamW(source.parameters(), **HP)
    for s in range(2):  # `late` gets no gradient: the checkpoint has no state for it
        x = torch.randn(16, 24, generator=torch.Generator().manual_seed(s))
        source(x, s).pow(2).mean().backward()
        sopt.step()
        sopt.zero_grad()
    ck = roundtrip({"model": source.state_dict(), "optim": sopt.state_dict()})
    assert len(ck["optim"]["state"]) == 4

    model, opt = fresh(seed=1)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optim"])
    for name, value in model.state_dict().items():
        assert torch.equal(value, ck["model"][name].to(value.dtype)), name

    ref = Net()
    ref.load_state_dict(ck["model"])
    ropt = torch.optim.AdamW(ref.parameters(), **HP)
    ropt.load_state_dict(ck["optim"])
    for s in range(2, 9):
        x = torch.randn(16, 24, generator=torch.Generator().manual_seed(s))
        model(x.to(torch.bfloat16), s).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x, s).pow(2).mean().backward()
        ropt.step()
        ropt.zero_grad()
    for rec, (name, p) in zip(records_of(opt), ref.named_parameters()):
        # the masters start from the bf16 weights the model holds: bf16 rounding apart
        assert float((rec.master.view(rec.shape) - p.detach()).norm() / p.detach().norm()) < 1e-2, name
