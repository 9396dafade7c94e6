"""Typed Python wrappers around the native kernels (cpu_offload._C).

Scope: check every tensor argument (type, device, dtype, contiguity, shapes, overlap) and
raise a TypeError/ValueError that names the argument and index, then hand raw pointers to
the native code, which releases the GIL while it works; check thread counts and CPU ids
against the process's affinity mask. Non-goal: autograd, CUDA tensors.

NOTE: a kernel never writes (or reads) through a stale pointer. Validated tensor lists are
cached by the identity of their tensor objects, because the full checks (and the overlap
check) cost more than the kernel for many small tensors; a cached entry is used only after
native code has checked, on this call, that every tensor still has the data pointer, byte
count and contiguity it was validated with: those fix the bytes a kernel touches as the
tensor's own live memory. The negation bit is checked on every call as well, because
``t.data = t._neg_view()`` keeps all three while t's values stop being its memory's. After
``resize_``, ``set_``, ``.data = ...`` or an in-place view op, the call validates from
scratch: it raises an error naming the argument (e.g. a size mismatch, a negated view) or
works on the tensor's new memory. Two changes a hit does not see: a dtype changed in place
to another of the same byte count (``t.data = t.view(torch.int32)``): the kernel then reads
the tensor's bytes as the dtype it was validated with; and a shape changed in place to
another of the same element count (``t.resize_(m, n)``): the kernels work on flat memory,
so that call works as on flat views. The accessors are torch.Tensor's own, called with
__torch_function__ off, so a subclass or a mode cannot misreport a tensor's memory, and the
lists are snapshotted, so their tensors live until the kernel returns. Outside the
guarantee, as for torch's own ops: changing a tensor from another thread while a call on it
runs, a storage shrunk under a live tensor (``untyped_storage().resize_``) and
reallocated at its old address, and memory the process may not write (a read-only NumPy
array or memmap, ``bytes``: torch warns that writing such a tensor is undefined). The cache holds weak references only; ``clear_cache()`` is
never needed for correctness.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import weakref
from collections import OrderedDict
from itertools import chain
from typing import Iterator, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

from cpu_offload._common.checks import check_float32, check_int, real_of
from cpu_offload import _C
from cpu_offload._common.cpulist import format_cpulist

__all__ = [
    "adamw_step",
    "sign_sgd_step",
    "adamw_inverse_step",
    "sign_sgd_inverse_step",
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
# NOTE: an LRU cache misses on every call of a cycle over more lists than it holds. Full
# offload's worker cycles over the kernel calls of all its chunk plans every step, and the
# slots a chunk gets rotate from step to step, so their number grows with the model
# (_full/chunk_runner.py); a miss validates from scratch (about 60 us for five lists of five
# tensors, several times that while the GIL is contended). An entry costs a few hundred
# bytes and one weak reference per tensor.
CACHE_ENTRIES = 8192


# ---------------------------------------------------------------- ISA and threads

def _apply_isa_override() -> None:
    name = os.environ.get("CPU_OFFLOAD_ISA")
    if not name:
        return
    try:
        _C.set_isa(name=name)
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
    _C.set_isa(name=name)
    try:
        yield
    finally:
        _C.set_isa(name=previous)


def _allowed_cpus() -> set:
    """The CPUs this process (its calling thread) may run on."""
    return os.sched_getaffinity(0)


def set_num_threads(n: int) -> None:
    """Sets the number of native worker threads (default: CPUs in the affinity mask).

    Raises ValueError unless ``1 <= n <=`` the number of CPUs in the affinity mask: the
    kernels are memory-bound, and more threads than CPUs only adds contention.
    """
    check_int("n", n, low=1)
    allowed = _allowed_cpus()
    if n > len(allowed):
        raise ValueError(f"n={n} is more than the {len(allowed)} CPUs this process may use "
                         f"(affinity mask {format_cpulist(allowed)})")
    _C.set_num_threads(n=n)


def get_num_threads() -> int:
    return _C.get_num_threads()


def pin_threads(cpus: Optional[Sequence[int]]) -> None:
    """Pins native worker k to ``cpus[k % len(cpus)]``; ``None`` or ``[]`` unpins.

    Raises ValueError, before anything changes, for an id that is not an int or not in
    the process's affinity mask (``os.sched_getaffinity(0)``).
    """
    try:
        cpus = [] if cpus is None else list(cpus)
    except TypeError:
        raise TypeError(f"cpus must be a sequence of CPU ids or None, got {type(cpus).__name__}") from None
    allowed = _allowed_cpus()
    for i, c in enumerate(cpus):
        check_int(f"cpus[{i}]", c, low=0)
        if c not in allowed:
            raise ValueError(f"cpus[{i}]={c} is not a CPU this process may use "
                             f"(affinity mask {format_cpulist(allowed)})")
    _C.pin_threads(cpus=cpus)  # NOTE: validates again: the mask may have changed meanwhile


def get_pinned_cpus() -> Optional[list]:
    cpus = list(_C.pinned_cpus())
    return cpus or None


# ---------------------------------------------------------------- validation + cache

# NOTE: torch.Tensor's own accessors, called with __torch_function__ off (_TRUE_MEMORY):
# a subclass or mode cannot make the kernels see memory other than the tensor's.
_T = torch.Tensor
_data_ptr, _numel, _is_contiguous = _T.data_ptr, _T.numel, _T.is_contiguous
_is_neg, _is_conj = _T.is_neg, _T.is_conj
_dtype, _is_cpu, _layout, _shape = _T.dtype.__get__, _T.is_cpu.__get__, _T.layout.__get__, _T.shape.__get__
_is_nested = _T.is_nested.__get__
_ACCESSORS = (_T.data_ptr, torch._C.TensorBase.nbytes, _T.is_contiguous)  # for TensorBatch.unchanged
_TRUE_MEMORY = torch._C.DisableTorchFunction


def _memory_of(label, t, numel, itemsize):
    """The data pointer of a dense CPU tensor, checked to be real memory inside its storage."""
    # NOTE: a FakeTensor claims a CPU device and a storage, but its data_ptr() is 0 (with a
    # deprecation warning, not an error): it is refused before its pointer is read, and any
    # other non-empty tensor whose pointer is null is refused below.
    if isinstance(t, FakeTensor):
        raise ValueError(f"{label} has no memory of its own to update (a FakeTensor); pass a plain CPU tensor")
    try:
        ptr = _data_ptr(t)
        storage = _T.untyped_storage(t)
        begin, nbytes = storage.data_ptr(), storage.nbytes()
    except RuntimeError as e:  # wrapper subclasses (DTensor, functional tensors) have no storage of their own
        raise ValueError(f"{label} has no memory of its own to update ({e}); pass a plain CPU tensor") from None
    if numel and not begin <= ptr <= ptr + numel * itemsize <= begin + nbytes:
        raise ValueError(f"{label} does not fit in its storage ({nbytes} bytes); "
                         "was its storage resized under it?")
    if numel and not ptr:
        raise ValueError(f"{label} has no memory of its own to update (its data pointer is null); "
                         "pass a plain CPU tensor")
    return ptr


def _check_list(name, tensors, count, dtypes, like=None):
    """Validates one list; returns (its dtype, its data pointers).

    ``like``: (name, tensors) of the first list: tensor i must have the shape of its tensor i.
    """
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    if count is not None and len(tensors) != count:
        raise ValueError(f"{name} has {len(tensors)} tensors, expected {count} (one per params entry)")
    dtype = None
    ptrs = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if not _is_cpu(t) or _layout(t) != torch.strided:
            raise ValueError(f"{name}[{i}] is a {t.device.type} {_layout(t)} tensor; the kernels need dense CPU tensors")
        if _is_nested(t):  # NOTE: a nested tensor of layout torch.strided, which has no sizes to check
            raise ValueError(f"{name}[{i}] is a nested tensor; the kernels need dense CPU tensors")
        d = _dtype(t)
        if d not in dtypes:
            allowed = " or ".join(str(x) for x in dtypes)
            raise TypeError(f"{name}[{i}] has dtype {d}, expected {allowed}")
        if dtype is not None and d != dtype:
            raise TypeError(f"{name}[{i}] has dtype {d} but {name}[0] has {dtype}; one dtype per list")
        dtype = d
        if not _is_contiguous(t):
            raise ValueError(f"{name}[{i}] is not contiguous")
        # NOTE: a lazily negated (or conjugated) view's memory holds the values of its base;
        # the kernels read memory, so they would see the wrong sign. ``.data =`` can set the
        # negation bit in place, so a cache hit checks it again (_prepared).
        if _is_neg(t) or _is_conj(t):
            what, fix = ("negated view (is_neg())", "resolve_neg") if _is_neg(t) else \
                ("conjugated view (is_conj())", "resolve_conj")
            raise ValueError(f"{name}[{i}] is a lazily {what}: its memory does not hold its values, "
                             f"which the kernels read; pass t.{fix}() (or t.clone())")
        n = _numel(t)
        if like is not None:
            first, other = like[0], like[1][i]
            if n != _numel(other):
                raise ValueError(f"{name}[{i}] has {n} elements but {first}[{i}] has {_numel(other)}")
            if _shape(t) != _shape(other):
                raise ValueError(f"{name}[{i}] has shape {tuple(_shape(t))} but {first}[{i}] has shape "
                                 f"{tuple(_shape(other))}; pass tensors of one shape (or flat views of all)")
        ptrs.append(_memory_of(f"{name}[{i}]", t, n, d.itemsize))
    return dtype, ptrs


class _Entry:
    __slots__ = ("batch", "codes", "refs")


_cache: "OrderedDict[tuple, _Entry]" = OrderedDict()
_cache_lock = threading.RLock()


def clear_cache() -> None:
    """Forgets every validated tensor list. Never needed for correctness (see the module
    note); it only frees the cache's memory."""
    with _cache_lock:
        _cache.clear()


