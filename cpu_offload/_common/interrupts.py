# Ctrl-C and multi-parameter mutations: a rollback, a redo or a checkpoint load changes
# every parameter's master, moments and step count one after another; a
# KeyboardInterrupt between two of them would leave some parameters rolled back and
# others not, with nothing to tell which. ``deferred_interrupts()`` holds SIGINT back
# until the block is complete, then delivers it as the handler in place would have.
#
# ``interruptible()`` lets a user's callback inside such a block (a closure) be interrupted.
#
# Scope: SIGINT on the main thread (the only thread Python delivers signals to; on any
# other thread the block runs as is). Non-goals: other signals, and making a block that
# hangs interruptible (every wait of the pipeline has its own timeout).

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

__all__ = ["deferred_interrupts", "interruptible"]


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Run the block with SIGINT deferred; a SIGINT received meanwhile is delivered when
    it ends (``KeyboardInterrupt`` under Python's default handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    deferring = _Deferring(previous)
    try:
        signal.signal(signal.SIGINT, deferring)
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if deferring.received:
            _deliver(previous, deferring.received[0])


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside ``deferred_interrupts()``: run the block with SIGINT handled at once, as outside
    it (a user's callback, such as a ``step(closure)``'s closure, which may block)."""
    handler = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if not isinstance(handler, _Deferring):
        yield
        return
    signal.signal(signal.SIGINT, handler.previous)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


class _Deferring:
    """The SIGINT handler of a deferred block: records the signal for delivery at its end."""

    def __init__(self, previous):
        self.previous = previous  # the handler the block replaced
        self.received: list = []

    def __call__(self, signum, frame) -> None:
        self.received.append(frame)


def _deliver(handler, frame) -> None:
    if handler is signal.SIG_IGN:
        return
    if handler is signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)
        return
    if callable(handler):
        handler(signal.SIGINT, frame)  # default_int_handler raises KeyboardInterrupt
        return
    raise KeyboardInterrupt  # a handler installed outside Python (None)
