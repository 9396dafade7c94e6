# FullCPUOffloadOptimizer on CPU parameters (synchronous copies, same pipeline):
# equivalence with the reference and with torch.optim.AdamW, accumulation,
# skipping, schedulers, small staging slots, checkpoints, stats and errors.
import copy
import io
import os
import re
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import cpu_offload._full.chunk_runner as runner_mod
from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from helpers import (Net, SMALL, assert_same_state, batches, build, capture, check_stepped_once, expected, named, records_of, run,
                     snapshot, train_step, worker_parts_of)


@pytest.mark.parametrize("kind", ["adamw", "sign_sgd"])
@pytest.mark.parametrize("k", [1, 3])
def test_matches_reference_and_torch(kind, k):
    model, off, init, history = run(kind, k, 6, **SMALL)
    recs = named(model, off)
    exact = expected(kind, init, history, exact=True)
    loose = expected(kind, init, history, exact=False)
    assert off.stats()["chunks"] > 2  # the small slots split the step into several chunks
    for n, rec in recs.items():
        master = rec.master.view(rec.shape)
        assert torch.equal(master, exact[n]), n  # same operations, same order: bit-exact
        torch.testing.assert_close(master, loose[n], rtol=1e-5, atol=1e-6, msg=n)
        assert torch.equal(rec.param.detach(), master.to(torch.bfloat16)), n  # compute copy = round(master)
    # never-stepped parameter: untouched, no step counted (like torch)
    assert recs["unused"].step == 0 and torch.equal(recs["unused"].master.view(5), init["unused"])
    assert recs["l1.weight"].step == 6
    # frozen parameter: not offloaded, not cast
    assert model.frozen.dtype == torch.float32 and torch.equal(model.frozen, init["frozen"])
    assert all(p.grad is None for p in model.parameters())


def test_fp32_compute_and_keep_fp32():
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, keep_fp32=[model.extra], **SMALL)
    assert model.extra.dtype == torch.float32 and model.l1.weight.dtype == torch.bfloat16
    x = torch.randn(4, 24)
    model(x.to(torch.bfloat16), use_extra=True).float().sum().backward()  # fp32 and bf16 grads in one step
    off.step()
    rec = named(model, off)["extra"]
    assert rec.step == 1 and torch.equal(model.extra.detach(), rec.master.view(rec.shape))
    model2, opt2 = build("adamw")
    FullCPUOffloadOptimizer(opt2, compute_dtype=torch.float32).close()
    assert all(p.dtype == torch.float32 for p in model2.parameters())


def test_state_dict_resume_is_bit_identical():
    def fresh():
        model, opt = build("adamw")
        return model, FullCPUOffloadOptimizer(opt, grad_accum_steps=2, **SMALL)

    def train(model, off, steps):
        for s in steps:
            for x, extra in batches(s, 2):
                model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean().backward()
            off.step()
            off.zero_grad()

    model, off = fresh()
    train(model, off, range(3))
    buf = io.BytesIO()
    torch.save(off.state_dict(), buf)
    train(model, off, range(3, 6))
    final = {n: r.master.clone() for n, r in named(model, off).items()}

    model2, off2 = fresh()
    buf.seek(0)
    off2.load_state_dict(torch.load(buf))
    for n, rec in named(model2, off2).items():  # the compute copy is refreshed
        assert torch.equal(rec.param.detach(), rec.master.view(rec.shape).to(torch.bfloat16)), n
    train(model2, off2, range(3, 6))
    for n, rec in named(model2, off2).items():
        assert torch.equal(rec.master, final[n]), n


def test_state_dict_format():
    model, off, _, _ = run("adamw", 1, 2, **SMALL)
    sd = off.state_dict()
    torch_sd = build("adamw")[1].state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in torch_sd["param_groups"]]
    rec = named(model, off)["l2.weight"]
    entry = sd["state"][rec.index]
    assert set(entry) == {"step", "master", "exp_avg", "exp_avg_sq", "master_step"}
    assert entry["step"].item() == entry["master_step"].item() == 2.0 and entry["exp_avg"].shape == (64, 64)
    assert entry["master"].dtype == torch.float32
    assert off.state[model.l2.weight]["exp_avg_sq"].shape == (64, 64)
    with pytest.raises(ValueError, match="param groups"):
        off.load_state_dict({"state": {}, "param_groups": sd["param_groups"][:1]})


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32])
def test_wrapping_an_optimizer_that_holds_state_carries_the_state_over(compute_dtype):
    """An AdamW that has stepped (a warm-up without offload, or a checkpoint loaded before
    wrapping) was wrapped from step 0 with zero moments, without a word: its next step was a
    first step. Its state now carries over, exactly as loading its state_dict into a fresh
    wrapper does, with the masters taken from the fp32 weights before the cast; the torch
    optimizer's own copy is dropped, as full offload keeps the state on the host."""
    def warmed_up():
        model, opt = build("adamw")
        for s in range(2):
            for x, extra in batches(s, 1):
                model(x, use_extra=extra).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = warmed_up()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved = copy.deepcopy(opt.state_dict())
    carried = FullCPUOffloadOptimizer(opt, compute_dtype=compute_dtype, **SMALL)
    fresh_model, fresh = build("adamw")
    fresh_model.load_state_dict(weights)
    loaded = FullCPUOffloadOptimizer(fresh, compute_dtype=compute_dtype, **SMALL)
    loaded.load_state_dict(saved)
    for n, rec in named(model, carried).items():
        entry = saved["state"].get(rec.index)
        assert rec.step == (0 if entry is None else int(entry["step"])), n
        assert torch.equal(rec.master, weights[n].reshape(-1)), n  # the fp32 weights, not rounded
        if entry is not None:
            assert torch.equal(rec.exp_avg, entry["exp_avg"].reshape(-1)), n
            assert torch.equal(rec.exp_avg_sq, entry["exp_avg_sq"].reshape(-1)), n
    assert named(model, carried)["l1.weight"].step == 2
    assert not opt.state  # NOTE: the inner optimizer's own tensors are dropped
    for off, m in ((carried, model), (loaded, fresh_model)):
        for s in range(2, 4):
            for x, extra in batches(s, 1):
                m(x.to(compute_dtype), use_extra=extra).float().pow(2).mean().backward()
            off.step()
            off.zero_grad()
    for n, rec in named(model, carried).items():
        other = named(fresh_model, loaded)[n]
        assert rec.step == other.step and torch.equal(rec.master, other.master), n
        assert torch.equal(rec.exp_avg_sq, other.exp_avg_sq), n
    carried.close()
    loaded.close()


def test_a_state_that_cannot_be_carried_over_is_refused_and_leaves_everything_as_it_was():
    model, opt = build("adamw")
    opt.state[model.l2.weight] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(7), "exp_avg_sq": torch.zeros(7)}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"state cannot be carried over: .*local shape \(7,\), expected \(64, 64\)"):
        FullCPUOffloadOptimizer(opt, **SMALL)
    assert all(torch.equal(p, weights[n]) and p.dtype == torch.float32 for n, p in model.named_parameters())
    assert opt.state[model.l2.weight]["exp_avg"].shape == (7,)
    del opt.state[model.l2.weight]
    assert opt.state[model.l1.weight] == {}  # NOTE: torch's defaultdict: a lookup makes an empty entry
    FullCPUOffloadOptimizer(opt, **SMALL).close()  # nothing of the failed construction stays behind