def _forget(key):
    def callback(_ref):
        with _cache_lock:
            _cache.pop(key, None)
    return callback


_OPTIONAL_LISTS = ("compute_params",)  # the lists a kernel may be called without (None)


def _prepared(kind: str, named_lists, dtypes_by_name):
    """Returns (the validated native batch, the lists as tuples), from the cache when valid.

    named_lists: [(name, list-or-None)], params first; dtypes_by_name: allowed dtypes.
    Call it with _TRUE_MEMORY entered, right before the kernel, and keep the returned
    tuples until the kernel returns.
    """
    present = []
    for name, tensors in named_lists:
        if tensors is None and name in _OPTIONAL_LISTS:
            continue
        if tensors is None:
            raise TypeError(f"{name} must be a list or tuple of tensors, got None")
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
        # NOTE: a tuple snapshot: the tensors stay alive while the kernel runs without the
        # GIL, whatever another thread does to the caller's list meanwhile.
        present.append((name, tensors if type(tensors) is tuple else tuple(tensors)))
    lists = tuple(lst for _, lst in present)
    key = (kind, tuple(n for n, _ in present), _C.identity_key(lists=lists))
    with _cache_lock:
        entry = _cache.get(key)
    # NOTE: is_neg() on a hit as well (about 0.1 us a tensor): ``t.data = t._neg_view()`` keeps
    # what unchanged() compares. A float32 or bfloat16 tensor cannot carry the conjugation bit.
    if (entry is not None and entry.batch.unchanged(lists=lists, accessors=_ACCESSORS)
            and not any(map(_is_neg, chain.from_iterable(lists)))):
        with _cache_lock:
            if key in _cache:
                _cache.move_to_end(key)
        return entry, lists

    params_name, params = present[0]
    dtype, ptrs = _check_list(params_name, params, None, dtypes_by_name[params_name])
    codes, all_ptrs = {params_name: dtype}, [ptrs]
    numels = [_numel(t) for t in params]
    for name, tensors in present[1:]:
        codes[name], ptrs = _check_list(name, tensors, len(params), dtypes_by_name[name], (params_name, params))
        all_ptrs.append(ptrs)
    operands = [(name, ptrs, _T.element_size(tensors[0]) if tensors else 4)
                for (name, tensors), ptrs in zip(present, all_ptrs)]
    entry = _Entry()
    entry.batch = _C.TensorBatch(numels=numels, operands=operands)  # raises ValueError on overlap
    entry.codes = codes
    callback = _forget(key)
    unique = {id(t): t for lst in lists for t in lst}.values()
    entry.refs = [weakref.ref(t, callback) for t in unique]
    with _cache_lock:
        _cache[key] = entry
        while len(_cache) > CACHE_ENTRIES:
            _cache.popitem(last=False)
    return entry, lists


