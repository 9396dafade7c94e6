# Accumulation windows whose length is set per step (grad_accum_steps), and
# scale_grads_ before or after the last backward: the loop of RL/SFT trainers
# (a varying number of micro-batches, a divide factor, clipping, step) against
# torch.optim.AdamW fed the same gradients.
import pytest
import torch

from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from helpers import (HALF_STATE, SMALL, batches, build, capture, check_stepped_once, count_rollbacks, fp32_reference,
                     normwise, records_of, snapshot, train_step, watch_rollbacks)

COUNTS = [1, 3, 2, 5]  # micro-batches per step
CLIP = 0.3


def micro_batch(step, m):
    return torch.randn(4, 24, generator=torch.Generator().manual_seed(100 * step + m))


def divide_factor(count):
    return 1.0 / (count * 4)  # e.g. one over the step's tokens


def loop_step(model, off, step, count, *, announce: bool):
    """One step of the trainer's loop; ``announce``: the factor is given before the backward passes."""
    off.grad_accum_steps = count
    if announce:
        off.scale_grads_(divide_factor(count))
    for m in range(count):
        model(micro_batch(step, m).to(torch.bfloat16)).float().pow(2).sum().backward()
    if not announce:
        off.scale_grads_(divide_factor(count))
    norm = float(off.clip_grad_norm_(CLIP))
    off.step()
    off.zero_grad()
    return norm


def torch_replay(init, history, counts):
    """torch.optim.AdamW on fp32 copies: sum, divide, clip, step."""
    params, ref = fp32_reference("adamw", init)
    norms = []
    for grads, count in zip(history, counts):
        for n, p in params.items():
            p.grad = sum(grads[n][1:], grads[n][0].clone()).mul_(divide_factor(count)) if n in grads else None
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in params.values() if p.grad is not None], CLIP)))
        ref.step()
    return params, ref, norms


@pytest.mark.parametrize("announce", [True, False])
def test_variable_windows_with_scaling_and_clipping_match_torch(announce):
    model, opt = build("adamw")
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = capture(model)
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=max(COUNTS), **SMALL)
    history, norms = [], []
    for s, count in enumerate(COUNTS):
        grads.clear()
        norms.append(loop_step(model, off, s, count, announce=announce))
        assert off.stats()["backward_passes"] == count
        history.append({n: list(g) for n, g in grads.items()})
    params, ref, ref_norms = torch_replay(init, history, COUNTS)
    for ours, theirs in zip(norms, ref_norms):
        assert abs(ours - theirs) <= 1e-6 * theirs
    assert sum(n > CLIP for n in ref_norms) >= 2  # clipping active
    by_id = {id(p): n for n, p in model.named_parameters()}
    for rec in records_of(off):
        n = by_id[id(rec.param)]
        st = ref.state.get(params[n], {})
        assert normwise(rec.master.view(rec.shape), params[n].detach()) < 1e-5, n
        if st:
            assert normwise(rec.exp_avg.view(rec.shape), st["exp_avg"]) < 1e-5, n
            assert normwise(rec.exp_avg_sq.view(rec.shape), st["exp_avg_sq"]) < 1e-5, n


