"""Typed Python wrappers around the native kernels (cpu_offload._C).

Scope: check every tensor argument (type, device, dtype, contiguity, sizes, overlap) and
raise a TypeError/ValueError that names the argument and index, then hand raw pointers to
the native code, which releases the GIL while it works; check thread counts and CPU ids
against the process's affinity mask. Non-goal: autograd, CUDA tensors.

NOTE: a validated tensor list is cached by the identity of its tensor objects, so calling
again with the same tensor objects skips the per-tensor checks (they cost more than the
kernel for many small tensors). The cache holds weak references and drops an entry as soon
as any of its tensors is freed. It cannot see a tensor whose storage is swapped in place
(``t.data = ...``, ``t.set_(...)``, ``t.resize_(...)``): after doing that to a tensor you
passed here, call ``clear_cache()``.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import weakref
from collections import OrderedDict
from typing import Iterator, Optional, Sequence

import torch

from cpu_offload import _C
from cpu_offload.topology import format_cpulist

__all__ = [
    "adamw_step",
    "sign_sgd_step",
    "accumulate_",
    "isa",
    "available_isas",
    "set_num_threads",
    "get_num_threads",
    "pin_threads",
    "get_pinned_cpus",
    "clear_cache",
]

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_OUT_KIND = {None: 0, torch.float32: 1, torch.bfloat16: 2}
_CACHE_SIZE = 256


# ---------------------------------------------------------------- ISA and threads

def _apply_isa_override() -> None:
    name = os.environ.get("CPU_OFFLOAD_ISA")
    if not name:
        return
    try:
        _C.set_isa(name)
    except ValueError as e:
        raise ValueError(
            f"CPU_OFFLOAD_ISA={name!r}: {e}; this CPU runs {available_isas()}"
        ) from None


def isa() -> str:
    """The ISA whose kernels run now: 'scalar', 'avx2', 'avx512' or 'avx512_bf16'."""
    return _C.isa()


def available_isas() -> list:
    """ISAs compiled into this build that this CPU supports, narrowest first."""
    return list(_C.available_isas())


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Runs the block with the kernels of ISA ``name`` (tests and benchmarks)."""
    previous = _C.isa()
    _C.set_isa(name)
    try:
        yield
    finally:
        _C.set_isa(previous)


def _allowed_cpus() -> set:
    """The CPUs this process (its calling thread) may run on."""
    return os.sched_getaffinity(0)