def _check_scalar(name, value, *, low=None, high=None, high_open=False):
    """A finite float in [low, high] (or [low, high)) that float32 holds; -0.0 becomes 0.0.

    Any real number (numpy's included, not a bool) or a one-element tensor. The constants
    the kernels derive from several values (1 - lr*weight_decay, the bias-corrected step
    size) are checked by the native code, which raises ValueError naming the values.
    """
    value = real_of(name, value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    check_float32(name, value)
    return value + 0.0  # NOTE: -0.0 + 0.0 is +0.0: a zero factor never flips the sign of a zero


def _adamw_hyper(lr, beta1, beta2, eps, weight_decay, grad_scale) -> dict:
    """The checked AdamW hyper-parameters as floats, by the names _C.adamw takes."""
    return dict(lr=_check_scalar("lr", lr, low=0.0),
                beta1=_check_scalar("beta1", beta1, low=0.0, high=1.0, high_open=True),
                beta2=_check_scalar("beta2", beta2, low=0.0, high=1.0, high_open=True),
                eps=_check_scalar("eps", eps, low=0.0),
                weight_decay=_check_scalar("weight_decay", weight_decay, low=0.0),
                grad_scale=_check_scalar("grad_scale", grad_scale, low=0.0))


def _steps_ptr(steps, count):
    """data_ptr of a valid steps tensor with `count` entries (call with _TRUE_MEMORY entered)."""
    if not isinstance(steps, torch.Tensor):
        raise TypeError(f"steps must be a torch.Tensor of int64 step counts, got {type(steps).__name__}")
    if _is_nested(steps):
        raise ValueError("steps must be a contiguous 1-D int64 CPU tensor, got a nested tensor")
    if (_dtype(steps) != torch.int64 or not _is_cpu(steps) or _layout(steps) != torch.strided
            or _T.dim(steps) != 1 or not _is_contiguous(steps)):
        raise ValueError(
            f"steps must be a contiguous 1-D int64 CPU tensor, got {steps.dtype} {steps.device} shape {tuple(steps.shape)}")
    if _numel(steps) != count:
        raise ValueError(f"steps has {_numel(steps)} entries, expected {count} (one per params entry)")
    return _memory_of("steps", steps, count, 8) if count else 0


_FP32 = (torch.float32,)
_GRADS = (torch.float32, torch.bfloat16)
_MOMENTS = (torch.float32, torch.bfloat16)


# ---------------------------------------------------------------- kernels

def adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay,
               grad_scale=1.0, compute_params=None) -> None:
    """One AdamW step (torch.optim.AdamW semantics) over a list of tensors, in one pass.

    Args:
        params: fp32 master weights, updated in place.
        grads: fp32 or bf16 gradients (one dtype for the list).
        exp_avgs, exp_avg_sqs: first and second moments, updated in place; fp32, or both
            bf16: widened to fp32, updated in fp32 (the parameter update uses these
            unrounded values) and stored rounded like ``tensor.to(torch.bfloat16)``.
        steps: 1-D int64 tensor, one step count (>= 0) per tensor; each is incremented first
            and the bias corrections use the new value (like torch's ``state["step"]``).
        lr, beta1, beta2, eps, weight_decay: as torch.optim.AdamW (decoupled decay).
        grad_scale: multiplies each gradient before use (e.g. 1/loss_scale, a clipping
            coefficient); finite and >= 0. 0 is the step with zero gradients (the step count,
            the moments' decay and the weight decay still apply), which is what torch does
            after ``clip_grad_norm_(max_norm=0)``; a negative factor raises ValueError.
        compute_params: optional bf16 or fp32 tensors that receive the updated weights.

    Tensor i of every list has the shape of ``params[i]`` (the library passes flat views).
    Empty lists are a no-op (the lists must still agree in length), like torch's foreach ops.
    """
    hyper = _adamw_hyper(lr, beta1, beta2, eps, weight_decay, grad_scale)
    with _TRUE_MEMORY():
        entry, _alive = _prepared(
            "adamw", [("params", params), ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                      ("compute_params", compute_params)],
            {"params": _FP32, "grads": _GRADS, "exp_avgs": _MOMENTS, "exp_avg_sqs": _MOMENTS,
             "compute_params": _GRADS})
        steps_ptr = _steps_ptr(steps, entry.batch.size)
    if entry.batch.size == 0:
        return  # NOTE: empty lists carry no dtype, so no output kind: nothing to hand to _C
    _C.adamw(batch=entry.batch, grad_dtype=_DTYPE_CODE.get(entry.codes["grads"], 0),
             moment_dtype=_moment_code(entry), out_kind=_OUT_KIND[entry.codes.get("compute_params")],
             steps=steps_ptr, **hyper)


