# Gradient clipping and the non-finite guard of full offload (CPU parameters):
# clipped steps against torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW fed
# the same gradients, unclipped steps bit-identical to no clipping, skipped steps
# (NaN loss: bit-identical; Inf in one parameter: rolled back, finite, close),
# error_if_nonfinite, SignSGD, the max_grad_norm option.
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from helpers import (LOSS_SCALES, SMALL, STEPS, assert_same_state, batches, build, capture, check_stepped_once, check_unchanged,
                     count_rollbacks, fp32_reference, host_bytes_of, normwise, records_of, snapshot, train, train_step,
                     watch_rollbacks, window_records_of)

# Norms up to 50x max_norm, changing 10-40x from step to step: the speculative step's
# factor (the last step's coefficient) is far from the final one.
HEAVY_LOSS_SCALES = [0.3, 4.0, 1.0, 12.0, 0.1, 2.5]


def torch_replay(kind, init, history, clip):
    """torch.optim.AdamW on fp32 copies, clipped by torch.nn.utils.clip_grad_norm_."""
    params, ref = fp32_reference(kind, init)
    norms = []
    for grads in history:
        for n, p in params.items():
            p.grad = grads[n].clone() if n in grads else None
        with_grad = [p for p in params.values() if p.grad is not None]
        norms.append(torch.nn.utils.clip_grad_norm_(with_grad, clip))
        ref.step()
    return params, ref, norms


@pytest.mark.parametrize("scales, clip", [(LOSS_SCALES, 0.25), (HEAVY_LOSS_SCALES, 0.5)])
@pytest.mark.parametrize("k, grad_copy", [(1, "host"), (1, "device"), (2, "device")])
def test_clipped_steps_match_torch(k, grad_copy, scales, clip):
    model, off, init, history, norms = train("adamw", k, STEPS, clip=clip, loss_scale=lambda s: scales[s % len(scales)],
                                             grad_copy=grad_copy)
    assert off.grad_copy == (None if k > 1 else grad_copy)
    params, ref, ref_norms = torch_replay("adamw", init, history, clip)
    clipped = sum(float(n) > clip for n in ref_norms)
    assert 3 <= clipped <= STEPS - 3  # clipping active on some steps and not on others
    for ours, theirs in zip(norms, ref_norms):
        assert ours.dtype == torch.float32 and ours.dim() == 0
        assert abs(float(ours) - float(theirs)) <= 1e-6 * float(theirs)
    by_id = {id(p): n for n, p in model.named_parameters()}
    for p, ours in off.state.items():
        n = by_id[id(p)]
        st = ref.state[params[n]]
        assert normwise(ours["master"], params[n].detach()) < 1e-5, n
        if "exp_avg" in st:
            assert normwise(ours["exp_avg"], st["exp_avg"]) < 1e-5, n
            assert normwise(ours["exp_avg_sq"], st["exp_avg_sq"]) < 1e-5, n
        assert torch.equal(p.detach(), ours["master"].to(torch.bfloat16)), n
    assert off.stats()["clip_coef"] is not None and off.stats()["skipped_steps"] == 0


@pytest.mark.parametrize("k, grad_copy", [(1, "host"), (1, "device"), (2, "device")])
def test_after_a_clipped_step_each_step_runs_once_with_its_final_coefficient(k, grad_copy, monkeypatch):
    """Once a step clipped, the next windows are not stepped speculatively (a redo costs a
    rollback and a second step): each is stepped once with its own coefficient, without a
    rollback, and equals the reference on the state before it bit for bit."""
    rollbacks = count_rollbacks(monkeypatch)
    model, opt = build("adamw")
    grads = capture(model)  # registered first: runs before the offload hook
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=k, grad_copy=grad_copy, **SMALL)
    for s in range(6):
        before = snapshot(off)
        grads.clear()
        rollbacks.clear()
        train_step(model, off, s, k, loss_factor=LOSS_SCALES[s % len(LOSS_SCALES)])
        off.clip_grad_norm_(1e-3)  # clips every step, by a coefficient that changes each time
        off.step()
        coef = off.stats()["clip_coef"]
        assert coef < 1.0
        if s == 0:
            assert rollbacks, "the first clipped step speculated with factor 1: it is redone"
            off.zero_grad()
            continue
        assert rollbacks == [], s
        check_stepped_once(model, off, before, grads, coef, s)
        off.zero_grad()