def test_a_gradient_left_in_param_grad_at_wrapping_is_refused_and_leaves_everything_as_it_was():
    """A backward before wrapping and no zero_grad(): the wrap cast the weights to bf16 and left
    the fp32 .grad, to which autograd then added the next gradient, and the first backward
    failed with "an FSDP2 model must be wrapped before its first forward pass" on a model
    without FSDP2, discarding the window. Construction now refuses it, naming the parameter."""
    model, opt = build("adamw")
    model(torch.randn(4, 24)).pow(2).mean().backward()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"param_groups\[0\]\[0\].* hold a gradient.*zero_grad\(\) before wrapping"):
        FullCPUOffloadOptimizer(opt, **SMALL)
    assert all(torch.equal(p, weights[n]) and p.dtype == torch.float32 for n, p in model.named_parameters())
    opt.zero_grad()
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    train_step(model, off, 0, 1)
    off.step()
    off.close()


def test_a_graph_recorded_before_wrapping_is_refused_naming_that_not_fsdp2():
    """A forward before wrapping and its backward after it, on a model without FSDP2: the graph
    recorded fp32 weights, so the gradients come fp32 to bf16 compute copies. The refusal said
    "an FSDP2 model must be wrapped ... before its first forward pass"; it now names the graph
    recorded before the cast and says to run the forward again, which then steps."""
    model, opt = build("adamw")
    grads = capture(model)  # registered first: runs before the offload hook
    loss = model(torch.randn(4, 24)).pow(2).mean()
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\[\d\] is torch.float32 but its compute copy is "
                                           r"torch.bfloat16: the backward's graph was recorded by a forward before "
                                           r"offload_optimizer cast the weights.*forward again"):
        loss.backward()
    before = snapshot(off)
    grads.clear()
    with pytest.warns(RuntimeWarning, match="backward pass 1 of 1 raised; 0 of 8 parameters"):
        train_step(model, off, 1, 1)
    off.step()
    check_stepped_once(model, off, before, grads, 1.0, "the forward run again after wrapping")
    off.close()


def test_a_gradient_hook_registered_after_wrapping_is_warned_once_that_it_sees_none():
    """Post-accumulate-grad hooks run in registration order and full offload's takes the
    gradient off the device: one registered after wrapping found param.grad None, so a hook
    guarded on None did nothing, with no word. Now the first backward warns once, naming the
    parameter; a hook registered before wrapping sees the gradient and gets no warning."""
    model, opt = build("adamw")
    seen = {}

    def first_look(key):  # whether the hook's first call saw a gradient
        return lambda p: seen.__setitem__(key, seen.get(key, p.grad is not None))

    model.l1.bias.register_post_accumulate_grad_hook(first_look("before"))
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step(model, off, 0, 1)
    off.step()
    off.zero_grad()
    model.l2.weight.register_post_accumulate_grad_hook(first_look("after"))
    name = named(model, off)["l2.weight"].name
    with pytest.warns(RuntimeWarning, match=rf"post-accumulate-grad hook registered on {re.escape(repr(name))} after "
                                            r"offload_optimizer .* sees param.grad None.* before wrapping"):
        train_step(model, off, 1, 1)
    off.step()
    off.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        train_step(model, off, 2, 1)
    off.step()
    assert seen == {"before": True, "after": False}
    off.close()


def test_zero_gradients_left_at_wrapping_are_held_as_zero_grad_leaves_them():
    """``zero_grad(set_to_none=False)`` after a backward, then wrapping: the zero gradients stay
    in .grad in torch, so a parameter without a gradient in the next window is still stepped
    (with zeros). They are taken at wrapping as the wrapper's own zero_grad(set_to_none=False)
    leaves them: .grad is None, and the parameter holds a zero gradient."""
    model, opt = build("adamw")
    grads = capture(model)  # registered first: runs before the offload hook
    model(torch.randn(4, 24), use_extra=True).pow(2).mean().backward()
    opt.zero_grad(set_to_none=False)
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    assert all(p.grad is None for p in model.parameters())
    before = snapshot(off)
    grads.clear()
    train_step(model, off, 1, 1)  # an odd step: `extra` gets no gradient
    off.step()
    assert "extra" not in grads
    check_stepped_once(model, off, before, {**grads, "extra": [torch.zeros(8)]}, 1.0, "zero gradients at wrapping")
    off.close()


def test_stats_and_bounded_staging():
    model, off, _, _ = run("adamw", 1, 1, **SMALL)
    st = off.stats()
    grad_elems = sum(r.numel for r in records_of(off) if r.step)
    assert st["d2h_bytes"] == 2 * grad_elems and st["h2d_bytes"] == 2 * grad_elems
    assert st["pinned_bytes"] <= SMALL["pinned_bytes"]
    assert st["kernel_s"] > 0 and st["host_bytes"] > 0
    assert off.param_groups is off.optimizer.param_groups


def test_accumulation_protocol_errors():
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=2, **SMALL)
    x = torch.randn(2, 24, dtype=torch.bfloat16)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"middle of an accumulation window .* call zero_grad\(\) first to drop the window"):
        off.load_state_dict(off.state_dict())  # saving is torch's: the state of the last step
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"before step\(\): call step\(\)"):
        model(x).sum().backward()
    off.step()
    # zero_grad in the middle of a window discards it, like torch
    model(x).sum().backward()
    off.zero_grad()
    before = {n: r.step for n, r in named(model, off).items()}
    model(x).sum().backward()
    model(x).sum().backward()
    off.step()
    assert all(named(model, off)[n].step == s + 1 for n, s in before.items() if n != "unused" and n != "extra")


def test_constructor_errors(monkeypatch):
    model = Net()
    with pytest.raises(TypeError, match="AdamW and cpu_offload.SignSGD"):
        FullCPUOffloadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for flag in ("amsgrad", "maximize"):
        with pytest.raises(ValueError, match=flag):
            FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), **{flag: True}))
    with pytest.raises(ValueError, match="grad_accum_steps"):
        FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), grad_accum_steps=0)
    with pytest.raises(ValueError, match="compute_dtype"):
        FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), compute_dtype=torch.float16)
    import cpu_offload._full.host_state as hs

    class Tiny:
        available = 1000
    monkeypatch.setattr(hs.psutil, "virtual_memory", lambda: Tiny())
    with pytest.raises(MemoryError, match=r"needs \d+ bytes of host RAM .* only 1000 bytes"):
        FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()))
    assert model.l1.weight.dtype == torch.float32  # nothing was cast


@pytest.mark.parametrize("convert, dtype", [("float", torch.float32), ("half", torch.float16),
                                            ("double", torch.float64)])
def test_a_model_cast_after_wrapping_is_refused_and_keeps_its_masters(convert, dtype):
    """``model.float()`` after wrapping made the next window take the cast compute copies
    (the masters rounded to bf16) for new masters: their low bits were lost without a word;
    ``half()`` and ``double()`` failed only in the worker, at the step. Now the next backward
    raises, naming the parameter; cast back, training goes on from the kept masters."""
    x = torch.randn(4, 24)
    runs = []
    for cast in (False, True):
        model, opt = build("adamw")
        off = FullCPUOffloadOptimizer(opt, **SMALL)
        model(x.to(torch.bfloat16)).float().pow(2).mean().backward()
        off.step()
        off.zero_grad()
        if cast:
            masters = [r.master.clone() for r in records_of(off)]
            assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)  # low bits to lose
            weights = [p.detach().clone() for p in model.parameters()]
            getattr(model, convert)()
            with pytest.raises(TypeError, match=rf"compute copy of param_groups\[\d\]\[\d\] is now {dtype}"):
                model(x.to(dtype)).float().pow(2).mean().backward()
            with pytest.warns(RuntimeWarning, match="0 of 8 parameters had their update applied"):
                off.zero_grad()
            assert all(torch.equal(r.master, m) for r, m in zip(records_of(off), masters))
            for p, was in zip(model.parameters(), weights):  # cast back (half() rounded some, and the frozen one)
                p.data = was
        model(x.to(torch.bfloat16)).float().pow(2).mean().backward()
        off.step()
        runs.append([(r.step, r.master) for r in records_of(off)])
        off.close()
    for (step, master), (want_step, want) in zip(runs[1], runs[0]):
        assert step == want_step and torch.equal(master, want)


