# Host state stepped on the device (stream_share=), on CPU parameters: the "device" is then the
# CPU, so the streamed records go through the same slots and copies as on a GPU, stepped by
# device_state.py's operations. Any share trains bit for bit like the all-host run (AdamW with
# fp32 or bf16 moments, SignSGD, accumulation, zero-filled gradients, a skipped step, clipping),
# records longer than a slot and a ring that wraps included; checkpoints load across shares;
# a failure inside the streamed step names the parameter it left partly updated; a Ctrl-C at
# any line of it ends as without it; bad values are refused naming the argument.
import pytest
import torch

from cpu_offload._full import streamed_step
from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from helpers import SMALL, Gate, assert_same_state, batches, named, records_of, sigint_at_line, train_step
from test_gpu_state import assert_a_checkpoint_loads_across, build, state_of, train


@pytest.fixture
def small_slots(monkeypatch):
    """Slots of 300 elements: the model's larger weights span several, and the ring of
    4 wraps within a step."""
    monkeypatch.setattr(streamed_step, "SLOT_ELEMENTS", 300)


@pytest.mark.filterwarnings("ignore:cpu_offload. optimizer step skipped")
@pytest.mark.parametrize("kind, k, state_dtype, zero_fill", [
    ("adamw", 1, torch.float32, False), ("adamw", 2, torch.float32, True), ("adamw", 1, torch.bfloat16, True),
    ("adamw", 3, torch.bfloat16, False), ("sign_sgd", 1, torch.float32, False), ("sign_sgd", 2, torch.float32, True)])
@pytest.mark.parametrize("share", [0.5, 1.0])
def test_any_stream_share_trains_bit_for_bit_like_the_all_host_run(kind, k, state_dtype, zero_fill, share,
                                                                   small_slots):
    opts = dict(state_dtype=state_dtype) if kind == "adamw" else {}
    host_model, host, _ = train(kind, k, 6, gpu_state=None, zero_fill=zero_fill, nan_at=3, **opts)
    split_model, split, _ = train(kind, k, 6, gpu_state=None, stream_share=share, zero_fill=zero_fill, nan_at=3,
                                  **opts)
    streamed = [r for r in records_of(split) if r.on_device]
    assert 0 < len(streamed) < len(records_of(split)) if share < 1 else len(streamed) == len(records_of(split))
    assert all(r.master.device.type == "cpu" and not r.master.is_cuda for r in streamed)
    plan = split._device.streamed.plan(streamed)
    assert len(plan) > 4 and all(stop - start <= 300 for start, stop, _ in plan)  # split records, a wrapped ring
    assert split.stats()["gpu_state_bytes"] == sum(4 * r.numel for r in streamed if k > 1)  # their accumulators
    assert host.stats()["skipped_steps"] == split.stats()["skipped_steps"] == 1  # the NaN step
    assert_same_state(state_of(host_model, host), state_of(split_model, split))


@pytest.mark.parametrize("how", ["max_grad_norm", "clip_grad_norm_"])
def test_a_clipped_stream_share_steps_each_parameter_as_the_path_it_took(how, small_slots):
    """The host parameters are stepped during backward, rolled back and redone when clipping
    sets the factor (with the rollback's error of about one ulp, docs/full-offload.md); the
    streamed ones once, at step(), with the final factor, as device parameters are: each equals
    the run whose parameters all took its path, bit for bit."""
    opts = dict(max_grad_norm=1e-3) if how == "max_grad_norm" else dict(clip=1e-3)
    runs = {name: train("adamw", 1, 5, state_dtype=torch.bfloat16, **split, **opts)
            for name, split in (("host", dict(gpu_state=None)), ("device", dict(gpu_state=1 << 40)),
                                ("streamed", dict(gpu_state=None, stream_share=0.5)))}
    coefs = {name: [coef for coef, _ in history] for name, (_, _, history) in runs.items()}
    assert coefs["host"] == coefs["device"] == coefs["streamed"] and all(c < 1 for c in coefs["host"])
    states = {name: state_of(model, off) for name, (model, off, _) in runs.items()}
    model, off, _ = runs["streamed"]
    path = {n: "device" if r.on_device else "host" for n, r in named(model, off).items()}
    assert sorted(set(path.values())) == ["device", "host"]
    assert_same_state(states["streamed"], {n: states[path[n]][n] for n in states["streamed"]})


@pytest.mark.parametrize("save_share, load_share", [(0.0, 0.5), (1.0, 0.0), (0.5, 1.0)])
def test_a_checkpoint_loads_with_any_stream_share(save_share, load_share):
    assert_a_checkpoint_loads_across(dict(stream_share=save_share), dict(stream_share=load_share))


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "auto", None, float("nan")])
def test_bad_stream_share_values_are_refused_naming_the_argument(bad):
    model, opt = build("adamw")
    with pytest.raises(ValueError, match="stream_share"):
        FullCPUOffloadOptimizer(opt, stream_share=bad, **SMALL)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing changed


