# Native kernels: every ISA equals the scalar path bit for bit (sizes, offsets, threads,
# splits, fp32 and bf16 moments); bf16 outputs and bf16 moments equal
# tensor.to(torch.bfloat16) of the fp32 values; every invalid input raises a
# Python exception naming the argument; the validation cache re-validates changed tensors.
# (Sequences that used to abort or corrupt the process: test_native_safety.py.)
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from cpu_offload import _C, kernels
from helpers import gen, isa_params

SIZES = [0, 1, 15, 16, 17, 31, 33, 4099, 1 << 20]
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.5)


def _views(numels, offset, dtype, g, scale=1.0, positive=False):
    """Tensors that start `offset` elements into a larger buffer (unaligned views)."""
    out = []
    for n in numels:
        base = torch.rand(n + offset, generator=g) if positive else torch.randn(n + offset, generator=g)
        out.append((base * scale).to(dtype)[offset:])
    return out


def _adamw_state(numels, offset, grad_dtype, seed, moment_dtype=torch.float32):
    g = gen(seed)
    return dict(
        params=_views(numels, offset, torch.float32, g),
        grads=_views(numels, offset, grad_dtype, g),
        exp_avgs=_views(numels, offset, moment_dtype, g, 0.1),
        exp_avg_sqs=_views(numels, offset, moment_dtype, g, 0.01, positive=True),
        steps=torch.arange(len(numels), dtype=torch.int64) * 3,
    )


def _clone(state):
    return {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone()) for k, v in state.items()}


def _use_threads(n):
    # NOTE: through _C: up to 3 workers even on a 2-CPU machine, on purpose (results must not
    # depend on the worker count); kernels.set_num_threads refuses more than the CPUs.
    _C.set_num_threads(n)


def _run_adamw(state, out_dtype, isa, threads, steps=2, out_offset=0):
    _use_threads(threads)
    out = None if out_dtype is None else [torch.empty(p.numel() + out_offset, dtype=out_dtype)[out_offset:]
                                          for p in state["params"]]
    with kernels.use_isa(isa):
        for _ in range(steps):
            kernels.adamw_step(state["params"], state["grads"], state["exp_avgs"], state["exp_avg_sqs"],
                               state["steps"], compute_params=out, **HYPER)
    return out


def _assert_same_bits(a, b, any_nan=False):
    """Bit equality; with any_nan, a NaN matches a NaN of any sign and payload."""
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[x.dtype]
        if any_nan:
            nan = torch.isnan(x)
            assert torch.equal(nan, torch.isnan(y))
            x, y = x[~nan], y[~nan]
        assert torch.equal(x.view(ints), y.view(ints))


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_adamw_isa_equals_scalar(isa, grad_dtype, moment_dtype, out_dtype, threads, split_everything):
    for offset in (0, 1, 3):
        numels = SIZES if offset == 0 else SIZES[:-1]  # the 1M tensor once per case is enough
        state = _adamw_state(numels, offset, grad_dtype, seed=hash((offset, str(grad_dtype))) % 1000,
                             moment_dtype=moment_dtype)
        expected = _clone(state)
        out_ref = _run_adamw(expected, out_dtype, "scalar", 1)
        out = _run_adamw(state, out_dtype, isa, threads, out_offset=offset)  # unaligned streamed output
        for name in ("params", "exp_avgs", "exp_avg_sqs"):
            _assert_same_bits(state[name], expected[name])
        assert torch.equal(state["steps"], expected["steps"])
        if out_dtype is not None:
            _assert_same_bits(out, out_ref)
            _assert_same_bits(out, [p.to(out_dtype) for p in state["params"]])


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 3])
def test_sign_sgd_and_accumulate_isa_equal_scalar(isa, grad_dtype, threads, split_everything):
    g = gen(7)
    params = _views(SIZES, 1, torch.float32, g)
    grads = _views(SIZES, 1, grad_dtype, g)
    grads[3][::5] = 0  # sign(0) = 0
    results = {}
    for which, n_threads in (("ref", 1), ("isa", threads)):
        _use_threads(n_threads)
        p = [t.clone() for t in params]
        out = [torch.empty(t.numel() + 5, dtype=torch.bfloat16)[5:] for t in p]
        acc = [torch.empty(t.numel()) for t in p]
        with kernels.use_isa("scalar" if which == "ref" else isa):
            kernels.sign_sgd_step(p, grads, lr=1e-2, weight_decay=0.1, compute_params=out)
            kernels.accumulate_(acc, grads, add=False)
            kernels.accumulate_(acc, grads, add=True)
        results[which] = (p, out, acc)
    for a, b in zip(results["ref"], results["isa"]):
        _assert_same_bits(a, b)
    _assert_same_bits(results["isa"][2], [g.float() + g.float() for g in grads])