def test_add_param_group_rejected():
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    with pytest.raises(RuntimeError, match="cannot add parameter groups"):
        off.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def step_with(model, off, step):
    for x, extra in batches(step, 1):
        model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean().backward()
    off.step()
    off.zero_grad()


CHANGED_GROUPS = {
    "a parameter appended": lambda groups, new: groups[0]["params"].append(new),
    "a parameter removed": lambda groups, new: groups[1]["params"].pop(0),
    "a parameter replaced": lambda groups, new: groups[0]["params"].__setitem__(0, new),
    "a group added past the wrapper": lambda groups, new: groups.append({"params": [new], "lr": 0.1}),
}


@pytest.mark.parametrize("change", CHANGED_GROUPS)
def test_param_groups_changed_after_wrapping_are_refused_at_the_next_backward(change):
    """A parameter put into (or taken out of) the groups after wrapping has no host state:
    it would never be stepped (torch would step it). The next backward raises; with the
    groups restored, training goes on."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    step_with(model, off, 0)
    saved = [dict(group, params=list(group["params"])) for group in off.param_groups]
    CHANGED_GROUPS[change](off.param_groups, nn.Parameter(torch.zeros(2)))
    with pytest.raises(RuntimeError, match="param_groups no longer hold the parameters"):
        step_with(model, off, 1)
    off.param_groups[:] = [off.param_groups[g] for g in range(len(saved))]
    for group, before in zip(off.param_groups, saved):
        group["params"] = before["params"]
    steps = {n: rec.step for n, rec in named(model, off).items()}
    with pytest.warns(RuntimeWarning, match="raised"):
        step_with(model, off, 2)
    assert named(model, off)["l1.weight"].step == steps["l1.weight"] + 1
    off.close()


MORE_CHANGED_GROUPS = {
    **CHANGED_GROUPS,
    "a group removed": lambda groups, new: groups.pop(),
    "an empty group put first": lambda groups, new: groups.insert(0, {"params": []}),
}


@pytest.mark.parametrize("change", MORE_CHANGED_GROUPS)
def test_param_groups_changed_between_two_passes_of_a_window_are_refused_before_the_last_one_steps(change):
    """The parameters were checked only at a window's first pass: changed between two passes,
    the last one stepped its chunks with another group's hyper-parameters, or its worker failed
    with an IndexError, before step() said what was wrong. The last pass now refuses them,
    before any chunk is stepped."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=2, **SMALL)
    step_with(model, off, 0)
    x = torch.randn(2, 24, dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    MORE_CHANGED_GROUPS[change](off.param_groups, nn.Parameter(torch.zeros(2)))
    steps = [rec.step for rec in records_of(off)]
    with pytest.raises(RuntimeError, match="param_groups no longer hold the parameters"):
        model(x).float().pow(2).mean().backward()
    assert [rec.step for rec in records_of(off)] == steps  # nothing stepped
    with pytest.warns(RuntimeWarning):
        off.zero_grad()
    off.close()


def test_worker_error_surfaces_with_names(monkeypatch):
    def boom(*args, **kwargs):
        raise ValueError("injected kernel failure")
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=2, **SMALL)
    monkeypatch.setattr(runner_mod.kernels, "accumulate_", boom)
    x = torch.randn(2, 24, dtype=torch.bfloat16)
    # The worker fails accumulating micro-batch 0; a later hook (waiting for a
    # slot in this backward, or the next backward's first hook) reports it.
    with pytest.raises(RuntimeError, match=r"worker failed on chunk \d+ \(micro-batch 0, accumulation\) "
                                           r"with parameters \[param_groups.*injected kernel failure"):
        for _ in range(2):
            model(x).sum().backward()
    with pytest.warns(RuntimeWarning, match="discarded"):
        off.step()  # raised once; the window it hit is closed and nothing was stepped
    assert all(r.step == 0 for r in records_of(off))
    off.close()


def slow_adamw(monkeypatch, seconds):
    """Make every AdamW kernel call of the worker take ``seconds`` longer."""
    import time
    real = runner_mod.kernels.adamw_step

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)
    monkeypatch.setattr(runner_mod.kernels, "adamw_step", slow)


def test_timeout_has_pipeline_diagnostic(monkeypatch):
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, timeout_s=0.1, **SMALL)
    slow_adamw(monkeypatch, 0.5)
    with pytest.raises(TimeoutError, match=r"(?s)timed out after .*pipeline: micro-batch .*d2h ring \[.*h2d ring"):
        model(torch.randn(2, 24, dtype=torch.bfloat16)).sum().backward()
        off.step()
    monkeypatch.undo()  # NOTE: close() recovers the window first: its drain must end within the timeout
    time.sleep(0.6)  # the kernel call still sleeping
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        off.close()


TIMEOUT_CASES = {
    "no wait at all": dict(kernel_s=0.0, timeout_s=1e-9, ring=SMALL),
    "a slow kernel": dict(kernel_s=0.3, timeout_s=0.1, ring=SMALL),
    # one slot smaller than l2.weight: the hook times out in the middle of staging it
    "a parameter over two slots": dict(kernel_s=0.3, timeout_s=0.1, ring=dict(num_slots=1, pinned_bytes=2 * 4096)),
    "a Ctrl-C while the recovery waits": dict(kernel_s=0.3, timeout_s=0.1, ring=SMALL, sigint_after_s=0.15),
    # slots for every gradient: no hook waits, the drain at the end of backward times out
    "the drain at the end of backward": dict(kernel_s=0.3, timeout_s=0.1, ring=dict(pinned_bytes=1 << 20)),
}


