# Validating full offload's speculative step: gradient clipping and the
# non-finite guard, decided after the window's chunks were already stepped.
#
# The chunks are stepped during backward with the window's factor known so far
# (1, or one announced before the last backward), times the factor the previous
# window was given after its last backward (its clipping coefficient and
# scale_grads_ factors): consecutive steps clip and divide by similar numbers, and
# the rollback's error grows like 2**-24 * (speculative / final factor)**2 for the
# second moment, so speculating with the last factor keeps it at float32
# rounding. Steps that never clip keep factor 1 and are never redone. Once the
# last pass drained:
#   - a NaN or Inf gradient on any rank (skip_nonfinite): what was stepped is
#     rolled back (rollback.py) and the step is skipped. The chunk runner stops
#     stepping at the first non-finite chunk, so after a NaN loss nothing was
#     stepped and the state is bit-identical to before the step;
#   - a factor that differs from the one applied (max_grad_norm, clip_grad_norm_,
#     scale_grads_): rolled back and stepped again with the new factor. A step
#     that does not clip keeps factor 1 and is never touched;
#   - chunks the runner held back (the window deferred its step, see ``defers``, their
#     speculative g*g could overflow float32, which no rollback undoes, or the gradients
#     read so far already exceed the clipping limit, ``clip_limit``): the stepped ones are
#     rolled back and all are stepped with the final factor;
#   - hyper-parameters changed after the window's last backward began (a loop that sets
#     the learning rate between backward and step(), as torch allows): step() rolls back
#     and redoes the step with the values it reads, as torch's step() would use them.
# The window's gradients stay available for this until it closes: the host
# accumulators (grad_accum_steps > 1) or, without accumulation,
# ``ParamRecord.retained``: the host copy the chunk runner keeps of each gradient
# (grad_copy="host") or the gradient itself, left on the device (grad_copy="device").
#
# Scope: the window's factor, its norms, skip / redo. Non-goals: the norms'
# arithmetic (grad_norms.py), the inverse step (rollback.py), the protocol
# (optimizer.py).

from __future__ import annotations

import math
import time
import warnings
from typing import Callable, Optional

import torch

from cpu_offload._full.grad_norms import clip_coefficient, local_norm, total_norm
from cpu_offload._full.host_state import note_versions, write_compute_copies
from cpu_offload._common.checks import FLOAT32_MAX
from cpu_offload._common.interrupts import deferred_interrupts
from cpu_offload._full.rollback import rollback_adamw_pieces_, rollback_sign_sgd_pieces_

__all__ = ["StepValidator"]

_WARN_EVERY_S = 60.0
# The hyper-parameters each rollback reads from a stepped piece's hparams; the first ones are
# the group's options, which a user may set after the window's last backward began.
_ADAMW_OPTIONS = ("lr", "beta1", "beta2", "eps", "weight_decay")
_ADAMW_HPARAMS = _ADAMW_OPTIONS + ("grad_scale",)
_SIGN_SGD_OPTIONS = ("lr", "weight_decay")
_SIGN_SGD_HPARAMS = _SIGN_SGD_OPTIONS + ("grad_scale",)


def _same_sign_sgd_step(applied: dict, target: dict) -> bool:
    """Whether SignSGD's step with ``applied`` equals the one with ``target``.

    NOTE: sign(g*c) depends on c > 0 only where g*c rounds to 0 in float32: |g| >= 2^-149,
    so never when c > 0.5; two factors above 0.5 give the same step."""
    if any(applied[name] != target[name] for name in _SIGN_SGD_OPTIONS):
        return False
    a, b = applied["grad_scale"], target["grad_scale"]
    return a == b or min(a, b) > 0.5


