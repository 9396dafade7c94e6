# Undoing a speculative optimizer step by inverse arithmetic.
#
# Full offload steps each chunk during backward, before the window's gradient
# norm (or a non-finite gradient on another rank) is known. When the step must
# be skipped or redone with a coefficient, what was stepped is rolled back from
# the new state and the gradient that produced it:
#
#   AdamW (forward, csrc/kernels/optimizer_kernels.h):
#     p' = p0*decay;  m1 = b1*m0 + (1-b1)*g;  v1 = b2*v0 + (1-b2)*g*g
#     p1 = p' + nss*m1/(sqrt(v1) + eps_hat)
#   inverse:
#     u = nss*m1/(sqrt(v1) + eps_hat)   (the same bits as in the forward step)
#     p0 = (p1 - u)/decay;  m0 = (m1 - (1-b1)*g)/b1;  v0 = max((v1 - (1-b2)*g*g)/b2, 0)
#   SignSGD: p0 = (p1 + lr*sign(g))/decay
#
# NOTE: exact only to float32 rounding: p1 - u recovers p' within half an ulp of p1
# (the forward addition rounded), and each division adds half an ulp. The masters
# come back within about one ulp, the moments within a few ulps of the larger of
# their terms; nothing that was finite becomes NaN or Inf (v0 is clamped at 0).
# A moment whose beta is 0 carries no information about its old value: it comes
# back as 0, which no later step reads.
#
# Scope: the inverse arithmetic on flat fp32 host views. Non-goals: deciding
# when to roll back (step_validation.py), fetching the gradients.

from __future__ import annotations

import math

import torch


__all__ = ["rollback_adamw_", "rollback_sign_sgd_"]


def rollback_adamw_(param, grad, exp_avg, exp_avg_sq, step: int, *, lr, beta1, beta2, eps, weight_decay,
                    grad_scale=1.0) -> None:
    """Undo one AdamW step in place; ``step`` is the count that step used (1 for the first).

    NOTE: in-place float32 operations with one temporary pair (a rare path over the whole
    model: it must not allocate a copy per operation); a float32 sqrt that is not correctly
    rounded changes u by an ulp of u, far below the half ulp of p1 the inverse loses anyway.
    """
    bias_correction1 = 1.0 - beta1 ** step
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    decay = 1.0 - lr * weight_decay
    g = grad.to(torch.float32, copy=True)
    if grad_scale != 1.0:
        g.mul_(grad_scale)
    u = torch.sqrt(exp_avg_sq).add_(eps * bc2_sqrt)                  # sqrt(v1) + eps_hat
    u = torch.mul(exp_avg, -(lr * bc2_sqrt / bias_correction1)).div_(u)   # nss*m1/denom
    param.sub_(u)                                                     # p' = p0 * decay
    if decay != 0.0:
        param.div_(decay)
    if beta1 > 0:
        exp_avg.sub_(torch.mul(g, 1.0 - beta1, out=u)).div_(beta1)   # m0 = (m1 - (1-b1)*g)/b1
    else:
        exp_avg.zero_()
    if beta2 > 0:
        torch.mul(g, 1.0 - beta2, out=u).mul_(g)                       # (1-b2)*g*g
        exp_avg_sq.sub_(u).div_(beta2).clamp_(min=0.0)                 # v0 = max((v1 - (1-b2)*g*g)/b2, 0)
    else:
        exp_avg_sq.zero_()


def rollback_sign_sgd_(param, grad, *, lr, weight_decay) -> None:
    """Undo one SignSGD step in place."""
    param.add_(torch.sign(grad).to(torch.float32).mul_(lr))
    decay = 1.0 - lr * weight_decay
    if decay != 0.0:
        param.div_(decay)
