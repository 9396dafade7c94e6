# overlap_forward on CPU parameters (the worker thread runs the same pipeline as on a GPU):
# step() returns while chunks are still being stepped, the backlog is stepped in the next
# forward's order, each module's forward waits for its own new weights, reads outside a
# forward wait through the optimizer, and every run equals the same run without the option
# bit for bit: AdamW with fp32 and bf16 moments, SignSGD, clipping that redoes steps, a NaN
# step, accumulation windows, grad_copy="host", part of the state on the device (gpu_state=).
# A worker failure after step() surfaces on the caller's thread in the next forward, and an
# interrupt while a forward waits leaves nothing behind. torch's attention layers wait for
# their children's weights; the model pickles, and its copies' hooks wait for nothing.

import copy
import gc
import io
import math
import random
import threading
import time
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

from cpu_offload._full.chunk_runner import ChunkRunner
from cpu_offload._full.host_state import ParamRecord
from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from cpu_offload._full.pipeline import Chunk, Pipeline
from cpu_offload._full.transfer import HostRing, SyncTransfer
from helpers import HALF_STATE, Gate, batches, build, phase_of, records_of, staging_rings_of, written_elsewhere

# Rings that hold every gradient of helpers.Net (12.6 KB), in 8 KiB slots: with the kernels
# held, backward must not wait for a slot.
RINGS = dict(pinned_bytes=1 << 16, num_slots=4)


def check_split(off, opts):
    """With ``gpu_state``, some parameters and not all were stepped as device parameters."""
    if "gpu_state" in opts:
        on_device = [r.on_device for r in records_of(off)]
        assert any(on_device) and not all(on_device), on_device


def state_of(model, off):
    return {r.name: (r.master.clone(), None if r.exp_avg is None else r.exp_avg.clone(),
                     None if r.exp_avg_sq is None else r.exp_avg_sq.clone(), r.step, r.param.detach().clone())
            for r in records_of(off)}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for n in a:
        for x, y in zip(a[n], b[n]):
            assert x == y if not torch.is_tensor(x) else torch.equal(x, y), n


def train(kind, *, overlap, steps=6, k=1, gate=None, clip=None, clip_steps=None, nan_step=None, nan_param=None,
          **opts):
    """``build(kind)`` trained for ``steps`` windows of ``k`` passes; with a ``gate``, the
    kernels are held during each window's last backward, so that step() returns with the
    window in flight (the next forward opens it). Returns the model, the wrapper and how many steps returned landing.
    ``clip_steps``: the steps that clip (all if None); ``nan_param``: the one parameter whose
    gradient is NaN at ``nan_step`` (else the loss is)."""
    model, opt = build(kind)
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=k, overlap_forward=model if overlap else None,
                                  **{**RINGS, **opts})
    landing = 0
    for s in range(steps):
        hook = None
        if s == nan_step and nan_param is not None:
            hook = dict(model.named_parameters())[nan_param].register_hook(lambda g: g * float("nan"))
        for m, (x, extra) in enumerate(batches(s, k)):
            loss = model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean()  # opens the gate
            if s == nan_step and nan_param is None:
                loss = loss * float("nan")
            if gate is not None and m == k - 1:
                off.wait_for_weights()  # NOTE: the worker may still be closing the last chunk
                gate.close()
            loss.backward()
        if hook is not None:
            hook.remove()
        if clip is not None and (clip_steps is None or s in clip_steps):
            off.clip_grad_norm_(clip)
        off.step()
        landing += off._proto.landing
        off.zero_grad()
    off.wait_for_weights()
    return model, off, landing


@pytest.mark.parametrize("kind, opts", [
    ("adamw", {}),
    ("adamw", {"state_dtype": torch.bfloat16}),
    ("adamw", {"grad_copy": "host"}),
    ("adamw", {"skip_nonfinite": False}),
    ("sign_sgd", {}),
    ("adamw", {"gpu_state": HALF_STATE}),
    ("adamw", {"gpu_state": HALF_STATE, "state_dtype": torch.bfloat16}),
])
def test_overlap_equals_the_plain_run_bit_for_bit(monkeypatch, kind, opts):
    model, off, _ = train(kind, overlap=False, **opts)
    want = state_of(model, off)
    off.close()
    model, off, landing = train(kind, overlap=True, gate=Gate(monkeypatch), **opts)
    assert landing == 6  # every step returned with chunks in flight
    assert_same(state_of(model, off), want)
    check_split(off, opts)
    off.close()


