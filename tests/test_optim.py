# cpu_offload.SignSGD (a torch optimizer) equals the native sign_sgd kernel bit for bit; it
# refuses a bad lr or weight_decay in any param group, and so does full offload's
# read_hparams, values whose float32 constants overflow included.
import numpy as np
import pytest
import torch
import torch.nn as nn

from cpu_offload import SignSGD, kernels
from cpu_offload._full.options import read_hparams
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


def _sign_sgd_group_error(group, error, words):
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(error, match=words):
        SignSGD([{"params": [torch.zeros(2, requires_grad=True)]}, dict(group, params=[p])], lr=0.1)


@pytest.mark.parametrize("group, error, words", [
    (dict(lr=-1.0), ValueError, r"param_groups\[1\]\['lr'\] is -1.0: it must be finite and >= 0"),
    (dict(lr=float("inf")), ValueError, r"param_groups\[1\]\['lr'\] is inf"),
    (dict(weight_decay=float("nan")), ValueError, r"param_groups\[1\]\['weight_decay'\] is nan"),
    (dict(lr="0.1"), TypeError, r"param_groups\[1\]\['lr'\] must be a number, got '0.1'"),
    (dict(weight_decay=torch.tensor(0.1)), TypeError, r"param_groups\[1\]\['weight_decay'\] must be a number"),
    (dict(lr=1e39), ValueError, r"param_groups\[1\]\['lr'\] is 1e\+39, which overflows float32"),
    (dict(weight_decay=2**1100), ValueError, r"param_groups\[1\]\['weight_decay'\] is \d+: it must be finite"),
    (dict(lr=1e20, weight_decay=1e20), ValueError,
     r"param_groups\[1\]\['weight_decay'\] gives 1 - lr \* weight_decay = -1e\+40, which overflows float32"),
])
def test_sign_sgd_refuses_a_bad_group_at_construction(group, error, words):
    _sign_sgd_group_error(group, error, words)


def test_sign_sgd_refuses_bad_groups_added_loaded_or_edited_later():
    p, q = torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)
    opt = SignSGD([p], lr=0.5)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['lr'\] is nan"):
        opt.add_param_group({"params": [q], "lr": float("nan")})
    assert len(opt.param_groups) == 1  # refused before it was added
    opt.add_param_group({"params": [q], "weight_decay": 0.1})  # the defaults fill the rest
    state = opt.state_dict()
    state["param_groups"][0]["lr"] = -5.0
    opt.load_state_dict(state)
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\] is -5.0"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(3))  # nothing stepped
    opt.param_groups[0]["lr"] = 0.5
    opt.param_groups[1]["weight_decay"] = float("inf")
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['weight_decay'\] is inf"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(3))  # checked before any group steps
    opt.param_groups[1]["weight_decay"] = 0.0
    opt.step()
    assert torch.equal(p.detach(), torch.full((3,), -0.5))


@pytest.mark.parametrize("number", [np.float32, np.float16, float])
def test_sign_sgd_with_numpy_hyperparameters_equals_the_kernel_bitwise(number):
    """With lr and weight_decay given as numpy float32 (or float16) scalars, SignSGD computed
    1 - lr*wd in that precision, where the kernel (and so full offload) computes it in double
    and rounds once: about one pair in five stepped to other bits."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    for _ in range(40):
        lr, wd = (number(float(v)) for v in torch.rand(2, generator=g, dtype=torch.float64) * torch.tensor([1.0, 0.5]))
        p = torch.randn(64, generator=g)
        grad = torch.randn(64, generator=g)
        flat = p.clone()
        param = nn.Parameter(p.clone())
        param.grad = grad.clone()
        SignSGD([param], lr=lr, weight_decay=wd).step()
        kernels.sign_sgd_step([flat], [grad], lr=lr, weight_decay=wd)
        assert torch.equal(param.detach(), flat), (lr, wd)


def test_sign_sgd_refuses_a_sparse_gradient_before_any_parameter_steps():
    """The dense parameter before an Embedding(sparse=True) was stepped when the sparse
    gradient was met; refused before any parameter changes now, as torch's AdamW refuses."""
    dense = torch.nn.Parameter(torch.zeros(3))
    emb = torch.nn.Embedding(4, 2, sparse=True)
    table = emb.weight.detach().clone()
    opt = SignSGD([{"params": [dense]}, {"params": [emb.weight], "weight_decay": 0.1}], lr=0.5)
    (dense.sum() + emb(torch.tensor([1])).sum()).backward()
    with pytest.raises(RuntimeError, match="SignSGD does not support sparse gradients") as refused:
        opt.step()
    assert torch.equal(dense.detach(), torch.zeros(3)) and torch.equal(emb.weight.detach(), table)
    assert "param_groups[1][0]" in str(refused.value)
    emb.weight.grad = None
    opt.step()
    assert torch.equal(dense.detach(), torch.full((3,), -0.5))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64])