@pytest.mark.parametrize("case", list(TIMEOUT_CASES))
def test_a_timeout_in_backward_leaves_each_step_count_with_its_master(monkeypatch, sigint_raises, case):
    """A TimeoutError out of backward abandoned the window while chunks were still queued; the
    worker stepped them afterwards, so masters, moments and weights changed and no step was
    counted (the next step's bias correction one step off), and step() said nothing had been
    updated. A parameter whose staging the timeout cut was dropped half stepped, and a Ctrl-C
    in the recovery's wait left the queued chunks to run later too. Now the recovery runs every
    chunk queued and the rest of a cut parameter, whole: a parameter's count grows exactly when
    its master changed, and the error or a warning says how many took the step (a timeout in the
    drain at the end of backward said nothing). A larger timeout_s set on the optimizer then
    applies to the next steps."""
    import signal
    import threading
    c = TIMEOUT_CASES[case]
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, timeout_s=c["timeout_s"], **c["ring"])
    if c["kernel_s"]:
        slow_adamw(monkeypatch, c["kernel_s"])
    before = {n: (rec.master.clone(), rec.step) for n, rec in named(model, off).items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TimeoutError) as info:
            model(torch.randn(2, 24, dtype=torch.bfloat16)).sum().backward()
        if "sigint_after_s" in c:
            threading.Timer(c["sigint_after_s"], lambda: os.kill(os.getpid(), signal.SIGINT)).start()
            with pytest.raises(KeyboardInterrupt):  # delivered once the recovery is whole
                off.zero_grad()
                time.sleep(10)  # (if the recovery ended first, the Ctrl-C lands here)
        else:
            off.zero_grad()
        time.sleep(2 * c["kernel_s"])  # whatever the worker might still run would have run by now
    monkeypatch.undo()
    assert not off._pipeline.in_flight
    stepped = 0
    for n, rec in named(model, off).items():
        master, step = before[n]
        changed = not torch.equal(rec.master, master)
        assert rec.step == step + changed, (n, rec.step, changed)
        assert torch.equal(rec.param.detach().reshape(-1), rec.master.to(torch.bfloat16)), n
        stepped += changed
    said = [str(w.message) for w in caught] + list(getattr(info.value, "__notes__", []))
    if "sigint_after_s" not in c:  # NOTE: else the recovery ends with the KeyboardInterrupt, not the warning
        assert any(f"{stepped} of {len(records_of(off))} parameters had their update applied" in s for s in said), said
    counts = {n: rec.step for n, rec in named(model, off).items()}
    off.timeout_s = 60.0  # the next steps wait as long as they need
    off.zero_grad()
    model(torch.randn(2, 24, dtype=torch.bfloat16)).sum().backward()
    off.step()
    assert named(model, off)["l1.weight"].step == counts["l1.weight"] + 1
    with pytest.raises(ValueError, match="timeout_s must be a number > 0"):
        off.timeout_s = 0
    off.close()


@pytest.mark.parametrize("unscale_first", [False, True])
def test_a_grad_scaler_step_is_refused_saying_why_and_what_to_do(unscale_first):
    """torch.amp.GradScaler cannot work here (the update runs during backward, on the scaled
    gradients). scaler.step(opt) raised torch's "No inf checks were recorded for this
    optimizer"; it now raises saying why and what to do, and leaves the window for step()."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randn(2, 24, dtype=torch.bfloat16)).float().sum()).backward()
    if unscale_first:
        scaler.unscale_(off)
    with pytest.raises(RuntimeError, match=r"torch.amp.GradScaler does not work with offload='full'.*drop the scaler"):
        scaler.step(off)
    assert not hasattr(off, "found_inf") and not hasattr(off, "grad_scale")  # nothing of the scaler's is left
    steps = [r.step for r in records_of(off)]
    off.step()  # the window closes as without the scaler
    off.zero_grad()
    assert [r.step for r in records_of(off)] == steps
    model(torch.randn(2, 24, dtype=torch.bfloat16)).float().sum().backward()
    off.step()
    off.close()


BAD_OPTIONS = [
    *[pytest.param(name, bad, error, id=f"{name}={bad!r}") for name, bad, error in [
        ("timeout_s", float("inf"), ValueError), ("timeout_s", 1e30, ValueError), ("timeout_s", 0, ValueError),
        ("sysfs_root", None, TypeError), ("sysfs_root", 3, TypeError),
        ("keep_fp32", None, TypeError), ("keep_fp32", "l1.weight", TypeError), ("keep_fp32", ["l1.weight"], TypeError),
    ]],
    pytest.param("keep_fp32", lambda m: m.l1.weight, TypeError, id="keep_fp32=one parameter, not a list"),
    pytest.param("keep_fp32", lambda m: [m.l1.weight.detach().clone()], ValueError, id="keep_fp32=[a copy]"),
]


@pytest.mark.parametrize("name,bad,error", BAD_OPTIONS)
def test_bad_options_are_refused_naming_the_argument(name, bad, error):
    model, opt = build("adamw")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=name):
        FullCPUOffloadOptimizer(opt, **{name: bad(model) if callable(bad) else bad}, **SMALL)
    for key, value in model.state_dict().items():  # nothing changed
        assert value.dtype == torch.float32 and torch.equal(value, before[key]), key


def test_num_slots_alone_that_would_exceed_the_pinned_default_is_refused():
    # Slots are at least 4 KiB: a million of them took 8 GB of pinned memory, past the default cap.
    model, opt = build("adamw")
    with pytest.raises(ValueError, match=r"num_slots=1000000 needs at least 8192000000 bytes of pinned staging"):
        FullCPUOffloadOptimizer(opt, num_slots=10**6)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    FullCPUOffloadOptimizer(opt, num_slots=8).close()  # within the default: taken


def test_keep_fp32_takes_a_generator_of_the_optimizers_parameters():
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, keep_fp32=(p for n, p in model.named_parameters() if n == "extra"), **SMALL)
    assert model.extra.dtype == torch.float32 and model.l1.weight.dtype == torch.bfloat16
    off.close()


@pytest.mark.parametrize("key,bad,error", [("amsgrad", True, ValueError), ("maximize", True, ValueError),
                                           ("capturable", True, ValueError), ("lr", "0.01", TypeError),
                                           ("decoupled_weight_decay", False, ValueError),
                                           ("decoupled_weight_decay", 0, ValueError),
                                           ("decoupled_weight_decay", np.False_, ValueError),
                                           ("decoupled_weight_decay", torch.tensor(False), ValueError),
                                           ("betas", (0.9,), ValueError), ("betas", (0.9, 0.95, 0.5), ValueError),
                                           ("lr", torch.tensor(0.01, device="meta"), ValueError)])
def test_a_group_option_set_after_wrapping_is_refused_at_the_next_backward(key, bad, error):
    """Setting an option full offload cannot honour in a live group (a user, a scheduler)
    raises at the next backward, before anything is stepped; undone, training goes on as if
    the refused pass had never run."""
    runs = []
    for refuse in (True, False):
        model, opt = build("adamw")
        off = FullCPUOffloadOptimizer(opt, **SMALL)
        step_with(model, off, 0)
        if refuse:
            good = off.param_groups[1][key]
            off.param_groups[1][key] = bad
            with pytest.raises(error, match=rf"param_groups\[1\].*{key}|{key}.*param_groups\[1\]"):
                step_with(model, off, 1)
            off.param_groups[1][key] = good
            with pytest.warns(RuntimeWarning, match="raised"):
                step_with(model, off, 2)
        else:
            step_with(model, off, 2)
        step_with(model, off, 3)
        runs.append({n: (rec.step, rec.master.clone()) for n, rec in named(model, off).items()})
        off.close()
    refused, plain = runs
    for n, (step, master) in plain.items():
        assert refused[n][0] == step and torch.equal(refused[n][1], master), n


# torch's Adam and AdamW test decoupled_weight_decay for truth: any false value is Adam's L2 penalty
FALSE_DECOUPLING = {"False": False, "0": 0, "np.False_": np.False_, "tensor(False)": torch.tensor(False), "None": None}
TRUE_DECOUPLING = {"1": 1, "np.True_": np.True_, "tensor(True)": torch.tensor(True)}


@pytest.mark.parametrize("value", FALSE_DECOUPLING.values(), ids=FALSE_DECOUPLING.keys())
def test_decoupled_weight_decay_false_by_truth_is_refused_at_construction(value):
    """A false value other than ``False`` makes torch run Adam's L2 penalty as ``False`` does: it
    is refused alike. Before, only ``is False`` was, and full offload ran decoupled decay."""
    model, opt = build("adamw")
    opt.param_groups[1]["decoupled_weight_decay"] = value
    with pytest.raises(ValueError, match=r"decoupled_weight_decay=.*\(param_groups\[1\]\).*L2 penalty"):
        FullCPUOffloadOptimizer(opt, **SMALL)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing changed


@pytest.mark.parametrize("value", TRUE_DECOUPLING.values(), ids=TRUE_DECOUPLING.keys())
def test_decoupled_weight_decay_true_by_truth_steps_as_true(value):
    """A true value other than ``True`` is AdamW's decoupled decay to torch, and steps as ``True``."""
    runs = []
    for decoupled in (True, value):
        model, opt = build("adamw")
        for group in opt.param_groups:
            group["decoupled_weight_decay"] = decoupled
        off = FullCPUOffloadOptimizer(opt, **SMALL)
        step_with(model, off, 0)
        step_with(model, off, 1)
        runs.append({n: rec.master.clone() for n, rec in named(model, off).items()})
        off.close()
    for n, master in runs[0].items():
        assert torch.equal(runs[1][n], master), n


