# Full offload's protocol as a table: docs/architecture.md shows the table the code checks
# every phase change against; a change outside it raises at once; and a training loop's
# calls (accumulation, a short window, clipping, zero_grad, an aborted backward, close)
# only take transitions of the table.
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from cpu_offload._full import protocol
from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from cpu_offload._full.protocol import TRANSITIONS, Phase, ProtocolError, ProtocolState

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_the_documented_table_is_the_code_table():
    text = DOC.read_text()
    section = text[text.index("| from | to | what moves it |"):]
    rows = [line for line in section.splitlines()[2:] if line.startswith("|")]
    documented = set()
    for line in rows:
        src, dst, what = (cell.strip() for cell in line.strip("|").split("|"))
        sources = list(Phase) if src == "any" else [Phase[src]]
        for phase in sources:
            documented.add((phase, Phase[dst], what))
    assert documented == {(a, b, w) for (a, b), w in TRANSITIONS.items()}


def test_a_transition_outside_the_table_raises():
    state = ProtocolState()
    state.move(Phase.IDLE)
    with pytest.raises(ProtocolError, match="IDLE -> ACCUMULATING"):
        state.move(Phase.ACCUMULATING)
    assert state.phase is Phase.IDLE
    state.move(Phase.CLOSED)
    with pytest.raises(ProtocolError):
        state.move(Phase.BACKWARD)


def test_a_training_loop_takes_only_table_transitions(monkeypatch):
    taken = []
    real = ProtocolState.move

    def spy(self, to):
        taken.append((self.phase, to))
        real(self, to)

    monkeypatch.setattr(protocol.ProtocolState, "move", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), grad_accum_steps=3,
                                  pinned_bytes=4 * 4096, num_slots=2)

    def backward(scale=1.0):
        (model(torch.randn(4, 8).to(torch.bfloat16)).float().pow(2).mean() * scale).backward()

    for _ in range(3):
        backward()
    opt.clip_grad_norm_(1e-3)
    opt.step()
    opt.zero_grad()
    backward()  # a short window, clipped in its middle
    opt.clip_grad_norm_(1e-3)
    opt.step()
    opt.zero_grad(set_to_none=False)
    opt.step()  # no backward: steps the zero gradients torch keeps
    backward()
    opt.zero_grad()  # an abandoned window
    opt.zero_grad()
    model[0].weight.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.zero_grad()  # recovers the aborted backward
    opt.close()
    assert taken and all(pair in TRANSITIONS for pair in taken)
    assert (Phase.IDLE, Phase.APPLIED) in taken
    phases = {p for pair in taken for p in pair}
    assert {Phase.BACKWARD, Phase.ACCUMULATING, Phase.APPLIED, Phase.ABORTED, Phase.CLOSED} <= phases
    assert re.search(r"ProtocolState\.move", DOC.read_text())
