# cpu_offload.SignSGD (a torch optimizer) equals the native sign_sgd kernel bit for bit.
import pytest
import torch

from cpu_offload import SignSGD, kernels
from helpers import gen


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_sign_sgd_optimizer_equals_kernel(weight_decay):
    g = gen(9)
    params = [torch.randn(s, generator=g).requires_grad_() for s in [(17,), (32, 33)]]
    opt = SignSGD(params, lr=1e-2, weight_decay=weight_decay)
    flat = [p.detach().clone().flatten() for p in params]
    for _ in range(20):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        grads[0][::3] = 0
        for p, gr in zip(params, grads):
            p.grad = gr
        opt.step()
        kernels.sign_sgd_step(flat, [gr.flatten() for gr in grads], lr=1e-2, weight_decay=weight_decay)
    for p, f in zip(params, flat):
        assert torch.equal(p.detach().flatten(), f)


def test_sign_sgd_skips_params_without_grad_and_validates():
    p = torch.ones(3, requires_grad=True)
    SignSGD([p], lr=0.5).step()
    assert torch.equal(p.detach(), torch.ones(3))
    with pytest.raises(ValueError, match="lr"):
        SignSGD([p], lr=-1.0)
    with pytest.raises(ValueError, match="weight_decay"):
        SignSGD([p], lr=1.0, weight_decay=-1.0)
    for bad in ("0.1", None, True):
        with pytest.raises(TypeError, match="lr"):
            SignSGD([p], lr=bad)
        with pytest.raises(TypeError, match="weight_decay"):
            SignSGD([p], weight_decay=bad)


def test_sign_sgd_works_with_bf16_params_and_lr_scheduler():
    p = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    opt = SignSGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        p.grad = torch.tensor([1.0, -1.0, 0.0, 2.0], dtype=torch.bfloat16)
        opt.step()
        sched.step()
    assert p.detach().tolist() == [-1.5, 1.5, 0.0, -1.5]
