# deferred_interrupts(): SIGINT and the Python handlers of the signals schedulers send before
# they stop a job are held back until the block is complete, then run in the order received,
# each once, even when one raises or a signal lands while they are put back; interruptible()
# inside it takes Ctrl-C at once; a signal left to its default action is not touched.
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


def test_interruptible_takes_ctrl_c_at_once_and_leaves_the_other_signals_deferred(sigint_raises):
    ran = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: ran.append("term"))
    try:
        with deferred_interrupts():
            with pytest.raises(KeyboardInterrupt):
                with interruptible():
                    signal.raise_signal(signal.SIGTERM)
                    ran.append("callback")
                    signal.raise_signal(signal.SIGINT)
                    ran.append("not reached")
            signal.raise_signal(signal.SIGINT)  # deferred again
            ran.append("block")
    except KeyboardInterrupt:
        ran.append("interrupt")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert ran == ["callback", "block", "term", "interrupt"]


def test_every_handler_runs_and_the_first_exception_is_raised(sigint_raises):
    """A handler that raised (SIGINT's) kept those of the signals received after it from
    running, and a second one that raised replaced its exception."""
    class JobEnd(Exception):
        pass
    ran = []

    def term(signum, frame):
        ran.append("term")
        raise JobEnd
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, term),
                signal.SIGUSR1: signal.signal(signal.SIGUSR1, lambda signum, frame: ran.append("usr1"))}
    try:
        with pytest.raises(KeyboardInterrupt):
            with deferred_interrupts():
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                    signal.raise_signal(signum)
        assert ran == ["term", "usr1"]
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_a_ctrl_c_while_the_handlers_are_put_back_loses_no_later_signal(sigint_raises, monkeypatch):
    """A Ctrl-C raised as soon as SIGINT's handler was back stopped the others from being put
    back: they stayed the ended block's, and every later SIGTERM was recorded for nobody."""
    ran = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: ran.append("term"))
    real_signal, armed = signal.signal, [False]

    def signal_then_ctrl_c(signum, handler):
        old = real_signal(signum, handler)
        if armed[0] and signum == signal.SIGINT and handler is signal.default_int_handler:
            armed[0] = False
            signal.raise_signal(signal.SIGINT)  # lands before the next handler is put back
        return old
    monkeypatch.setattr(signal, "signal", signal_then_ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            with deferred_interrupts():
                armed[0] = True
        monkeypatch.undo()
        signal.raise_signal(signal.SIGTERM)
        assert ran == ["term"]
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