def _moment_code(entry) -> int:
    moment_dtype = entry.codes["exp_avgs"]
    if entry.codes["exp_avg_sqs"] != moment_dtype:
        raise ValueError(f"exp_avg_sqs has dtype {entry.codes['exp_avg_sqs']} but exp_avgs has {moment_dtype}; "
                         "both moments must be float32 or both bfloat16")
    return _DTYPE_CODE.get(moment_dtype, 0)


def sign_sgd_step(params, grads, *, lr, weight_decay, grad_scale=1.0, compute_params=None) -> None:
    """One SignSGD step: p <- p - lr*wd*p (wd > 0), then p <- p - lr*sign(g*grad_scale), sign(0) = 0.

    Args:
        params: fp32 weights, updated in place.
        grads: fp32 or bf16 gradients.
        lr, weight_decay: step size and decoupled weight decay.
        grad_scale: the gradients' factor (a clipping coefficient), >= 0; the product is
            rounded to float32 before its sign is taken, so 0 (or a product that rounds to 0)
            steps nothing but the decay, as torch's SignSGD on the scaled gradient.
        compute_params: optional bf16 or fp32 tensors that receive the updated weights.

    Shapes and empty lists: as for ``adamw_step``.
    """
    lr = _check_scalar("lr", lr, low=0.0)
    weight_decay = _check_scalar("weight_decay", weight_decay, low=0.0)
    grad_scale = _check_scalar("grad_scale", grad_scale, low=0.0)
    with _TRUE_MEMORY():
        entry, _alive = _prepared("sign_sgd", [("params", params), ("grads", grads), ("compute_params", compute_params)],
                                  {"params": _FP32, "grads": _GRADS, "compute_params": _GRADS})
    if entry.batch.size == 0:
        return  # empty lists: a no-op, as for adamw_step
    _C.sign_sgd(batch=entry.batch, grad_dtype=_DTYPE_CODE.get(entry.codes["grads"], 0),
                out_kind=_OUT_KIND[entry.codes.get("compute_params")], lr=lr, weight_decay=weight_decay,
                grad_scale=grad_scale)


