# Ctrl-C and multi-parameter mutations: a rollback, a redo or a checkpoint load changes
# every parameter's master, moments and step count one after another; a
# KeyboardInterrupt between two of them would leave some parameters rolled back and
# others not, with nothing to tell which. ``deferred_interrupts()`` holds SIGINT back
# until the block is complete, then delivers it as the handler in place would have.
#
# Scope: SIGINT on the main thread (the only thread Python delivers signals to; on any
# other thread the block runs as is). Non-goals: other signals, and making a block that
# hangs interruptible (every wait of the pipeline has its own timeout).

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

__all__ = ["deferred_interrupts"]


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Run the block with SIGINT deferred; a SIGINT received meanwhile is delivered when
    it ends (``KeyboardInterrupt`` under Python's default handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list = []
    previous = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            _deliver(previous, received[0])


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
