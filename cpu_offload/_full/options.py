# What full offload reads from the wrapped optimizer and its own options.
#
# Scope: which optimizers it can run, their hyper-parameters (validated on the
# caller's thread), the option checks, the staging slot size. Non-goals: host state
# (host_state.py), the protocol (protocol.py), the CPU binding (binding.py).

from __future__ import annotations

import math
import numbers
import os
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch

from cpu_offload._common.checks import check_float32, check_int, item_of
from cpu_offload._common.wrapping import check_not_offloaded
from cpu_offload.optim import SignSGD
from cpu_offload._full.packing import align_up

__all__ = ["check_optimizer", "check_options", "check_keep_fp32", "check_gpu_state", "check_stream_share",
           "staging_rings", "ring_rooms", "Rings", "read_hparams"]

_UNSUPPORTED_ADAMW = ("amsgrad", "maximize", "capturable", "differentiable")


def check_optimizer(optimizer) -> str:
    """The algorithm full offload runs for ``optimizer``: "adamw" or "sign_sgd"."""
    check_not_offloaded(optimizer)
    if type(optimizer) is torch.optim.AdamW:
        return "adamw"  # its options: read_hparams
    if type(optimizer) is SignSGD:
        return "sign_sgd"
    cls = type(optimizer)
    name = f"torch.optim.{cls.__name__}" if cls.__module__.startswith("torch.optim") else cls.__qualname__
    also = ("; or build torch.optim.AdamW instead (with weight_decay=0 it makes the same update as "
            "torch.optim.Adam without weight decay)") if cls is torch.optim.Adam else ""
    raise TypeError(
        f"offload='full' runs only torch.optim.AdamW and cpu_offload.SignSGD on the CPU, got {name}: use "
        f"offload='optimizer' (the default), which keeps any torch optimizer's state in host RAM between "
        f"steps{also}"
    )


def check_options(*, algorithm: str, grad_accum_steps, compute_dtype, state_dtype, num_slots, pinned_bytes,
                  timeout_s, sysfs_root) -> None:
    check_int("grad_accum_steps", grad_accum_steps, low=1)
    if compute_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"compute_dtype must be torch.bfloat16 or torch.float32, got {compute_dtype}")
    if state_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype!r}")
    if state_dtype == torch.bfloat16 and algorithm != "adamw":
        raise ValueError("state_dtype=torch.bfloat16 stores AdamW's moments in bf16; SignSGD keeps no moments, "
                         "so leave state_dtype at torch.float32 (the default)")
    if num_slots is not None:
        check_int("num_slots", num_slots, low=1)
    if pinned_bytes is not None:
        check_int("pinned_bytes", pinned_bytes, low=2 * (num_slots or 4) * 4096, detail=f" (num_slots={num_slots or 4})")
    check_timeout(timeout_s)
    if not isinstance(sysfs_root, (str, os.PathLike)):
        raise TypeError(f"sysfs_root must be a path (str or os.PathLike), got {sysfs_root!r}")


def check_timeout(timeout_s) -> None:
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
            or not 0 < timeout_s <= threading.TIMEOUT_MAX):
        raise ValueError(f"timeout_s must be a number > 0 and at most threading.TIMEOUT_MAX "
                         f"({threading.TIMEOUT_MAX:g}), got {timeout_s!r}")


def check_keep_fp32(keep_fp32, optimizer) -> set:
    """The ids of the parameters ``keep_fp32`` names; each must be one of ``optimizer``'s."""
    if isinstance(keep_fp32, (torch.Tensor, str, bytes)) or not isinstance(keep_fp32, Iterable):
        hint = ": wrap a single parameter in a list" if isinstance(keep_fp32, torch.Tensor) else ""
        raise TypeError(f"keep_fp32 must be an iterable of the optimizer's parameters, got "
                        f"{type(keep_fp32).__name__}{hint}")
    members = {id(p) for group in optimizer.param_groups for p in group["params"]}
    keep = set()
    for i, p in enumerate(keep_fp32):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"keep_fp32[{i}] must be a parameter of the optimizer, got {type(p).__name__}")
        if id(p) not in members:
            raise ValueError(f"keep_fp32[{i}] (shape {tuple(p.shape)}) is not a parameter of the optimizer: pass "
                             f"the model's own parameter objects, not copies")
        keep.add(id(p))
    return keep


