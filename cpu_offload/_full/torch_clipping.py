# torch.nn.utils.clip_grad_norm_ and clip_grad_value_ over a full-offload model's parameters.
# Their gradients never stay in .grad (the hooks take them to the host), so torch's functions
# would see none: nothing clipped, a norm of 0, and no word of it. HF Trainer's default
# max_grad_norm=1.0, accelerate's clip_grad_norm_ and Lightning's gradient_clip_val all call
# them. ``install()``, run when the package is imported, puts in their place
# functions that, for parameters one full-offload optimizer drives, clip through it (its
# clip_grad_norm_: torch's arguments and result) when they are all of that optimizer's, and
# raise a ValueError that says what to do otherwise (part of them, several optimizers, or
# value clipping, which it cannot do); any other parameters go to torch's functions unchanged,
# with a warning when none of them holds a gradient while a full-offload window holds its
# gradients on the host (a list filtered on ``p.grad is not None`` is empty then).
# A function imported before cpu_offload (``from torch.nn.utils import clip_grad_value_``
# above ``import cpu_offload``) is torch's own object, which the module attributes no longer
# reach: ``install()`` points the wrapper torch put around each of them at the function here
# too, so every reference behaves the same.
#
# Scope: clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_. Non-goals: get_total_norm,
# which takes gradients, not parameters, and so cannot tell whose they are.

from __future__ import annotations

import functools
import sys
import warnings

import torch

from cpu_offload._full import ownership

__all__ = ["install"]


def _unwrapped(fn):
    """torch's function under the ``@_no_grad`` wrapper of torch/nn/utils/clip_grad.py, and the
    wrapper's closure cell that holds it (``(fn, None)`` where torch wraps it otherwise)."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_freevars != ("func",) or not fn.__closure__:
        return fn, None
    cell = fn.__closure__[0]
    return cell.cell_contents, cell


_clip_grad = torch.nn.utils.clip_grad
_torch_clip_grad_norm_, _clip_grad_norm_cell = _unwrapped(_clip_grad.clip_grad_norm_)
_torch_clip_grad_value_, _clip_grad_value_cell = _unwrapped(_clip_grad.clip_grad_value_)
_torch_clip_grads_with_norm_, _clip_grads_with_norm_cell = _unwrapped(_clip_grad._clip_grads_with_norm_)


def _as_list(parameters) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _owner_of_all(params: list, what: str):
    """The full-offload optimizer that drives ``params``, or None when none of them is
    driven by one; raises when they are not exactly one optimizer's parameters."""
    owners: dict = {}
    others_hold_grad = False
    for p in params:
        owner = ownership.owner_of(p)
        if owner is not None:
            owners.setdefault(id(owner), (owner, set()))[1].add(id(p))
        else:
            others_hold_grad = others_hold_grad or p.grad is not None
    if not owners:
        return None
    if len(owners) > 1:
        raise ValueError(f"torch.nn.utils.{what}: the parameters belong to {len(owners)} full-offload optimizers, "
                         "whose gradients are on the host: clip each through its own (opt.clip_grad_norm_)")
    owner, mine = next(iter(owners.values()))
    if others_hold_grad:
        raise ValueError(f"torch.nn.utils.{what}: the parameters mix a full-offload optimizer's (gradients on the "
                         "host) with others that hold .grad: clip them apart (opt.clip_grad_norm_ for the first; "
                         "under a framework, its clipping off and max_grad_norm= on offload_optimizer)")
    owned = ownership.owned_count(owner)
    if len(mine) != owned:
        raise ValueError(
            f"torch.nn.utils.{what}: {len(mine)} of the {owned} parameters of a full-offload "
            "optimizer: their gradients are on the host and are clipped together; pass all of them "
            "(model.parameters()) or call opt.clip_grad_norm_(max_norm)")
    return owner


def _caller_level() -> int:
    """The stack level of the code that called torch's clipping (through torch's wrapper of it
    too, when it was imported before cpu_offload)."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == _clip_grad.__file__:
        frame, level = frame.f_back, level + 1
    return level


@functools.wraps(_torch_clip_grad_norm_, assigned=("__name__", "__qualname__", "__doc__"))
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    params = _as_list(parameters)
    owner = _owner_of_all(params, "clip_grad_norm_")
    if owner is None:
        if all(p.grad is None for p in params) and any(w._window_phase() for w in ownership.live_owners()):
            warnings.warn(
                f"torch.nn.utils.clip_grad_norm_ got no parameter that holds a gradient ({len(params)} parameters) "
                "while a full-offload optimizer holds this window's gradients on the host: nothing was clipped. "
                "Under full offload param.grad is None after backward, so a list filtered on p.grad is empty: "
                "pass model.parameters() (or call opt.clip_grad_norm_)", RuntimeWarning, stacklevel=_caller_level())
        with torch.no_grad():
            return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    return owner.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)


@functools.wraps(_torch_clip_grad_value_, assigned=("__name__", "__qualname__", "__doc__"))
def clip_grad_value_(parameters, clip_value, foreach=None):
    params = _as_list(parameters)
    if any(ownership.owner_of(p) is not None for p in params):
        raise ValueError("torch.nn.utils.clip_grad_value_: a full-offload optimizer's gradients are on the host "
                         "and cannot be clipped by value; clip by norm (torch.nn.utils.clip_grad_norm_, or "
                         "max_grad_norm= on offload_optimizer)")
    with torch.no_grad():
        return _torch_clip_grad_value_(params, clip_value, foreach)


@functools.wraps(_torch_clip_grads_with_norm_, assigned=("__name__", "__qualname__", "__doc__"))
def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    params = _as_list(parameters)
    if any(ownership.owner_of(p) is not None for p in params):
        raise ValueError(
            "torch.nn.utils.clip_grads_with_norm_ got a full-offload optimizer's parameters, whose gradients are on "
            "the host: it would clip nothing. Clip with torch.nn.utils.clip_grad_norm_ (it clips through the "
            "optimizer) or opt.clip_grad_norm_(max_norm)")
    with torch.no_grad():
        return _torch_clip_grads_with_norm_(params, max_norm, total_norm, foreach)


def install() -> None:
    """Put the functions above in place of torch's (idempotent)."""
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        module.clip_grad_norm_ = clip_grad_norm_
        module.clip_grad_value_ = clip_grad_value_
    torch.nn.utils.clip_grads_with_norm_ = clip_grads_with_norm_
    torch.nn.utils.clip_grad._clip_grads_with_norm_ = clip_grads_with_norm_
    # NOTE: torch's own objects, held by whoever imported them before cpu_offload, run what
    # their wrapper's cell holds; the functions above call torch's unwrapped ones, so no loop.
    for cell, ours in ((_clip_grad_norm_cell, clip_grad_norm_), (_clip_grad_value_cell, clip_grad_value_),
                       (_clip_grads_with_norm_cell, clip_grads_with_norm_)):
        if cell is not None:
            cell.cell_contents = ours