def adamw_inverse_step(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay,
                       grad_scale=1.0) -> None:
    """Undoes one ``adamw_step`` in place, from the state after it and the gradients it used.

    With u = nss*m1/(sqrt(v1) + eps_hat), the forward's update from its own constants:
    p0 = (p1 - u)/decay, m0 = (m1 - (1-b1)*g)/b1, v0 = max((v1 - (1-b2)*g*g)/b2, 0); the
    division by decay is skipped when decay == 0, and a moment whose beta is 0 comes back 0.
    Exact to float32 rounding only: the error model is in cpu_offload/_full/rollback.py.

    Args:
        params, grads, exp_avgs, exp_avg_sqs: as ``adamw_step``, after the step to undo.
        steps: 1-D int64 tensor, the step count each undone step used (>= 1; read only: the
            caller keeps its own counts).
        lr, beta1, beta2, eps, weight_decay, grad_scale: those of the step to undo.
    """
    hyper = _adamw_hyper(lr, beta1, beta2, eps, weight_decay, grad_scale)
    with _TRUE_MEMORY():
        entry, _alive = _prepared(
            "adamw_inverse", [("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
                              ("exp_avg_sqs", exp_avg_sqs)],
            {"params": _FP32, "grads": _GRADS, "exp_avgs": _MOMENTS, "exp_avg_sqs": _MOMENTS})
        steps_ptr = _steps_ptr(steps, entry.batch.size)
    if entry.batch.size == 0:
        return
    _C.adamw_inverse(batch=entry.batch, grad_dtype=_DTYPE_CODE.get(entry.codes["grads"], 0),
                     moment_dtype=_moment_code(entry), steps=steps_ptr, **hyper)


def sign_sgd_inverse_step(params, grads, *, lr, weight_decay, grad_scale=1.0) -> None:
    """Undoes one ``sign_sgd_step`` in place: p <- (p + lr*sign(g*grad_scale))/(1 - lr*wd),
    the division skipped when 1 - lr*wd == 0.

    Args:
        params: fp32 weights after the step, updated in place.
        grads: the fp32 or bf16 gradients the step used (before ``grad_scale``).
        lr, weight_decay, grad_scale: those of the step to undo.
    """
    lr = _check_scalar("lr", lr, low=0.0)
    weight_decay = _check_scalar("weight_decay", weight_decay, low=0.0)
    grad_scale = _check_scalar("grad_scale", grad_scale, low=0.0)
    with _TRUE_MEMORY():
        entry, _alive = _prepared("sign_sgd_inverse", [("params", params), ("grads", grads)],
                                  {"params": _FP32, "grads": _GRADS})
    if entry.batch.size == 0:
        return
    _C.sign_sgd_inverse(batch=entry.batch, grad_dtype=_DTYPE_CODE.get(entry.codes["grads"], 0), lr=lr,
                        weight_decay=weight_decay, grad_scale=grad_scale)


def accumulate_(accumulators, grads, add: bool) -> None:
    """fp32 gradient accumulation: ``acc <- acc + g`` (add=True) or ``acc <- g``.

    Args:
        accumulators: fp32 tensors, updated in place.
        grads: fp32 or bf16 gradients of the same shapes (empty lists: a no-op).
        add: False on the first micro-batch (copy), True afterwards.
    """
    if not isinstance(add, bool):
        raise TypeError(f"add must be a bool, got {type(add).__name__}")
    with _TRUE_MEMORY():
        entry, _alive = _prepared("accumulate", [("accumulators", accumulators), ("grads", grads)],
                                  {"accumulators": _FP32, "grads": _GRADS})
    _C.accumulate(batch=entry.batch, grad_dtype=_DTYPE_CODE.get(entry.codes["grads"], 0), add=add)


def scale_stream_(buffer: torch.Tensor, factor: float) -> None:
    """Bandwidth probe: ``buffer <- buffer * factor`` (one read, one write per element)."""
    with _TRUE_MEMORY():
        _, (ptr,) = _check_list("buffer", [buffer], 1, _FP32)
        n = _numel(buffer)
    _C.scale_stream(ptr=ptr, numel=n, factor=float(factor))


_apply_isa_override()
