# StateOffloadOptimizer (offload="optimizer") on CPU parameters: the state moves
# between separate host buffers and working tensors around each step, exactly
# as it does between pinned host RAM and the GPU.
import io

import torch
import torch.nn as nn

from cpu_offload.optim import SignSGD
from cpu_offload.state_offload import StateOffloadOptimizer


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    data = [torch.randn(8, 12, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    return model, data


def train(model, opt, data, clip=None):
    for x in data:
        model(x).pow(2).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # grads stay on the device
        opt.step()
        opt.zero_grad()


def test_equals_wrapped_optimizer_bitwise():
    m1, data = model_and_data()
    m2, _ = model_and_data()
    plain = torch.optim.AdamW(m1.parameters(), lr=1e-2, weight_decay=0.1)
    wrapped = StateOffloadOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1))
    train(m1, plain, data, clip=0.5)
    train(m2, wrapped, data, clip=0.5)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    # between steps the moments are the host buffers, not the working copies
    for p in m2.parameters():
        assert wrapped.state[p]["exp_avg"] is wrapped._host[(id(p), "exp_avg")]
    assert wrapped.param_groups is wrapped.optimizer.param_groups


def test_state_dict_round_trip_and_scheduler():
    m1, data = model_and_data()
    opt = StateOffloadOptimizer(SignSGD(m1.parameters(), lr=1e-2, weight_decay=0.01))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    train(m1, opt, data[:3])
    sched.step()
    assert abs(opt.param_groups[0]["lr"] - 9e-3) < 1e-12

    m2, _ = model_and_data()
    m3, _ = model_and_data()
    a = StateOffloadOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2))
    train(m2, a, data[:3])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    m3.load_state_dict(m2.state_dict())
    b = StateOffloadOptimizer(torch.optim.AdamW(m3.parameters(), lr=1e-2))
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    for p in m3.parameters():
        assert b.state[p]["exp_avg"] is b._host[(id(p), "exp_avg")]
    train(m2, a, data[3:])
    train(m3, b, data[3:])
    for x, y in zip(m2.parameters(), m3.parameters()):
        assert torch.equal(x, y)


def test_add_param_group_passes_through():
    model, data = model_and_data()
    opt = StateOffloadOptimizer(torch.optim.AdamW(model[0].parameters(), lr=1e-2))
    opt.add_param_group({"params": model[2].parameters(), "lr": 1e-3})
    train(model, opt, data[:2])
    assert len(opt.state) == 4