def test_sign_sgd_refuses_a_parameter_it_cannot_step_before_any_parameter_steps(dtype):
    """A complex or integer parameter failed inside torch.sign or the in-place update, after
    the parameters before it (and its own weight decay) had been stepped."""
    dense = torch.nn.Parameter(torch.ones(3))
    odd = torch.nn.Parameter(torch.ones(2, dtype=dtype), requires_grad=False)
    odd.grad = torch.ones(2, dtype=dtype)
    dense.grad = torch.ones(3)
    opt = SignSGD([dense, odd], lr=0.1, weight_decay=0.5)
    with pytest.raises(TypeError, match=r"floating-point.*param_groups\[0\]\[1\]"):
        opt.step()
    assert torch.equal(dense.detach(), torch.ones(3)) and torch.equal(odd, torch.ones(2, dtype=dtype))


def test_sign_sgd_accepts_large_values_whose_float32_constants_are_finite():
    p = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    opt = SignSGD([p], lr=1e30, weight_decay=1e-31)
    p.grad = torch.tensor([1.0, 0.0, -1.0])
    opt.step()
    flat = torch.tensor([1.0, 2.0, 3.0])
    kernels.sign_sgd_step([flat], [p.grad], lr=1e30, weight_decay=1e-31)
    assert torch.equal(p.detach(), flat) and torch.isfinite(flat).all()


@pytest.mark.parametrize("algorithm, group, words", [
    ("adamw", dict(lr=1e39), r"param_groups\[1\]\['lr'\] is 1e\+39, which overflows float32"),
    ("adamw", dict(eps=1e39), r"param_groups\[1\]\['eps'\] is 1e\+39, which overflows float32"),
    ("adamw", dict(eps=5e-45), r"param_groups\[1\]\['eps'\] gives eps \* sqrt\(1 - beta2\) = 1.58e-46 at step 1, "
                               r"which rounds to 0 in float32"),
    ("adamw", dict(weight_decay=1e42), r"param_groups\[1\]\['weight_decay'\] is 1e\+42, which overflows"),
    ("adamw", dict(lr=1e20, weight_decay=1e20), r"param_groups\[1\]\['weight_decay'\] gives 1 - lr \* weight_decay"),
    ("adamw", dict(lr=1e33, betas=(0.999999, 0.0)),
     r"param_groups\[1\]\['lr'\] gives the bias-corrected step size .* = 1e\+39, which overflows float32"),
    ("sign_sgd", dict(lr=1e39), r"param_groups\[1\]\['lr'\] is 1e\+39, which overflows float32"),
    ("sign_sgd", dict(lr=1e20, weight_decay=1e20), r"param_groups\[1\]\['weight_decay'\] gives 1 - lr"),
])
def test_read_hparams_refuses_groups_whose_float32_constants_overflow(algorithm, group, words):
    good = dict(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    with pytest.raises(ValueError, match=words):
        read_hparams([good, dict(good, **group)], algorithm)
    large = dict(good, lr=1e30, weight_decay=1e-31)  # every derived constant is finite
    assert read_hparams([large], algorithm)[0]["lr"] == 1e30
