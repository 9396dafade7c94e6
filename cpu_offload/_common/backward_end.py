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
# object released without having been called means that backward died.
#
# Scope: the signal only. Non-goals: what the owner does with it
# (optimizer.py).

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["watch_backward", "outside_backward"]


def outside_backward() -> bool:
    """True when the calling thread runs no autograd graph task."""
    return torch._C._current_graph_task_id() == -1


class _Watch:
    """Shared by the callbacks of one watched backward."""

    __slots__ = ("on_end", "on_died", "settled")

    def __init__(self, on_end: Callable[[], None], on_died: Callable[[], None]) -> None:
        self.on_end, self.on_died, self.settled = on_end, on_died, False

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
        watch.settled = True
        watch.on_end()

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
        if not self.watch.settled:
            torch.autograd.Variable._execution_engine.queue_callback(_TaskCallback(self.watch))

    def __del__(self) -> None:
        if not getattr(self, "called", True):  # NOTE: as in _TaskCallback
            self.watch.died()


def watch_backward(on_end: Callable[[], None], on_died: Callable[[], None]) -> None:
    """From inside a backward (a gradient hook): call ``on_end()`` once the
    outermost backward has finished its nodes, or ``on_died()`` when it raised.

    NOTE: ``on_died`` may run on another thread (the one that releases the graph
    task) and during garbage collection: it must only record the fact.
    """
    torch.autograd.Variable._execution_engine.queue_callback(_TaskCallback(_Watch(on_end, on_died)))