@pytest.mark.parametrize("how", ["max_grad_norm", "torch clip_grad_norm_"])
def test_under_steady_clipping_short_windows_and_the_windows_after_them_run_once(how, monkeypatch):
    """A framework steps a short last window at each epoch's end (its batches not a multiple of
    the accumulation). Under steady clipping, a short window was stepped with factor 1 and redone
    (max_grad_norm), or its clip, made before step() while the window was still accumulating,
    was not remembered and the full window after it speculated with factor 1 and was redone
    (torch.nn.utils.clip_grad_norm_): each off by the rollback's error (up to 1e-2 of v with
    these coefficients), without a word. Each step after the first now runs once with its final
    coefficient, bit for bit the reference on the state before it."""
    rollbacks = count_rollbacks(monkeypatch)
    model, opt = build("adamw")
    grads = capture(model)  # registered first: runs before the offload hook
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=2, max_grad_norm=1e-3 if how == "max_grad_norm" else None,
                                  **SMALL)
    for s, passes in enumerate([2, 2, 1, 2, 2, 1, 2]):
        before = snapshot(off)
        grads.clear()
        rollbacks.clear()
        train_step(model, off, s, passes, loss_factor=LOSS_SCALES[s % len(LOSS_SCALES)])
        if how != "max_grad_norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # clips every step
        off.step()
        coef = off.stats()["clip_coef"]
        assert coef < 1.0
        if s > 0:
            assert rollbacks == [], (s, passes)
            check_stepped_once(model, off, before, grads, coef, (s, passes))
        off.zero_grad()


def test_the_logged_grad_norm_is_the_one_clip_grad_norm_returned_in_full_and_short_windows():
    """In a short window (step() after fewer passes than grad_accum_steps, a framework's last
    of an epoch), stats()["grad_norm"] was the norm after torch's clip (its max_norm), where a
    full window's is the norm before it, as clip_grad_norm_ returns it."""
    model, opt = build("adamw", seed=int(torch.randint(1 << 30, ())))
    grads = capture(model)
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=3, **SMALL)
    for s, passes in enumerate([3, 2, 1, 3, 2]):
        grads.clear()
        train_step(model, off, s, passes, loss_factor=LOSS_SCALES[s % len(LOSS_SCALES)])
        returned = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
        off.step()
        summed = [torch.stack(g).sum(0) for g in grads.values()]
        expected = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in summed])))
        assert abs(returned - expected) <= 1e-5 * expected, (s, passes)
        assert float(torch.tensor(off.stats()["grad_norm"], dtype=torch.float32)) == returned, (s, passes)
        assert off.stats()["clip_coef"] < 1.0
        off.zero_grad()
    off.close()


@pytest.mark.parametrize("k", [1, 2])
def test_clipping_to_zero_steps_with_zero_gradients_like_torch(k):
    # clip_grad_norm_(0) gives coefficient 0: the kernels step with grad_scale=0 (the
    # speculative step of the next window too), which they accept (only < 0 is refused).
    model, off, init, history, norms = train("adamw", k, 6, clip=0.0)
    params, ref, ref_norms = torch_replay("adamw", init, history, 0.0)
    by_id = {id(p): n for n, p in model.named_parameters()}
    for p, ours in off.state.items():
        n = by_id[id(p)]
        assert normwise(ours["master"], params[n].detach()) < 1e-5, n
        assert int(ours["step"]) == int(ref.state[params[n]].get("step", 0)), n
    assert off.stats()["clip_coef"] == 0.0


@pytest.mark.parametrize("kind", ["adamw", "sign_sgd"])
@pytest.mark.parametrize("k", [1, 2])
def test_steps_that_do_not_clip_are_bit_identical(kind, k):
    plain = train(kind, k, 6, skip_nonfinite=False)[1]
    clipped = train(kind, k, 6, clip=1e6)[1]  # never clips; guard on (the default)
    option = train(kind, k, 6, max_grad_norm=1e6)[1]
    for a, b, c in zip(plain.state.values(), clipped.state.values(), option.state.values()):
        assert torch.equal(a["master"], b["master"]) and torch.equal(a["master"], c["master"]), a
        assert int(a["step"]) == int(b["step"]) == int(c["step"])
        if kind == "adamw":
            assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and torch.equal(a["exp_avg_sq"], c["exp_avg_sq"])