class ChunkGate(Gate):
    """Holds the worker at the start of each chunk while closed (not only its kernels, as
    Gate does): step() then returns before the worker has decided anything about the
    window's chunks, which it then takes last-arrived first."""

    def __init__(self, monkeypatch):
        super().__init__(monkeypatch)
        real = ChunkRunner.run

        def gated(runner, chunk):
            assert self.opened.wait(30), "the gate was never opened"
            return real(runner, chunk)
        monkeypatch.setattr(ChunkRunner, "run", gated)


@pytest.mark.parametrize("case", ["a NaN in the last parameter to arrive", "a clip limit known, no clip",
                                  "a clip limit known, clipping again"])
def test_what_a_rollback_undoes_does_not_depend_on_the_order_the_worker_runs_chunks(monkeypatch, case):
    """The worker takes optimizer chunks last-arrived first under overlap_forward, so which
    chunks it had stepped when a non-finite gradient or a gradient norm above the last clip's
    limit stopped the speculative step depended on its timing, and so did the rounding of
    their rollback: a run differed from the run without the option (masters by an ulp). Where
    step() returned before the worker had run a chunk, a known clip limit exceeded by a
    window that did not clip made the next call raise ProtocolError ("the worker held back a
    chunk after step() had returned"). The decisions are now taken in arrival order, and such
    a window lands before step() returns."""
    opts = {"a NaN in the last parameter to arrive": dict(nan_step=2, nan_param="l1.weight"),
            "a clip limit known, no clip": dict(clip=0.05, clip_steps={2, 3}, steps=7),
            "a clip limit known, clipping again": dict(clip=0.05, clip_steps={2, 3, 6}, steps=8)}[case]
    rings = dict(pinned_bytes=1 << 16, num_slots=8)  # 4 KiB slots: four optimizer chunks a window
    model, off, _ = train("adamw", overlap=False, **rings, **opts)
    want = state_of(model, off)
    off.close()
    for gate in (Gate, ChunkGate):
        model, off, _ = train("adamw", overlap=True, gate=gate(monkeypatch), **rings, **opts)
        assert_same(state_of(model, off), want)
        off.close()
        monkeypatch.undo()


@pytest.mark.parametrize("case", ["clip every step", "clip never", "nan", "accumulation", "accumulation, no guard",
                                  "clip every step, half on the device", "nan, half on the device"])
def test_validation_and_windows_under_overlap_equal_the_plain_run(monkeypatch, case):
    opts = {"clip every step": dict(clip=1e-3), "clip never": dict(clip=1e6), "nan": dict(nan_step=2),
            "accumulation": dict(k=2), "accumulation, no guard": dict(k=2, skip_nonfinite=False),
            "clip every step, half on the device": dict(clip=1e-3, gpu_state=HALF_STATE),
            "nan, half on the device": dict(nan_step=2, gpu_state=HALF_STATE)}[case]
    model, off, _ = train("adamw", overlap=False, **opts)
    want, skipped = state_of(model, off), off.stats()["skipped_steps"]
    off.close()
    model, off, landing = train("adamw", overlap=True, gate=Gate(monkeypatch), **opts)
    assert_same(state_of(model, off), want)
    assert off.stats()["skipped_steps"] == skipped == case.startswith("nan")
    # A redo, a skip, or norms read from the host accumulators need the window's chunks
    # done before step() returns; the other windows overlap.
    assert landing == {"clip every step": 0, "clip never": 6, "nan": 5, "accumulation": 0,
                       "accumulation, no guard": 6}[case.split(", half")[0]]
    check_split(off, opts)
    off.close()


