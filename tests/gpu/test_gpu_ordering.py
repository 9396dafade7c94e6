# Full offload on CUDA with a deliberately slow compute stream (marked gpu,
# skipped without CUDA): every hand-off between the compute stream, the copy
# streams and the CPU worker is ordered by events, so work issued after the
# final backward and before step() sees the finished new weights, and a second
# backward before step() gets the library's error, never a race.
# Run: pytest -m gpu tests/gpu/test_gpu_ordering.py
import pytest
import torch
import torch.nn as nn

from cpu_offload import offload_optimizer
from helpers import records_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time per delay


class Delay(torch.autograd.Function):
    """Identity whose backward first keeps the compute stream busy."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        torch.cuda._sleep(SLEEP_CYCLES)
        return g


class Net(nn.Module):
    def __init__(self, d=512, blocks=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = Delay.apply(torch.tanh(b(x)))
        return x


def fresh_forward(opt, model, x):
    """The forward with compute weights rebuilt from the host masters (read from the records:
    ``opt.state`` refuses reads between the window's last backward and step())."""
    torch.cuda.synchronize()
    ref = Net().cuda().to(torch.bfloat16)
    masters = {id(r.param): r.master for r in records_of(opt)}
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            q.copy_(masters[id(p)].view(p.shape).to(torch.bfloat16))
    return ref(x)


@pytest.mark.parametrize("accum", [1, 2])
def test_forward_before_step_sees_new_weights_under_a_slow_compute_stream(accum):
    torch.manual_seed(0)
    model = Net().cuda()
    opt = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), offload="full",
                            grad_accum_steps=accum, pinned_bytes=1 << 20, num_slots=2)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    for _ in range(4):
        for _ in range(accum):
            model(x).float().pow(2).mean().backward()
        with torch.no_grad():
            early = model(x)  # issued before step(), behind the delayed backward
        assert torch.equal(early, fresh_forward(opt, model, x))
        with pytest.raises(RuntimeError, match=r"call step\(\) \(or zero_grad\(\)\) after every window"):
            model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            assert torch.equal(model(x), fresh_forward(opt, model, x))
    assert opt.stats()["chunks"] > 1
    opt.close()