@pytest.mark.parametrize("k", [1, 2])
def test_max_grad_norm_option_equals_the_call(k):
    called = train("adamw", k, 8, clip=0.5)[1]
    option = train("adamw", k, 8, max_grad_norm=0.5)[1]
    for a, b in zip(called.state.values(), option.state.values()):
        assert torch.equal(a["master"], b["master"]) and torch.equal(a["exp_avg"], b["exp_avg"]), a
    assert option.stats()["grad_norm"] is not None


@pytest.mark.parametrize("k", [1, 2])
def test_a_clip_that_logs_the_norm_under_the_max_grad_norm_option_sees_the_norm_before_it(k):
    """With max_grad_norm= on the optimizer and the framework's clipping off, HF Trainer calls
    clip_grad_norm_(params, inf) before step() to log the norm. In a full window it got the norm
    already clipped (max_grad_norm itself, every clipped step), in a short one the norm before;
    stats() then held the clipped norm and a coefficient of 1. The option's clip is the window's
    last: the call returns torch's norm of the window's gradients, stats() the norm and the
    coefficient the option clipped with, and the weights are those of the run without the call."""
    clip = 0.1
    plain = train("adamw", k, 6, max_grad_norm=clip)
    model, off, init, history, norms = train("adamw", k, 6, max_grad_norm=clip, clip=math.inf)
    ref_norms = torch_replay("adamw", init, history, math.inf)[2]
    assert sum(float(n) > clip for n in ref_norms) >= 3  # steps that clip
    for ours, theirs in zip(norms, ref_norms):
        assert abs(float(ours) - float(theirs)) <= 1e-6 * float(theirs)
    stats = off.stats()
    assert abs(stats["grad_norm"] - float(ref_norms[-1])) <= 1e-6 * float(ref_norms[-1])
    assert stats["clip_coef"] == plain[1].stats()["clip_coef"] < 1.0
    assert_same_state(snapshot(plain[1]), snapshot(off))


def test_the_max_grad_norm_option_clips_after_a_late_scale_grads_as_after_an_early_one():
    """max_grad_norm clips the gradients step() uses: a factor given by scale_grads_() after the
    last backward comes before the option's clip, as one given before the first backward does
    (it came after, so the step's norm was the factor times the limit)."""
    runs, logs = [], []
    for early in (True, False):
        model, opt = build("adamw")
        off = FullCPUOffloadOptimizer(opt, max_grad_norm=0.1, **SMALL)
        logs.append([])
        for s in range(4):
            if early:
                off.scale_grads_(0.5)
            train_step(model, off, s, 1)
            if not early:
                off.scale_grads_(0.5)
            off.step()
            off.zero_grad()
            logs[-1].append((off.stats()["grad_norm"], off.stats()["clip_coef"]))
        runs.append(snapshot(off))
    assert logs[0] == logs[1] and sum(coef < 1.0 for _, coef in logs[0]) == 2
    for name, (early, late) in {n: (runs[0][n], runs[1][n]) for n in runs[0]}.items():
        assert early[3] == late[3], name
        for a, b in zip(early[:3], late[:3]):  # the two take other speculative paths: rounding apart
            assert normwise(a, b) < 1e-6, name


@pytest.mark.parametrize("k", [1, 2])
def test_torch_clip_grad_norm_over_the_model_clips_through_the_optimizer(k):
    """torch.nn.utils.clip_grad_norm_(model.parameters()) (HF Trainer's, accelerate's and
    Lightning's clipping) equals the wrapper's call bit for bit. Before, it saw no gradient
    (they are on the host), returned 0 and clipped nothing, without a word."""
    from torch.nn.utils import clip_grad_norm_  # NOTE: as a script imports it, after cpu_offload

    called = train("adamw", k, 8, clip=0.5)
    via_torch = train("adamw", k, 8, clip=0.5, clip_with=lambda model, clip: clip_grad_norm_(model.parameters(), clip))
    assert [float(n) for n in via_torch[4]] == [float(n) for n in called[4]]
    assert any(float(n) > 0.5 for n in called[4])  # some steps clip
    for a, b in zip(called[1].state.values(), via_torch[1].state.values()):
        assert torch.equal(a["master"], b["master"]) and torch.equal(a["exp_avg"], b["exp_avg"]), a