def test_accumulation_chunks_still_queued_run_before_the_optimizer_chunks(monkeypatch):
    opts = dict(k=2, skip_nonfinite=False, steps=3, pinned_bytes=1 << 17, num_slots=8)  # 8 KiB slots
    model, off, _ = train("adamw", overlap=False, **opts)
    want = state_of(model, off)
    off.close()
    gate = Gate(monkeypatch, accumulate=True)
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=2, overlap_forward=model, skip_nonfinite=False,
                                  pinned_bytes=1 << 17, num_slots=8)
    for s in range(3):
        for x, extra in batches(s, 2):
            loss = model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean()
            off.wait_for_weights()
            gate.close()  # both passes' chunks queue up behind the first one
            loss.backward()
        off.step()
        off.zero_grad()
    off.wait_for_weights()
    assert_same(state_of(model, off), want)
    off.close()


def step_held(monkeypatch, done):
    """``done`` windows with overlap_forward, then one more whose kernels are held: its step()
    returns with every chunk in flight. Returns the model, the wrapper and the gate."""
    gate = Gate(monkeypatch)
    model, off, _ = train("adamw", overlap=True, steps=done, gate=gate)
    gate.close()
    x, extra = batches(done, 1)[0]
    model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean().backward()
    off.step()
    return model, off, gate


def test_step_returns_first_and_each_forward_reads_the_new_weights(monkeypatch):
    model, off, _ = train("adamw", overlap=False, steps=3)
    torch.manual_seed(5)
    probe = torch.randn(4, 24).to(torch.bfloat16)
    want = model(probe, use_extra=True)
    off.close()
    model, off, gate = step_held(monkeypatch, 2)
    assert off._proto.landing and off._pipeline.in_flight  # held: no chunk of this step has run
    assert phase_of(off).name == "IDLE"
    off.zero_grad()  # does not wait
    assert not gate.opened.is_set()
    assert torch.equal(model(probe, use_extra=True), want)  # each module waited for its new weights
    assert not off._proto.landing  # the root module's hook waited for its own (extra, unused): all landed
    off.close()


def test_a_wrapper_dropped_while_its_last_step_lands_finishes_that_step(monkeypatch):
    """close() waits for the last step's weights. The finalizer that releases a wrapper nobody
    holds (a train() function that returns the model) stopped the worker with the step's
    chunks still queued: some parameters silently lacked the last step."""
    want_model, want_off, _ = train("adamw", overlap=False, steps=3)
    want = {n: p.detach().clone() for n, p in want_model.named_parameters()}
    want_off.close()
    model, off, gate = step_held(monkeypatch, 2)
    assert off._pipeline.in_flight
    dropped = weakref.ref(off)
    del off
    gc.collect()
    assert dropped() is None
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), want[n]), n


def test_a_wrapper_the_collector_drops_on_the_worker_thread_finishes_its_last_step(monkeypatch):
    """The garbage collector runs a finalizer on whichever thread allocates: here the worker,
    inside a chunk of the step the dropped wrapper left landing. The finalizer waited for
    that worker, itself, until the timeout, then dropped the queued chunks anyway."""
    from cpu_offload import kernels

    want_model, want_off, _ = train("adamw", overlap=False, steps=3)
    want = {n: p.detach().clone() for n, p in want_model.named_parameters()}
    want_off.close()
    gate = Gate(monkeypatch)
    model, off, _ = train("adamw", overlap=True, steps=2, gate=gate, timeout_s=5.0)
    collect = threading.Event()
    gated = kernels.adamw_step

    def collecting(*args, **kwargs):
        out = gated(*args, **kwargs)
        if collect.is_set():
            collect.clear()
            gc.collect()  # NOTE: finalizers run here, on the worker thread
        return out
    monkeypatch.setattr(kernels, "adamw_step", collecting)
    gate.close()
    x, extra = batches(2, 1)[0]
    model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean().backward()
    off.step()
    worker, dropped = off._pipeline._thread, weakref.ref(off)
    cycle = [off]
    cycle.append(cycle)  # NOTE: only the collector frees it
    gc.disable()
    try:
        del off, cycle
        collect.set()
        gate.opened.set()
        worker.join(30)
    finally:
        gc.enable()
    for thread in threading.enumerate():
        if thread.name.startswith("cpu_offload"):
            thread.join(30)
    assert not worker.is_alive() and dropped() is None
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), want[n]), n


