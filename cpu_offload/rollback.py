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
# NOTE: with bf16 moments (state_dtype) the forward step used the unrounded fp32
# m1, v1 and stored them rounded; the inverse can only read the rounded ones. It
# computes in fp32 from them and the copy back rounds m0, v0 to bf16. The update
# u it recomputes is then off by up to about 2**-8 of |u| (not the same bits), so
# the master comes back within about |u| * 2**-8 instead of one ulp, and each
# moment within about one bf16 ulp of its terms (the stored rounding, divided by
# beta, rounded again). A skipped step's moments are therefore not bit-identical
# to before it when something had been stepped; a NaN loss steps nothing.
#
# Scope: the inverse arithmetic on flat host views (fp32 masters, fp32 or bf16
# moments). Non-goals: deciding when to roll back (step_validation.py),
# fetching the gradients.

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
    m1 = exp_avg if exp_avg.dtype == torch.float32 else exp_avg.float()  # bf16 moments: widened exactly
    v1 = exp_avg_sq if exp_avg_sq.dtype == torch.float32 else exp_avg_sq.float()
    u = torch.sqrt(v1).add_(eps * bc2_sqrt)                                # sqrt(v1) + eps_hat
    u = torch.mul(m1, -(lr * bc2_sqrt / bias_correction1)).div_(u)         # nss*m1/denom
    param.sub_(u)                                                          # p' = p0 * decay
    if decay != 0.0:
        param.div_(decay)
    if beta1 > 0:
        m1.sub_(torch.mul(g, 1.0 - beta1, out=u)).div_(beta1)         # m0 = (m1 - (1-b1)*g)/b1
    else:
        m1.zero_()
    if beta2 > 0:
        torch.mul(g, 1.0 - beta2, out=u).mul_(g)                       # (1-b2)*g*g
        v1.sub_(u).div_(beta2).clamp_(min=0.0)                         # v0 = max((v1 - (1-b2)*g*g)/b2, 0)
    else:
        v1.zero_()
    if m1 is not exp_avg:  # bf16 moments: the copy back rounds like .to(torch.bfloat16)
        exp_avg.copy_(m1)
        exp_avg_sq.copy_(v1)


def rollback_sign_sgd_(param, grad, *, lr, weight_decay) -> None:
    """Undo one SignSGD step in place."""
    param.add_(torch.sign(grad).to(torch.float32).mul_(lr))
    decay = 1.0 - lr * weight_decay
    if decay != 0.0:
        param.div_(decay)
