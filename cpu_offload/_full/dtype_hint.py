# The explanation added to a dtype error in the first forward pass after full offload
# cast a model's parameters to bf16 in place.
#
# A plain fp32 model fed fp32 inputs fails its first forward after offload="full" with
# torch's own "mat1 and mat2 must have the same dtype". Until the optimizer's first backward
# ends (it calls ``remove()``), two process-wide module hooks watch forward passes; a
# dtype-mismatch error that mentions bfloat16 gets a note saying what happened and what to
# do (autocast, or bf16 inputs). Where the innermost failing module got no input wider than
# bf16 but holds frozen parameters or buffers that are (left as they were beside the cast
# ones, such as spectral_norm's vectors), the note names them instead. Then training steps
# pay nothing.
# NOTE: torch.compile compiles a module for the process-wide hooks present; a forward run
# while they are and its checkpointed recompute run once they are gone would differ. So
# they stay until a backward ends, and go at once, with no hint given, before an outermost
# forward that holds a compiled module: the model compiles once, without them.
#
# ``add_note`` (a note on an exception, also on Python < 3.11) serves the optimizer's errors too.
#
# Non-goals: checking inputs before the forward (a model may cast its inputs itself, so a
# check could refuse a correct model), replacing torch's exception (a hook cannot: torch
# silences a hook's exception while another one propagates, so the note is added to it).

from __future__ import annotations

import sys
import threading

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

__all__ = ["HINT", "add_note", "watch_first_forward"]

HINT = ("cpu_offload: offload='full' cast the model's trainable parameters to {dtype} in place (the fp32 master "
        "weights live in host RAM), so fp32 inputs no longer match them: run the forward under "
        "torch.autocast(device_type, dtype={dtype}), or give the model {dtype} inputs")
WIDE_HINT = ("cpu_offload: offload='full' cast the model's trainable parameters to {dtype} in place (the fp32 "
             "master weights live in host RAM) and left frozen ones and buffers as they were, so {module}'s {wide} "
             "no longer {verb} the {dtype} parameters and activations: {remedy}")
_FROZEN_REMEDY = ("run the forward under torch.autocast(device_type, dtype={dtype}), or cast those frozen parameters "
                  "to {dtype}")
_BUFFER_REMEDY = ("cast those to {dtype} (the module's .to({dtype})), or keep the parameters beside them in fp32 "
                  "(offload_optimizer(..., keep_fp32=[...]), under torch.autocast)")
_PREFIX = "cpu_offload: offload='full' cast"


def _is_dtype_mismatch(exc: BaseException, dtype: torch.dtype) -> bool:
    text = str(exc).lower()
    name = str(dtype).rsplit(".", 1)[-1]  # "bfloat16"
    return isinstance(exc, RuntimeError) and name in text and "float" in text.replace(name, "")


def _wide_note(module: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """The note naming the module's own frozen floating-point parameters and buffers wider
    than ``dtype`` (a parametrization's, such as spectral_norm's power-iteration vectors, or
    BatchNorm's running statistics), or None without any."""
    def wide(t):
        return t is not None and t.is_floating_point() and t.dtype.itemsize > dtype.itemsize
    frozen = [f"{n} ({p.dtype})" for n, p in module.named_parameters(recurse=False) if not p.requires_grad and wide(p)]
    buffers = [f"{n} ({b.dtype})" for n, b in module.named_buffers(recurse=False) if wide(b)]
    if not frozen and not buffers:
        return None
    said = []
    if frozen:
        said.append("frozen " + ", ".join(frozen))
    if buffers:
        said.append(("buffers " if len(buffers) > 1 else "buffer ") + ", ".join(buffers))
    return WIDE_HINT.format(dtype=dtype, module=type(module).__name__, wide=" and ".join(said),
                            verb="matches" if len(frozen) + len(buffers) == 1 else "match",
                            remedy=(_BUFFER_REMEDY if buffers else _FROZEN_REMEDY).format(dtype=dtype))


def _explain(exc: BaseException, dtype: torch.dtype, module: torch.nn.Module, wide_inputs: bool) -> None:
    # NOTE: every enclosing module's hook sees the same exception, innermost first: one note,
    # from the module that raised it.
    if any(str(n).startswith(_PREFIX) for n in getattr(exc, "__notes__", ())) or (
            exc.args and _PREFIX in str(exc.args[0])) or not _is_dtype_mismatch(exc, dtype):
        return
    add_note(exc, (None if wide_inputs else _wide_note(module, dtype)) or HINT.format(dtype=dtype))


def add_note(exc: BaseException, note: str) -> None:
    """Add ``note`` to an exception being raised (on Python < 3.11, to its message)."""
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}",) + exc.args[1:]


class _FirstForward:
    """The two global hooks and the per-thread stack of modules in their forward."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.local = threading.local()
        self.handles = [register_module_forward_pre_hook(self._enter),
                        register_module_forward_hook(self._leave, always_call=True)]

    def _enter(self, module, args) -> None:
        if torch.compiler.is_compiling():
            return
        stack = self.local.__dict__.setdefault("stack", [])
        if not stack and any(_is_compiled(m) for m in module.modules()):
            self.remove()
            return
        # NOTE: the exception being handled when the forward starts (one when a forward runs
        # in an except block) is not the forward's own failure.
        wide = any(isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype.itemsize > self.dtype.itemsize
                   for a in args)
        stack.append((module, sys.exc_info()[1], wide))

    def _leave(self, module, args, output) -> None:
        if torch.compiler.is_compiling():
            return
        stack = getattr(self.local, "stack", None)
        if not stack or stack[-1][0] is not module:
            return
        _, before, wide_inputs = stack.pop()
        exc = sys.exc_info()[1]
        if exc is not None and exc is not before:
            _explain(exc, self.dtype, module, wide_inputs)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _is_compiled(module: torch.nn.Module) -> bool:
    """``torch.compile(module)``'s wrapper, or a module after ``module.compile()``."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # NOTE: not imported: nothing compiled
    return ((eval_frame is not None and isinstance(module, eval_frame.OptimizedModule))
            or getattr(module, "_compiled_call_impl", None) is not None)


def watch_first_forward(dtype: torch.dtype) -> _FirstForward:
    """Explain a dtype error of the forward passes after the cast to ``dtype``, until
    ``remove()`` on the result."""
    return _FirstForward(dtype)