def test_a_model_load_right_after_step_waits_for_the_weights_still_landing(monkeypatch):
    """model.load_state_dict() right after step() (a resume in the same process): the weights
    still landing overwrote the loaded ones, and a torch checkpoint loaded next into the
    optimizer took its masters from them, silently. The load waits for them first, as a
    module's state_dict() does."""
    torch.manual_seed(3)
    checkpoint = {n: torch.randn_like(t) for n, t in build("adamw")[0].state_dict().items()}
    model, off, gate = step_held(monkeypatch, 2)
    assert off._pipeline.in_flight
    model.load_state_dict(checkpoint)
    for n, t in model.state_dict().items():
        assert torch.equal(t, checkpoint[n].to(t.dtype)), n
    off.close()


def test_a_forward_between_backward_and_step_reads_the_new_weights(monkeypatch):
    model, off, _ = train("adamw", overlap=False, steps=2)
    torch.manual_seed(5)
    probe = torch.randn(4, 24).to(torch.bfloat16)
    want_out, want_l1 = model(probe), model.l1.state_dict()
    off.close()
    gate = Gate(monkeypatch)
    model, off, _ = train("adamw", overlap=True, steps=1, gate=gate)
    x, extra = batches(1, 1)[0]
    loss = model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean()
    gate.close()
    loss.backward()
    assert phase_of(off).name == "APPLIED" and off._pipeline.in_flight
    assert torch.equal(model(probe), want_out)  # the window's update, as without the option
    got = model.l1.state_dict()
    assert all(torch.equal(got[n], want_l1[n]) for n in want_l1)
    off.step()
    off.close()


def layers(n=6, width=32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(n)])


def test_the_backlog_is_stepped_in_the_next_forwards_order(monkeypatch):
    model = layers()
    # slots of 4 KiB: two 2 KiB weights per chunk, three chunks
    off = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=model,
                                  pinned_bytes=8 * 4096, num_slots=4)
    order = []
    real = ParamRecord.piece_stepped
    layer = {id(m.weight): i for i, m in enumerate(model)}
    monkeypatch.setattr(ParamRecord, "piece_stepped", lambda rec: (order.append(layer[id(rec.param)]), real(rec))[1])
    gate = Gate(monkeypatch)
    gate.close()
    model(torch.randn(2, 32).to(torch.bfloat16)).float().sum().backward()  # gradients arrive 5, 4, ..., 0
    off.step()
    off.wait_for_weights()
    # The chunks the worker had not begun when backward ended run last-arrived first (in
    # arrival order without the reordering: 5, 4, 3, 2, 1, 0). The one it held at the gate
    # runs first: the last arrived when it woke, (5, 4), (3, 2) or (1, 0).
    assert order in ([5, 4, 1, 0, 3, 2], [3, 2, 1, 0, 5, 4], [1, 0, 3, 2, 5, 4])
    off.close()