def test_announced_factor_is_free_and_equals_a_scaled_loss():
    """A factor given before the last backward runs no redo and equals scaling the loss."""
    a_model, a_opt = build("adamw")
    b_model, b_opt = build("adamw")
    a = FullCPUOffloadOptimizer(a_opt, grad_accum_steps=2, **SMALL)
    b = FullCPUOffloadOptimizer(b_opt, grad_accum_steps=2, **SMALL)
    rollbacks = []
    watch_rollbacks(a, lambda stepped: rollbacks.append(len(stepped)))
    for s in range(3):
        a.scale_grads_(0.25)
        for m in range(2):
            a_model(micro_batch(s, m).to(torch.bfloat16)).float().pow(2).sum().backward()
            (b_model(micro_batch(s, m).to(torch.bfloat16)).float().pow(2).sum() * 0.25).backward()
        a.step()
        b.step()
    for ra, rb in zip(records_of(a), records_of(b)):
        torch.testing.assert_close(ra.master, rb.master, rtol=1e-6, atol=1e-7)
    assert rollbacks == []  # no redo: the kernels applied the factor
    assert a.stats()["backward_passes"] == 2


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32_moments", "bf16_moments"])
def test_a_factor_before_a_short_windows_step_is_carried_into_the_next_window(monkeypatch, state_dtype):
    """grad_accum_steps=3, windows of 1, 2 and 3 passes, scale_grads_(0.5) before each step():
    a short window's factor comes after its last backward, as a full window's, so the window
    after it expects it and none is rolled back and redone; the run equals the one that gives
    each factor before the window's passes, bit for bit, and torch's. Before, only a
    clip_grad_norm_ there was carried: each full window after a short one was redone (with
    bf16 moments, with the rollback's error in its state)."""
    counts = [1, 2, 3, 1, 2, 3, 3]
    runs = {}
    for announce in (True, False):
        model, opt = build("adamw")
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = capture(model)
        off = FullCPUOffloadOptimizer(opt, grad_accum_steps=3, state_dtype=state_dtype, **SMALL)
        rollbacks = count_rollbacks(monkeypatch)
        history = []
        for s, count in enumerate(counts):
            grads.clear()
            if announce:
                off.scale_grads_(0.5)
            for m in range(count):
                model(micro_batch(s, m).to(torch.bfloat16)).float().pow(2).sum().backward()
            if not announce:
                off.scale_grads_(0.5)
            off.step()
            off.zero_grad()
            history.append({n: list(g) for n, g in grads.items()})
        assert rollbacks == [], announce
        names = {id(p): n for n, p in model.named_parameters()}
        runs[announce] = {names[id(rec.param)]: (rec.master.clone(), rec.exp_avg.clone(), rec.exp_avg_sq.clone(),
                                                 rec.step) for rec in records_of(off)}
        off.close()
    for n, (master, exp_avg, exp_avg_sq, step) in runs[False].items():
        want = runs[True][n]
        assert all(torch.equal(a, b) for a, b in zip((master, exp_avg, exp_avg_sq), want[:3])), n
        assert step == want[3], n
    params, ref = fp32_reference("adamw", init)
    for grads_of in history:
        for n, p in params.items():
            p.grad = sum(grads_of[n][1:], grads_of[n][0].clone()).mul_(0.5) if n in grads_of else None
        ref.step()
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    for n, (master, *_, step) in runs[False].items():
        if step:
            assert normwise(master.view_as(params[n]), params[n].detach()) < tol, n


@pytest.mark.parametrize("count", [1, 3])
def test_the_logged_norm_counts_a_factor_given_before_or_after_the_last_backward(count):
    """stats()["grad_norm"] is the norm of the step's gradients (before clipping) whenever
    scale_grads_ gave them their factor: a factor after the last backward left it out."""
    runs = {}
    for when in ("before", "after"):
        model, opt = build("adamw")
        grads = capture(model)
        off = FullCPUOffloadOptimizer(opt, grad_accum_steps=count, **SMALL)
        logged, torch_norms = [], []
        for s in range(3):
            grads.clear()
            factor = 0.5 + s
            if when == "before":
                off.scale_grads_(factor)
            for m in range(count):
                model(micro_batch(s, m).to(torch.bfloat16)).float().pow(2).sum().backward()
            if when == "after":
                off.scale_grads_(factor)
            off.step()
            off.zero_grad()
            logged.append(off.stats()["grad_norm"])
            summed = [sum(g[1:], g[0].clone()) * factor for g in grads.values()]
            torch_norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double())
                                                                          for g in summed]))))
        off.close()
        for ours, theirs in zip(logged, torch_norms):
            assert abs(ours - theirs) <= 1e-6 * theirs, (when, logged, torch_norms)
        runs[when] = logged
    assert runs["before"] == runs["after"]


@pytest.mark.parametrize("late", [False, True], ids=["before_the_last_backward", "after_it"])
def test_a_factor_the_kernels_cannot_take_is_refused_at_the_call_and_changes_nothing(late):
    """Factors whose product overflows float32 (the kernels' grad_scale) were accepted, and the
    window's step then failed in the CPU worker; '2' and True were taken as numbers. Each is
    refused at the call, naming the factor; the window steps as if it had not been given."""
    runs = []
    for refuse in (True, False):
        model, opt = build("adamw")
        off = FullCPUOffloadOptimizer(opt, **SMALL)
        x = micro_batch(0, 0).to(torch.bfloat16)
        if late:
            model(x).float().pow(2).sum().backward()
        off.scale_grads_(2.0)
        if refuse:
            with pytest.raises(ValueError, match=r"factor gives the window's .* = 4e\+38, which overflows float32"):
                off.scale_grads_(2e38)  # alone it fits
            for bad in ("2", True):
                with pytest.raises(TypeError, match="factor must be a number"):
                    off.scale_grads_(bad)
        if not late:
            model(x).float().pow(2).sum().backward()
        off.step()
        runs.append([r.master.clone() for r in records_of(off)])
        off.close()
    refused, plain = runs
    assert all(torch.equal(a, b) for a, b in zip(refused, plain))


