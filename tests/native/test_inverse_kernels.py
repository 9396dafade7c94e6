# The native inverse steps (kernels.adamw_inverse_step, kernels.sign_sgd_inverse_step):
# every ISA equals the pure-torch reference bit for bit (fp32 and bf16 gradients and
# moments, sizes 0 to 1,000,003, any thread count and split, Inf/NaN/denormals); a forward
# step then its inverse gives the old state back within the bound of rollback.py's header;
# the native rollback equals the torch-op rollback it replaced wherever torch's float32
# sqrt is correctly rounded; invalid input raises an exception naming the argument.
import math

import pytest
import torch

from cpu_offload import _C, kernels
from cpu_offload.reference import adamw_inverse_reference_, sign_sgd_inverse_reference_
from cpu_offload._full.rollback import rollback_sign_sgd_
from helpers import gen, isa_params

SIZES = [0, 1, 7, 16, 33, 4099, 1_000_003]
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.5)
_INTS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _assert_same_bits(a, b):
    """Bit equality; a NaN matches a NaN of any sign and payload."""
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        nan = torch.isnan(x)
        assert torch.equal(nan, torch.isnan(y))
        assert torch.equal(x[~nan].view(_INTS[x.dtype]), y[~nan].view(_INTS[y.dtype]))


def _with_specials(t, g):
    """t with Inf, -Inf, NaN, denormals and signed zeros at random places (in its dtype)."""
    t = t.clone()
    n = t.numel()
    if n == 0:
        return t
    specials = torch.tensor([math.inf, -math.inf, math.nan, 1e-40, -1e-40, 0.0, -0.0, 1e-45])
    at = torch.randint(0, n, (max(1, n // 50),), generator=g)
    t[at] = specials[torch.randint(0, len(specials), (len(at),), generator=g)].to(t.dtype)
    return t


def _state(numels, grad_dtype, moment_dtype, seed, specials=True):
    g = gen(seed)
    state = dict(params=[], grads=[], exp_avgs=[], exp_avg_sqs=[])
    for n in numels:
        p, gr = torch.randn(n, generator=g), torch.randn(n, generator=g).to(grad_dtype)
        m = (torch.randn(n, generator=g) * 0.1).to(moment_dtype)
        v = (torch.rand(n, generator=g) * 0.01).to(moment_dtype)
        if specials:
            p, gr, m, v = (_with_specials(t, g) for t in (p, gr, m, v))
            v = v.abs()  # a second moment is never negative
        for k, t in zip(state, (p, gr, m, v)):
            state[k].append(t)
    state["steps"] = torch.arange(1, len(numels) + 1, dtype=torch.int64) * 3
    return state


def _clone(state):
    return {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone()) for k, v in state.items()}


def _reference(state, hyper):
    ref = _clone(state)
    for i in range(len(ref["params"])):
        adamw_inverse_reference_(ref["params"][i], ref["grads"][i], ref["exp_avgs"][i], ref["exp_avg_sqs"][i],
                                 int(ref["steps"][i]), **hyper)
    return ref


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_adamw_inverse_equals_reference_bitwise(isa, grad_dtype, moment_dtype, threads, split_everything):
    state = _state(SIZES, grad_dtype, moment_dtype, seed=threads)
    ref = _reference(state, HYPER)
    _C.set_num_threads(threads)  # NOTE: up to 3 workers on 2 CPUs on purpose, see test_kernels.py
    with kernels.use_isa(isa):
        kernels.adamw_inverse_step(state["params"], state["grads"], state["exp_avgs"], state["exp_avg_sqs"],
                                   state["steps"], **HYPER)
    for k in ("params", "exp_avgs", "exp_avg_sqs"):
        _assert_same_bits(state[k], ref[k])
    assert torch.equal(state["steps"], ref["steps"])  # read only


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("hyper", [
    dict(HYPER, beta1=0.0), dict(HYPER, beta2=0.0), dict(HYPER, lr=0.5, weight_decay=2.0),   # decay == 0
    dict(HYPER, lr=0.5, weight_decay=3.0), dict(HYPER, weight_decay=0.0, grad_scale=1.0),     # decay < 0; == 1
])
def test_adamw_inverse_edge_hyperparameters_equal_reference(isa, hyper, split_everything):
    state = _state([1, 37, 5000], torch.float32, torch.float32, seed=7)
    ref = _reference(state, hyper)
    with kernels.use_isa(isa):
        kernels.adamw_inverse_step(state["params"], state["grads"], state["exp_avgs"], state["exp_avg_sqs"],
                                   state["steps"], **hyper)
    for k in ("params", "exp_avgs", "exp_avg_sqs"):
        _assert_same_bits(state[k], ref[k])
    if hyper["beta1"] == 0.0:
        assert all(not m.any() for m in state["exp_avgs"])


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("weight_decay", [0.1, 0.0, 1 / 0.02])  # the last: decay == 0
def test_sign_sgd_inverse_equals_reference_bitwise(isa, grad_dtype, threads, weight_decay, split_everything):
    state = _state(SIZES, grad_dtype, torch.float32, seed=11)
    for gr in state["grads"]:
        gr[::5] = 0  # sign(0) = 0
    params, ref = state["params"], [p.clone() for p in state["params"]]
    for p, gr in zip(ref, state["grads"]):
        sign_sgd_inverse_reference_(p, gr, lr=0.02, weight_decay=weight_decay)
    _C.set_num_threads(threads)
    with kernels.use_isa(isa):
        kernels.sign_sgd_inverse_step(params, state["grads"], lr=0.02, weight_decay=weight_decay)
    _assert_same_bits(params, ref)


def _ulp(x):
    """The spacing of float32 at |x| (at least the smallest normal's)."""
    x = x.abs().clamp_min(torch.finfo(torch.float32).tiny)
    return torch.nextafter(x, torch.tensor(math.inf)) - x


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_forward_then_inverse_recovers_the_state(grad_dtype, moment_dtype):
    """Within rollback.py's bound: masters about one ulp of the larger of p0, p1 (fp32 moments)
    or |u| * 2**-8 (bf16 moments) away, moments a few ulps of the larger of their terms (one
    bf16 ulp of it)."""
    g = gen(3)
    n = 100_003
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g).to(grad_dtype)
    m0 = (torch.randn(n, generator=g) * 0.1).to(moment_dtype)
    v0 = (torch.rand(n, generator=g) * 0.01).to(moment_dtype)
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    steps = torch.full((1,), 4, dtype=torch.int64)
    kernels.adamw_step([p], [grad], [m], [v], steps, **HYPER)
    u = (p - p0 * (1 - HYPER["lr"] * HYPER["weight_decay"])).abs()
    p1, m1, v1 = p.clone(), m.float(), v.float()
    kernels.adamw_inverse_step([p], [grad], [m], [v], steps, **HYPER)
    assert int(steps) == 5
    gs = grad.float() * HYPER["grad_scale"]
    b1, b2 = HYPER["beta1"], HYPER["beta2"]
    # the larger of each moment's terms, over its beta: what the rounding errors scale with
    m_terms = torch.maximum(m1.abs(), ((1 - b1) * gs).abs()) / b1
    v_terms = torch.maximum(v1, (1 - b2) * gs * gs) / b2
    if moment_dtype == torch.float32:
        assert ((p - p0).abs() <= 2 * _ulp(torch.maximum(p0.abs(), p1.abs()))).all()
        assert ((m.float() - m0.float()).abs() <= 4 * _ulp(m_terms)).all()
        assert ((v.float() - v0.float()).abs() <= 4 * _ulp(v_terms)).all()
    else:
        # NOTE: "about 2**-8 of |u|": half a bf16 ulp of m1 (up to 2**-8 of it) plus half that
        # of v1 through the sqrt, so at most 1.5 * 2**-8 (1.42 * 2**-8 seen here)
        assert ((p - p0).abs() <= u * 1.5 * 2**-8 + 2 * _ulp(p0)).all()
        assert ((m.float() - m0.float()).abs() <= m_terms * 2**-7).all()  # one bf16 ulp of the terms
        assert ((v.float() - v0.float()).abs() <= v_terms * 2**-7).all()


def _torch_op_rollback_adamw_(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay,
                              grad_scale=1.0):
    """The rollback as torch ops, as it was before the native inverse (for comparison only)."""
    bias_correction1 = 1.0 - beta1 ** step
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    decay = 1.0 - lr * weight_decay
    g = grad.to(torch.float32, copy=True)
    if grad_scale != 1.0:
        g.mul_(grad_scale)
    m1 = exp_avg if exp_avg.dtype == torch.float32 else exp_avg.float()
    v1 = exp_avg_sq if exp_avg_sq.dtype == torch.float32 else exp_avg_sq.float()
    u = torch.sqrt(v1).add_(eps * bc2_sqrt)
    u = torch.mul(m1, -(lr * bc2_sqrt / bias_correction1)).div_(u)
    param.sub_(u)
    if decay != 0.0:
        param.div_(decay)
    m1.sub_(torch.mul(g, 1.0 - beta1, out=u)).div_(beta1)
    torch.mul(g, 1.0 - beta2, out=u).mul_(g)
    v1.sub_(u).div_(beta2).clamp_(min=0.0)
    if m1 is not exp_avg:
        exp_avg.copy_(m1)
        exp_avg_sq.copy_(v1)


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_native_rollback_equals_the_torch_op_rollback_where_its_sqrt_is_correctly_rounded(moment_dtype):
    """NOTE: torch's float32 CPU sqrt is not correctly rounded for some inputs; the native
    inverse uses the forward's correctly rounded sqrt, so its u has the forward's bits."""
    state = _state([200_003], torch.bfloat16, moment_dtype, seed=5, specials=False)
    old, new = _clone(state), _clone(state)
    def args(s):
        return s["params"][0], s["grads"][0], s["exp_avgs"][0], s["exp_avg_sqs"][0], 3

    _torch_op_rollback_adamw_(*args(old), **HYPER)
    # NOTE: the native inverse alone: rollback_adamw_ then keeps the moments AdamW can reach,
    # which this random state is not (tests/full/test_window_faults.py checks that part)
    param, grad, exp_avg, exp_avg_sq, step = args(new)
    kernels.adamw_inverse_step([param], [grad], [exp_avg], [exp_avg_sq], torch.tensor([step]), **HYPER)
    v1 = state["exp_avg_sqs"][0].float()
    sqrt_exact = torch.sqrt(v1).view(torch.int32) == torch.sqrt(v1.double()).float().view(torch.int32)
    for k in ("exp_avgs", "exp_avg_sqs"):  # no sqrt in the moments' inverse
        _assert_same_bits(old[k], new[k])
    _assert_same_bits([old["params"][0][sqrt_exact]], [new["params"][0][sqrt_exact]])
    differ = (old["params"][0] != new["params"][0]).sum().item()
    assert differ <= (~sqrt_exact).sum().item()


def test_rollback_sign_sgd_equals_the_torch_op_rollback():
    state = _state([70_001], torch.bfloat16, torch.float32, seed=9, specials=False)
    p, grad = state["params"][0], state["grads"][0]
    old = p.clone()
    old.add_(torch.sign(grad).to(torch.float32).mul_(0.01))
    old.div_(1.0 - 0.01 * 0.1)
    rollback_sign_sgd_(p, grad, lr=0.01, weight_decay=0.1)
    _assert_same_bits([p], [old])


def _good():
    return dict(params=[torch.zeros(8)], grads=[torch.zeros(8)], exp_avgs=[torch.zeros(8)],
                exp_avg_sqs=[torch.zeros(8)], steps=torch.ones(1, dtype=torch.int64))


@pytest.mark.parametrize("change, error, words", [
    (lambda a, h: a.update(params=[torch.zeros(8, dtype=torch.float64)]), TypeError, ["params[0]", "float64"]),
    (lambda a, h: a.update(grads=[torch.zeros(8, dtype=torch.int32)]), TypeError, ["grads[0]"]),
    (lambda a, h: a.update(grads=[torch.zeros(7)]), ValueError, ["grads[0]", "7 elements"]),
    (lambda a, h: a.update(exp_avgs=[]), ValueError, ["exp_avgs", "expected 1"]),
    (lambda a, h: a.update(exp_avg_sqs=[torch.zeros(8, dtype=torch.bfloat16)]), ValueError, ["exp_avg_sqs"]),
    (lambda a, h: a.update(params=[torch.zeros(16)[::2]]), ValueError, ["params[0]", "contiguous"]),
    (lambda a, h: a.update(grads=a["params"]), ValueError, ["overlap"]),
    (lambda a, h: a.update(grads=(1,)), TypeError, ["grads[0]"]),
    (lambda a, h: a.update(steps=[1]), TypeError, ["steps"]),
    (lambda a, h: a.update(steps=torch.ones(1, dtype=torch.int32)), ValueError, ["steps", "int64"]),
    (lambda a, h: a.update(steps=torch.ones(2, dtype=torch.int64)), ValueError, ["steps", "2 entries"]),
    (lambda a, h: a.update(steps=torch.zeros(1, dtype=torch.int64)), ValueError, ["steps[0]", ">= 1"]),
    (lambda a, h: h.update(beta1=1.0), ValueError, ["beta1"]),
    (lambda a, h: h.update(beta2=-0.1), ValueError, ["beta2"]),
    (lambda a, h: h.update(lr=math.nan), ValueError, ["lr"]),
    (lambda a, h: h.update(eps="1e-8"), TypeError, ["eps"]),
    (lambda a, h: h.update(grad_scale=math.inf), ValueError, ["grad_scale"]),
])
def test_adamw_inverse_rejects_bad_input(change, error, words):
    args, hyper = _good(), dict(HYPER)
    change(args, hyper)
    with pytest.raises(error) as info:
        kernels.adamw_inverse_step(args["params"], args["grads"], args["exp_avgs"], args["exp_avg_sqs"],
                                   args["steps"], **hyper)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_sign_sgd_inverse_rejects_bad_input():
    with pytest.raises(TypeError, match=r"grads\[0\]"):
        kernels.sign_sgd_inverse_step([torch.zeros(4)], [torch.zeros(4, dtype=torch.int64)], lr=0.1,
                                      weight_decay=0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        kernels.sign_sgd_inverse_step([torch.zeros(4)], [torch.zeros(4)], lr=0.1, weight_decay=-1.0)
    with pytest.raises(ValueError, match=r"grads\[0\] has 3 elements"):
        kernels.sign_sgd_inverse_step([torch.zeros(4)], [torch.zeros(3)], lr=0.1, weight_decay=0.0)


def test_native_entry_points_take_keywords_only():
    with pytest.raises(TypeError):
        _C.adamw_inverse(None, 0, 0, 0, 1e-3, 0.9, 0.99, 1e-8, 0.0, 1.0)
