# The one offload setting: offload_optimizer(optimizer, offload=...).
#
# Scope: validate the mode and its keyword options, with errors that say what to write
# instead; return the optimizer unchanged ("none"), a StateOffloadOptimizer ("optimizer",
# the default) or a FullCPUOffloadOptimizer ("full").
# Non-goals: aliases or guessing (an unknown mode is a ValueError, an unknown keyword a
# TypeError, whatever it may have meant), anything the wrappers themselves do.

from __future__ import annotations

import inspect

import torch

from cpu_offload._common.checks import check_int
from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from cpu_offload._state.optimizer import StateOffloadOptimizer

__all__ = ["offload_optimizer", "OFFLOAD_MODES"]

OFFLOAD_MODES = ("optimizer", "full", "none")



def _keyword_options(cls) -> tuple:
    """The keyword-only options of a wrapper's constructor, beyond grad_accum_steps."""
    params = inspect.signature(cls.__init__).parameters.values()
    return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name != "grad_accum_steps")


# Keyword options each mode accepts (beyond grad_accum_steps, accepted by all), read from the
# constructors so that the two lists cannot drift apart.
_OPTIONS = {
    "none": (),
    "optimizer": _keyword_options(StateOffloadOptimizer),
    "full": _keyword_options(FullCPUOffloadOptimizer),
}
# Keywords people write for the mode itself.
_MODE_WORDS = ("mode", "offload_mode", "offload_type", "kind", "type", "strategy")


def _unknown_keywords(offload: str, options: dict) -> str:
    """The TypeError message for keywords ``offload`` does not accept."""
    unknown = sorted(set(options) - set(_OPTIONS[offload]))
    for key in unknown:
        if key in _MODE_WORDS or (isinstance(options[key], str) and options[key] in OFFLOAD_MODES):
            value = options[key] if options[key] in OFFLOAD_MODES else "full"
            return (f"offload_optimizer() got an unexpected keyword argument {key!r}: the mode is set with "
                    f"offload=; did you mean offload_optimizer(optimizer, offload={value!r})?")
    accepted = ", ".join(("grad_accum_steps",) + _OPTIONS[offload])
    message = (f"offload_optimizer(offload={offload!r}) got unexpected keyword argument(s) "
               f"{', '.join(unknown)}; accepted: {accepted}")
    elsewhere = [f"{key} is an option of offload={mode!r}" for key in unknown
                 for mode, keys in _OPTIONS.items() if key in keys]
    return message + ("; " + ", ".join(elsewhere) if elsewhere else "")


def offload_optimizer(optimizer: torch.optim.Optimizer, offload: str = "optimizer", **options):
    """Move an optimizer's work or state off the device.

    Args:
        optimizer: a ``torch.optim.Optimizer`` built over the model's parameters
            (for FSDP2, after ``fully_shard`` and before the first forward).
        offload: ``"optimizer"`` (default): the optimizer state lives in pinned
            host RAM between steps and the step runs on the device;
            ``"full"``: fp32 masters, moments and gradients in host RAM, the
            step runs on the CPU during backward (torch.optim.AdamW or
            cpu_offload.SignSGD only; the model's parameters become bf16, so
            run the forward under ``torch.autocast`` or feed bf16 inputs);
            ``"none"``: the optimizer, unchanged.
        grad_accum_steps: backward passes per step (all modes; ``"full"``
            needs it (default 1), ``"optimizer"`` starts its copies of the state
            during the last one (default: the longest window seen so far)).
        **options: mode-specific keywords, see FullCPUOffloadOptimizer and
            StateOffloadOptimizer.
    """
    if not isinstance(offload, str) or offload not in OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {', '.join(repr(m) for m in OFFLOAD_MODES)}; got {offload!r}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    grad_accum_steps = options.pop("grad_accum_steps", None)
    if set(options) - set(_OPTIONS[offload]):
        raise TypeError(_unknown_keywords(offload, options))
    if offload == "none":
        check_int("grad_accum_steps", grad_accum_steps, low=1, none="")  # the wrappers check their own
        return optimizer
    if offload == "optimizer":
        return StateOffloadOptimizer(optimizer, grad_accum_steps=grad_accum_steps, **options)
    return FullCPUOffloadOptimizer(optimizer, grad_accum_steps=1 if grad_accum_steps is None else grad_accum_steps,
                                   **options)