GRAD_COPY_PLACES = ("device", "host")


def check_gpu_state(gpu_state) -> None:
    """``gpu_state``: None (every state on the host), a byte budget, or ``"auto"``."""
    if gpu_state is None or gpu_state == "auto":
        return
    if isinstance(gpu_state, bool) or not isinstance(gpu_state, int) or gpu_state < 0:
        raise ValueError(f"gpu_state must be None, a number of bytes >= 0 or 'auto', got {gpu_state!r}")


def check_stream_share(stream_share) -> float:
    """``stream_share``: the share of the host parameters' elements the device steps, in [0, 1]."""
    if isinstance(stream_share, bool) or not isinstance(stream_share, (int, float)) \
            or not 0.0 <= stream_share <= 1.0:
        raise ValueError(f"stream_share must be a number from 0 to 1, got {stream_share!r}")
    return float(stream_share)


def check_clipping_options(*, max_grad_norm, skip_nonfinite, grad_copy) -> Optional[float]:
    if grad_copy not in GRAD_COPY_PLACES:
        raise ValueError(f"grad_copy must be one of {', '.join(map(repr, GRAD_COPY_PLACES))}, got {grad_copy!r}")
    if not isinstance(skip_nonfinite, bool):
        raise TypeError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}")
    if max_grad_norm is None:
        return None
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) \
            or not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be a finite number > 0 or None, got {max_grad_norm!r}")
    return float(max_grad_norm)


_MIB = 1 << 20
# The staging rings by default: 1/8 of the gradient bytes in all (1/16 per direction), between
# PINNED_MIN and PINNED_MAX, in slots of about SLOT_BYTES.
PINNED_MIN, PINNED_MAX, SLOT_BYTES = 512 * _MIB, 4096 * _MIB, 256 * _MIB
# With overlap_forward the device-to-host ring grows to hold the backlog, up to this size.
BACKLOG_MAX = 16384 * _MIB


@dataclass(frozen=True)
class Rings:
    """The two staging rings' shape: slots of ``slot_bytes`` each."""

    d2h_slots: int
    h2d_slots: int
    slot_bytes: int

    @property
    def nbytes(self) -> int:
        return (self.d2h_slots + self.h2d_slots) * self.slot_bytes


