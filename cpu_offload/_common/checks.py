# Argument checks shared by the public entry points, with messages that name the argument.
#
# Scope: whole-number options (an int, never a bool, at least some bound; None where the
# option has a default meaning); hyper-parameters and the constants derived from them that
# the kernels narrow to float32; real numbers, the one a one-element tensor holds included;
# a parameter's name in messages, its place in the optimizer's param_groups.
# Non-goals: checks of one entry point only (they stay beside it).

from __future__ import annotations

import math
import numbers
import struct
from typing import Optional

import torch

__all__ = ["check_int", "check_float32", "item_of", "real_of", "position_of"]

FLOAT32_MAX = 3.4028234663852886e38


def check_int(name: str, value, *, low: int, none: Optional[str] = None, detail: str = "") -> None:
    """Raise ValueError unless ``value`` is an int >= ``low`` (``True`` is not an int here).

    ``none``: ``value`` may also be None, which means this (shown in the message; "" for
    nothing to add). ``detail`` follows the bound in the message.
    """
    if value is None and none is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        allowed = "" if none is None else "None" + (f" ({none})" if none else "") + " or "
        raise ValueError(f"{name} must be {allowed}an int >= {low}{detail}, got {value!r}")


def check_float32(name: str, value: float, derived: str = "") -> None:
    """Raise ValueError naming ``name`` when the finite ``value`` rounds to an infinity in
    float32, the precision the kernels compute in (csrc/scalars.cpp checks the same).

    ``derived``: what ``value`` is when it is a constant computed from ``name`` (e.g.
    ``"1 - lr * weight_decay"``), shown in the message.
    """
    try:
        struct.pack("<f", value)  # NOTE: raises OverflowError exactly when float(value) rounds to +-inf
    except OverflowError:
        subject = f"{name} gives {derived} = {value:g}" if derived else f"{name} is {value:g}"
        raise ValueError(f"{subject}, which overflows float32 (largest finite {FLOAT32_MAX:.4g}): "
                         "the kernels compute in float32") from None


def item_of(name: str, value):
    """``value``, or the Python number a one-element tensor ``value`` holds.

    Raise ValueError naming ``name`` for a tensor of another size, or one whose value
    cannot be read (a meta or fake tensor).
    """
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != 1:
        raise ValueError(f"{name} must be a number or a one-element tensor")
    try:
        return value.item()
    except (RuntimeError, NotImplementedError) as e:  # a meta or fake tensor holds no value
        raise ValueError(f"{name}: cannot read the value of this {value.device.type} tensor ({e}); "
                         "pass a number or a CPU tensor") from None


def real_of(name: str, value) -> float:
    """``value`` as a float: any real number (numpy's included, never a bool) or the one a
    one-element tensor holds (``item_of``); an int beyond any double is +-inf.

    Raise TypeError naming ``name`` for anything else (a string, a list).
    """
    value = item_of(name, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:  # an int beyond any double
        return math.inf if value > 0 else -math.inf


def position_of(param_groups, param) -> str:
    """``param``'s place in ``param_groups`` as messages name it (``param_groups[g][i]``), or
    "a parameter" when no group holds it."""
    return next((f"param_groups[{g}][{i}]" for g, group in enumerate(param_groups)
                 for i, q in enumerate(group["params"]) if q is param), "a parameter")
