# Ctrl-C and multi-parameter mutations: a rollback, a redo or a checkpoint load changes
# every parameter's master, moments and step count one after another; a
# KeyboardInterrupt between two of them would leave some parameters rolled back and
# others not, with nothing to tell which. ``deferred_interrupts()`` holds SIGINT back
# until the block is complete, then delivers it as the handler in place would have. It
# holds back the Python handlers of the signals schedulers send before they stop a job
# (SIGTERM, SIGHUP, SIGUSR1, SIGUSR2) too: such a handler that saves a checkpoint would
# otherwise save the state half changed.
#
# ``interruptible()`` lets a user's callback inside such a block (a closure) be interrupted.
#
# Scope: those signals on the main thread (the only thread Python runs signal handlers on;
# on any other thread the block runs as is). Non-goals: other signals, a signal whose
# action is not a Python handler (the default action of SIGTERM ends the process at once),
# and making a block that hangs interruptible (every wait of the pipeline has its own
# timeout).

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

__all__ = ["deferred_interrupts", "interruptible"]

# NOTE: SIGINT always (its default, Python's default_int_handler, raises KeyboardInterrupt);
# the others only while a Python handler is installed for them
_DEFERRED = (signal.SIGINT,) + tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                                     if hasattr(signal, name))


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Run the block with SIGINT, and the Python handlers of SIGTERM, SIGHUP, SIGUSR1 and
    SIGUSR2, deferred; a signal received meanwhile is delivered when it ends, in the order
    received (SIGINT: ``KeyboardInterrupt`` under Python's default handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list = []
    replaced: dict = {}
    try:
        for signum in _DEFERRED:
            previous = signal.getsignal(signum)
            if signum == signal.SIGINT or callable(previous):
                replaced[signum] = previous
                signal.signal(signum, _Deferring(previous, received))
    except ValueError:  # not the main interpreter
        _restore(replaced)
        yield
        return
    except BaseException:
        _restore(replaced)
        raise
    try:
        yield
    finally:
        _restore(replaced)
        _deliver_all(received, replaced)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside ``deferred_interrupts()``: run the block with the deferred signals handled at
    once, as outside it (a user's callback, such as a ``step(closure)``'s closure, which may
    block)."""
    deferring = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _DEFERRED:
            handler = signal.getsignal(signum)
            if isinstance(handler, _Deferring):
                deferring[signum] = handler
    if not deferring:
        yield
        return
    _restore({signum: handler.previous for signum, handler in deferring.items()})
    try:
        yield
    finally:
        _restore(deferring)


def _restore(handlers: dict) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def _deliver_all(received: list, handlers: dict) -> None:
    """Each signal received once, in order: its handler's exception (KeyboardInterrupt) is
    raised after the signals behind it are raised again for their own handlers."""
    pending = []
    for signum, frame in received:
        if all(signum != s for s, _ in pending):
            pending.append((signum, frame))
    for i, (signum, frame) in enumerate(pending):
        try:
            _deliver(handlers[signum], signum, frame)
        except BaseException:
            for later, _ in pending[i + 1:]:
                signal.raise_signal(later)  # NOTE: run by Python at its next check, as any signal
            raise


class _Deferring:
    """The handler of a deferred block: records the signal for delivery at its end."""

    def __init__(self, previous, received: list):
        self.previous = previous  # the handler the block replaced
        self.received = received  # (signal number, frame), shared by the block's signals

    def __call__(self, signum, frame) -> None:
        self.received.append((signum, frame))


def _deliver(handler, signum: int, frame) -> None:
    if handler is signal.SIG_IGN:
        return
    if handler is signal.SIG_DFL:
        signal.raise_signal(signum)
        return
    if callable(handler):
        handler(signum, frame)  # default_int_handler raises KeyboardInterrupt
        return
    raise KeyboardInterrupt  # a SIGINT handler installed outside Python (None)
