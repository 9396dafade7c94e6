# Ctrl-C and multi-parameter mutations: a rollback, a redo or a checkpoint load changes
# every parameter's master, moments and step count one after another; a
# KeyboardInterrupt between two of them would leave some parameters rolled back and
# others not, with nothing to tell which. ``deferred_interrupts()`` holds SIGINT back
# until the block is complete, then delivers it as the handler in place would have. It
# holds back the Python handlers of the signals schedulers send before they stop a job
# (SIGTERM, SIGHUP, SIGUSR1, SIGUSR2) too: such a handler that saves a checkpoint would
# otherwise save the state half changed.
#
# ``interruptible()`` lets a user's callback inside such a block (a closure) be interrupted
# by Ctrl-C.
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
    SIGUSR2, deferred; each signal received meanwhile is delivered once when it ends, in the
    order received (SIGINT: ``KeyboardInterrupt`` under Python's default handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    block = _Block()
    replaced: dict = {}
    try:
        for signum in _DEFERRED:
            previous = signal.getsignal(signum)
            if signum == signal.SIGINT or callable(previous):
                replaced[signum] = previous
                signal.signal(signum, _Deferring(previous, block))
    except ValueError:  # not the main interpreter
        _end(block, replaced)
        yield
        return
    except BaseException:
        _end(block, replaced)
        raise
    try:
        yield
    finally:
        _end(block, replaced)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside ``deferred_interrupts()``: run the block with SIGINT handled at once, as outside
    it (a user's callback, such as a ``step(closure)``'s closure, which may block). The other
    signals stay deferred to the end of the enclosing block."""
    handler = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if not isinstance(handler, _Deferring):
        yield
        return
    signal.signal(signal.SIGINT, handler.previous)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


class _Block:
    """One deferred block: the signals it received, (number, frame), and whether it still
    runs. NOTE: once it has ended its handlers forward each signal at once to the one they
    replaced, so a handler that a signal kept from being restored (a Ctrl-C raised in the
    middle of the restoring) still runs the user's."""

    def __init__(self):
        self.received: list = []
        self.running = True


class _Deferring:
    """The handler of a deferred block: records the signal for delivery at the block's end."""

    def __init__(self, previous, block: _Block):
        self.previous = previous  # the handler the block replaced
        self.block = block

    def __call__(self, signum, frame) -> None:
        if self.block.running:
            self.block.received.append((signum, frame))
        else:
            _deliver(self.previous, signum, frame)


def _end(block: _Block, replaced: dict) -> None:
    """The block ends: its handlers forward from now on, the replaced ones are put back, and
    what it received is delivered, each handler run even when one before it raised."""
    block.running = False
    try:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)
    finally:
        _deliver_all(block.received, replaced)


def _deliver_all(received: list, handlers: dict) -> None:
    """Each signal received once, in the order received; the first exception a handler raised
    (KeyboardInterrupt) is raised once every one has run."""
    delivered, raised = set(), None
    for signum, frame in received:
        if signum in delivered:
            continue
        delivered.add(signum)
        try:
            _deliver(handlers[signum], signum, frame)
        except BaseException as e:
            raised = raised or e
    if raised is not None:
        raise raised


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