def _bf16_edge_values():
    """fp32 values at bf16 rounding ties (both parities), near ties, NaN, inf, denormals, overflow."""
    hi = torch.randint(0, 1 << 16, (4096,), generator=gen(3), dtype=torch.int64)
    lows = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF], dtype=torch.int64)
    bits = (hi[:, None] << 16 | lows[None, :]).flatten()
    bits = torch.cat([bits, torch.tensor([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x00008000, 0x80018000,
                                          0x00000001, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7F800000,
                                          0xFF800000, 0x00000000, 0x80000000], dtype=torch.int64)])
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return bits.to(torch.int32).view(torch.float32)


def _assert_rounds_like_torch(out, values):
    """out == values.to(torch.bfloat16) bit for bit, except that every NaN is the canonical 0x7FC0."""
    expected = values.to(torch.bfloat16)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert torch.equal(out[nan].view(torch.int16), torch.full_like(out[nan].view(torch.int16), 0x7FC0))


@pytest.mark.parametrize("isa", isa_params())
def test_bf16_output_rounds_like_torch(isa):
    values = _bf16_edge_values()
    for offset in (0, 5):  # vector body and scalar tail see every value
        p = values[offset:].clone()
        out = torch.empty(p.numel(), dtype=torch.bfloat16)
        with kernels.use_isa(isa):  # lr = 0, wd = 0: p is unchanged, so out = bf16(p)
            kernels.sign_sgd_step([p], [torch.ones_like(p)], lr=0.0, weight_decay=0.0, compute_params=[out])
        _assert_rounds_like_torch(out, values[offset:])