@pytest.mark.parametrize("source,option", [
    (lambda groups: torch.optim.AdamW(groups, amsgrad=True), "amsgrad=True"),
    (lambda groups: torch.optim.Adam(groups, weight_decay=0.1), "decoupled_weight_decay=False"),  # L2, not AdamW's
])
def test_loading_a_checkpoint_with_an_option_full_offload_cannot_honour_changes_nothing(source, option):
    """A torch AdamW(amsgrad=True) or Adam(weight_decay > 0) checkpoint: refused at
    load_state_dict, naming the option."""
    model, opt = build("adamw")
    source = source([{"params": g["params"], "lr": g["lr"]} for g in build("adamw")[1].param_groups])
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    step_with(model, off, 0)
    before = copy.deepcopy(off.state_dict())
    saved = copy.deepcopy(source.state_dict())
    saved["param_groups"][0]["lr"] = 0.5
    with pytest.raises(ValueError, match=rf"state_dict: .*{option}.*\(param_groups\[0\]\)"):
        off.load_state_dict(saved)
    after = off.state_dict()
    assert [g["lr"] for g in after["param_groups"]] == [g["lr"] for g in before["param_groups"]]
    for i, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(after["state"][i][key]), torch.as_tensor(value)), (i, key)
    step_with(model, off, 1)  # and the optimizer trains on


@pytest.mark.parametrize("betas", [(0.9,), (0.9, 0.95, 0.5), 0.9])
def test_loading_betas_of_the_wrong_length_changes_nothing(betas):
    """betas must be two numbers: one was refused only inside the CPU worker (KeyError
    'beta2'), three trained silently where torch's AdamW raises at step(). Refused at
    load_state_dict, naming the group and key, before anything changes; the optimizer trains on."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    step_with(model, off, 0)
    before = copy.deepcopy(off.state_dict())
    saved = copy.deepcopy(before)
    saved["param_groups"][0]["betas"] = betas
    saved["param_groups"][1]["lr"] = 0.5
    with pytest.raises(ValueError, match=r"state_dict: param_groups\[0\]\['betas'\]"):
        off.load_state_dict(saved)
    after = off.state_dict()
    assert [(g["betas"], g["lr"]) for g in after["param_groups"]] == \
        [(g["betas"], g["lr"]) for g in before["param_groups"]]
    for i, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(after["state"][i][key], value), (i, key)
    step_with(model, off, 1)  # and the optimizer trains on
    stepped = off.state_dict()["state"]
    assert any(stepped[i]["step"] > entry["step"] for i, entry in before["state"].items())
    off.close()


def test_close_is_idempotent_and_removes_hooks():
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    off.close()
    off.close()
    model(torch.randn(2, 24, dtype=torch.bfloat16)).sum().backward()
    assert model.l1.weight.grad is not None  # no hook consumed it
    with pytest.raises(RuntimeError, match="closed"):
        off.step()


@pytest.mark.parametrize("read", ["state_dict", "state"])
def test_reading_the_state_of_a_closed_optimizer_says_to_take_state_dict_before_close(read):
    """The fp32 masters are the only fp32 copy of the weights; a run that called close()
    before saving got "this FullCPUOffloadOptimizer is closed" and no way out named."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    off.close()
    with pytest.raises(RuntimeError, match=r"closed: take opt.state_dict\(\) \(the fp32 masters and moments\) "
                                           r"before close\(\)"):
        off.state_dict() if read == "state_dict" else off.state[model.l1.weight]["master"]


def test_close_in_the_middle_of_an_accumulation_window_says_it_drops_it():
    """close() after 1 of 3 backward passes dropped the accumulated gradients without a word."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=3, **SMALL)
    masters = [r.master.clone() for r in records_of(off)]
    model(torch.randn(2, 24, dtype=torch.bfloat16)).float().sum().backward()
    with pytest.warns(RuntimeWarning, match=r"close\(\) dropped an open accumulation window \(1 of 3 backward "
                                            r"passes\).*call step\(\) first"):
        off.close()
    assert all(torch.equal(r.master, m) and r.step == 0 for r, m in zip(records_of(off), masters))
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=3, **SMALL)
    model(torch.randn(2, 24, dtype=torch.bfloat16)).float().sum().backward()
    off.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off.close()  # nothing open: nothing said


def test_closure_and_lr_change_apply_to_next_step():
    model, opt = build("sign_sgd")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    rec = named(model, off)["l1.bias"]
    x = torch.randn(2, 24, dtype=torch.bfloat16)
    loss = off.step(lambda: model(x).float().sum().backward() or torch.tensor(1.0))
    assert loss.item() == 1.0
    for g in off.param_groups:
        g["lr"] = 0.0
        g["weight_decay"] = 0.0
    before = rec.master.clone()
    model(x).float().sum().backward()
    off.step()
    assert torch.equal(rec.master, before)


@pytest.mark.parametrize("edit,words", [
    (lambda sd: sd.update(state=[]), r"state_dict\['state'\] must be a dict"),
    (lambda sd: sd["param_groups"][0].update(params=5), r"state_dict\['param_groups'\]\[0\] must be a dict with a list 'params'"),
    (lambda sd: [g.update(late_hyperparameters=[True]) for g in sd["param_groups"]],
     r"param_groups\[0\]\['late_hyperparameters'\] must be True or False"),
    (lambda sd: [g.update(speculation_factor=torch.ones(2)) for g in sd["param_groups"]],
     r"param_groups\[0\]\['speculation_factor'\] must be a number or a one-element tensor"),
    (lambda sd: sd["param_groups"][1].update(lr=torch.tensor(0.1, device="meta")),
     r"param_groups\[1\]\['lr'\]: cannot read the value of this meta tensor"),
], ids=["state a list", "params an int", "late flag a list", "factor of two elements", "lr on the meta device"])
def test_a_malformed_state_dict_is_refused_naming_the_key_before_anything_changes(edit, words):
    """These raised Python's own errors naming nothing (no attribute 'get', no len(), unhashable
    type, a tensor that cannot be converted to a Scalar, item() of a meta tensor). A ValueError
    names the key now, before anything changes; the optimizer trains on."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    step_with(model, off, 0)
    before, weights = snapshot(off), copy.deepcopy(model.state_dict())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in off.param_groups]
    saved = copy.deepcopy(off.state_dict())
    for entry in saved["state"].values():  # a partial write would show
        entry["exp_avg"] = entry["exp_avg"] + 1
    edit(saved)
    with pytest.raises(ValueError, match=words):
        off.load_state_dict(saved)
    assert_same_state(snapshot(off), before)
    assert all(torch.equal(value, weights[key]) for key, value in model.state_dict().items())
    assert [{k: v for k, v in g.items() if k != "params"} for g in off.param_groups] == groups
    step_with(model, off, 1)  # and the optimizer trains on
    assert any(rec.step > before[rec.name][3] for rec in records_of(off))
    off.close()


