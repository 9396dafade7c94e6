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
# the master comes back within about |u| * 2**-8 instead of one ulp (but after a first
# step, whose fp32 m1 and v1 are recomputed from zeros: ``_undo_first_steps``), and each
# moment within about one bf16 ulp of its terms (the stored rounding, divided by
# beta, rounded again). A skipped step's moments are therefore not bit-identical
# to before it when something had been stepped; a NaN loss steps nothing.
#
# NOTE: AdamW's moments after t steps of any gradients satisfy m*m <= K_t*v, with
#   K_t = (1-b1)**2/(1-b2) * sum_{k<t} (b1*b1/b2)**k
# (Cauchy-Schwarz on m = sum (1-b1)*b1**k*g_{t-k} and v = sum (1-b2)*b2**k*g_{t-k}**2), and
# before the first step m = v = 0. Where the step's own gradient term dominated v1 (a
# first step, a gradient far above its history: a loss spike), the old v comes back as 0
# (the rounding of v1 is larger than it) beside an m0 that is the old m or, where m1 was
# dominated too, the rounding of m1; a redo with a much smaller factor then divided that
# by eps: weights moved by orders of magnitude more than lr. So after the inverse, a first
# step's moments are set to 0 (exact), and where v0 is lost (within a few roundings of the
# gradient's term) it is raised to at least m0*m0/K_t (10% under it, for the rounding of
# a state at the bound), which the true v0 is above (with the betas of the steps before):
# the redo is then an AdamW step of AdamW's size, whatever the rounding lost.
#
# Scope: the inverse step over the stepped pieces, one native call per group of pieces
# with the same hyper-parameters and dtypes, parallel over the kernel pool (kernels.py
# checks the tensors). Non-goals: deciding when to roll back (validation.py), fetching
# the gradients.

from __future__ import annotations

import math
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
    """Undo one AdamW step in place on each tensor of the lists, in one native call (and
    one per block of first steps).

    Args:
        params, exp_avgs, exp_avg_sqs: contiguous fp32 masters and fp32 (or both bf16)
            moments after the step, updated in place.
        grads: the gradients the step used (before ``grad_scale``).
        steps: the count each tensor's step used (1 for the first).
        lr, beta1, beta2, eps, weight_decay, grad_scale: those of the step.
    """
    hp = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
    grads = [_kernel_grad(g) for g in grads]
    first = [i for i, step in enumerate(steps) if step == 1]
    rest = [i for i, step in enumerate(steps) if step != 1]
    _undo_first_steps([params[i] for i in first], [grads[i] for i in first], hp)
    if rest:
        pick = [[xs[i] for i in rest] for xs in (params, grads, exp_avgs, exp_avg_sqs)]
        kernels.adamw_inverse_step(*pick, torch.tensor([steps[i] for i in rest], dtype=torch.int64), **hp)
        _keep_reachable_moments(*pick[1:], [steps[i] for i in rest], float(beta1), float(beta2), float(grad_scale))
    for i in first:
        exp_avgs[i].zero_()
        exp_avg_sqs[i].zero_()


# NOTE: the fp32 scratch a first step's undo works in: 12 B an element, at most 192 MiB at once.
_FIRST_STEP_BLOCK = 1 << 24


def _undo_first_steps(params, grads, hp: dict) -> None:
    """The masters before a first step. Their moments were 0, so the forward step's fp32 m1
    and v1 are that step on zeros: the inverse reads those (the update's own bits), not the
    ones it stored (with bf16 moments, rounded). Pieces are cut at _FIRST_STEP_BLOCK elements
    and batched up to that many, two native calls a batch."""
    batch, size = [], 0
    for param, grad in zip(params, grads):
        for start in range(0, param.numel(), _FIRST_STEP_BLOCK):
            p, g = param[start : start + _FIRST_STEP_BLOCK], grad[start : start + _FIRST_STEP_BLOCK]
            if batch and size + p.numel() > _FIRST_STEP_BLOCK:
                _undo_first_step_batch(batch, size, hp)
                batch, size = [], 0
            batch.append((p, g))
            size += p.numel()
    if batch:
        _undo_first_step_batch(batch, size, hp)


def _undo_first_step_batch(pieces, size: int, hp: dict) -> None:
    """The first steps of ``pieces`` ([(master, gradient)], ``size`` elements in all) undone."""
    ps, gs = [p for p, _ in pieces], [g for _, g in pieces]
    numels = [p.numel() for p in ps]
    m1, v1, scratch = (list(torch.zeros(size, dtype=torch.float32).split(numels)) for _ in range(3))
    kernels.adamw_step(scratch, gs, m1, v1, torch.zeros(len(ps), dtype=torch.int64), **hp)
    kernels.adamw_inverse_step(ps, gs, m1, v1, torch.ones(len(ps), dtype=torch.int64), **hp)


def _keep_reachable_moments(grads, exp_avgs, exp_avg_sqs, steps: Sequence[int], beta1: float, beta2: float,
                            grad_scale: float) -> None:
    """Moments AdamW can reach after ``step - 1 >= 1`` steps where the inverse lost v0 (the
    header's NOTE), in place."""
    if beta1 == 0.0 or beta2 == 0.0:  # NOTE: a moment whose beta is 0 is not read again
        return
    q = beta1 * beta1 / beta2
    for g, m, v, step in zip(grads, exp_avgs, exp_avg_sqs, steps):
        t = step - 1  # the steps the moments hold (a first step's are restored as zeros)
        if q > 1.0 and t * math.log(q) > 600.0:
            continue  # the bound is beyond any float
        k = (1.0 - beta1) ** 2 / (1.0 - beta2) * (t if q == 1.0 else (1.0 - q**t) / (1.0 - q))
        # v0 within a few roundings of the step's gradient term (b2*v0 < 4 ulp of (1-b2)*g*g) is lost
        ulp = 2.0**-8 if v.dtype == torch.bfloat16 else 2.0**-23
        vf = v.float()
        lost = vf < g.float().mul(grad_scale).square_().mul_(4.0 * ulp * (1.0 - beta2) / beta2)
        v.copy_(torch.where(lost, torch.maximum(vf, m.float().square().div_(k * 1.1)), vf))


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