@pytest.mark.parametrize("isa", isa_params())
def test_bf16_moments_round_like_torch_and_update_with_fp32(isa):
    """Against the same ISA with fp32 moments: the parameter update uses the unrounded fp32
    moments (same params), and the stored bf16 moments are the fp32 ones rounded like torch."""
    values = _bf16_edge_values()
    for offset in (0, 5):  # vector body and scalar tail see every value
        grads = [values[offset:]]
        n = grads[0].numel()
        params = torch.randn(n, generator=gen(4))
        states = {dtype: dict(params=[params.clone()], exp_avgs=[torch.zeros(n, dtype=dtype)],
                              exp_avg_sqs=[torch.zeros(n, dtype=dtype)], steps=torch.zeros(1, dtype=torch.int64))
                  for dtype in (torch.float32, torch.bfloat16)}
        f32, bf16 = states[torch.float32], states[torch.bfloat16]
        # Step 1: beta1 = beta2 = 0 gives m = g and v = g*g, so the new moments are the edge
        # values (ties of both parities, NaN, inf, denormals, overflow to inf). Step 2 loads
        # those rounded moments (bf16 denormals, inf, NaN) and updates them with real betas.
        for beta1, beta2 in ((0.0, 0.0), (0.9, 0.999)):
            with kernels.use_isa(isa):
                for s in (f32, bf16):
                    kernels.adamw_step(s["params"], grads, s["exp_avgs"], s["exp_avg_sqs"], s["steps"], lr=1e-3,
                                       beta1=beta1, beta2=beta2, eps=1e-8, weight_decay=0.1)
            # NOTE: which NaN operand an add passes on is the compiler's choice (it may swap
            # the operands of a commutative add), so NaN payloads may differ between builds.
            _assert_same_bits(bf16["params"], f32["params"], any_nan=True)
            for name in ("exp_avgs", "exp_avg_sqs"):
                _assert_rounds_like_torch(bf16[name][0], f32[name][0])
                f32[name][0].copy_(bf16[name][0])  # the next step starts from the same moments


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_nan_and_inf_propagate_like_reference(isa, moment_dtype):
    from cpu_offload.reference import adamw_reference_
    g = torch.randn(100, generator=gen(1))
    g[[3, 40, 77]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    p = torch.randn(100, generator=gen(2))
    m, v = torch.zeros(100, dtype=moment_dtype), torch.zeros(100, dtype=moment_dtype)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    with kernels.use_isa(isa):
        kernels.adamw_step([p], [g], [m], [v], torch.zeros(1, dtype=torch.int64), lr=1e-3, beta1=0.9,
                           beta2=0.999, eps=1e-8, weight_decay=0.0)
    adamw_reference_(rp, g, rm, rv, 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    for a, b in ((p, rp), (m, rm), (v, rv)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(p[[3, 40, 77]]).all()


def test_many_tiny_and_one_large_tensor_in_one_call(split_everything):
    numels = [1] * 50 + [3 << 20] + [2] * 50
    state = _adamw_state(numels, 0, torch.bfloat16, seed=11)
    expected = _clone(state)
    _run_adamw(expected, None, "scalar", 1, steps=1)
    _run_adamw(state, None, kernels.isa(), 2, steps=1)
    _assert_same_bits(state["params"], expected["params"])


# ---------------------------------------------------------------- validation

def _good(n=3, size=8):
    return dict(params=[torch.zeros(size) for _ in range(n)], grads=[torch.zeros(size) for _ in range(n)],
                exp_avgs=[torch.zeros(size) for _ in range(n)], exp_avg_sqs=[torch.zeros(size) for _ in range(n)],
                steps=torch.zeros(n, dtype=torch.int64))


def _call(**changes):
    args = _good()
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    for k, v in changes.items():
        (hyper if k in hyper or k in ("grad_scale", "compute_params") else args)[k] = v
    kernels.adamw_step(args["params"], args["grads"], args["exp_avgs"], args["exp_avg_sqs"], args["steps"], **hyper)


@pytest.mark.parametrize("change, error, words", [
    (dict(grads=[torch.zeros(8), torch.zeros(8, dtype=torch.float16), torch.zeros(8)]), TypeError, r"grads\[1\].*float16"),
    (dict(exp_avgs=[torch.zeros(8), torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)]), TypeError, r"exp_avgs\[2\]"),
    (dict(exp_avgs=[torch.zeros(8, dtype=torch.float16) for _ in range(3)]), TypeError, r"exp_avgs\[0\].*float16"),
    (dict(exp_avg_sqs=[torch.zeros(8, dtype=torch.bfloat16) for _ in range(3)]), ValueError,
     r"exp_avg_sqs has dtype torch.bfloat16 but exp_avgs has torch.float32"),
    (dict(exp_avgs=[torch.zeros(8, dtype=torch.bfloat16) for _ in range(3)]), ValueError,
     r"exp_avg_sqs has dtype torch.float32 but exp_avgs has torch.bfloat16"),
    (dict(grads=[torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8)]), TypeError, r"grads\[1\].*one dtype"),
    (dict(params=[torch.zeros(8), torch.zeros(8, device="meta"), torch.zeros(8)]), ValueError, r"params\[1\].*meta"),
    (dict(exp_avg_sqs=[torch.zeros(8), torch.zeros(16)[::2], torch.zeros(8)]), ValueError, r"exp_avg_sqs\[1\].*contiguous"),
    (dict(grads=[torch.zeros(8), torch.zeros(8), torch.zeros(9)]), ValueError, r"grads\[2\] has 9 elements"),
    (dict(grads=[torch.zeros(8), torch.zeros(8)]), ValueError, r"grads has 2 tensors, expected 3"),
    (dict(grads=[torch.zeros(8), "x", torch.zeros(8)]), TypeError, r"grads\[1\] must be a torch.Tensor"),
    (dict(grads=torch.zeros(8)), TypeError, r"grads must be a list"),
    (dict(grads=None), TypeError, r"grads must be a list or tuple of tensors, got None"),
    (dict(exp_avg_sqs=None), TypeError, r"exp_avg_sqs must be a list or tuple of tensors, got None"),
    (dict(params=None), TypeError, r"params must be a list or tuple of tensors, got None"),
    (dict(steps=torch.zeros(3)), ValueError, r"steps must be"),
    (dict(steps=torch.zeros(2, dtype=torch.int64)), ValueError, r"steps has 2 entries"),
    (dict(steps=[0, 0, 0]), TypeError, r"steps must be a torch.Tensor"),
    (dict(lr=-1.0), ValueError, r"lr must be >= 0"),
    (dict(lr=float("nan")), ValueError, r"lr must be finite"),
    (dict(beta1=1.0), ValueError, r"beta1 must be < 1"),
    (dict(beta2="0.9"), TypeError, r"beta2 must be a number"),
    (dict(eps=-1e-8), ValueError, r"eps"),
    (dict(weight_decay=-0.1), ValueError, r"weight_decay"),
    (dict(grad_scale=float("inf")), ValueError, r"grad_scale"),
    (dict(compute_params=[torch.zeros(8), torch.zeros(8), torch.zeros(8, dtype=torch.int32)]), TypeError, r"compute_params\[2\]"),
])
def test_adamw_rejects_bad_input(change, error, words):
    with pytest.raises(error, match=words):
        _call(**change)


def test_overlapping_tensors_are_rejected():
    buf = torch.zeros(32)
    args = _good(2)
    args["exp_avgs"] = [buf[:8], buf[4:12]]   # overlaps itself
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] and exp_avgs\[1\] overlap"):
        kernels.adamw_step(**args, lr=1e-3, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.0)
    args = _good(2)
    args["grads"] = [args["params"][0], torch.zeros(8)]   # a gradient aliasing a parameter
    with pytest.raises(ValueError, match=r"overlap"):
        kernels.adamw_step(**args, lr=1e-3, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.0)
    args = _good(2)
    buf = torch.zeros(8)
    args["params"][1] = buf
    args["steps"] = buf.view(torch.int64)[:2]              # written too: must not alias an operand
    with pytest.raises(ValueError, match=r"steps and params\[1\] overlap"):
        kernels.adamw_step(**args, lr=1e-3, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.0)
    out = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"compute_params\[1\]"):
        kernels.sign_sgd_step([torch.zeros(8), torch.zeros(8)], [torch.zeros(8), torch.zeros(8)], lr=1.0,
                              weight_decay=0.0, compute_params=[out, out])


