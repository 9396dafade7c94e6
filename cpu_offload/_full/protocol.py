# The backward/step protocol of full offload: its phases, the transitions allowed between
# them (the table docs/architecture.md shows), and the one function that changes phase.
#
#   IDLE ──first gradient──► BACKWARD (pass j of a window of k)
#   BACKWARD ──outermost backward ends, j < k-1──► ACCUMULATING (gradients summed on the host)
#   BACKWARD ──outermost backward ends, j = k-1──► APPLIED (the tail is drained and the
#                                                   speculative step validated)
#   ACCUMULATING ──first gradient──► BACKWARD (pass j+1)
#   ACCUMULATING ──step()──► APPLIED ──► IDLE (a short window: the step runs on what was
#                                             accumulated)
#   ACCUMULATING ──zero_grad()──► IDLE (the window is discarded, like torch, with its factors)
#   APPLIED ──step() / zero_grad() / close()──► IDLE (load_state_dict() and state_dict() are refused)
#   IDLE ──zero_grad()──► IDLE (drops a factor announced for the window)
#   BACKWARD, ACCUMULATING, APPLIED ──a failure──► ABORTED ──recovery──► IDLE
#   any ──close()──► CLOSED;  CLOSED ──construction complete──► IDLE
#
# With overlap_forward, step() may enter IDLE while the window's last chunks still run
# (``landing``): the next forward's modules wait for their own weights, and the next
# backward, close() and every public call but zero_grad() and stats() wait for all of them
# and close the window's bookkeeping first.
#
# Calls that leave the phase as it is (clip_grad_norm_, scale_grads_, a gradient after
# the window's last pass: refused) are not transitions. Scope: the table and the check.
# Non-goals: what each transition does (optimizer.py).

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Phase", "TRANSITIONS", "ProtocolError", "ProtocolState"]


class Phase(enum.Enum):
    IDLE = "idle"
    BACKWARD = "in a backward pass"
    ACCUMULATING = "in the middle of an accumulation window"
    APPLIED = "after the window's last backward pass, before step()"
    ABORTED = "after a backward pass that raised"
    CLOSED = "closed"


# (from, to) -> what moves the optimizer along it.
TRANSITIONS = {
    (Phase.CLOSED, Phase.IDLE): "construction complete",
    (Phase.IDLE, Phase.BACKWARD): "the window's first gradient",
    (Phase.ACCUMULATING, Phase.BACKWARD): "the first gradient of the window's next pass",
    (Phase.BACKWARD, Phase.ACCUMULATING): "a pass before the window's last one ended",
    (Phase.BACKWARD, Phase.APPLIED): "the window's last pass ended: its update landed and was validated",
    (Phase.ACCUMULATING, Phase.APPLIED): "step() in a short window: the update ran on what was accumulated",
    (Phase.IDLE, Phase.APPLIED): "step() with no backward after zero_grad(set_to_none=False): the kept zero "
                                 "gradients were stepped",
    (Phase.APPLIED, Phase.IDLE): "step(), zero_grad() or close() closed the window",
    (Phase.ACCUMULATING, Phase.IDLE): "zero_grad() discarded the window",
    (Phase.IDLE, Phase.IDLE): "zero_grad() between windows",
    (Phase.BACKWARD, Phase.ABORTED): "the backward pass raised (seen at the next call, module forward or gradient)",
    (Phase.ACCUMULATING, Phase.ABORTED): "a worker failure, or a failure while finishing the window",
    (Phase.APPLIED, Phase.ABORTED): "a worker failure, or a failure of the rollback and redo",
    (Phase.ABORTED, Phase.IDLE): "recovered: the stepped parameters count the step, the rest is discarded",
    **{(phase, Phase.CLOSED): "close()" for phase in Phase},
}


class ProtocolError(AssertionError):
    """A phase change outside TRANSITIONS: a bug in the library, never the user's."""


@dataclass(eq=False)
class ProtocolState:
    """The protocol's mutable state, one object per optimizer.

    NOTE: kept in one object that the wrapper references, never as attributes rebound on the
    wrapper: a proxy holding a shallow copy of the wrapper's ``__dict__`` (Lightning's
    LightningOptimizer) then drives the same state as the wrapper and its hooks.
    """

    phase: Phase = Phase.CLOSED
    window: int = 1  # backward passes in the coming (or running) window: grad_accum_steps
    micro: int = 0  # backward passes completed in the open window
    final: bool = False  # the running backward is the window's last
    gen: int = 0  # identifies the watched backward; stale signals carry an older one
    died: int = -1  # generation of a backward that raised, until recovered
    zero_fill: bool = False  # zero_grad(set_to_none=False): step grad-less parameters with zeros
    zeroed: bool = False  # no window was stepped since that zero_grad: torch's .grad tensors hold zeros
    # a window was stepped and no zero_grad() came since: torch's .grad would still hold its
    # gradients, and the next backward would add to them (here each window starts from none)
    grads_left: bool = False
    warned_grads_left: bool = False
    warned_zero_grad: bool = False
    warned_no_gradient: bool = False  # step() with no gradient since the last one: said once
    warned_late_hook: bool = False  # a gradient hook registered after ours, which sees None: said once
    blocked_s: float = 0.0
    last_stats: dict = field(default_factory=dict)
    # overlap_forward: step() returned with the window's last chunks in flight; they land
    # (window.land_window) before anything else reads or changes the host state.
    landing: bool = False
    landing_stats: dict = field(default_factory=dict)  # that step's figures, completed when it lands
    # APPLIED: the window's new weights are on the device and noted (window.land_window), so
    # a version change seen by step() is the user's (always so without overlap_forward).
    landed: bool = False
    # recovering a window that a backward left (optimizer._settle): one thread at a time
    lock: Any = field(default_factory=threading.RLock)
    thread: int = field(default_factory=threading.get_ident)  # the thread of the last call (or construction)

    def died_unrecovered(self) -> bool:
        """The watched backward raised in its window and nothing has recovered it yet. NOTE:
        one that died before its window began (IDLE) left nothing to recover, nor one whose
        end was recorded before it raised (a Ctrl-C held back there)."""
        return self.died == self.gen and self.phase is Phase.BACKWARD

    def move(self, to: Phase) -> None:
        """Change phase along TRANSITIONS; anything else raises ProtocolError."""
        if (self.phase, to) not in TRANSITIONS:
            raise ProtocolError(f"full offload's protocol has no transition {self.phase.name} -> {to.name}")
        self.phase = to