def test_a_streamed_step_that_fails_between_two_pieces_of_a_parameter_names_it_as_partly_updated(
        monkeypatch, small_slots):
    """An out-of-memory after a parameter's first slot was stepped and sent back, before its
    second: its host master holds one part of the step; step() names it and no other, those
    sent back whole count their step, those not reached keep theirs."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, stream_share=1.0, **SMALL)
    train_step(model, off, 0, 1)
    off.step()
    off.zero_grad()
    train_step(model, off, 1, 1)
    streamed = off._device.streamed
    plan = streamed.plan([r for r in records_of(off) if r.pieces_total])
    # the first piece that is not a record's first: the record it continues is then torn
    calls = [p for _, _, pieces in plan for p in pieces]
    fail_at = next(i for i, (rec, lo, _) in enumerate(calls) if lo != streamed._offset[id(rec)])
    torn = calls[fail_at][0]
    before = {n: (r.master.clone(), r.step) for n, r in named(model, off).items()}
    real, seen = streamed_step.step_flat, [0]

    def failing(*args):
        if seen[0] == fail_at:
            raise torch.OutOfMemoryError("out of memory (injected)")
        seen[0] += 1
        return real(*args)

    monkeypatch.setattr(streamed_step, "step_flat", failing)
    with pytest.raises(RuntimeError, match="only partly updated.*reload the last checkpoint") as err:
        off.step()
    assert f"[{torn.name!r}]" in str(err.value)
    assert isinstance(err.value.__context__, torch.OutOfMemoryError)
    done = {id(rec) for rec, _, _ in calls[:fail_at]} - {id(torn)}
    for n, r in named(model, off).items():
        changed = not torch.equal(r.master, before[n][0])
        if r is torn:
            assert changed and r.step == before[n][1]
        elif id(r) in done:
            assert changed and r.step == before[n][1] + 1, n
        else:
            assert not changed and r.step == before[n][1], n
    off.close()


def test_a_ctrl_c_at_any_line_of_the_streamed_step_ends_as_without_it(sigint_raises, small_slots):
    """The streamed step runs inside step()'s deferred-interrupt block: a Ctrl-C at any of its
    lines is raised once the step is complete, so training goes on as without it."""
    def run(k):
        model, opt = build("adamw")
        off = FullCPUOffloadOptimizer(opt, stream_share=0.5, **SMALL)
        train_step(model, off, 0, 1)
        if k is None:
            off.step()
        else:
            hit, raised = sigint_at_line(k, off.step, start="_step_device_state")
            if not hit:
                off.close()
                return None
            assert isinstance(raised, KeyboardInterrupt), (k, raised)
        off.zero_grad()
        train_step(model, off, 1, 1)
        off.step()
        state = state_of(model, off)
        off.close()
        return state

    want, k = run(None), 0
    while (got := run(k + 1)) is not None:
        k += 1
        assert_same_state(got, want)
    assert k > 20, k


def _held_run(monkeypatch, *, share, then="step", clip=None, steps=4, gpu_state=None):
    """``build("adamw")`` trained for ``steps`` windows, the CPU kernels held during each
    window's last backward (helpers.Gate): with a stream share the backward returns with
    the CPU's chunks in flight, and step() (or ``then``) lands them. Returns the model, the
    wrapper and how many windows ended their backward in flight."""
    gate = Gate(monkeypatch)
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, stream_share=share, gpu_state=gpu_state, pinned_bytes=1 << 16, num_slots=4)
    in_flight = 0
    for s in range(steps):
        ((x, extra),) = batches(s, 1)
        loss = model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean()
        gate.close()
        loss.backward()
        in_flight += off._pipeline.in_flight
        if clip is not None:
            off.clip_grad_norm_(clip)
        if then == "step":
            off.step()
        else:
            getattr(off, then)()
        gate.opened.set()
        off.zero_grad()
    return model, off, in_flight


@pytest.mark.filterwarnings("ignore:cpu_offload. zero_grad.. without step")
@pytest.mark.parametrize("then, clip", [("step", None), ("step", 1e-3), ("zero_grad", None)])
def test_with_a_stream_share_the_cpus_last_chunks_land_in_step_and_the_run_is_exact(monkeypatch, then, clip):
    """With a stream share, the window's last backward returns without waiting for the CPU's
    chunks, so the streamed step at step() runs beside them: step() (or zero_grad()) lands
    them, a clip redoes them; each parameter equals, bit for bit, the run whose parameters all
    took its path (host: the run without the share; streamed: with every state on the device,
    stepped once as they are, where a clip leaves the host's rollback error)."""
    host_model, host, held = _held_run(monkeypatch, share=0.0, then=then, clip=clip)
    assert held == 0  # without the share, backward waits for its chunks
    device_model, device, _ = _held_run(monkeypatch, share=0.0, then=then, clip=clip, gpu_state=1 << 40)
    model, off, held = _held_run(monkeypatch, share=0.5, then=then, clip=clip)
    assert held == (4 if clip is None else 1)  # NOTE: a window after a clipped one holds its chunks back
    want = {"host": state_of(host_model, host), "device": state_of(device_model, device)}
    path = {n: "device" if r.on_device else "host" for n, r in named(model, off).items()}
    assert sorted(set(path.values())) == ["device", "host"]
    got = state_of(model, off)
    assert_same_state(got, {n: want[path[n]][n] for n in got})


def test_with_a_stream_share_a_forward_between_backward_and_step_reads_the_landed_weights(monkeypatch):
    model, off, _ = _held_run(monkeypatch, share=0.5, steps=1)
    gate = Gate(monkeypatch)
    torch.manual_seed(5)
    probe = torch.randn(4, 24).to(torch.bfloat16)
    ((x, extra),) = batches(1, 1)
    loss = model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean()
    before = model(probe)
    gate.close()
    loss.backward()
    assert off._pipeline.in_flight and not gate.opened.is_set()
    got = model(probe)  # waits for the CPU's chunks: the gate opens
    assert gate.opened.is_set() and off._proto.landed and not off._pipeline.in_flight
    assert not torch.equal(got, before)  # the host parameters' update is in it
    assert torch.equal(model(probe), got)
    off.step()
    off.close()