def test_deepcopy_of_state_dict_is_snapshot():
    model, off, _, _ = run("adamw", 1, 1, **SMALL)
    snap = copy.deepcopy(off.state_dict())
    model(torch.randn(2, 24, dtype=torch.bfloat16)).sum().backward()
    off.step()
    rec = named(model, off)["l1.weight"]
    assert not torch.equal(snap["state"][rec.index]["master"], rec.master.view(rec.shape))


def test_load_state_dict_is_atomic_and_names_the_entry():
    model, off, _, _ = run("adamw", 1, 2, **SMALL)
    good = copy.deepcopy(off.state_dict())
    before = copy.deepcopy(off.state_dict())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    last = max(good["state"])
    rec = next(r for r in records_of(off) if r.index == last)
    with FakeTensorMode():
        fake = torch.zeros(rec.shape)
    bad_cases = [
        (lambda e: e.pop("step"), ValueError, "has no 'step'"),
        (lambda e: e.pop("exp_avg_sq"), ValueError, "has no 'exp_avg_sq'"),
        (lambda e: e.__setitem__("exp_avg", torch.zeros(rec.numel + 1)), ValueError, "local shape"),
        (lambda e: e.__setitem__("master", torch.zeros(3, rec.numel)), ValueError, "local shape"),
        (lambda e: e.__setitem__("step", torch.tensor(-1.0)), ValueError, "non-negative whole number"),
        (lambda e: e.__setitem__("exp_avg", [0.0]), TypeError, "must be a tensor"),
        # NOTE: tensors without values passed the checks; the copy then failed after earlier entries were written
        (lambda e: e.__setitem__("exp_avg_sq", torch.zeros(rec.shape, device="meta")), ValueError, "holds no values"),
        (lambda e: e.__setitem__("exp_avg", fake), ValueError, "holds no values"),
    ]
    for corrupt, exc, match in bad_cases:
        sd = copy.deepcopy(good)
        for entry in sd["state"].values():  # every other entry changed: a partial write would show
            entry["step"] = torch.tensor(99.0)
            entry["exp_avg"] = entry["exp_avg"] + 1
        corrupt(sd["state"][last])
        with pytest.raises(exc, match=rf"state_dict\['state'\]\[{last}\].*\({rec.name}\).*{match}|{match}"):
            off.load_state_dict(sd)
        now = off.state_dict()
        for i, entry in before["state"].items():
            assert all(torch.equal(entry[k], now["state"][i][k]) for k in entry), i
        assert all(torch.equal(p.detach(), weights[n]) for n, p in model.named_parameters())


def test_plain_adamw_checkpoint_takes_masters_from_current_weights():
    torch.manual_seed(0)
    plain_model = Net()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    plain_model(torch.randn(4, 24)).pow(2).mean().backward()
    plain.step()
    model, opt = build("adamw")
    model.load_state_dict(plain_model.state_dict())
    off = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **SMALL)
    off.load_state_dict(plain.state_dict())
    with torch.no_grad():
        model.l1.bias.add_(1.0)  # weights changed after the load win at the next state_dict()
    bias = next(r for r in records_of(off) if r.param is model.l1.bias)
    assert torch.equal(off.state_dict()["state"][bias.index]["master"], model.l1.bias.detach().float())
    with torch.no_grad():
        model.l1.bias.sub_(1.0)
    off.state_dict()
    for rec in records_of(off):
        if rec is bias:
            continue
        src = plain_model.get_parameter(next(n for n, p in model.named_parameters() if p is rec.param))
        assert torch.equal(rec.master.view(rec.shape), src.detach())  # wrapped from the fp32 weights
        if src in plain.state:
            assert torch.equal(rec.exp_avg.view(rec.shape), plain.state[src]["exp_avg"]) and rec.step == 1
        else:
            assert rec.step == 0 and not rec.exp_avg.any()


def test_state_dict_hooks_run_like_torch():
    model, off, _, _ = run("adamw", 1, 1, **SMALL)
    calls = []
    off.register_state_dict_pre_hook(lambda opt: calls.append(("pre", opt is off)))
    off.register_state_dict_post_hook(lambda opt, sd: calls.append(("post", "state" in sd)) or {**sd, "extra": 1})
    off.register_load_state_dict_pre_hook(
        lambda opt, sd: calls.append(("load_pre", sd.get("extra"))) or {k: v for k, v in sd.items() if k != "extra"})
    off.register_load_state_dict_post_hook(lambda opt: calls.append(("load_post", opt is off)))
    sd = off.state_dict()
    assert sd["extra"] == 1
    off.load_state_dict(sd)
    assert calls == [("pre", True), ("post", True), ("load_pre", 1), ("load_post", True)]


def test_hooks_registered_on_the_torch_optimizer_before_wrapping_run_once():
    """Full offload never calls the torch optimizer's step() or state-dict methods, so the
    hooks registered on it before wrapping never ran, without a word (the default mode runs
    them). They run once, around the wrapper's, and a handle from either removes its hook."""
    model, opt = build("adamw")
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("step_pre", o)))
    post = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("step_post", o)))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append(("state_dict_post", o)))
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load_state_dict_post", o)))
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    model(torch.randn(2, 24, dtype=torch.bfloat16)).float().sum().backward()
    off.step()
    off.load_state_dict(off.state_dict())
    assert calls == [("step_pre", off), ("step_post", off), ("state_dict_post", off), ("load_state_dict_post", off)]
    post.remove()
    extra = off.register_step_post_hook(lambda o, args, kwargs: calls.append(("wrapper_post", o)))
    calls.clear()
    model(torch.randn(2, 24, dtype=torch.bfloat16)).float().sum().backward()
    off.step()
    assert calls == [("step_pre", off), ("wrapper_post", off)]
    off.close()  # NOTE: ``extra`` not removed: a hook registered on the wrapper ends with it
    model.float()
    again = FullCPUOffloadOptimizer(opt, **SMALL)
    calls.clear()
    model(torch.randn(2, 24, dtype=torch.bfloat16)).float().sum().backward()
    again.step()
    assert calls == [("step_pre", again)]
    again.close()
    model.float()
    calls.clear()
    model(torch.randn(2, 24)).sum().backward()
    opt.step()  # the torch optimizer on its own again: its own hook only
    assert calls == [("step_pre", opt)] and extra.id not in opt._optimizer_step_post_hooks


def test_step_blocked_counts_the_tail_after_backward(monkeypatch):
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    slow_adamw(monkeypatch, 0.05)
    model(torch.randn(2, 24, dtype=torch.bfloat16)).float().sum().backward()
    off.step()
    # the last chunk is queued when backward ends, so the loop waits at least its kernel
    assert off.stats()["step_blocked_s"] >= 0.05
    assert off.stats()["kernel_s"] >= 0.05 * off.stats()["chunks"]