@pytest.mark.parametrize("kind", ["adamw", "sign_sgd"])
def test_a_large_late_factor_then_a_large_early_one_steps(kind):
    """The next window speculates with its own factor times the one the last window got after
    its last backward. Each fit float32 (scale_grads_ checks its own window) but not their
    product, and SignSGD's speculative step failed in the CPU worker (grad_scale 1e+40). The
    step speculates without the last window's factor then, and equals the step with the factor."""
    model, opt = build(kind)
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    x = micro_batch(0, 0).to(torch.bfloat16)
    model(x).float().pow(2).sum().backward()
    off.scale_grads_(1e30)  # after the last backward: the next window speculates with it
    off.step()
    off.zero_grad()
    ref_model, ref_opt = build(kind)
    ref = FullCPUOffloadOptimizer(ref_opt, **SMALL)
    saved = off.state_dict()
    for group in saved["param_groups"]:
        group["speculation_factor"] = 1.0  # the reference's window speculates with its own factor alone
    ref.load_state_dict(saved)
    for wrapper, m in ((off, model), (ref, ref_model)):
        wrapper.scale_grads_(1e10)
        m(micro_batch(1, 0).to(torch.bfloat16)).float().pow(2).sum().backward()
        wrapper.step()
    assert all(torch.equal(a.master, b.master) and a.step == b.step for a, b in zip(records_of(off), records_of(ref)))
    assert max(r.step for r in records_of(off)) == 2
    off.close()
    ref.close()


def test_window_length_errors():
    model, opt = build("adamw")
    one = FullCPUOffloadOptimizer(opt, **SMALL)
    with pytest.raises(ValueError, match="host accumulators"):
        one.grad_accum_steps = 2
    with pytest.raises(ValueError, match="int >= 1"):
        one.grad_accum_steps = 0
    with pytest.raises(ValueError, match="factor"):
        one.scale_grads_(0.0)
    with pytest.raises(ValueError, match="factor"):
        one.scale_grads_(float("nan"))
    one.close()
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=4, **SMALL)
    off.grad_accum_steps = 3
    for m in range(2):
        model(micro_batch(0, m).to(torch.bfloat16)).float().pow(2).sum().backward()
    with pytest.raises(ValueError, match="already ran 2 backward passes"):
        off.grad_accum_steps = 2
    off.grad_accum_steps = 2 + 1  # still longer than what ran: allowed
    model(micro_batch(0, 2).to(torch.bfloat16)).float().pow(2).sum().backward()
    with pytest.raises(RuntimeError, match="between windows"):
        off.grad_accum_steps = 4
    off.step()
    assert off.stats()["backward_passes"] == 3
    off.grad_accum_steps = 1  # a window of one with accumulators
    model(micro_batch(1, 0).to(torch.bfloat16)).float().pow(2).sum().backward()
    with pytest.raises(RuntimeError, match="already applied its update"):
        model(micro_batch(1, 1).to(torch.bfloat16)).float().pow(2).sum().backward()
    off.step()
    assert off.stats()["backward_passes"] == 1


@pytest.mark.parametrize("gpu_state", [None, HALF_STATE], ids=["host", "half_on_the_device"])
@pytest.mark.parametrize("when", ["before_the_forward", "before_the_backward"])
@pytest.mark.parametrize("k", [2, 3])
def test_a_gradient_assigned_between_two_passes_replaces_the_windows_sum_as_in_torch(k, when, gpu_state):
    """``p.grad = x`` between two backward passes of a window: torch's next pass adds to x, so
    the window's gradient is x plus what follows. Full offload's hooks had taken the earlier
    passes to the host and added x plus the next gradient to them, silently. Now x replaces
    the window's sum so far, as in torch (but on the parameter whose gradient the pass
    produces first: its hook cannot tell x plus that gradient from the gradient)."""
    model, opt = build("adamw")
    grads = capture(model)  # registered first: sees x plus the pass's gradient
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=k, gpu_state=gpu_state, **SMALL)
    train_step(model, off, 0, k)
    off.step()
    off.zero_grad()
    before, assigned, g = snapshot(off), ("l1.weight", "l2.bias"), torch.Generator().manual_seed(7)
    grads.clear()

    def assign():
        for name in assigned:
            p = model.get_parameter(name)
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)

    for m, (x, extra) in enumerate(batches(1, k)):
        if m == 1 and when == "before_the_forward":
            assign()
        loss = model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean()
        if m == 1 and when == "before_the_backward":
            assign()
        loss.backward()
    off.step()
    window = {n: (g[1:] if n in assigned else g) for n, g in grads.items()}
    check_stepped_once(model, off, before, window, 1.0, when)
    off.close()