class StepValidator:
    """Per-optimizer validation state; one object shared by the wrapper and its proxies.

    Args:
        records, pipeline, algorithm, accumulate, grad_copy: the wrapper's.
        skip_nonfinite: skip a step whose gradients hold NaN or Inf on any rank.
        max_grad_norm: clip every step to this total 2-norm (None: only on request).
        stacklevel: returns the ``stacklevel`` of a warning aimed at the user's code.
    """

    def __init__(self, *, records, pipeline, algorithm: str, accumulate: bool, grad_copy: Optional[str],
                 skip_nonfinite: bool,
                 max_grad_norm: Optional[float], stacklevel: Callable[[], int]) -> None:
        self.records, self.pipeline = records, pipeline
        self.algorithm, self.accumulate = algorithm, accumulate
        self.from_host = grad_copy != "device"  # the redo reads the host accumulators or copies
        self.skip_nonfinite, self.max_grad_norm = skip_nonfinite, max_grad_norm
        self.tracking = skip_nonfinite or max_grad_norm is not None
        self.stacklevel = stacklevel
        self.skipped_steps = 0
        self._warned_at = -math.inf
        self.predicted = 1.0  # the factor the last window was given after its last backward
        self.predicted_late_hparams = False  # the last window's hyper-parameters changed after its last backward
        # the 2-norm the next windows will likely be clipped to: the last clip's (also by
        # max_grad_norm, so that the option and a framework's clip_grad_norm_ step alike)
        self.clip_limit: Optional[float] = None
        self._warned_late_hparams = False
        self.open_window()

    def open_window(self) -> None:
        self.scale = 1.0  # the factor on this window's gradients (clip_grad_norm_, scale_grads_)
        self.late = 1.0  # the part of it given after the window's last backward started
        # the part given since the window's last pass ended (or before its first): late too when
        # step() then closes the window short, not when a pass follows (pass_begins)
        self.since_pass = 1.0
        # NOTE: max_grad_norm's coefficient is the window's last clip, a factor of its own: a
        # clip_grad_norm_ or scale_grads_ after it comes before it (it is taken again), so the
        # norm such a call returns is the one before the option's clip, in any window
        self.option_coef: Optional[float] = None  # None: not clipped by the option yet
        self._window_limit: Optional[float] = None  # the smallest finite 2-norm clip_grad_norm_ limit
        self.skipped = False
        self._norms: dict = {}  # norm_type -> norm of the window's unscaled gradients
        self.grad_norm: Optional[float] = None  # the last norm computed since a pass began (scaled)
        self.clip_coef: Optional[float] = None  # the last clipping coefficient of this window
        self.late_hparams = False  # step() found hyper-parameters other than those of the last backward

    # ------------------------------------------------------------- norms
    def window_records(self) -> list:
        return [r for r in self.records if (r.has_accum if self.accumulate else r.pieces_total > 0)]

    def norm(self, norm_type: float) -> float:
        """Total norm of the window's gradients times the window's factor."""
        if self.skipped:
            return math.nan  # NOTE: a skipped window's host copies stop at its first non-finite chunk
        if norm_type not in self._norms:
            if self.from_host:
                self._settle_chunks()  # the worker writes the host copies as it steps
            recs = self.window_records()
            local = [float(local_norm(r.accum if self.accumulate else r.retained, norm_type)) for r in recs]
            self._norms[norm_type] = total_norm(list(zip(recs, local)), norm_type)
        return self.scale * self._norms[norm_type]

    def clip(self, max_norm: float, norm_type: float, *, late: bool, error_if_nonfinite: bool = False,
             in_place: bool = False) -> float:
        """torch.nn.utils.clip_grad_norm_ on the window: returns the total norm and
        multiplies the window's factor by the clipping coefficient (``late``: after
        the window's last backward started). ``in_place``: in the middle of an
        accumulation window (drained), scale the host accumulators instead, as torch
        scales ``param.grad``: the passes that follow add unscaled gradients to them."""
        total = self.norm(norm_type)
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite ({total}), so they cannot be "
                "clipped; with error_if_nonfinite=False this step would be skipped (skip_nonfinite) instead")
        self.grad_norm, self.clip_coef = total, clip_coefficient(max_norm, total)
        # NOTE: a clip that cannot clip (max_norm inf: a framework that only logs the norm) leaves
        # the limit the clips before it set
        if math.isfinite(max_norm):
            self.clip_limit = max_norm if norm_type == 2.0 else None
            if norm_type == 2.0:
                self._window_limit = min(max_norm, math.inf if self._window_limit is None else self._window_limit)
        if not math.isfinite(total):
            return total
        if in_place:
            if self.clip_coef != 1.0:
                coef = torch.tensor(self.clip_coef, dtype=torch.float32)  # as torch's float32 coefficient
                with deferred_interrupts(), torch.no_grad():
                    for rec in self.window_records():
                        rec.accum.mul_(coef)
                self._norms.clear()
            # NOTE: also the factor the next window speculates with if step() follows: a clip
            # before step() in a short window (a framework's last one of an epoch) comes after
            # its last backward
            self.since_pass *= self.clip_coef
        else:
            self.rescale(self.clip_coef, late=late)
        self._clip_by_option_again()
        return total

    def pass_begins(self) -> None:
        """A backward pass adds to the window's gradients: norms computed so far are stale, and
        the factors given since the last pass came before this one."""
        self._norms.clear()
        self.grad_norm = None
        self.since_pass = 1.0

    def short_window_ends(self) -> None:
        """step() closes the window after fewer passes than grad_accum_steps (or none): the
        factors given since its last pass came after it, as a full window's after its last
        backward, and the next window speculates with them."""
        self.late *= self.since_pass
        self.since_pass = 1.0

    def close_window(self, *, abandoned: bool = False) -> None:
        """The window ends; the next one speculates with its late factor, unless it was
        abandoned (zero_grad() before its last pass, a failure): then with the last one's."""
        if not abandoned:
            self.predicted = self.late * (self.option_coef or 1.0)
            self.predicted_late_hparams = self.late_hparams
        self.open_window()

    def rescale(self, factor: float, *, late: bool) -> None:
        """``late``: after the window's last backward started; else it may still be
        (``since_pass``, short_window_ends)."""
        self.scale *= factor
        if late:
            self.late *= factor
        else:
            self.since_pass *= factor

    def scale_grads(self, factor: float, *, late: bool) -> None:
        """scale_grads_(): the window's gradients times ``factor``. A norm already computed in
        this window (``grad_norm``, before clipping) scales with them: the norm logged is the
        same whether the factor came before or after the window's last backward."""
        self.rescale(factor, late=late)
        if self.grad_norm is not None:
            self.grad_norm *= factor
        self._clip_by_option_again()

    def factor(self) -> float:
        """The factor the window's step applies to its gradients."""
        return self.scale * (self.option_coef or 1.0)

    def _clip_by_option(self) -> None:
        """max_grad_norm: clip the window's gradients as every call so far left them."""
        total = self.norm(2.0)
        self.grad_norm, self.clip_coef = total, clip_coefficient(self.max_grad_norm, total)
        self.option_coef = self.clip_coef
        self.clip_limit = min(self.max_grad_norm, math.inf if self._window_limit is None else self._window_limit)

    def _clip_by_option_again(self) -> None:
        """A clip_grad_norm_ or scale_grads_ after the option's clip comes before it."""
        if self.option_coef is not None and math.isfinite(self.norm(2.0)):
            self._clip_by_option()

    def defers(self) -> bool:
        """Whether the window's last backward holds its chunks back until step(), instead of
        stepping them speculatively.

        NOTE: a redo (rollback plus a second step) costs two passes over the state after
        backward; stepping once with the final values costs one. A window is deferred when
        the last one ended with hyper-parameters set after its last backward began (they
        will almost surely differ again, so speculating would only add the rollback) or,
        with AdamW, with a factor other than 1 (it clipped, or was scaled after its last
        backward; SignSGD's update does not depend on the factor). A run that never clips
        speculates with factor 1 every step."""
        return self.predicted_late_hparams or (self.algorithm == "adamw" and self.predicted != 1.0)

    def speculative_scale(self) -> float:
        """The factor the window's last backward steps with."""
        # NOTE: before the window's last pass: no option_coef yet. Each factor fits float32 (the
        # kernels' grad_scale), their product may not: then without the last window's
        factor = self.scale * self.predicted
        return factor if factor <= FLOAT32_MAX else self.scale

    # ------------------------------------------------------- after the last pass
    def after_final_pass(self) -> None:
        """The window's last pass has drained: skip, clip or keep the speculative step."""
        if not self.tracking:
            return
        recs = self.window_records()
        local = [(r, math.sqrt(r.grad_sq)) for r in recs]
        if self.pipeline.nonfinite and local and all(math.isfinite(n) for _, n in local):
            local.append((recs[0], math.nan))  # a chunk stopped before its norms were all read
        self._norms[2.0] = n = total_norm(local, 2.0)
        # NOTE: a norm computed since the last pass began (a clip before step() closed a short
        # window) is of these gradients before that clip, the one to log: scale holds its factor
        if self.grad_norm is None:
            self.grad_norm = self.scale * n
        if not math.isfinite(n):
            if self.skip_nonfinite:
                self._skip()
            return
        if self.max_grad_norm is not None:
            self._clip_by_option()
            if not self.predicted_late_hparams:  # NOTE: else step() steps it once, with the values it reads
                self.apply()

    def apply(self, current: Optional[list] = None) -> None:
        """Make the applied update match the window's factor and ``current`` (the groups'
        hyper-parameters as step() reads them; None: those of the last backward): a
        rollback and a redo when they changed, or when chunks were held back from the
        speculative step (SignSGD: when its step changes, ``_same_sign_sgd_step``)."""
        if self.skipped or not self.pipeline.hparams:
            return
        names = _ADAMW_HPARAMS if self.algorithm == "adamw" else _SIGN_SGD_HPARAMS
        target = [dict(hp, grad_scale=self.factor()) for hp in (current or self.pipeline.hparams)]

        def differs(hp: dict, group: int) -> bool:
            if self.algorithm != "adamw":
                return not _same_sign_sgd_step(hp, target[group])
            return any(hp[name] != target[group][name] for name in names)

        change = self._late_change(current) if current is not None else None
        if self.pipeline.held_back or any(differs(hp, g) for g, hp in enumerate(self.pipeline.hparams)):
            self._settle_chunks()  # the redo needs every speculative step done
        stepped = self.pipeline.stepped
        held_back = self.pipeline.held_back
        if held_back or any(differs(piece.hparams, piece.rec.group) for piece in stepped):
            # NOTE: the rollback and the redo change every stepped parameter one after another;
            # a Ctrl-C in between would leave some rolled back and others not.
            with deferred_interrupts():
                self._rollback(stepped)
                # every host parameter staged for this step: stepped, held back or zero-filled
                # (device ones are stepped once, when the window closes: device_state.py)
                recs = [r for r in self.records if r.pieces_total > 0 and not r.on_device]
                self.pipeline.restep(recs, target, grads_on_host=self.from_host)
                note_versions(recs)
        if change is not None and not self._warned_late_hparams:
            self._warn_late(change)

    def _late_change(self, current: list) -> Optional[tuple]:
        """The first group option that differs in ``current`` from the window's last backward,
        as ``(group, key, old, new)``, or None; noted for the next window (``defers``)."""
        keys = _ADAMW_OPTIONS if self.algorithm == "adamw" else _SIGN_SGD_OPTIONS
        change = next(((g, key, hp[key], current[g][key]) for g, hp in enumerate(self.pipeline.hparams)
                       for key in keys if hp[key] != current[g][key]), None)
        self.late_hparams = change is not None
        return change

    def _warn_late(self, change: tuple) -> None:
        """Once per optimizer: what changed late, and what it costs."""
        self._warned_late_hparams = True
        g, key, old, new = change
        warnings.warn(
            f"cpu_offload: param_groups[{g}]['{key}'] changed from {old:g} to {new:g} after the window's last "
            f"backward pass began; full offload steps during that backward, so step() rolled back what that backward stepped "
            f"and stepped again with the new value, as torch would use it (a second pass over the state; while it goes on, "
            f"the steps wait for step() instead of overlapping backward). Set hyper-parameters before the "
            f"window's last backward (before its forward) to keep the step overlapped",
            RuntimeWarning, stacklevel=self.stacklevel())

    def _settle_chunks(self) -> None:
        """The window's chunks still in flight (overlap_forward) have run; a worker failure raises."""
        if self.pipeline.in_flight:
            self.pipeline.drain()
            self.pipeline.raise_error()

    def _skip(self) -> None:
        self._settle_chunks()
        with deferred_interrupts():  # NOTE: all or nothing, as in apply()
            # the device got the rolled-back step's weights: send the old ones
            write_compute_copies(self._rollback(self.pipeline.stepped))
        self.skipped = True
        self.skipped_steps += 1
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            warnings.warn(f"cpu_offload: optimizer step skipped: a gradient was NaN or Inf ({self.skipped_steps} "
                          "skipped since construction; this warning repeats at most once a minute)",
                          RuntimeWarning, stacklevel=self.stacklevel())

    def _rollback(self, stepped: list) -> list:
        """Undo every stepped piece; returns their records (step counts restored).
        NOTE: one native call per group of pieces that share hyper-parameters and dtypes
        (parallel over the kernel pool), not one per piece."""
        recs: dict = {}
        host_grads: dict = {}  # grad_copy="device": fetched once per parameter
        names = _ADAMW_HPARAMS if self.algorithm == "adamw" else _SIGN_SGD_HPARAMS
        groups: dict = {}  # (hparams, grad dtype, moment dtype) -> ([master], [grad], [exp_avg], [exp_avg_sq], [step])
        with torch.no_grad():
            for rec, start, numel, step, hp in stepped:  # chunk_runner.SteppedPiece
                piece = slice(start, start + numel)
                if self.accumulate:
                    grad = rec.accum[piece]
                elif self.from_host:
                    grad = rec.retained[piece]
                else:
                    if id(rec) not in host_grads:
                        host_grads[id(rec)] = rec.retained.to("cpu")
                    grad = host_grads[id(rec)][piece]
                moments = rec.exp_avg.dtype if self.algorithm == "adamw" else None
                key = (tuple(hp[n] for n in names), grad.dtype, moments)
                masters, grads, exp_avgs, exp_avg_sqs, steps = groups.setdefault(key, ([], [], [], [], []))
                masters.append(rec.master[piece])
                grads.append(grad)
                if self.algorithm == "adamw":
                    exp_avgs.append(rec.exp_avg[piece])
                    exp_avg_sqs.append(rec.exp_avg_sq[piece])
                    steps.append(step)
                recs[id(rec)] = rec
            for (values, *_), (masters, grads, exp_avgs, exp_avg_sqs, steps) in groups.items():
                hp = dict(zip(names, values))
                if self.algorithm == "adamw":
                    rollback_adamw_pieces_(masters, grads, exp_avgs, exp_avg_sqs, steps, **hp)
                else:
                    rollback_sign_sgd_pieces_(masters, grads, **hp)
        for rec in recs.values():
            rec.undo_step()
        return list(recs.values())