def set_num_threads(n: int) -> None:
    """Sets the number of native worker threads (default: CPUs in the affinity mask).

    Raises ValueError unless ``1 <= n <=`` the number of CPUs in the affinity mask: the
    kernels are memory-bound, and more threads than CPUs only adds contention.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    allowed = _allowed_cpus()
    if n > len(allowed):
        raise ValueError(f"n={n} is more than the {len(allowed)} CPUs this process may use "
                         f"(affinity mask {format_cpulist(allowed)})")
    _C.set_num_threads(n)


def get_num_threads() -> int:
    return _C.get_num_threads()


def pin_threads(cpus: Optional[Sequence[int]]) -> None:
    """Pins native worker k to ``cpus[k % len(cpus)]``; ``None`` or ``[]`` unpins.

    Raises ValueError, before anything changes, for an id that is not an int or not in
    the process's affinity mask (``os.sched_getaffinity(0)``).
    """
    cpus = [] if cpus is None else list(cpus)
    allowed = _allowed_cpus()
    for i, c in enumerate(cpus):
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"cpus[{i}] must be a non-negative int, got {c!r}")
        if c not in allowed:
            raise ValueError(f"cpus[{i}]={c} is not a CPU this process may use "
                             f"(affinity mask {format_cpulist(allowed)})")
    _C.pin_threads(cpus)  # NOTE: validates again: the mask may have changed meanwhile


def get_pinned_cpus() -> Optional[list]:
    cpus = list(_C.pinned_cpus())
    return cpus or None


# ---------------------------------------------------------------- validation + cache

def _check_list(name, tensors, count, dtypes, numels=None):
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    if count is not None and len(tensors) != count:
        raise ValueError(f"{name} has {len(tensors)} tensors, expected {count} (one per params entry)")
    dtype = None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu" or t.layout != torch.strided:
            raise ValueError(f"{name}[{i}] is a {t.device.type} {t.layout} tensor; the kernels need dense CPU tensors")
        if t.dtype not in dtypes:
            allowed = " or ".join(str(d) for d in dtypes)
            raise TypeError(f"{name}[{i}] has dtype {t.dtype}, expected {allowed}")
        if dtype is not None and t.dtype != dtype:
            raise TypeError(f"{name}[{i}] has dtype {t.dtype} but {name}[0] has {dtype}; one dtype per list")
        dtype = t.dtype
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}] is not contiguous")
        if numels is not None and t.numel() != numels[i]:
            raise ValueError(f"{name}[{i}] has {t.numel()} elements but params[{i}] has {numels[i]}")
    return dtype


class _Entry:
    __slots__ = ("batch", "codes", "refs")


_cache: "OrderedDict[tuple, _Entry]" = OrderedDict()
_cache_lock = threading.RLock()


def clear_cache() -> None:
    """Forgets every validated tensor list (see the module note)."""
    with _cache_lock:
        _cache.clear()


def _forget(key):
    def callback(_ref):
        with _cache_lock:
            _cache.pop(key, None)
    return callback


def _prepared(kind: str, named_lists, dtypes_by_name) -> _Entry:
    """Returns the validated native batch for these lists, from the cache when possible.

    named_lists: [(name, list-or-None)], params first; dtypes_by_name: allowed dtypes.
    """
    present = [(n, l) for n, l in named_lists if l is not None]
    for name, tensors in present:
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    key = (kind, tuple(n for n, _ in present), _C.identity_key(tuple(l for _, l in present)))
    with _cache_lock:
        entry = _cache.get(key)
        if entry is not None:
            _cache.move_to_end(key)
            return entry

    params_name, params = present[0]
    codes = {params_name: _check_list(params_name, params, None, dtypes_by_name[params_name])}
    numels = [t.numel() for t in params]
    for name, tensors in present[1:]:
        codes[name] = _check_list(name, tensors, len(params), dtypes_by_name[name], numels)
    operands = [(name, [t.data_ptr() for t in tensors], tensors[0].element_size() if tensors else 4)
                for name, tensors in present]
    entry = _Entry()
    entry.batch = _C.TensorBatch(numels, operands)  # raises ValueError on overlap
    entry.codes = codes
    callback = _forget(key)
    unique = {id(t): t for _, l in present for t in l}.values()
    entry.refs = [weakref.ref(t, callback) for t in unique]
    with _cache_lock:
        _cache[key] = entry
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return entry


def _check_scalar(name, value, *, low=None, high=None, high_open=False):
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    return value


def _check_steps(steps, count):
    if not isinstance(steps, torch.Tensor):
        raise TypeError(f"steps must be a torch.Tensor of int64 step counts, got {type(steps).__name__}")
    if steps.dtype != torch.int64 or steps.device.type != "cpu" or steps.dim() != 1 or not steps.is_contiguous():
        raise ValueError(
            f"steps must be a contiguous 1-D int64 CPU tensor, got {steps.dtype} {steps.device} shape {tuple(steps.shape)}")
    if steps.numel() != count:
        raise ValueError(f"steps has {steps.numel()} entries, expected {count} (one per params entry)")


_FP32 = (torch.float32,)
_GRADS = (torch.float32, torch.bfloat16)


# ---------------------------------------------------------------- kernels

def adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay,
               grad_scale=1.0, compute_params=None) -> None:
    """One AdamW step (torch.optim.AdamW semantics) over a list of tensors, in one pass.

    Args:
        params: fp32 master weights, updated in place.
        grads: fp32 or bf16 gradients (one dtype for the list).
        exp_avgs, exp_avg_sqs: fp32 first and second moments, updated in place.
        steps: 1-D int64 tensor, one step count per tensor; each is incremented first and
            the bias corrections use the new value (like torch's ``state["step"]``).
        lr, beta1, beta2, eps, weight_decay: as torch.optim.AdamW (decoupled decay).
        grad_scale: multiplies each gradient before use (e.g. 1/loss_scale).
        compute_params: optional bf16 or fp32 tensors that receive the updated weights.
    """
    lr = _check_scalar("lr", lr, low=0.0)
    beta1 = _check_scalar("beta1", beta1, low=0.0, high=1.0, high_open=True)
    beta2 = _check_scalar("beta2", beta2, low=0.0, high=1.0, high_open=True)
    eps = _check_scalar("eps", eps, low=0.0)
    weight_decay = _check_scalar("weight_decay", weight_decay, low=0.0)
    grad_scale = _check_scalar("grad_scale", grad_scale)
    entry = _prepared("adamw", [("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
                                ("exp_avg_sqs", exp_avg_sqs), ("compute_params", compute_params)],
                      {"params": _FP32, "grads": _GRADS, "exp_avgs": _FP32, "exp_avg_sqs": _FP32,
                       "compute_params": _GRADS})
    _check_steps(steps, len(params))
    _C.adamw(entry.batch, _DTYPE_CODE.get(entry.codes["grads"], 0),
             _OUT_KIND[entry.codes.get("compute_params")], steps.data_ptr(),
             lr, beta1, beta2, eps, weight_decay, grad_scale)


def sign_sgd_step(params, grads, *, lr, weight_decay, compute_params=None) -> None:
    """One SignSGD step: p <- p - lr*wd*p (wd > 0), then p <- p - lr*sign(g), sign(0) = 0.

    Args:
        params: fp32 weights, updated in place.
        grads: fp32 or bf16 gradients (any scale: the sign ignores it).
        lr, weight_decay: step size and decoupled weight decay.
        compute_params: optional bf16 or fp32 tensors that receive the updated weights.
    """
    lr = _check_scalar("lr", lr, low=0.0)
    weight_decay = _check_scalar("weight_decay", weight_decay, low=0.0)
    entry = _prepared("sign_sgd", [("params", params), ("grads", grads), ("compute_params", compute_params)],
                      {"params": _FP32, "grads": _GRADS, "compute_params": _GRADS})
    _C.sign_sgd(entry.batch, _DTYPE_CODE.get(entry.codes["grads"], 0),
                _OUT_KIND[entry.codes.get("compute_params")], lr, weight_decay)


def accumulate_(accumulators, grads, add: bool) -> None:
    """fp32 gradient accumulation: ``acc <- acc + g`` (add=True) or ``acc <- g``.

    Args:
        accumulators: fp32 tensors, updated in place.
        grads: fp32 or bf16 gradients of the same sizes.
        add: False on the first micro-batch (copy), True afterwards.
    """
    if not isinstance(add, bool):
        raise TypeError(f"add must be a bool, got {type(add).__name__}")
    entry = _prepared("accumulate", [("accumulators", accumulators), ("grads", grads)],
                      {"accumulators": _FP32, "grads": _GRADS})
    _C.accumulate(entry.batch, _DTYPE_CODE.get(entry.codes["grads"], 0), add)


def scale_stream_(buffer: torch.Tensor, factor: float) -> None:
    """Bandwidth probe: ``buffer <- buffer * factor`` (one read, one write per element)."""
    _check_list("buffer", [buffer], 1, _FP32)
    _C.scale_stream(buffer.data_ptr(), buffer.numel(), float(factor))


_apply_isa_override()