def test_each_step_writes_the_new_weights_into_the_parameters_storage_of_that_step():
    # A chunk layout's plan is reused from step to step; the destination of its weight
    # copies is looked up each time (whole parameters, and pieces of l2's weight, which
    # SMALL's slots split): a
    # parameter given new storage between steps receives the next step's weights there.
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    recs = named(model, off)
    for _ in range(3):
        model(torch.randn(2, 24, dtype=torch.bfloat16)).float().sum().backward()
        off.step()
        off.zero_grad()
        for p in model.parameters():
            p.data = p.data.clone()
    model(torch.randn(2, 24, dtype=torch.bfloat16)).float().sum().backward()
    off.step()
    for n, rec in recs.items():
        assert rec.step == (0 if n in ("unused", "extra") else 4), n
        assert torch.equal(rec.param.detach(), rec.master.view(rec.shape).to(torch.bfloat16)), n
    off.close()


def test_the_worker_issues_a_chunks_weight_copies_before_it_frees_the_chunks_gradient_slot(monkeypatch):
    # Freeing the slot wakes a gradient hook waiting for one, and the main thread would then
    # hold the GIL the worker needs to issue the copies: the worker issues them first.
    # Its time on them counts as worker_overhead_s, not as kernel time.
    import time
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    order = []
    transfer, runner = worker_parts_of(off)
    real_copies, real_release = transfer.h2d_copies, runner._release

    def slow_copies(dsts, srcs, after=None):
        time.sleep(0.02)
        order.append("copies issued")
        return real_copies(dsts, srcs, after)

    def release(chunk):
        if chunk.slot is not None and chunk.slot.owner == chunk.seq:
            order.append("slot freed")
        return real_release(chunk)
    monkeypatch.setattr(transfer, "h2d_copies", slow_copies)
    monkeypatch.setattr(runner, "_release", release)
    model(torch.randn(2, 24, dtype=torch.bfloat16)).float().sum().backward()
    off.step()
    st = off.stats()
    assert st["chunks"] > SMALL["num_slots"] + 1
    assert order == ["copies issued", "slot freed"] * st["chunks"]
    assert st["worker_overhead_s"] >= 0.02 * st["chunks"] > st["kernel_s"]


def test_slot_waits_show_a_backward_held_up_by_the_worker(monkeypatch):
    # With 2 staging slots and a kernel slower than the gradients arrive, backward waits
    # for a free slot at least (chunks - slots) kernels minus the first; a fast kernel
    # leaves it free.
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    model(torch.randn(2, 24, dtype=torch.bfloat16)).float().sum().backward()
    off.step()
    fast = off.stats()
    assert fast["slot_wait_s"] < 0.05 and fast["chunks"] > SMALL["num_slots"] + 1
    slow_adamw(monkeypatch, 0.05)
    off.zero_grad()
    model(torch.randn(2, 24, dtype=torch.bfloat16)).float().sum().backward()
    off.step()
    st = off.stats()
    assert st["slot_wait_s"] >= 0.05 * (st["chunks"] - SMALL["num_slots"] - 1)
    assert st["kernel_s"] >= 0.05 * st["chunks"] and st["grad_wait_s"] >= 0.0 and st["h2d_slot_wait_s"] >= 0.0


def test_the_steady_state_validates_only_new_plans(monkeypatch):
    # The worker cycles over every chunk plan's kernel calls each step, and the slots a chunk
    # gets rotate, so a model of many chunks uses more tensor lists than a small LRU cache of
    # validated lists holds; every call would then validate its lists from scratch. Once
    # the plans exist, a kernel call validates only the lists of a plan built for it.
    from cpu_offload import kernels
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(201)))
    slot = 2 * 64 * 64 * 2 + 4096  # two weights and their biases per chunk
    off = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), pinned_bytes=8 * slot, num_slots=4)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    runner = worker_parts_of(off)[1]
    validated, new_calls = [0], [0]
    real_check, real_build = kernels._check_list, runner._build_plan

    def check_list(name, *args, **kwargs):
        validated[0] += name in ("params", "accumulators")  # one per validation of a call's lists
        return real_check(name, *args, **kwargs)

    def build_plan(*args):
        plan = real_build(*args)
        new_calls[0] += len(plan.optimizer_calls) + len(plan.accumulate_calls)
        return plan
    monkeypatch.setattr(kernels, "_check_list", check_list)
    monkeypatch.setattr(runner, "_build_plan", build_plan)
    for _ in range(12):
        model(x).float().pow(2).mean().backward()
        off.step()
        off.zero_grad()
    assert new_calls[0] > 256  # more lists than a cache of the old size held
    late_validated, late_new = validated[0], new_calls[0]
    for _ in range(4):
        model(x).float().pow(2).mean().backward()
        off.step()
        off.zero_grad()
    assert off.stats()["chunks"] > 30
    assert validated[0] - late_validated == new_calls[0] - late_new
    off.close()


def test_copying_or_pickling_full_offload_is_refused_with_a_clear_error():
    """A deepcopy gave an object that failed at its first use on a private attribute."""
    import copy
    import io
    import pickle

    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    for how in (copy.deepcopy, pickle.dumps, lambda o: torch.save(o, io.BytesIO())):
        with pytest.raises(TypeError, match="cannot be copied or pickled .* save opt.state_dict"):
            how(off)
    off.close()


def test_a_step_with_no_gradient_since_the_last_one_says_so_once():
    """PEFT's load_adapter (HF Trainer's resume) replaces bf16 adapters by new fp32
    parameters: the optimizer kept its old ones, got no gradient, and every step did nothing
    without a word. Such a step now warns (once), naming the likely cause."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    x = torch.randn(2, 24, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    off.step()
    off.zero_grad()
    with torch.no_grad():  # the parameters replaced, as PEFT's cast to fp32 replaces them
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, torch.nn.Parameter(p.detach().float()))
    steps = [r.step for r in records_of(off)]
    with pytest.warns(RuntimeWarning, match=r"no gradient for any .* parameters .*\(PEFT's load_adapter"):
        model(x.float()).sum().backward()
        off.step()
    off.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x.float()).sum().backward()
        off.step()
    assert [r.step for r in records_of(off)] == steps
    off.close()


@pytest.mark.parametrize("k", [1, 2])
def test_backward_after_step_without_zero_grad_says_that_gradients_do_not_build_up_across_steps(k):
    """torch adds the next backward's gradients to the .grad the last step() left, when no
    zero_grad() came between; full offload keeps no gradient after step(), so such a loop
    trains on each window's own gradients. It used to say nothing; now it warns, once."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=k, **SMALL)
    x = torch.randn(2, 24, dtype=torch.bfloat16)

    def window():
        for _ in range(k):
            model(x).float().sum().backward()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for clear in (lambda: off.zero_grad(), lambda: model.zero_grad(),
                      lambda: off.zero_grad(set_to_none=False)):
            clear()  # before the backward, or after step(): torch's .grad then starts from none (or zeros)
            window()
            off.step()
        off.zero_grad()
        window()  # the first window, here after a zero_grad(), as any window after one
        off.step()
    with pytest.warns(RuntimeWarning, match=r"backward\(\) after step\(\) with no zero_grad\(\) between.*"
                                            r"torch would add .* full offload .* steps each window on its own"):
        window()
    off.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        window()  # said once
        off.step()
    off.close()