def test_torch_clipping_refuses_what_it_cannot_clip_through_the_optimizer():
    """Part of the optimizer's parameters, parameters of two optimizers, parameters mixed with
    others that hold .grad, and clipping by value raise a ValueError that says what to do;
    parameters of no full-offload optimizer are clipped by torch as before."""
    (model, opt), (other, other_opt) = build("adamw"), build("adamw", seed=1)
    off, off2 = FullCPUOffloadOptimizer(opt, **SMALL), FullCPUOffloadOptimizer(other_opt, **SMALL)
    for m in (model, other):
        m(torch.randn(4, 24).to(torch.bfloat16)).float().pow(2).mean().backward()
    plain = torch.nn.Parameter(torch.ones(3))
    plain.grad = torch.full((3,), 4.0)
    with pytest.raises(ValueError, match="1 of the 8 parameters of a full-offload optimizer"):
        torch.nn.utils.clip_grad_norm_([model.l1.weight], 1.0)
    with pytest.raises(ValueError, match="belong to 2 full-offload optimizers"):
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *other.parameters()], 1.0)
    with pytest.raises(ValueError, match="mix a full-offload optimizer's"):
        torch.nn.utils.clip_grad_norm_([*model.parameters(), plain], 1.0)
    with pytest.raises(ValueError, match="cannot be clipped by value"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    assert float(torch.nn.utils.clip_grad_norm_(plain, 1.0)) == pytest.approx(math.sqrt(48))
    assert torch.allclose(plain.grad, torch.full((3,), 4.0 / (math.sqrt(48) + 1e-6)))
    torch.nn.utils.clip_grad_value_(plain, 0.1)
    assert torch.equal(plain.grad, torch.full((3,), 0.1))
    off.step()
    off2.step()



def test_torch_clipping_of_no_gradient_while_a_window_holds_them_on_the_host_warns():
    """``clip_grad_norm_([p for p in model.parameters() if p.grad is not None], ...)``, a common
    filter: under full offload param.grad is None after backward, so the list is empty and
    torch's function clipped nothing and returned 0, with no word. It now warns while a
    full-offload window holds its gradients on the host; between windows, or for parameters
    that hold .grad, it is torch's function as before."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    plain = torch.nn.Parameter(torch.ones(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(torch.nn.utils.clip_grad_norm_([], 1.0)) == 0.0  # no window open
    model(torch.randn(4, 24).to(torch.bfloat16)).float().pow(2).mean().backward()
    for params in ([p for p in model.parameters() if p.grad is not None], [plain]):
        with pytest.warns(RuntimeWarning, match="no parameter that holds a gradient.*nothing was clipped.*"
                                                "pass model.parameters"):
            assert float(torch.nn.utils.clip_grad_norm_(params, 1.0)) == 0.0
    plain.grad = torch.full((3,), 4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(torch.nn.utils.clip_grad_norm_(plain, 1.0)) == pytest.approx(math.sqrt(48))
    off.step()
    off.close()


# The script imports torch's clipping functions above cpu_offload, as a training script may.
IMPORTED_BEFORE = """
import sys
from torch.nn.utils import clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_
import torch
sys.path.insert(0, sys.argv[1])
from helpers import SMALL, build, train
from cpu_offload._full.optimizer import FullCPUOffloadOptimizer

called = train("adamw", 1, 6, clip=0.5)
early = train("adamw", 1, 6, clip=0.5, clip_with=lambda model, clip: clip_grad_norm_(model.parameters(), clip))
assert [float(n) for n in early[4]] == [float(n) for n in called[4]], (early[4], called[4])
assert any(float(n) > 0.5 for n in called[4])  # some steps clip
for a, b in zip(called[1].state.values(), early[1].state.values()):
    assert torch.equal(a["master"], b["master"]) and torch.equal(a["exp_avg"], b["exp_avg"])

model, opt = build("adamw")
off = FullCPUOffloadOptimizer(opt, **SMALL)
model(torch.randn(4, 24).to(torch.bfloat16)).float().pow(2).mean().backward()
for name, clip, match in (
        ("clip_grad_value_", lambda: clip_grad_value_(model.parameters(), 1e-3), "cannot be clipped by value"),
        ("clip_grads_with_norm_", lambda: clip_grads_with_norm_(model.parameters(), 1e-3, torch.tensor(5.0)),
         "would clip nothing"),
        ("clip_grad_norm_ of part", lambda: clip_grad_norm_([model.l1.weight], 1e-3), "1 of the 8 parameters")):
    try:
        clip()
    except ValueError as e:
        assert match in str(e), (name, str(e))
    else:
        raise AssertionError(name + " returned without clipping anything")
off.step()
assert off.stats()["clip_coef"] is None  # nothing was clipped

# Other parameters clip as in torch.
torch.manual_seed(3)
grads = [torch.randn(5) * 3, torch.randn(2, 3)]
total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
for clip, norm in ((lambda ps: clip_grad_norm_(ps, 1.0), total),
                   (lambda ps: clip_grads_with_norm_(ps, 1.0, torch.tensor(7.0)), 7.0)):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    clip(params)
    coef = torch.clamp(1.0 / (torch.as_tensor(norm) + 1e-6), max=1.0)
    assert coef < 1.0
    for p, g in zip(params, grads):
        assert torch.allclose(p.grad, g * coef, rtol=1e-6, atol=0)
plain = torch.nn.Parameter(torch.zeros(3))
plain.grad = torch.tensor([-4.0, 0.05, 4.0])
clip_grad_value_([plain], 0.1)
assert torch.equal(plain.grad, torch.tensor([-0.1, 0.05, 0.1]))
print("ok")
"""


def test_torch_clipping_imported_before_cpu_offload_clips_through_the_optimizer_or_raises(tmp_path):
    """``from torch.nn.utils import clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_``
    above ``import cpu_offload`` holds torch's own functions, which see no gradient (they are
    on the host). clip_grad_value_ clipped nothing without a word, and clip_grad_norm_ raised.
    Now each behaves as the one looked up after the import: clip_grad_norm_ clips through the
    optimizer bit for bit, the other two raise; other parameters clip as in torch."""
    script = tmp_path / "imported_before.py"
    script.write_text(IMPORTED_BEFORE)
    done = subprocess.run([sys.executable, str(script), str(Path(__file__).parents[1])], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_sign_sgd_clipping_returns_torch_norm_and_changes_no_update():
    model, off, init, history, norms = train("sign_sgd", 1, 6, clip=0.5)
    _, _, ref_norms = torch_replay("sign_sgd", init, history, 0.5)
    for ours, theirs in zip(norms, ref_norms):
        assert abs(float(ours) - float(theirs)) <= 1e-6 * float(theirs)
    plain = train("sign_sgd", 1, 6)[1]
    for a, b in zip(off.state.values(), plain.state.values()):
        assert torch.equal(a["master"], b["master"]), a


@pytest.mark.parametrize("k", [1, 2])
def test_nan_loss_skips_the_step_bit_identically(k):
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=k, **SMALL)
    for s in range(4):
        before = snapshot(off)
        weights = {r.name: r.param.detach().clone() for r in records_of(off)}
        if s == 2:
            with pytest.warns(RuntimeWarning, match="step skipped"):  # decided when the last backward ends
                train_step(model, off, s, k, loss_factor=math.nan)
            check_unchanged(off, before, weights)
            off.step()
            check_unchanged(off, before, weights)
            assert off.stats()["skipped"] and off.stats()["skipped_steps"] == 1
            assert math.isnan(off.stats()["grad_norm"])
        else:
            train_step(model, off, s, k)
            off.step()
        off.zero_grad()
    assert off.stats()["skipped_steps"] == 1 and not off.stats()["skipped"]
    assert all(torch.isfinite(st["master"]).all() for st in off.state.values())


@pytest.mark.parametrize("k, grad_copy", [(1, "host"), (1, "device"), (2, "device")])
def test_inf_in_one_gradient_rolls_back_what_was_stepped(k, grad_copy):
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=k, grad_copy=grad_copy, **SMALL)
    # l1's gradient arrives last (backward runs in reverse), after head and l2 were stepped
    armed = []
    model.l1.weight.register_hook(lambda g: g.index_fill(1, torch.tensor([3]), math.inf) if armed else g)
    rolled_back = []
    watch_rollbacks(off, lambda stepped: rolled_back.append(len(stepped)))
    for s in range(3):
        armed[:] = [True] if s == 1 else []
        before = snapshot(off)
        if s == 1:
            with pytest.warns(RuntimeWarning, match="step skipped"):
                train_step(model, off, s, k)
            assert rolled_back and rolled_back[0] > 0  # some pieces really were stepped first
            for r in records_of(off):
                m, ea, eas, st = before[r.name]
                assert r.step == st, r.name
                for now, then in ((r.master, m), (r.exp_avg, ea), (r.exp_avg_sq, eas)):
                    assert torch.isfinite(now).all(), r.name
                    # the documented bound: about one ulp of the values (moments: of their terms)
                    torch.testing.assert_close(now, then, rtol=1e-6, atol=1e-9, msg=r.name)
                assert torch.equal(r.param.detach(), r.master.view(r.shape).to(torch.bfloat16)), r.name
        else:
            train_step(model, off, s, k)
        off.step()
        off.zero_grad()
    assert off.stats()["skipped_steps"] == 1


def test_error_if_nonfinite_raises_like_torch():
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    x, extra = batches(0, 1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean() * math.inf).backward()
    with pytest.raises(RuntimeError, match="non-finite"):
        off.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert math.isnan(float(off.clip_grad_norm_(1.0)))  # torch returns the non-finite norm too
    off.step()
    assert off.stats()["skipped_steps"] == 1


def test_inf_norm_and_idle_and_bad_arguments():
    model, off, init, history, norms = train("adamw", 1, 1)
    x, extra = batches(5, 1)[0]
    model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean().backward()
    grads = [g for g in window_records_of(off)]
    expected = max(float(r.retained.float().abs().max()) for r in grads)
    assert float(off.clip_grad_norm_(1e9, norm_type=math.inf)) == expected
    with pytest.raises(ValueError, match="norm_type"):
        off.clip_grad_norm_(1.0, norm_type=-1)
    with pytest.raises(ValueError, match="max_norm"):
        off.clip_grad_norm_("one")
    with pytest.raises(ValueError, match="max_norm"):
        off.clip_grad_norm_(-1.0)
    off.step()
    assert float(off.clip_grad_norm_(1.0)) == 0.0  # no gradients since the step, as torch
    with pytest.raises(ValueError, match="max_grad_norm"):
        FullCPUOffloadOptimizer(build("adamw")[1], max_grad_norm=-1.0)
    with pytest.raises(TypeError, match="skip_nonfinite"):
        FullCPUOffloadOptimizer(build("adamw")[1], skip_nonfinite="yes")


def test_skip_nonfinite_false_gives_torch_behaviour():
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, skip_nonfinite=False, **SMALL)
    x, extra = batches(0, 1)[0]
    (model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean() * math.nan).backward()
    off.step()
    assert off.stats()["skipped_steps"] == 0
    assert torch.isnan(next(iter(off.state.values()))["master"]).any()  # like torch.optim.AdamW fed NaN gradients


def test_grad_copy_places_and_host_bytes():
    model, opt = build("adamw")
    padded = sum((p.numel() + 15) // 16 * 16 for p in model.parameters() if p.requires_grad)
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    assert off.grad_copy == "device" and host_bytes_of(off) == 12 * padded  # the default: nothing more on the host
    off.close()
    off = FullCPUOffloadOptimizer(build("adamw")[1], grad_copy="host", **SMALL)
    assert off.grad_copy == "host" and host_bytes_of(off) == 14 * padded  # + the 2 B bf16 copy
    off.close()
    with pytest.raises(ValueError, match="grad_copy"):
        FullCPUOffloadOptimizer(build("adamw")[1], grad_copy="gpu")


@pytest.mark.parametrize("grad_copy", ["host", "device"])
def test_zero_filled_parameters_are_clipped_and_rolled_back(grad_copy):
    """After zero_grad(set_to_none=False) a parameter without a gradient is stepped with zeros;
    clipping redoes it too (with the zeros it kept)."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, grad_copy=grad_copy, **SMALL)
    for s in range(3):
        x, _ = batches(s, 1)[0]
        model(x.to(torch.bfloat16), use_extra=s == 0).float().pow(2).sum().backward()  # extra: a gradient once
        assert float(off.clip_grad_norm_(0.01)) > 0.01
        off.step()
        off.zero_grad(set_to_none=False)
    extra = off.state[model.extra]
    assert int(extra["step"]) == 3 and torch.isfinite(extra["master"]).all()


@pytest.mark.parametrize("gpu_state", [None, 2000 * 4])
@pytest.mark.parametrize("k", [1, 2])
def test_sign_sgd_clipped_to_zero_only_decays_like_torch(k, gpu_state):
    # torch steps sign(0 * g) = 0: the weights only decay. The first step speculates with factor
    # 1 and is redone (within the redo's error, about an ulp); the later ones speculate with 0.
    model, off, init, history, _ = train("sign_sgd", k, 4, clip=0.0, gpu_state=gpu_state)
    params, _, _ = torch_replay("sign_sgd", init, history, 0.0)
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert off.stats()["gpu_state_bytes"] > 0 or gpu_state is None
    for p, ours in off.state.items():
        assert normwise(ours["master"].view(p.shape), params[by_id[id(p)]].detach()) < 1e-6, by_id[id(p)]

