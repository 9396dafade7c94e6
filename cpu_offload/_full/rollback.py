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
#   inverse (the same file, adamw_inverse_at):
#     u = nss*m1/(sqrt(v1) + eps_hat)   (the same bits as in the forward step: the
#                                        same float32 constants, csrc/scalars.cpp)
#     p0 = (p1 - u)/decay;  m0 = (m1 - (1-b1)*g)/b1;  v0 = max((v1 - (1-b2)*g*g)/b2, 0)
#   SignSGD: p0 = (p1 + lr*sign(g))/decay
# (no division when decay == 0; cpu_offload/reference.py has the same lines in torch).
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
# computes in fp32 from them and stores m0, v0 rounded to bf16. The update
# u it recomputes is then off by up to about 2**-8 of |u| (not the same bits), so
# the master comes back within about |u| * 2**-8 instead of one ulp, and each
# moment within about one bf16 ulp of its terms (the stored rounding, divided by
# beta, rounded again). A skipped step's moments are therefore not bit-identical
# to before it when something had been stepped; a NaN loss steps nothing.
#
# Scope: the inverse step over the stepped pieces, one native call per group of pieces
# with the same hyper-parameters and dtypes, parallel over the kernel pool (kernels.py
# checks the tensors). Non-goals: deciding when to roll back (validation.py), fetching
# the gradients.

from __future__ import annotations

from typing import Sequence

import torch

from cpu_offload import kernels

__all__ = ["rollback_adamw_", "rollback_sign_sgd_", "rollback_adamw_pieces_", "rollback_sign_sgd_pieces_"]

_KERNEL_GRADS = (torch.float32, torch.bfloat16)


def _kernel_grad(grad: torch.Tensor) -> torch.Tensor:
    """The gradient in a dtype the kernels read (fp16 widens exactly to fp32), contiguous."""
    if grad.dtype not in _KERNEL_GRADS:
        grad = grad.to(torch.float32)
    return grad.contiguous()


def rollback_adamw_pieces_(params, grads, exp_avgs, exp_avg_sqs, steps: Sequence[int], *, lr, beta1, beta2, eps,
                           weight_decay, grad_scale=1.0) -> None:
    """Undo one AdamW step in place on each tensor of the lists, in one native call.

    Args:
        params, exp_avgs, exp_avg_sqs: contiguous fp32 masters and fp32 (or both bf16)
            moments after the step, updated in place.
        grads: the gradients the step used (before ``grad_scale``).
        steps: the count each tensor's step used (1 for the first).
        lr, beta1, beta2, eps, weight_decay, grad_scale: those of the step.
    """
    kernels.adamw_inverse_step(list(params), [_kernel_grad(g) for g in grads], list(exp_avgs), list(exp_avg_sqs),
                               torch.tensor(list(steps), dtype=torch.int64), lr=lr, beta1=beta1, beta2=beta2,
                               eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)


def rollback_sign_sgd_pieces_(params, grads, *, lr, weight_decay, grad_scale=1.0) -> None:
    """Undo one SignSGD step in place on each tensor of the lists, in one native call."""
    kernels.sign_sgd_inverse_step(list(params), [_kernel_grad(g) for g in grads], lr=lr, weight_decay=weight_decay,
                                  grad_scale=grad_scale)


def rollback_adamw_(param, grad, exp_avg, exp_avg_sq, step: int, *, lr, beta1, beta2, eps, weight_decay,
                    grad_scale=1.0) -> None:
    """Undo one AdamW step in place; ``step`` is the count that step used (1 for the first)."""
    rollback_adamw_pieces_([param], [grad], [exp_avg], [exp_avg_sq], [step], lr=lr, beta1=beta1, beta2=beta2,
                           eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)


def rollback_sign_sgd_(param, grad, *, lr, weight_decay, grad_scale=1.0) -> None:
    """Undo one SignSGD step in place."""
    rollback_sign_sgd_pieces_([param], [grad], lr=lr, weight_decay=weight_decay, grad_scale=grad_scale)