def test_a_weight_shared_by_reentrant_checkpoint_segments_is_refused_naming_the_remedy():
    """A layer shared by two segments under torch.utils.checkpoint(use_reentrant=True): each
    segment's nested backward hands over part of its gradient. The error said a backward had
    been interrupted; it now names the checkpointing and what to use instead, which trains
    it as torch does."""
    import torch.utils.checkpoint as cp

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.shared, self.out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

        def forward(self, x, reentrant):
            h = self.inp(x)
            for _ in range(2):
                h = cp.checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=reentrant)
            return self.out(h)

    torch.manual_seed(0)
    model = Shared()
    reference = copy.deepcopy(model)
    off = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **SMALL)
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match=r"gradient of param_groups\[0\]\[[23]\] arrived twice .* reentrant "
                                           r"activation-checkpoint segment .* and again elsewhere in the same "
                                           r"backward .* use_reentrant=False"):
        model(x.bfloat16(), True).float().pow(2).mean().backward()
    with pytest.warns(RuntimeWarning, match="backward pass 1 of 1 raised"):  # what was stepped stays, as after any failure
        off.close()
    # The remedy it names: the same model, non-reentrant, steps as torch's AdamW on its gradients.
    model = copy.deepcopy(reference)
    grads = capture(model)  # the bf16 gradients, seen before full offload takes them
    off = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **SMALL)
    model(x.bfloat16(), False).float().pow(2).mean().backward()
    off.step()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    for n, p in reference.named_parameters():
        p.grad = grads[n][0]
    torch_opt.step()
    for n, p in reference.named_parameters():
        torch.testing.assert_close(off.state[dict(model.named_parameters())[n]]["master"], p.detach(),
                                   rtol=1e-6, atol=1e-7, msg=n)
    off.close()


def _gan_steps(freeze_d: bool, steps: int = 3):
    """The usual GAN loop with two full-offload optimizers: a discriminator step, then a
    generator step whose backward passes through the discriminator. Returns D, its
    optimizer, the warnings, and the gradients D's own steps handed over."""
    torch.manual_seed(0)
    gen_net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16))
    disc = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    init = {n: p.detach().clone() for n, p in disc.named_parameters()}
    d_grads = capture(disc)
    opt_g = FullCPUOffloadOptimizer(torch.optim.AdamW(gen_net.parameters(), lr=1e-2), **SMALL)
    opt_d = FullCPUOffloadOptimizer(torch.optim.AdamW(disc.parameters(), lr=1e-2), **SMALL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            real, z = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16)
            opt_d.zero_grad()
            fake = gen_net(z)
            ((disc(real).float() - 1).pow(2).mean() + disc(fake.detach()).float().pow(2).mean()).backward()
            opt_d.step()
            opt_g.zero_grad()
            disc.requires_grad_(not freeze_d)
            (disc(fake).float() - 1).pow(2).mean().backward()
            disc.requires_grad_(True)
            opt_g.step()
        opt_d.zero_grad()
    opt_g.close()
    return disc, opt_d, [str(w.message) for w in caught], init, d_grads


def test_a_gan_loop_that_freezes_the_discriminator_for_the_generators_backward_trains_it_as_torch():
    """In torch the generator's backward also fills the discriminator's .grad, which the next
    zero_grad() drops. Under full offload that backward steps the discriminator: the warning of
    a zero_grad() without step() now names this case and its remedy, which trains as torch."""
    disc, opt_d, said, _, _ = _gan_steps(freeze_d=False)
    assert [float(v["step"]) for v in opt_d.state_dict()["state"].values()] == [6.0] * 4  # torch: 3
    assert any("zero_grad() without step()" in m and "another loss's backward" in m and "requires_grad_(False)" in m
               for m in said), said
    opt_d.close()
    disc, opt_d, said, init, d_grads = _gan_steps(freeze_d=True)
    assert not [m for m in said if "cpu_offload" in m], said
    reference = {n: nn.Parameter(t.clone()) for n, t in init.items()}
    torch_opt = torch.optim.AdamW(reference.values(), lr=1e-2, foreach=False)
    for step in range(3):  # torch's AdamW on the same gradients, the discriminator's steps only
        for n, p in reference.items():
            p.grad = d_grads[n][step]
        torch_opt.step()
    params = dict(disc.named_parameters())
    for n, p in reference.items():
        assert float(opt_d.state[params[n]]["step"]) == 3.0
        torch.testing.assert_close(opt_d.state[params[n]]["master"], p.detach(), rtol=1e-6, atol=1e-7, msg=n)
    opt_d.close()


@pytest.mark.parametrize("numel", [2, 1])
def test_a_parameter_given_another_shape_through_data_is_refused_before_anything_changes(numel):
    # One element would broadcast into the master before the gradient's shape was refused.
    p, q = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    off = FullCPUOffloadOptimizer(torch.optim.AdamW([p, q], lr=1e-2), **SMALL)
    ((p.float() ** 2).sum() + (q.float() ** 2).sum()).backward()
    off.step()
    off.zero_grad()
    masters = [r.master.clone() for r in records_of(off)]
    with torch.no_grad():
        p.data = torch.full((numel,), 5.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\[0\] now has shape \({numel},\).* keeps it at shape "
                                         r"\(4,\)"):
        ((p.float() ** 2).sum() + (q.float() ** 2).sum()).backward()
    assert all(torch.equal(r.master, m) for r, m in zip(records_of(off), masters))
    with pytest.warns(RuntimeWarning, match="backward pass 1 of 1 raised; 0 of 2 parameters had their update"):
        off.close()


def test_parameters_on_the_meta_device_are_refused_naming_them():
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"parameter param_groups\[0\]\[0\] is on the meta device"):
        FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()))


def test_parameters_sharing_memory_are_refused_naming_both():
    # torch steps both through one memory; full offload would give each its own master and
    # compute copy, untying them.
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.empty(4))
    b.data = a.data
    with pytest.raises(ValueError, match=r"parameters param_groups\[0\]\[0\] and param_groups\[0\]\[1\] share memory"):
        FullCPUOffloadOptimizer(torch.optim.AdamW([a, b]))
    assert a.dtype == torch.float32  # nothing was cast
    flat = torch.randn(8)
    c, d = nn.Parameter(flat[:4]), nn.Parameter(flat[4:])  # views of one buffer that do not overlap: fine
    FullCPUOffloadOptimizer(torch.optim.AdamW([c, d])).close()


def test_a_loaded_state_dict_stays_the_callers_as_torch_copies_the_saved_groups():
    # A 0-d tensor lr, which LR schedulers change in place: the live group must not share it
    # with the state_dict loaded (a snapshot kept to roll back to, or a second optimizer).
    model = nn.Linear(8, 4)
    off = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01)), **SMALL)
    sched = torch.optim.lr_scheduler.StepLR(off, step_size=1, gamma=0.1)
    snapshot = copy.deepcopy(off.state_dict())
    for _ in range(2):
        off.load_state_dict(snapshot)
        assert float(off.param_groups[0]["lr"]) == float(torch.tensor(0.01))
        model(torch.randn(16, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        off.step()
        off.zero_grad()
        sched.step()
        assert float(snapshot["param_groups"][0]["lr"]) == float(torch.tensor(0.01))
    off.close()


def test_a_scheduler_built_on_the_torch_optimizer_before_wrapping_steps_its_lr_without_a_false_warning():
    # The common order: optimizer and scheduler built, then the optimizer wrapped. The
    # scheduler watches the torch optimizer's step(), which the wrapper does not call.
    model = nn.Linear(8, 4)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda epoch: 0.5 ** epoch)
    off = FullCPUOffloadOptimizer(adamw, **SMALL)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for _ in range(3):
            model(torch.randn(16, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            lrs.append(off.param_groups[0]["lr"])
            off.step()
            off.zero_grad()
            sched.step()
    assert lrs == [0.01, 0.005, 0.0025]
    off.close()
