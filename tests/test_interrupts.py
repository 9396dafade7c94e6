# deferred_interrupts(): SIGINT and the Python handlers of the signals schedulers send before
# they stop a job are held back until the block is complete, then run in the order received;
# interruptible() inside it runs them at once; a signal left to its default action is not
# touched.
import signal

import pytest

from cpu_offload._common.interrupts import deferred_interrupts, interruptible


def test_handlers_run_after_the_block_in_the_order_received(sigint_raises):
    ran = []

    def usr1(signum, frame):
        ran.append("usr1")
    previous = signal.signal(signal.SIGUSR1, usr1)
    try:
        with pytest.raises(KeyboardInterrupt):
            with deferred_interrupts():
                signal.raise_signal(signal.SIGUSR1)
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGUSR1)  # received twice: run once
                ran.append("block")
        assert ran == ["block", "usr1"]
        ran.clear()
        with pytest.raises(KeyboardInterrupt):
            with deferred_interrupts():
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGUSR1)
                ran.append("block")
        assert ran == ["block", "usr1"]  # behind the one that raised, at Python's next check
        assert signal.getsignal(signal.SIGUSR1) is usr1
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_interruptible_runs_handlers_at_once_and_defers_again_after(sigint_raises):
    ran = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: ran.append("term"))
    try:
        with deferred_interrupts():
            with interruptible():
                signal.raise_signal(signal.SIGTERM)
                ran.append("callback")
            signal.raise_signal(signal.SIGTERM)
            ran.append("block")
        assert ran == ["term", "callback", "block", "term"]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_left_to_its_default_action_is_not_replaced():
    previous = signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    try:
        with deferred_interrupts():
            assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR2, previous)
