# The reference and the native AdamW against torch.optim.AdamW (fused and foreach) over
# many steps, and the native kernels of every ISA against the reference, bit for bit (fp32
# and bf16 gradients, fp32 and bf16 moments).
import pytest
import torch

from cpu_offload import kernels
from cpu_offload.reference import adamw_reference_, sign_sgd_inverse_reference_, sign_sgd_reference_
from helpers import gen, isa_params

HYPERS = [
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1),
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-10, weight_decay=0.0),
]
SHAPES = [(33,), (4099,), (64, 65), (1,)]


def _relative_error(ours, theirs):
    """max |ours - theirs| / max |theirs|."""
    theirs = theirs.flatten()
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.mark.parametrize("hyper", HYPERS)
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_native_adamw_matches_torch_adamw_over_200_steps(hyper, impl):
    g = gen(len(impl) + int(hyper["lr"] * 1e4))
    torch_params = [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]
    opt = torch.optim.AdamW(torch_params, **hyper, **{impl: True})
    masters = [p.detach().clone().flatten() for p in torch_params]
    m = [torch.zeros_like(p) for p in masters]
    v = [torch.zeros_like(p) for p in masters]
    steps = torch.zeros(len(masters), dtype=torch.int64)
    beta1, beta2 = hyper["betas"]
    for _ in range(200):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        for p, gr in zip(torch_params, grads):
            p.grad = gr.clone()
        opt.step()
        kernels.adamw_step(masters, [gr.flatten() for gr in grads], m, v, steps, lr=hyper["lr"], beta1=beta1,
                           beta2=beta2, eps=hyper["eps"], weight_decay=hyper["weight_decay"])
    for i, p in enumerate(torch_params):
        state = opt.state[p]
        torch.testing.assert_close(masters[i], p.detach().flatten(), rtol=1e-5, atol=1e-7)
        # NOTE: moments are sums of signed terms, so single elements near zero carry a large
        # elementwise relative error from ordinary float32 rounding; the bound is normwise.
        assert _relative_error(m[i], state["exp_avg"]) <= 1e-5
        assert _relative_error(v[i], state["exp_avg_sq"]) <= 1e-5
        assert steps[i].item() == int(state["step"].item()) == 200


def _same_bits(a, b):
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_native_kernels_equal_reference_bitwise(isa, grad_dtype, moment_dtype):
    g = gen(5)
    n = 10007
    p = torch.randn(n, generator=g)
    m, v = torch.zeros(n, dtype=moment_dtype), torch.zeros(n, dtype=moment_dtype)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    steps = torch.zeros(1, dtype=torch.int64)
    hyper = dict(lr=2e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.25)
    for step in range(1, 31):
        grad = torch.randn(n, generator=g).to(grad_dtype)
        with kernels.use_isa(isa):
            kernels.adamw_step([p], [grad], [m], [v], steps, **hyper)
        adamw_reference_(rp, grad, rm, rv, step, **hyper)
    assert _same_bits(p, rp) and _same_bits(m, rm) and _same_bits(v, rv)
    sp, rsp = p.clone(), p.clone()
    for _ in range(10):
        grad = torch.randn(n, generator=g).to(grad_dtype)
        grad[::7] = 0
        with kernels.use_isa(isa):
            kernels.sign_sgd_step([sp], [grad], lr=1e-2, weight_decay=0.05)
        sign_sgd_reference_(rsp, grad, lr=1e-2, weight_decay=0.05)
    assert torch.equal(sp, rsp)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_scale", [0.0, 1e-30, 0.3, 0.5, 4.0])
def test_sign_sgd_takes_the_sign_of_the_scaled_gradient_as_torch_clips_it(isa, grad_dtype, grad_scale):
    # sign(g*c) differs from sign(g) where g*c rounds to 0: c = 0, or tiny gradients (subnormal
    # fp32 ones with c <= 0.5, or any with c = 1e-30).
    g = gen(9)
    n = 4099
    p = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g)
    grad[::3] *= 2.0 ** -140  # near the bottom of the fp32 range
    grad[1::11] = torch.finfo(torch.float32).smallest_normal * 2.0 ** -23  # the smallest subnormal
    grad = grad.to(grad_dtype)
    scaled = grad.float() * torch.tensor(grad_scale, dtype=torch.float32)  # torch's clip: g * coefficient
    forward, ref = p.clone(), p.clone()
    with kernels.use_isa(isa):
        kernels.sign_sgd_step([forward], [grad], lr=1e-2, weight_decay=0.05, grad_scale=grad_scale)
    sign_sgd_reference_(ref, scaled, lr=1e-2, weight_decay=0.05)
    assert torch.equal(forward, ref)
    inverse, ref_inverse = forward.clone(), forward.clone()
    with kernels.use_isa(isa):
        kernels.sign_sgd_inverse_step([inverse], [grad], lr=1e-2, weight_decay=0.05, grad_scale=grad_scale)
    sign_sgd_inverse_reference_(ref_inverse, scaled, lr=1e-2, weight_decay=0.05)
    assert torch.equal(inverse, ref_inverse)
