# overlap_forward on CUDA (marked gpu, skipped without CUDA): the copies to the device and
# the next forward are ordered by events and the forward pre-hooks, for real streams.
#   - a plain module and FSDP2 (one rank), with the CPU kernel slowed so that step()
#     returns with chunks in flight: masters, moments and compute copies equal the run
#     without the option bit for bit;
#   - a deliberately slow compute stream: a forward right after step(), and one between the
#     last backward and step(), read exactly the weights the host masters round to.
# Run: pytest -m gpu tests/gpu/test_gpu_forward_overlap.py
import time

import pytest
import torch

from cpu_offload import kernels, offload_optimizer
from helpers import LM, loss_fn, make_opt, records_of, shard_blocks, tokens
from test_gpu_ordering import Net, fresh_forward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def slow_kernels(monkeypatch, delay_s=0.005):
    real = kernels.adamw_step

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return real(*args, **kwargs)
    monkeypatch.setattr(kernels, "adamw_step", slow)


def run(fsdp, overlap, steps=5):
    torch.manual_seed(0)
    model = LM().cuda()
    if fsdp:
        model = shard_blocks(model)
    opt = offload_optimizer(make_opt(model), offload="full", pinned_bytes=1 << 22, num_slots=8,
                            overlap_forward=model if overlap else None)
    landing = 0
    for s in range(steps):
        loss_fn(model, tokens(s)).backward()
        opt.step()
        landing += opt._proto.landing
        opt.zero_grad()
    with torch.no_grad():
        out = model(tokens(steps)[:, :-1]).float().cpu()
    state = {r.name: (r.master.clone(), r.exp_avg.clone(), r.exp_avg_sq.clone(), r.step, r.local().detach().cpu())
             for r in records_of(opt)}
    opt.close()
    return out, state, landing


@pytest.mark.parametrize("fsdp", [False, True])
def test_overlap_equals_the_plain_run_bit_for_bit(monkeypatch, request, fsdp):
    if fsdp:
        request.getfixturevalue("single_rank_group")
    slow_kernels(monkeypatch)
    want_out, want, _ = run(fsdp, overlap=False)
    out, got, landing = run(fsdp, overlap=True)
    assert landing >= 3  # step() returned with chunks in flight
    assert torch.equal(out, want_out)
    assert got.keys() == want.keys()
    for n in want:
        for x, y in zip(got[n], want[n]):
            assert x == y if not torch.is_tensor(x) else torch.equal(x, y), n


def test_forwards_read_the_new_weights_under_a_slow_compute_stream(monkeypatch):
    slow_kernels(monkeypatch)
    torch.manual_seed(0)
    model = Net().cuda()
    opt = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), offload="full",
                            pinned_bytes=1 << 22, num_slots=4, overlap_forward=model)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    landing = 0
    for s in range(6):
        model(x).float().pow(2).mean().backward()
        if s % 2:  # waits for every chunk: the step after it has nothing in flight
            with torch.no_grad():
                early = model(x)  # between the last backward and step()
            assert torch.equal(early, fresh_forward(opt, model, x))
        opt.step()
        landing += opt._proto.landing
        with torch.no_grad():
            late = model(x)  # right after step(), the step's last chunks in flight
        assert torch.equal(late, fresh_forward(opt, model, x))
        opt.zero_grad()
    assert landing >= 2
    opt.close()
