"""Readable pure-torch AdamW and SignSGD updates and their inverses: the ground truth for
tests and benchmarks.

Each line is one float32 operation in the same order as the native kernels
(csrc/kernels/optimizer_kernels.h), so on the CPU the two agree bit for bit.
NOTE: scalars are float32 tensors of the operand's shape, not Python numbers: torch may
turn division by a Python scalar into multiplication by its reciprocal, and add/addcmul
with ``alpha``/``value`` may use a fused multiply-add; both would change the rounding.
NOTE: torch's float32 CPU sqrt is not correctly rounded (it differs from IEEE sqrt in about
one element in seven); the square root is taken in float64 and rounded once to float32,
which equals the correctly rounded float32 sqrt (53 >= 2*24 + 2 bits).
"""
from __future__ import annotations

import math

import torch

__all__ = ["adamw_reference_", "sign_sgd_reference_", "adamw_inverse_reference_", "sign_sgd_inverse_reference_"]


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, value, dtype=torch.float32)


def _sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x.double()).float()


def _nonzero_f32(value: float) -> bool:
    """Whether ``value`` rounded to float32 (as the kernels hold it) is not zero."""
    return float(torch.tensor(value, dtype=torch.float32)) != 0.0


def _clamp_min_f32(x: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """x < low ? low : x, elementwise (NaN stays NaN), like torch.clamp(x, min=low)."""
    return torch.where(x < low, low, x)


def adamw_reference_(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps,
                     weight_decay, grad_scale=1.0):
    """One AdamW step on fp32 ``param`` and fp32 or bf16 ``exp_avg``/``exp_avg_sq`` in place.

    ``step`` is the step count after this update (1 on the first step). Returns ``param``.
    bf16 moments are widened to fp32, updated in fp32, used unrounded for the parameter
    update, and stored rounded to nearest even (``.to(torch.bfloat16)``).
    """
    bias_correction1 = 1.0 - beta1 ** step          # in double, once per tensor
    bias_correction2 = 1.0 - beta2 ** step
    g = grad.float() * _f32(grad_scale, param)
    p = param * _f32(1.0 - lr * weight_decay, param)                       # decoupled weight decay
    m = exp_avg.float() * _f32(beta1, param) + g * _f32(1.0 - beta1, param)        # m = b1*m + (1-b1)*g
    v = exp_avg_sq.float() * _f32(beta2, param) + (g * _f32(1.0 - beta2, param)) * g   # v = b2*v + (1-b2)*g^2
    # lr * m_hat / (sqrt(v_hat) + eps) with the bias corrections folded into two constants:
    # (lr * sqrt(bc2) / bc1) * m / (sqrt(v) + eps * sqrt(bc2))
    bc2_sqrt = math.sqrt(bias_correction2)
    denom = _sqrt_f32(v) + _f32(eps * bc2_sqrt, param)
    p = p + (_f32(-(lr * bc2_sqrt / bias_correction1), param) * m) / denom
    param.copy_(p)
    exp_avg.copy_(m.to(exp_avg.dtype))          # bf16 moments: rounded only here, after p used m, v
    exp_avg_sq.copy_(v.to(exp_avg_sq.dtype))
    return param


def sign_sgd_reference_(param, grad, *, lr, weight_decay):
    """One SignSGD step on ``param`` in place: p <- p*(1 - lr*wd); p <- p - lr*sign(g)."""
    p = param * _f32(1.0 - lr * weight_decay, param)
    p = p - _f32(lr, param) * torch.sign(grad.float())
    param.copy_(p)
    return param


def adamw_inverse_reference_(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps,
                             weight_decay, grad_scale=1.0):
    """Undoes one ``adamw_reference_`` step in place (cpu_offload/_full/rollback.py: the error model).

    ``step`` is the count that step used (1 for the first). The update u is recomputed with the
    forward's float32 constants; a division by a float32 decay of 0 is skipped, and a moment
    whose float32 beta is 0 comes back 0. Returns ``param``.
    """
    bias_correction1 = 1.0 - beta1 ** step          # in double, as in the forward step
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    decay = 1.0 - lr * weight_decay
    g = grad.float() * _f32(grad_scale, param)
    m1, v1 = exp_avg.float(), exp_avg_sq.float()    # bf16 moments: widened exactly
    denom = _sqrt_f32(v1) + _f32(eps * bc2_sqrt, param)                            # sqrt(v1) + eps_hat
    p = param - (_f32(-(lr * bc2_sqrt / bias_correction1), param) * m1) / denom    # p' = p1 - u
    if _nonzero_f32(decay):
        p = p / _f32(decay, param)                                                 # p0 = p' / decay
    zero = _f32(0.0, param)
    m = (m1 - g * _f32(1.0 - beta1, param)) / _f32(beta1, param) if _nonzero_f32(beta1) else zero  # m0
    v = (_clamp_min_f32((v1 - (g * _f32(1.0 - beta2, param)) * g) / _f32(beta2, param), zero)     # v0
         if _nonzero_f32(beta2) else zero)
    param.copy_(p)
    exp_avg.copy_(m.to(exp_avg.dtype))              # bf16 moments: rounded like .to(torch.bfloat16)
    exp_avg_sq.copy_(v.to(exp_avg_sq.dtype))
    return param


def sign_sgd_inverse_reference_(param, grad, *, lr, weight_decay):
    """Undoes one SignSGD step in place: p <- (p + lr*sign(g)) / (1 - lr*wd)."""
    decay = 1.0 - lr * weight_decay
    p = param + _f32(lr, param) * torch.sign(grad.float())   # p' = p1 + lr*sign(g)
    if _nonzero_f32(decay):
        p = p / _f32(decay, param)                            # p0 = p' / decay
    param.copy_(p)
    return param
