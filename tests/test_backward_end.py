# The end-of-backward signal (cpu_offload/_common/backward_end.py) under Ctrl-C: a SIGINT at
# any line of arming the watch inside a backward leaves no error for the interpreter to
# report at garbage collection, and the watch fires at most once, never both ways.
import gc
import sys

import torch

from cpu_offload._common.backward_end import watch_backward
from helpers import sigint_at_line


def test_a_ctrl_c_at_any_line_of_arming_the_watch_leaves_no_unraisable_error(sigint_raises, monkeypatch):
    """Before, a Ctrl-C inside a callback's constructor left an object without its fields,
    whose finalizer then raised AttributeError ("Exception ignored in ... __del__")."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    k = 0
    while True:
        k += 1
        fired, outcome = [], []

        def arm(p, k=k, fired=fired, outcome=outcome):
            outcome.append(sigint_at_line(k, lambda: watch_backward(lambda: fired.append("end"),
                                                                    lambda: fired.append("died"))))
        w = torch.ones(3, requires_grad=True)
        handle = w.register_post_accumulate_grad_hook(arm)
        (w * 2).sum().backward()  # NOTE: the interrupt is caught inside the hook (sigint_at_line)
        handle.remove()
        hit, raised = outcome.pop()
        gc.collect()  # NOTE: an interrupted callback is freed now, its finalizer run
        if not hit:
            break
        assert isinstance(raised, KeyboardInterrupt), (k, raised)
        assert fired in ([], ["end"], ["died"]), (k, fired)
        assert unraisable == [], (k, [u.exc_value for u in unraisable])
    assert k > 3


def test_a_ctrl_c_at_any_line_of_the_ending_callback_reports_that_the_backward_died(sigint_raises):
    """A backward that raises because a Ctrl-C landed in the callback that ends it reports
    died (after end, when end itself raised), so its owner recovers. Before, one after the
    callback had marked itself called reported nothing: the owner took the next backward's
    gradients for the dead one's and raised that they arrived twice."""
    k = 0
    while True:
        k += 1
        fired = []
        w = torch.ones(3, requires_grad=True)
        handle = w.register_post_accumulate_grad_hook(
            lambda p, fired=fired: watch_backward(lambda: fired.append("end"), lambda: fired.append("died")))
        hit, raised = sigint_at_line(k, lambda w=w: (w * 2).sum().backward(), start="__call__")
        handle.remove()
        if not hit:
            break
        assert isinstance(raised, KeyboardInterrupt), (k, raised)
        assert fired in (["died"], ["end", "died"]), (k, fired)
    assert k > 5