def test_sign_sgd_and_accumulate_reject_bad_input():
    with pytest.raises(TypeError, match=r"grads\[0\].*int64"):
        kernels.sign_sgd_step([torch.zeros(4)], [torch.zeros(4, dtype=torch.int64)], lr=1.0, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"weight_decay"):
        kernels.sign_sgd_step([torch.zeros(4)], [torch.zeros(4)], lr=1.0, weight_decay=-1.0)
    with pytest.raises(TypeError, match=r"accumulators\[0\].*bfloat16"):
        kernels.accumulate_([torch.zeros(4, dtype=torch.bfloat16)], [torch.zeros(4)], add=True)
    with pytest.raises(TypeError, match=r"add must be a bool"):
        kernels.accumulate_([torch.zeros(4)], [torch.zeros(4)], add=1)
    with pytest.raises(TypeError, match=r"grads must be a list or tuple of tensors, got None"):
        kernels.sign_sgd_step([torch.zeros(4)], None, lr=1.0, weight_decay=0.0)
    with pytest.raises(TypeError, match=r"accumulators must be a list or tuple of tensors, got None"):
        kernels.accumulate_(None, [torch.zeros(4)], add=True)
    with pytest.raises(TypeError, match=r"cpus must be a sequence of CPU ids or None, got int"):
        kernels.pin_threads(5)


def _random_adamw_args(shapes, seed, grad_shapes=None):
    g = gen(seed)
    grad_shapes = grad_shapes or shapes
    return dict(params=[torch.randn(s, generator=g) for s in shapes],
                grads=[torch.randn(s, generator=g) for s in grad_shapes],
                exp_avgs=[torch.randn(s, generator=g) * 0.1 for s in grad_shapes],
                exp_avg_sqs=[torch.rand(s, generator=g) * 0.01 for s in grad_shapes],
                steps=torch.randint(0, 5, (len(shapes),), generator=g))


def _snapshot(args):
    return [t.clone() for v in args.values() for t in (v if isinstance(v, list) else [v])]


def _unchanged(args, before):
    return all(torch.equal(a, b) for a, b in zip(_snapshot(args), before))


@pytest.mark.parametrize("grad_scale", [-1.0, -1e-30, -float("inf")])
def test_adamw_refuses_a_negative_grad_scale(grad_scale):
    args = _random_adamw_args([(16,), (3, 5)], seed=int.from_bytes(os.urandom(4), "little"))
    before = _snapshot(args)
    with pytest.raises(ValueError, match=r"grad_scale must be (>= 0|finite)"):
        kernels.adamw_step(**args, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                           grad_scale=grad_scale)
    assert _unchanged(args, before)


