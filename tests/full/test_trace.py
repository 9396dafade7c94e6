# The pipeline trace (CPU_OFFLOAD_TRACE, cpu_offload/_full/trace.py): off without the
# variable, a clear error naming it when it names no directory (before anything is touched),
# one file per optimizer written at close() with every chunk's events in their order on their
# threads, the forward's waits with overlap_forward, and a traced run equal to an untraced one
# bit for bit.
import json

import pytest
import torch

from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from cpu_offload._full.trace import ENV, NO_TRACE
from helpers import Gate, batches, build, records_of

RINGS = dict(pinned_bytes=1 << 16, num_slots=4)


def train(monkeypatch, *, overlap, steps=4, trace_dir=None):
    """``steps`` windows; with ``overlap``, each step returns with its kernels held (Gate),
    so the next forward waits for its weights."""
    if trace_dir is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, str(trace_dir))
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, overlap_forward=model if overlap else None, **RINGS)
    gate = Gate(monkeypatch) if overlap else None
    for s in range(steps):
        x, extra = batches(s, 1)[0]
        loss = model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean()  # opens the gate
        if gate is not None:
            off.wait_for_weights()
            gate.close()
        loss.backward()
        off.step()
        off.zero_grad()
    off.wait_for_weights()
    masters = [r.master.clone() for r in records_of(off)]
    return off, masters


def test_no_trace_without_the_variable(monkeypatch, tmp_path):
    off, _ = train(monkeypatch, overlap=False)
    assert off._pipeline.trace is NO_TRACE and NO_TRACE.events == []
    off.close()


@pytest.mark.parametrize("what", ["missing", "file"])
def test_a_value_that_names_no_directory_is_refused_before_anything_changes(monkeypatch, tmp_path, what):
    path = tmp_path / what
    if what == "file":
        path.write_text("")
    monkeypatch.setenv(ENV, str(path))
    model, opt = build("adamw")
    with pytest.raises(ValueError, match=f"{ENV}=.*is not a directory"):
        FullCPUOffloadOptimizer(opt, **RINGS)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing was cast
    monkeypatch.delenv(ENV)
    FullCPUOffloadOptimizer(opt, **RINGS).close()  # the parameters are free to wrap


@pytest.mark.parametrize("overlap", [False, True])
def test_each_chunk_is_traced_in_order_and_the_run_is_unchanged(monkeypatch, tmp_path, overlap):
    off, want = train(monkeypatch, overlap=overlap)
    off.close()
    off, got = train(monkeypatch, overlap=overlap, trace_dir=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert list(tmp_path.iterdir()) == []  # written when closed
    off.close()
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("trace_")
    events = json.loads(files[0].read_text())["events"]
    names = [e[2] for e in events]
    for name in ("step_begin", "step_end", "backward_begin", "backward_end"):
        assert names.count(name) == 4, name
    # six parameters each step, and "extra" on even steps ("unused" and "frozen" never)
    assert names.count("grad_staged") == sum(7 if s % 2 == 0 else 6 for s in range(4))
    chunk_events = ("chunk_queued", "chunk_take", "grads_landed", "kernel_begin", "kernel_end", "h2d_issued",
                    "chunk_done")
    seqs = {e[3] for e in events if e[2] == "chunk_queued"}
    assert len(seqs) >= 8  # at least two chunks a step
    for seq in seqs:
        mine = [e for e in events if e[2] in chunk_events and e[3] == seq]
        assert [e[2] for e in mine] == list(chunk_events), seq  # each once, in this order
        times = [e[0] for e in mine]
        assert times == sorted(times), seq
        assert mine[0][1] == "MainThread" and {e[1] for e in mine[1:]} == {"cpu_offload-worker"}
    waits = [e for e in events if e[2].startswith("forward_wait")]
    assert bool(waits) == overlap
    assert [e[2] for e in waits] == ["forward_wait_begin", "forward_wait_end"] * (len(waits) // 2)
    assert all(a[0] <= b[0] for a, b in zip(waits[::2], waits[1::2]))
