# Argument checks shared by the public entry points, with messages that name the argument.
#
# Scope: whole-number options (an int, never a bool, at least some bound; None where the
# option has a default meaning). Non-goals: checks of one entry point only (they stay
# beside it).

from __future__ import annotations

from typing import Optional

__all__ = ["check_int"]


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