@pytest.mark.parametrize("bad", [-1, -(2**63), 2**63 - 1])
def test_adamw_refuses_a_step_count_it_cannot_increment_and_changes_nothing(bad):
    """A count below 0 makes a bias correction 1 - beta^0 = 0 (an infinite step, NaN weights);
    the largest int64 cannot be incremented. The call is refused whole: no tensor and no
    count changes, the earlier entries' counts included."""
    args = _random_adamw_args([(16,), (3, 5), (7,)], seed=int.from_bytes(os.urandom(4), "little"))
    args["steps"][2] = bad
    before = _snapshot(args)  # the counts included
    with pytest.raises(ValueError, match=rf"steps\[2\] is {bad}"):
        kernels.adamw_step(**args, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    assert _unchanged(args, before)


def test_adamw_grad_scale_zero_is_the_step_with_zero_gradients():
    # NOTE: the library steps with 0 after clip_grad_norm_(max_norm=0), as torch does.
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    args = _random_adamw_args([(16,), (3, 5), (0,)], seed=int.from_bytes(os.urandom(4), "little"))
    for t in args["exp_avgs"]:
        t[::3] = 0.0  # a zero moment stays +0.0 under a zero factor
    zeros, negzero = _clone(args), _clone(args)
    zeros["grads"] = [torch.zeros_like(t) for t in args["grads"]]
    kernels.adamw_step(**args, **hyper, grad_scale=0.0)
    kernels.adamw_step(**negzero, **hyper, grad_scale=-0.0)
    kernels.adamw_step(**zeros, **hyper)
    for key in ("params", "exp_avgs", "exp_avg_sqs"):
        _assert_same_bits(args[key], zeros[key])
        _assert_same_bits(negzero[key], zeros[key])
    assert torch.equal(args["steps"], zeros["steps"])


_ADAMW = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


@pytest.mark.parametrize("kernel, hyper, words", [
    ("sign_sgd", dict(lr=1e39, weight_decay=0.0), r"lr is 1e\+39, which overflows float32"),
    ("sign_sgd", dict(lr=1.0, weight_decay=1e42), r"weight_decay is 1e\+42, which overflows float32"),
    ("sign_sgd", dict(lr=1e20, weight_decay=1e20), r"lr \* weight_decay .* overflows float32"),
    ("sign_sgd_inverse", dict(lr=1e20, weight_decay=1e20), r"lr \* weight_decay .* overflows float32"),
    ("adamw", dict(_ADAMW, grad_scale=1e39), r"grad_scale is 1e\+39, which overflows float32"),
    ("adamw", dict(_ADAMW, eps=1e39), r"eps is 1e\+39, which overflows float32"),
    # eps is a float32 subnormal; eps*sqrt(1 - beta2^t), which the kernel adds to sqrt(v), is 0 there
    ("adamw", dict(_ADAMW, eps=5e-45), r"eps: eps \* sqrt\(1 - beta2\^step\) = .* at step \d, which rounds to 0"),
    ("adamw", dict(_ADAMW, lr=1e20, weight_decay=1e20), r"lr \* weight_decay .* overflows float32"),
    # lr fits float32; the bias-corrected step size lr*sqrt(1 - beta2^t)/(1 - beta1^t) does not
    ("adamw", dict(_ADAMW, lr=1e34, beta1=0.999999, beta2=0.0), r"lr: the bias-corrected step size .* overflows float32"),
    ("adamw_inverse", dict(_ADAMW, lr=1e34, beta1=0.999999, beta2=0.0), r"lr: the bias-corrected step size .* overflows float32"),
])
def test_hyperparameters_that_overflow_float32_are_refused_and_change_nothing(kernel, hyper, words):
    """Finite as doubles, but the kernels compute in float32: a value, or a constant the kernel
    derives from it, that rounds to infinity there would make inf/NaN weights; so would a
    positive eps whose eps*sqrt(1 - beta2^t) rounds to 0 (0/0 where v = 0)."""
    args = _random_adamw_args([(16,), (3, 5), (7,)], seed=int.from_bytes(os.urandom(4), "little"))
    args["steps"] += 1  # an inverse step undoes a step >= 1
    before = _snapshot(args)
    with pytest.raises(ValueError, match=words):
        if kernel.startswith("adamw"):
            getattr(kernels, f"{kernel}_step")(**args, **hyper)
        else:
            getattr(kernels, f"{kernel}_step")(args["params"], args["grads"], **hyper)
    assert _unchanged(args, before)


def test_large_hyperparameters_whose_float32_constants_are_finite_are_accepted():
    p, g = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, -1.0])
    kernels.sign_sgd_step([p], [g], lr=1e30, weight_decay=0.0)
    assert torch.equal(p, torch.tensor([-1e30, 2.0, 1e30]))
    args = _random_adamw_args([(16,), (3, 5)], seed=int.from_bytes(os.urandom(4), "little"))
    args["grads"] = [t * 1e-33 for t in args["grads"]]  # times grad_scale: about 1e-3
    kernels.adamw_step(**args, **dict(_ADAMW, lr=1e30, weight_decay=1e-31), grad_scale=1e30)
    assert all(torch.isfinite(t).all() for t in args["params"] + args["exp_avgs"] + args["exp_avg_sqs"])