def staging_rings(records, keep: set, compute_dtype, *, pinned_bytes: Optional[int], num_slots: Optional[int],
                  room: int, backlog: bool = False, fill: bool = False) -> Rings:
    """The staging rings' shape; both have ``num_slots`` slots unless ``backlog``.

    ``pinned_bytes=None``: 1/8 of the gradient bytes, between 512 MiB and 4 GiB, or 512 MiB
    when the larger size does not fit in ``room`` (the host RAM left after the state); with
    ``fill``, for a room that already leaves the process its margin, the largest multiple of
    512 MiB that fits instead (at least 512 MiB).
    NOTE: under FSDP2 a block's gradients arrive at once, after its reduce-scatter; a ring
    smaller than that burst blocks backward until the CPU kernel frees a slot, and the GPU
    then idles (at 14B, 1.9 s of a 3.7 s step with 512 MiB). 1/16 of the gradient bytes per
    direction holds two to three such bursts of the capacity benchmark's models.
    ``num_slots=None``: slots of about 256 MiB, at least 4 per ring (so the 512 MiB floor has
    slots of 64 MiB). Small models get small slots: none is larger than all gradients together
    need. NOTE: each chunk costs the worker about 1 ms of Python between two kernel calls
    (issuing its copies, taking the next); 256 MiB slots instead of 64 MiB halved that time at
    8B (docs/full-offload-profile.md, "between two kernel calls").
    ``backlog`` (overlap_forward, sizes not given): slots of SLOT_BYTES (or all gradients, if
    smaller), the host-to-device ring as large as by default (at least 4 slots) and the
    device-to-host ring grown towards every gradient, both rings within half of ``room`` and
    the device-to-host one within BACKLOG_MAX. What it holds when backward ends is what the
    CPU steps during the next forward, in its order; one that holds every gradient never
    blocks backward. NOTE: the host-to-device ring need not grow: a slot is free again once
    its copy has landed, well within one chunk's kernel.
    """
    grad_bytes = sum(r.numel * (4 if id(r.param) in keep or compute_dtype == torch.float32 else 2) for r in records)
    all_grads = align_up(grad_bytes + 64 * len(records), 4096)
    sized = pinned_bytes is not None or num_slots is not None
    if pinned_bytes is None:
        pinned_bytes = min(PINNED_MAX, max(PINNED_MIN, grad_bytes // 8))
        if pinned_bytes > room:
            pinned_bytes = max(PINNED_MIN, room // PINNED_MIN * PINNED_MIN) if fill else PINNED_MIN
    if num_slots is None:
        num_slots = max(4, pinned_bytes // (2 * SLOT_BYTES))
    elif 2 * num_slots * 4096 > pinned_bytes:  # NOTE: given alone: slots of 4 KiB would exceed the default
        raise ValueError(f"num_slots={num_slots} needs at least {2 * num_slots * 4096} bytes of pinned staging (two "
                         f"rings of slots of at least 4096 bytes), more than the {pinned_bytes} bytes this model gets: "
                         "give fewer slots, or pinned_bytes as well")
    default = Rings(num_slots, num_slots, max(4096, min(pinned_bytes // (2 * num_slots), all_grads)))
    if not backlog or sized:
        return default
    slot = max(4096, min(SLOT_BYTES, all_grads))
    h2d = max(4, -(-default.h2d_slots * default.slot_bytes // slot))
    held = align_up(grad_bytes + grad_bytes // 16 + 64 * len(records), 4096)  # 1/16: packing's slack
    d2h = min(-(-held // slot), BACKLOG_MAX // slot, room // 2 // slot - h2d)
    grown = Rings(d2h, h2d, slot)
    return grown if d2h * slot > default.d2h_slots * default.slot_bytes else default


def ring_rooms() -> tuple:
    """Host rooms, largest first, at which ``staging_rings(..., fill=True)`` takes each size
    it can: unbounded (the default size), then every multiple of PINNED_MIN from PINNED_MAX
    down to 0 (the smallest)."""
    return (1 << 62, *range(PINNED_MAX, -1, -PINNED_MIN))


# With bf16 moments a rolled-back step is recomputed from the rounded moments: the update
# it undoes is within about 2**-8 of the real one (the rounding of m and v) only while
# eps_hat = eps*sqrt(1 - beta2**t) (smallest at t = 1) dominates the error of sqrt(v) from a
# bf16-subnormal v, at most sqrt(2**-134) = 2**-67: eps_hat >= 2**-57 keeps that error below
# 2**-10 of the denominator (eps >= 3.1e-17 for beta2 = 0.95, 2.2e-16 for beta2 = 0.999).
_BF16_MIN_EPS_HAT = 2.0**-57


def _length(items) -> Optional[int]:
    """``len(items)``, or None for a value without one (a number, a 0-d tensor, a string)."""
    if isinstance(items, (str, bytes)):
        return None
    try:
        return len(items)
    except TypeError:
        return None


def _check_float32_constants(g: int, values: dict, algorithm: str) -> None:
    """Raise ValueError, naming the group's key, when a constant the kernels derive from
    the group's values overflows float32 (csrc/scalars.cpp would refuse it mid-window)."""
    lr = values["lr"]
    check_float32(f"param_groups[{g}]['weight_decay']", 1.0 - lr * values["weight_decay"], "1 - lr * weight_decay")
    if algorithm == "adamw":
        # NOTE: the step size lr*sqrt(1 - beta2^t)/(1 - beta1^t) is largest at t = 1 or in the
        # limit t -> inf (lr, checked above): as a function of x = beta1^t its logarithm has
        # no interior maximum, so these two cover every step count.
        first = lr * math.sqrt(1.0 - values["beta2"]) / (1.0 - values["beta1"])
        check_float32(f"param_groups[{g}]['lr']", first,
                      "the bias-corrected step size lr * sqrt(1 - beta2) / (1 - beta1) of step 1")
        # NOTE: the kernels add eps*sqrt(1 - beta2^t) to sqrt(v), smallest at t = 1; where a positive
        # eps makes it 0 in float32, an element with v = 0 would step by 0/0 (NaN) where torch,
        # adding eps after the division, leaves it
        eps_hat = values["eps"] * math.sqrt(1.0 - values["beta2"])
        if values["eps"] > 0 and struct.unpack("<f", struct.pack("<f", eps_hat))[0] == 0.0:
            raise ValueError(f"param_groups[{g}]['eps'] gives eps * sqrt(1 - beta2) = {eps_hat:.3g} at step 1, which "
                             "rounds to 0 in float32: the kernels add it to sqrt(v), so an element with a zero "
                             "second moment would step by 0/0; use a larger eps")


def read_hparams(param_groups, algorithm: str, *, bf16_moments: bool = False) -> list:
    """Per-group hyper-parameters as floats, checked here so that a bad value
    raises on the caller's thread, naming the group, before any chunk is stepped."""
    keys = ("lr", "weight_decay") + (("betas", "eps") if algorithm == "adamw" else ())
    snap = []
    for g, group in enumerate(param_groups):
        # NOTE: checked at every window, not only at construction: load_state_dict (a torch
        # AdamW checkpoint's groups) or a user may set them later, and a flag left unhonoured
        # would train silently on other math.
        for key in _UNSUPPORTED_ADAMW if algorithm == "adamw" else ():
            if group.get(key):
                raise ValueError(f"full offload cannot honour AdamW option {key}=True (param_groups[{g}])")
        values = {}
        for key in keys:
            items = group[key] if key == "betas" else (group[key],)
            if key == "betas" and _length(items) != 2:
                raise ValueError(f"param_groups[{g}]['betas'] is {items!r}: it must be two numbers (beta1, beta2)")
            for i, v in enumerate(items):
                name = f"param_groups[{g}]['{key}']" + (f"[{i}]" if key == "betas" else "")
                if isinstance(v, torch.Tensor) and v.numel() == 1:
                    v = item_of(name, v)
                if isinstance(v, bool) or not isinstance(v, numbers.Real):
                    raise TypeError(f"{name} must be a number, got {v!r}")
                v = float(v)
                if not math.isfinite(v) or v < 0 or (key == "betas" and v >= 1):
                    raise ValueError(f"{name} is {v}: it must be finite and >= 0" + (" and < 1" if key == "betas" else ""))
                check_float32(name, v)
                values[key if key != "betas" else f"beta{i + 1}"] = v
        _check_float32_constants(g, values, algorithm)
        decoupled = group.get("decoupled_weight_decay", True)
        where = f"param_groups[{g}]['decoupled_weight_decay']"
        if algorithm == "adamw" and values["weight_decay"] and not item_of(where, decoupled):
            # NOTE: torch's AdamW honours the key, read for truth (0, np.False_, tensor(False) and
            # None as False): Adam's L2 penalty (g + wd*p), which the kernels do not run; a
            # torch.optim.Adam checkpoint loaded here sets it.
            raise ValueError(f"full offload cannot honour decoupled_weight_decay={decoupled!r} with weight_decay="
                             f"{values['weight_decay']:g} (param_groups[{g}]): that is torch.optim.Adam's L2 penalty; "
                             f"full offload runs AdamW's decoupled weight decay")
        if bf16_moments and values["eps"] * math.sqrt(1.0 - values["beta2"]) < _BF16_MIN_EPS_HAT:
            least = _BF16_MIN_EPS_HAT / math.sqrt(1.0 - values["beta2"])
            raise ValueError(
                f"param_groups[{g}]['eps'] is {values['eps']:g}: with state_dtype=torch.bfloat16 a step that "
                f"clipping or the non-finite guard rolls back is recomputed from the bf16 moments, which needs "
                f"eps >= {least:.3g} for beta2={values['beta2']:g}; use a larger eps or state_dtype=torch.float32")
        snap.append(values)
    return snap
