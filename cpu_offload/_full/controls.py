# What a training loop can say about the coming optimizer step of full offload,
# in torch's vocabulary: how many backward passes the window has
# (``grad_accum_steps``, settable per window), a factor on its gradients
# (``scale_grads_``) and global-norm clipping (``clip_grad_norm_``).
#
# A factor known before the window's last backward starts is free: the kernels
# apply it as they step. One given after it (the update already ran during
# backward) is applied at ``step()`` by a rollback and a redo (validation.py).
#
# Scope: these three public controls and their argument checks. Non-goals: the
# protocol (optimizer.py), the norm and redo mechanics (validation.py).

from __future__ import annotations

import math

import torch

from cpu_offload._common.checks import check_float32, check_int, real_of
from cpu_offload._full.grad_norms import check_norm_type
from cpu_offload._full.protocol import Phase

__all__ = ["WindowControls"]


class WindowControls:
    """Mixed into FullCPUOffloadOptimizer (uses its ``_proto``, ``_validator``, ``_enter``)."""

    @property
    def grad_accum_steps(self) -> int:
        """Backward passes of the coming window; the last one runs the optimizer.

        Set it before a window's first backward pass when the number of
        micro-batches varies from step to step (or later in the window, while its
        last pass has not started yet). A window longer than 1 needs the host
        accumulators, which exist when the optimizer was built with
        ``grad_accum_steps > 1`` (build it with the largest count you use).
        """
        return self._proto.window

    @grad_accum_steps.setter
    def grad_accum_steps(self, value: int) -> None:
        check_int("grad_accum_steps", value, low=1)
        self._enter()
        phase = self._proto.phase
        if value > 1 and not self._accumulate:
            raise ValueError(f"grad_accum_steps={value} needs host accumulators, which this optimizer was built "
                             "without: pass the largest grad_accum_steps you will use when wrapping the optimizer")
        if phase in (Phase.BACKWARD, Phase.APPLIED):
            raise RuntimeError(f"grad_accum_steps can only be set between windows or between backward passes "
                               f"(now {phase.value}); set it before the window's first backward pass")
        if phase is Phase.ACCUMULATING and value <= self._proto.micro:
            raise ValueError(f"grad_accum_steps={value}, but this window already ran {self._proto.micro} backward "
                             "passes; call step() to end it")
        self._proto.window = value

    def scale_grads_(self, factor: float) -> None:
        """Multiply every gradient of the window by ``factor`` (a number > 0; the window's
        factors multiplied must stay finite in float32, the kernels' precision): the window's
        whole sum, like ``p.grad.mul_(factor)`` for every parameter after the window's last
        backward in torch, whenever it is called (between two backward passes it scales the
        passes still to come too, not only those so far).

        Before the window's last backward pass it costs nothing (the kernels
        scale as they step); after it, ``step()`` rolls the update back and
        redoes it, unless the previous window was given the same factor after
        its last backward (the next window speculates with that one; a short
        window's factor given after its last pass, before its ``step()``, counts
        as given after its last backward). Factors
        multiply; clipping afterwards sees the scaled norm. ``zero_grad()`` drops the
        factors of a window that it abandons, as it drops torch's scaled gradients.
        """
        factor = real_of("factor", factor)
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
        self._enter()
        if self._proto.phase is Phase.BACKWARD:
            raise RuntimeError("scale_grads_() called during a backward pass")
        # NOTE: the kernels take the window's factor as their float32 grad_scale
        check_float32("factor", self._validator.scale * factor,
                      "the window's factor on its gradients (its scale_grads_ factors and clipping coefficients)")
        self._validator.scale_grads(factor, late=self._proto.phase is Phase.APPLIED)

    def _drain_accumulation(self) -> None:
        self._pipeline.drain()
        self._pipeline.raise_error()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach=None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the gradients of the coming step.

        Call it after the window's last backward pass (or after fewer, before a
        short window's ``step()``), where a script would clip ``param.grad``; in the
        middle of a window it scales what was accumulated so far, as torch does.
        Returns the total norm over every gradient of the step (all ranks) as a
        0-d float32 tensor on the parameters' device; ``step()`` applies
        ``min(1, max_norm / (total + 1e-6))`` to all of them. ``foreach`` is
        accepted for torch's signature and ignored.
        """
        try:
            max_norm = float(max_norm)
        except (TypeError, ValueError):
            raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}") from None
        if not max_norm >= 0:
            raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
        p = check_norm_type(norm_type)
        self._enter()
        if self._proto.phase is Phase.BACKWARD:
            raise RuntimeError("clip_grad_norm_() called during a backward pass; call it after backward()")
        phase = self._proto.phase
        if phase is Phase.ACCUMULATING:
            # NOTE: the worker may still be adding the last pass into the accumulators
            self._guarded(self._drain_accumulation)
        total = 0.0 if phase is Phase.IDLE else \
            self._validator.clip(max_norm, p, late=phase is Phase.APPLIED, error_if_nonfinite=error_if_nonfinite,
                                 in_place=phase is Phase.ACCUMULATING)
        return torch.tensor(total, dtype=torch.float32, device=self._records[0].local().device)