def test_numpy_scalars_are_numbers_and_a_tensor_without_a_value_is_named():
    for lr in (np.float32(0.5), np.float64(0.5), np.int64(1)):
        p = torch.tensor([1.0, 0.0, 2.0])
        kernels.sign_sgd_step([p], [torch.tensor([1.0, -1.0, 0.0])], lr=lr, weight_decay=np.float32(0.0))
        assert torch.equal(p, torch.tensor([1.0 - float(lr), float(lr), 2.0]))
    args = _random_adamw_args([(16,)], seed=0)
    kernels.adamw_step(**args, lr=np.float32(1e-3), beta1=np.float64(0.9), beta2=np.float32(0.5), eps=1e-8,
                       weight_decay=np.int64(0), grad_scale=np.float32(2.0))
    with pytest.raises(TypeError, match=r"lr must be a number, got bool_?"):
        kernels.sign_sgd_step([torch.zeros(3)], [torch.zeros(3)], lr=np.bool_(True), weight_decay=0.0)
    with pytest.raises(ValueError, match=r"lr must be finite"):
        kernels.sign_sgd_step([torch.zeros(3)], [torch.zeros(3)], lr=2**1100, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"lr: .*meta"):
        kernels.sign_sgd_step([torch.zeros(3)], [torch.zeros(3)], lr=torch.zeros((), device="meta"),
                              weight_decay=0.0)
    with pytest.raises(ValueError, match=r"grad_scale: .*meta"):
        kernels.adamw_step(**args, **_ADAMW, grad_scale=torch.ones(1, device="meta"))


def test_lazily_negated_views_are_refused():
    """``torch.tensor([1+2j]).conj().imag`` is a contiguous float32 tensor of value -2 whose
    memory holds +2 (is_neg()): the kernels read memory, so they would see the wrong sign."""
    neg = torch.tensor([1 + 2j]).conj().imag
    assert neg.is_neg() and neg.is_contiguous() and neg.dtype == torch.float32
    with pytest.raises(ValueError, match=r"grads\[0\] is a lazily negated view .*resolve_neg"):
        kernels.sign_sgd_step([torch.zeros(1)], [neg], lr=0.1, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"grads\[1\] is a lazily negated view"):
        kernels.accumulate_([torch.zeros(1), torch.zeros(1)], [torch.ones(1), neg], add=False)
    acc = torch.zeros(1)
    kernels.accumulate_([acc], [neg.resolve_neg()], add=False)
    assert acc.item() == -2.0