class _Landing(SyncTransfer):
    """Copies that land when the test says so: a marker is the chunk's name."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.landed = set()

    def is_done(self, marker):
        return marker in self.landed


@pytest.mark.parametrize("forward_order", [True, False])
def test_the_worker_takes_the_last_arrived_optimizer_chunk_that_has_landed(forward_order):
    ring = dict(num_slots=1, slot_bytes=4096, pin=False)
    transfer = _Landing()
    pipeline = Pipeline(transfer=transfer, algorithm="adamw", d2h=HostRing("d2h", **ring),
                        h2d=HostRing("h2d", **ring), accumulate=True, timeout_s=5.0, forward_order=forward_order)

    def chunk(name, final=True):
        return Chunk(seq=0, micro=0, final=final, slot=None, hparams=None, marker=name)

    def taken(queue, landed):
        transfer.landed = set(landed)
        with pipeline._cv:  # NOTE: held, so the idle worker cannot take them
            pipeline._queue.extend(chunk(n, final=not n.startswith("acc")) for n in queue)
            names = [pipeline._take().marker for _ in queue]
        return names

    order = ["acc1", "acc2", "a", "b", "c"]
    if forward_order:
        # accumulation chunks first, in order; then the last-arrived landed, else the oldest
        assert taken(order, landed=["a", "b"]) == ["acc1", "acc2", "b", "a", "c"]
        assert taken(["a", "b", "c"], landed=[]) == ["a", "b", "c"]
        assert taken(["a", "b", "c"], landed=["a", "b", "c"]) == ["c", "b", "a"]
    else:
        assert taken(order, landed=["a", "b"]) == order
    pipeline.close()


def test_reads_outside_a_forward_wait_for_the_weights(monkeypatch):
    model, off, _ = train("adamw", overlap=False, steps=2)
    want_model, want_opt = model.state_dict(), off.state_dict()
    off.close()
    model, off, _ = step_held(monkeypatch, 1)
    got = model.l2.state_dict()  # a hooked module's state_dict waits for every weight
    assert not off._proto.landing
    assert torch.equal(got["weight"], want_model["l2.weight"])
    assert all(torch.equal(v, want_model[n]) for n, v in model.state_dict().items())
    got = off.state_dict()["state"]
    assert all(torch.equal(got[i]["exp_avg"], want_opt["state"][i]["exp_avg"]) for i in want_opt["state"])
    off.close()


def test_a_worker_failure_after_step_surfaces_in_the_next_forward(monkeypatch):
    model = layers()
    off = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=model,
                                  pinned_bytes=8 * 4096, num_slots=4)  # one kernel call per chunk
    x = torch.randn(2, 32).to(torch.bfloat16)
    before = {r.name: r.master.clone() for r in records_of(off)}
    gate = Gate(monkeypatch)
    gate.close()
    model(x).float().sum().backward()
    off.step()
    gate.fail_at = gate.calls + 2  # the second chunk fails, the third is skipped
    with pytest.raises(RuntimeError, match=r"injected kernel failure.*after step\(\) returned, so \d of 6") as raised:
        model(x)
    # Each parameter took the step entirely or not at all, as the message says.
    took = {r.name for r in records_of(off) if r.step == 1}
    assert 0 < len(took) < 6 and f"so {len(took)} of 6" in str(raised.value)
    for r in records_of(off):
        assert torch.equal(r.master, before[r.name]) == (r.name not in took), r.name
        assert torch.equal(r.param.detach(), r.master.to(torch.bfloat16).view_as(r.param)), r.name
    # The next step works.
    model(x).float().sum().backward()
    off.step()
    off.wait_for_weights()
    assert all(r.step == 1 + (r.name in took) for r in records_of(off))
    off.close()


@pytest.mark.parametrize("as_errors", [False, True], ids=["warnings", "warnings as errors"])
def test_a_worker_failure_after_the_last_step_warns_when_the_optimizer_is_dropped(monkeypatch, as_errors):
    """No forward follows the last step() of a run: the optimizer, dropped (or left to the
    interpreter's exit), stepped its queued chunks and swallowed their failure, so a script
    whose last step half failed exited with 0 and no word. The warning comes after the worker
    has stopped: under -W error it is raised in the finalizer, and may not keep it running."""
    model = layers()
    off = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=model,
                                  pinned_bytes=8 * 4096, num_slots=4)  # one kernel call per chunk
    gate = Gate(monkeypatch)
    gate.close()
    model(torch.randn(2, 32).to(torch.bfloat16)).float().sum().backward()
    off.step()
    gate.fail_at = gate.calls + 2
    records, pipeline = records_of(off), off._pipeline
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error" if as_errors else "always")
        unraisable = []
        monkeypatch.setattr("sys.unraisablehook", unraisable.append)  # a finalizer's exception
        del off
        gc.collect()
    assert not pipeline._thread.is_alive()
    if as_errors:
        assert len(unraisable) == 1 and "injected kernel failure" in str(unraisable[0].exc_value)
        return
    took = sum(r.step == 1 for r in records)
    assert 0 < took < 6
    failed = [w for w in caught if "injected kernel failure" in str(w.message)]
    assert len(failed) == 1 and failed[0].category is RuntimeWarning, [str(w.message) for w in caught]
    assert f"so {took} of 6 parameters took that step" in str(failed[0].message)


@pytest.mark.parametrize("where", ["a forward waits", "the window lands"])
def test_an_interrupt_while_waiting_leaves_the_run_exact(monkeypatch, where):
    model, off, _ = train("adamw", overlap=False, steps=3)
    want = state_of(model, off)
    off.close()
    model, off, gate = step_held(monkeypatch, 2)
    name = "wait_stepped" if where == "a forward waits" else "drain"
    real, armed = getattr(Pipeline, name), [True]  # Gate's: opens the gate, then waits

    def interrupted(self, *args):
        if armed[0]:
            armed[0] = False
            gate.opened.set()  # the chunks run on behind the interrupt
            raise KeyboardInterrupt
        return real(self, *args)
    monkeypatch.setattr(Pipeline, name, interrupted)
    x, _ = batches(2, 1)[0]
    wait = (lambda: model(x.to(torch.bfloat16))) if where == "a forward waits" else off.wait_for_weights
    with pytest.raises(KeyboardInterrupt):
        wait()
    assert off._proto.landing
    wait()  # lands the window
    assert_same(state_of(model, off), want)
    off.close()


@pytest.mark.parametrize("held", [False, True])
def test_the_weights_the_step_wrote_are_not_taken_for_the_users(monkeypatch, held):
    """Each window notes the weights it wrote, whether its chunks finished before step() or
    after: otherwise the next window copies every weight back to compare it with its master."""
    from cpu_offload._full import optimizer as full_optimizer
    changed = []
    real = full_optimizer.adopt_external_weights

    def counting(records):
        changed.append(sum(written_elsewhere(r) for r in records))
        return real(records)
    monkeypatch.setattr(full_optimizer, "adopt_external_weights", counting)
    _, off, landing = train("adamw", overlap=True, steps=5, gate=Gate(monkeypatch) if held else None)
    assert changed == [0] * 5
    assert not held or landing == 5  # held: every step() returned with its window in flight
    off.close()


def test_the_rings_hold_every_gradient():
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, overlap_forward=model)
    d2h, _ = staging_rings_of(off)
    grad_bytes = sum(r.numel * 2 for r in records_of(off))
    assert d2h.nbytes >= grad_bytes
    off.close()


def test_overlap_forward_is_checked():
    model, opt = build("adamw")
    with pytest.raises(TypeError, match="overlap_forward must be None or the model"):
        FullCPUOffloadOptimizer(opt, overlap_forward=[model])
    with pytest.raises(ValueError, match="overlap_forward: the model does not hold"):
        FullCPUOffloadOptimizer(opt, overlap_forward=nn.Linear(2, 2))


class AttentionBlock(nn.Module):
    """torch's attention layers read their children's weights in their own forward:
    nn.MultiheadAttention its out_proj's, nn.TransformerEncoderLayer's fast path (eval) all of them."""

    def __init__(self, layer: str, d: int = 64):
        super().__init__()
        self.inp = nn.Linear(d, d)
        if layer == "attention":
            self.att = nn.MultiheadAttention(d, 4, batch_first=True)
        else:
            self.att = nn.TransformerEncoderLayer(d, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        h = self.inp(x)
        h = self.att(h, h, h, need_weights=False)[0] if isinstance(self.att, nn.MultiheadAttention) else self.att(h)
        return self.out(h)


@pytest.mark.parametrize("layer", ["attention", "encoder"])
def test_torch_attention_layers_wait_for_their_childrens_weights(monkeypatch, layer):
    """MultiheadAttention's forward reads out_proj.weight without calling out_proj, so nothing
    waited for it: an evaluation right after step() read the old weight, and a training
    forward saved it for a backward that then failed on the step's in-place write. A slow
    CPU step (the regime overlap_forward is for) leaves those chunks behind the forward."""
    from cpu_offload import kernels
    real = kernels.adamw_step

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return real(*args, **kwargs)
    monkeypatch.setattr(kernels, "adamw_step", slow)
    waited = []
    await_weights = FullCPUOffloadOptimizer._await_weights

    def noting(self, recs, fsdp_state):
        waited.append({id(r.param) for r in recs})
        return await_weights(self, recs, fsdp_state)
    monkeypatch.setattr(FullCPUOffloadOptimizer, "_await_weights", noting)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = AttentionBlock(layer)
        off = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      overlap_forward=model if overlap else None, pinned_bytes=1 << 15, num_slots=4)
        evals = []
        for _ in range(3):
            model.train()
            model(x).float().pow(2).mean().backward()
            off.step()
            off.zero_grad()
            model.eval()
            with torch.no_grad():
                evals.append(model(x))  # right after step(): the weights may still be landing
        off.wait_for_weights()
        runs.append((evals, {n: p.detach().clone() for n, p in model.named_parameters()}))
        off.close()
    (want_evals, want), (got_evals, got) = runs
    assert {id(p) for p in model.att.parameters()} in waited  # the layer's own forward waits for them all
    assert all(torch.equal(a, b) for a, b in zip(got_evals, want_evals))
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_model_with_the_forward_waits_pickles_and_its_copies_do_not_wait(monkeypatch):
    """The waits were closures in the model's hook tables: torch.save(model) failed ("Can't
    pickle local object"), and a deep copy (an EMA or teacher model) kept hooks that called
    the optimizer, so its state_dict() raised once the optimizer was closed."""
    model, off, gate = step_held(monkeypatch, 2)
    off.wait_for_weights()
    buf = io.BytesIO()
    torch.save(model, buf)
    ema = copy.deepcopy(model)
    want = {n: t.clone() for n, t in model.state_dict().items()}
    off.close()
    buf.seek(0)
    for copied in (ema, torch.load(buf, weights_only=False)):
        got = copied.state_dict()
        assert all(torch.equal(got[n], want[n]) for n in want)
        copied.load_state_dict(want)
        x, extra = batches(0, 1)[0]
        assert torch.equal(copied(x.to(torch.bfloat16), use_extra=extra), model(x.to(torch.bfloat16), use_extra=extra))


def test_a_window_whose_norm_meets_the_clip_limit_to_the_last_bit_is_predicted_as_the_worker_sums_it(monkeypatch):
    """step() returns early only where the worker will hold nothing back for a known clip
    limit. Predicted from a sum of the squared norms in parameter order while the worker sums
    them in arrival order, a window whose 2-norm is the limit in one order and an ulp above it
    in the other was left running: the next forward raised ProtocolError, and a zero_grad()
    in place of step() dropped the window's update without a word."""
    rng = random.Random(1)
    while True:  # three gradients whose 2-norm depends on the order of the sum, in its last bit
        ga, gb, gc = (float(torch.tensor(rng.uniform(0.1, 1.0), dtype=torch.float32)) for _ in range(3))
        by_param, by_arrival = ga * ga + gb * gb + gc * gc, gc * gc + gb * gb + ga * ga
        if math.sqrt(by_arrival) > math.sqrt(by_param):
            break
    limit = math.sqrt(by_param)

    class Three(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (nn.Parameter(torch.zeros(1)) for _ in range(3))

        def forward(self, x):
            return (self.a * x * ga).sum() + (self.b * x * gb).sum() + (self.c * x * gc).sum()

    for close_with in ("step", "zero_grad"):
        model = Three()
        off = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), compute_dtype=torch.float32,
                                      overlap_forward=model, pinned_bytes=1 << 16, num_slots=4)
        gate = ChunkGate(monkeypatch)
        try:
            model(torch.full((1,), 0.1)).backward()
            off.clip_grad_norm_(limit)  # does not clip: the limit is known, the next window speculates
            off.step()
            off.zero_grad()
            before = [p.detach().clone() for p in model.parameters()]
            loss = model(torch.ones(1))
            gate.close()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # zero_grad() without step() says the update stays
                loss.backward()
                getattr(off, close_with)()
                off.zero_grad()
            model(torch.ones(1))  # waits for the window's weights
            assert all(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters())), close_with
            assert [int(off.state[p]["step"]) for p in model.parameters()] == [2, 2, 2]
        finally:
            gate.opened.set()
            off.close()
            monkeypatch.undo()
