# The end of a backward pass, as seen from inside it: a one-shot signal that
# fires once the outermost autograd graph task around a gradient hook has
# finished, or reports that it died (backward raised) instead.
#
# How: a callback object is queued on the current graph task. If the task is a
# nested one (the backward that a reentrant activation checkpoint runs inside
# its own backward node), the callback finds the enclosing node still being
# evaluated, hooks that node, and from there queues itself again on the
# enclosing task; and so on up to the outermost task. Autograd does not run the
# queued callbacks of a task that raised, but it does release them: a callback
# object released without having been called means that backward died, and so
# does a callback that raised (a Ctrl-C inside it).
#
# A backward that died leaves its owner something to recover, best before the
# next forward reads the weights the recovery writes (else autograd finds them
# changed in place, or the forward read stale ones): ``NextForwardHook``, armed
# by the owner when its backward dies, hands it every module about to run its
# forward outside a backward (the owner looks for its own parameters there).
#
# Scope: the signal and that hook. Non-goals: what the owner does with them
# (optimizer.py).

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["NextForwardHook", "watch_backward", "outside_backward"]


def outside_backward() -> bool:
    """True when the calling thread runs no autograd graph task."""
    return torch._C._current_graph_task_id() == -1


class _Watch:
    """Shared by the callbacks of one watched backward."""

    __slots__ = ("on_end", "on_died", "settled")

    def __init__(self, on_end: Callable[[], None], on_died: Callable[[], None]) -> None:
        self.on_end, self.on_died, self.settled = on_end, on_died, False

    def end(self) -> None:
        try:
            self.settled = True
            self.on_end()
        except BaseException:  # NOTE: the backward raises after all: the owner tells how far on_end got
            self.settled = True
            self.on_died()
            raise

    def died(self) -> None:
        if not self.settled:
            self.settled = True
            self.on_died()


class _TaskCallback:
    """Queued on a graph task: runs when the task has finished its nodes."""

    __slots__ = ("watch", "called")

    def __init__(self, watch: _Watch) -> None:
        self.watch, self.called = watch, False

    def __call__(self) -> None:
        # NOTE: an exception (a Ctrl-C) anywhere below makes the backward raise: it died.
        # (One on entering, before the try, leaves that to __del__.)
        try:
            self.called = True
            watch = self.watch
            if watch.settled:
                return
            node = torch._C._current_autograd_node()
            if node is not None:
                # NOTE: a nested graph task ends while the enclosing task is still
                # evaluating `node`; its post hook runs in the enclosing task.
                node.register_hook(_NodeHook(watch))
                return
            watch.end()
        except BaseException:
            self.watch.died()
            raise

    def __del__(self) -> None:
        # NOTE: a Ctrl-C inside __init__ leaves the fields unset; such a callback was never queued
        if not getattr(self, "called", True):
            self.watch.died()


class _NodeHook:
    """Post hook of the node that ran a nested backward: re-queues the watch on
    the enclosing graph task. One-shot (a retained graph may run it again)."""

    __slots__ = ("watch", "called")

    def __init__(self, watch: _Watch) -> None:
        self.watch, self.called = watch, False

    def __call__(self, grad_inputs, grad_outputs) -> None:
        if self.called:
            return
        self.called = True
        try:  # NOTE: as in _TaskCallback.__call__
            if not self.watch.settled:
                torch.autograd.Variable._execution_engine.queue_callback(_TaskCallback(self.watch))
        except BaseException:
            self.watch.died()
            raise

    def __del__(self) -> None:
        if not getattr(self, "called", True):  # NOTE: as in _TaskCallback
            self.watch.died()


def watch_backward(on_end: Callable[[], None], on_died: Callable[[], None]) -> None:
    """From inside a backward (a gradient hook): call ``on_end()`` once the
    outermost backward has finished its nodes, or ``on_died()`` when it raised
    (also after ``on_end()`` when that raised).

    NOTE: ``on_died`` may run on another thread (the one that releases the graph
    task) and during garbage collection: it must only record the fact.
    """
    torch.autograd.Variable._execution_engine.queue_callback(_TaskCallback(_Watch(on_end, on_died)))


class NextForwardHook:
    """A process-wide module forward pre-hook, registered while armed, that calls
    ``fn(module)`` before each module forward run outside a backward (a recompute inside one
    does not count), on any thread. ``fn`` decides whether there is anything to do.
    ``remove()`` disarms it, so it can sit among a wrapper's hook handles."""

    def __init__(self, fn: Callable[[torch.nn.Module], None]) -> None:
        self._fn, self._handle = fn, None

    def _pre_hook(self, module, args) -> None:
        if outside_backward():
            self._fn(module)

    def arm(self) -> None:
        if self._handle is None:
            self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._pre_hook)

    def remove(self) -> None:
        # NOTE: safe from inside the hook: torch iterates over a copy of the hooks
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