@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_are_refused():
    """A strided nested tensor is a CPU tensor of layout torch.strided whose sizes torch cannot
    give: it is refused naming the argument, before torch's internal error."""
    g = gen(int.from_bytes(os.urandom(4), "little"))
    n = 1 + int(torch.randint(100, (), generator=g))
    nested = torch.nested.nested_tensor([torch.randn(n, generator=g), torch.randn(n + 1, generator=g)])
    p, grad = torch.randn(2 * n + 1, generator=g), torch.randn(2 * n + 1, generator=g)
    p0 = p.clone()
    for name, call in [
        ("params", lambda: kernels.sign_sgd_step([nested], [nested.clone()], lr=0.1, weight_decay=0.0)),
        ("grads", lambda: kernels.sign_sgd_step([p], [nested], lr=0.1, weight_decay=0.0)),
        ("compute_params", lambda: kernels.sign_sgd_step([p], [grad], lr=0.1, weight_decay=0.0,
                                                         compute_params=[nested])),
        ("accumulators", lambda: kernels.accumulate_([nested], [grad], add=True)),
    ]:
        with pytest.raises(ValueError, match=rf"{name}\[0\] is a nested tensor; the kernels need dense CPU tensors"):
            call()
    steps = torch.nested.nested_tensor([torch.zeros(1, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"steps must be a contiguous 1-D int64 CPU tensor, got a nested tensor"):
        kernels.adamw_step([p], [grad], [torch.zeros_like(p)], [torch.zeros_like(p)], steps, lr=0.1, beta1=0.9,
                           beta2=0.99, eps=1e-8, weight_decay=0.0)
    assert torch.equal(p, p0)

def test_shapes_must_match_params_not_only_element_counts():
    seed = int.from_bytes(os.urandom(4), "little")
    args = _random_adamw_args([(17, 59)], seed, grad_shapes=[(1003,)])
    before = _snapshot(args)
    with pytest.raises(ValueError, match=r"grads\[0\] has shape \(1003,\) but params\[0\] has shape \(17, 59\)"):
        kernels.adamw_step(**args, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    assert _unchanged(args, before)
    args = _random_adamw_args([(17, 59), (4,)], seed)
    before = _snapshot(args)
    for name in ("exp_avgs", "exp_avg_sqs"):
        bad = dict(args, **{name: [args[name][0].reshape(-1), args[name][1]]})
        with pytest.raises(ValueError, match=rf"{name}\[0\] has shape \(1003,\) but params\[0\] has shape \(17, 59\)"):
            kernels.adamw_step(**bad, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    out = [torch.empty(59, 17, dtype=torch.bfloat16), torch.empty(4, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match=r"compute_params\[0\] has shape \(59, 17\) but params\[0\] has shape \(17, 59\)"):
        kernels.adamw_step(**args, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, compute_params=out)
    assert _unchanged(args, before)
    p, grad = torch.randn(17, 59, generator=gen(seed)), torch.randn(1003, generator=gen(seed + 1))
    p0, grad0 = p.clone(), grad.clone()
    with pytest.raises(ValueError, match=r"grads\[0\] has shape \(1003,\) but params\[0\] has shape \(17, 59\)"):
        kernels.sign_sgd_step([p], [grad], lr=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"grads\[0\] has shape \(1003,\) but accumulators\[0\] has shape \(17, 59\)"):
        kernels.accumulate_([p], [grad], True)
    assert torch.equal(p, p0) and torch.equal(grad, grad0)
    # Matching shapes (the library passes flat views of both) work as before.
    args = _random_adamw_args([(17, 59)], seed)
    want = _clone(args)
    kernels.adamw_step(**{k: ([t.reshape(-1) for t in v] if isinstance(v, list) else v) for k, v in args.items()},
                       lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    kernels.adamw_step(**want, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    _assert_same_bits(args["params"], want["params"])


def test_empty_lists_are_a_no_op():
    # Like torch's foreach ops; the lists must still agree in length (and steps in entries).
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    steps = torch.zeros(0, dtype=torch.int64)
    for out in (None, []):
        kernels.adamw_step([], [], [], [], steps, **hyper, compute_params=out)
        kernels.sign_sgd_step([], [], lr=1e-3, weight_decay=0.0, compute_params=out)
    kernels.accumulate_([], [], True)
    kernels.adamw_step((), (), (), (), steps, **hyper, compute_params=())
    with pytest.raises(ValueError, match=r"compute_params has 1 tensors, expected 0"):
        kernels.adamw_step([], [], [], [], steps, **hyper, compute_params=[torch.zeros(3)])
    with pytest.raises(ValueError, match=r"grads has 1 tensors, expected 0"):
        kernels.sign_sgd_step([], [torch.zeros(3)], lr=1e-3, weight_decay=0.0, compute_params=[])
    with pytest.raises(ValueError, match=r"steps has 1 entries, expected 0"):
        kernels.adamw_step([], [], [], [], torch.zeros(1, dtype=torch.int64), **hyper, compute_params=[])
    with pytest.raises(ValueError, match=r"grad_scale must be >= 0"):
        kernels.adamw_step([], [], [], [], steps, **hyper, grad_scale=-1.0)


def test_threads_and_pinning_settings():
    allowed = sorted(os.sched_getaffinity(0))
    outside = next(c for c in range(1024) if c not in allowed)
    pinned = kernels.get_pinned_cpus()   # (an earlier test may have bound the process)
    with pytest.raises(ValueError, match=r"n must be an int >= 1"):
        kernels.set_num_threads(0)
    with pytest.raises(ValueError, match=rf"n={len(allowed) + 1} is more than the {len(allowed)} CPUs"):
        kernels.set_num_threads(len(allowed) + 1)
    with pytest.raises(ValueError, match=r"cpus\[1\]"):
        kernels.pin_threads([allowed[0], -1])
    with pytest.raises(ValueError, match=rf"cpus\[0\]={outside} is not a CPU this process may use"):
        kernels.pin_threads([outside])
    assert kernels.get_pinned_cpus() == pinned
    kernels.set_num_threads(len(allowed))
    assert kernels.get_num_threads() == len(allowed)
    cpu = allowed[0]
    kernels.pin_threads([cpu])
    try:
        assert kernels.get_pinned_cpus() == [cpu]
        p = [torch.zeros(1 << 20)]
        kernels.sign_sgd_step(p, [torch.ones(1 << 20)], lr=1.0, weight_decay=0.0)
        assert torch.equal(p[0], torch.full((1 << 20,), -1.0))
        kernels.pin_threads(None)
        assert kernels.get_pinned_cpus() is None
    finally:
        kernels.pin_threads(pinned)


def test_cache_entry_dies_with_its_tensors_and_changed_lists_are_revalidated():
    kernels.clear_cache()
    args = _good(2)
    kernels.adamw_step(**args, lr=1e-3, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.0)
    kernels.adamw_step(**args, lr=1e-3, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.0)
    assert len(kernels._cache) == 1
    args["grads"][1] = torch.zeros(8, dtype=torch.float16)   # same list object, new content
    with pytest.raises(TypeError, match=r"grads\[1\]"):
        kernels.adamw_step(**args, lr=1e-3, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.0)
    del args
    assert len(kernels._cache) == 0


@pytest.mark.parametrize("change", ["data", "set_", "resize_"])
def test_cache_hit_follows_tensors_changed_in_place(change, split_everything):
    g = gen(21)
    params, grads = [torch.randn(300, generator=g) for _ in range(3)], [torch.randn(300, generator=g) for _ in range(3)]
    accs = [torch.randn(300, generator=g) for _ in range(3)]
    kernels.sign_sgd_step(params, grads, lr=0.1, weight_decay=0.0)
    kernels.accumulate_(accs, grads, add=True)
    old_p, old_acc = params[1].detach(), accs[2].detach()   # keep the old storages alive
    old_p_copy, old_acc_copy = old_p.clone(), old_acc.clone()
    new_p, new_acc = torch.randn(300, generator=g), torch.randn(300, generator=g)
    if change == "data":
        params[1].data, accs[2].data = new_p.clone(), new_acc.clone()
    elif change == "set_":
        params[1].set_(new_p.clone()), accs[2].set_(new_acc.clone())
    else:   # resize_ to a new size and back: new memory, same metadata as before
        params[1].resize_(5000).resize_(300).copy_(new_p), accs[2].resize_(5000).resize_(300).copy_(new_acc)
    kernels.sign_sgd_step(params, grads, lr=0.1, weight_decay=0.0)
    kernels.accumulate_(accs, grads, add=True)
    assert torch.equal(params[1], new_p - 0.1 * torch.sign(grads[1]))
    assert torch.equal(accs[2], new_acc + grads[2])
    if change != "resize_":   # (resize_ moved the shared storage itself: no old memory to check)
        assert torch.equal(old_p, old_p_copy) and torch.equal(old_acc, old_acc_copy)


@pytest.mark.parametrize("role", ["params", "grads", "accumulators"])
def test_cache_hit_sees_a_negation_bit_set_in_place(role):
    """``t.data = t._neg_view()`` keeps the data pointer, byte count and contiguity the cache
    checks, but t now reads as -memory: the next call is refused as for any negated view."""
    g = gen(int.from_bytes(os.urandom(4), "little"))
    n = 1 + int(torch.randint(5000, (), generator=g))
    params, grads = [torch.randn(n, generator=g) for _ in range(2)], [torch.randn(n, generator=g) for _ in range(2)]
    accs = [torch.randn(n, generator=g) for _ in range(2)]
    for _ in range(2):   # validated, then served from the cache
        kernels.sign_sgd_step(params, grads, lr=0.1, weight_decay=0.0)
        kernels.accumulate_(accs, grads, add=True)
    t = {"params": params, "grads": grads, "accumulators": accs}[role][1]
    ptr = t.data_ptr()
    t.data = t._neg_view()
    assert t.is_neg() and t.data_ptr() == ptr and t.is_contiguous()
    before = [x.clone() for x in params + grads + accs]
    if role != "accumulators":
        with pytest.raises(ValueError, match=rf"{role}\[1\] is a lazily negated view"):
            kernels.sign_sgd_step(params, grads, lr=0.1, weight_decay=0.0)
    if role != "params":
        with pytest.raises(ValueError, match=rf"{role}\[1\] is a lazily negated view"):
            kernels.accumulate_(accs, grads, add=True)
    assert all(torch.equal(x, y) for x, y in zip(params + grads + accs, before))
    t.data = t.resolve_neg()   # its values in its memory: cached again, and stepped from them
    want_p, want_acc = [p - 0.1 * torch.sign(gr) for p, gr in zip(params, grads)], [a + gr for a, gr in zip(accs, grads)]
    kernels.sign_sgd_step(params, grads, lr=0.1, weight_decay=0.0)
    kernels.accumulate_(accs, grads, add=True)
    assert all(torch.equal(x, y) for x, y in zip(params + accs, want_p + want_acc))

def test_isa_override_env(tmp_path):
    code = "import cpu_offload.kernels as k; print(k.isa())"
    env = dict(os.environ, CPU_OFFLOAD_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "scalar", out.stderr
    for bad in ("bogus", "neon"):
        env["CPU_OFFLOAD_ISA"] = bad
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "CPU_OFFLOAD_ISA" in out.stderr and bad in out.stderr
    missing = [i for i in _C.known_isas() if i not in kernels.available_isas()]
    if missing:
        env["CPU_OFFLOAD_ISA"] = missing[0]
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "not supported by this CPU" in out.stderr


def test_pool_works_after_fork():
    code = (
        "import os, torch, cpu_offload.kernels as k\n"
        "k._C.set_num_threads(2); p=[torch.zeros(1<<20)]; g=[torch.ones(1<<20)]\n"
        "k.sign_sgd_step(p, g, lr=1.0, weight_decay=0.0)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    k.sign_sgd_step(p, g, lr=1.0, weight_decay=0.0); os._exit(0 if p[0][0] == -2 else 3)\n"
        "_, status = os.waitpid(pid, 0); print(os.waitstatus_to_exitcode(status))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "0", out.stderr
